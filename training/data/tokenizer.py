"""Tokenizers for language models: UTF-8 bytes, or byte-level BPE trained at ingest.

Both map any text to ids and back without loss, and both end a document with one
end-of-document id (`eot`). A tokenizer is saved as `tokenizer.json` beside the raw data
(so DVC versions it with the data), copied into the shards folder and packed with the
model. The HF `tokenizers` library is imported only for BPE: the bytes tokenizer works
on machines that lack it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from training.atomic import atomic_file, write_json
from training.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
EOT_TEXT = "<|endoftext|>"  # BPE's end-of-document special token
BYTE_VOCAB = 257  # 256 byte values and the end-of-document id


class Tokenizer(ABC):
    """Text to ids and back. `eot` ends every document in a token stream."""

    kind: str
    vocab_size: int
    eot: int

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; end-of-document ids are left out, and byte sequences that are
        not valid UTF-8 (a model may sample them) become U+FFFD."""

    @abstractmethod
    def token_bytes(self) -> np.ndarray:
        """How many UTF-8 bytes each id stands for (int64, one per id; eot counts 0), so
        that a loss per token converts to bits per byte."""

    @abstractmethod
    def save(self, path: Path) -> None: ...

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        """The token stream of several documents, each followed by eot (uint32)."""
        stream: list[int] = []
        for text in texts:
            stream.extend(self.encode(text))
            stream.append(self.eot)
        return np.asarray(stream, dtype=np.uint32)


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text; 256 ends a document. Nothing to train."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB
    eot = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        counts = np.ones(self.vocab_size, dtype=np.int64)
        counts[self.eot] = 0
        return counts

    def save(self, path: Path) -> None:
        write_json(path, {"kind": self.kind, "vocab_size": self.vocab_size, "eot": self.eot})

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        # The bytes are the ids: view each text's encoding instead of building lists.
        eot = np.array([self.eot], dtype=np.uint32)
        parts: list[np.ndarray] = []
        for text in texts:
            parts += [np.frombuffer(text.encode("utf-8"), dtype=np.uint8), eot]
        return np.concatenate(parts, dtype=np.uint32) if parts else eot[:0]


class BpeTokenizer(Tokenizer):
    """Byte-level BPE (the HF `tokenizers` library): every text encodes, nothing is lost."""

    kind = "bpe"

    def __init__(self, hf: Any) -> None:
        # Text that happens to contain EOT_TEXT is data, not a document boundary.
        hf.encode_special_tokens = True
        self._hf = hf
        self.vocab_size = hf.get_vocab_size()
        eot = hf.token_to_id(EOT_TEXT)
        if eot is None:
            raise DataError(
                f"the BPE tokenizer has no end-of-document token {EOT_TEXT!r}; it was not "
                "written by gradline's ingest: re-run the ingest stage"
            )
        self.eot = int(eot)

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        # Byte-level BPE spells each byte as one character of its alphabet, so a token's
        # length in characters is its length in bytes; special tokens stand for none.
        special = set(self._hf.get_added_tokens_decoder())
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for token, token_id in self._hf.get_vocab(with_added_tokens=True).items():
            counts[token_id] = 0 if token_id in special else len(token)
        return counts

    def save(self, path: Path) -> None:
        with atomic_file(path, "w") as handle:
            handle.write(self._hf.to_str())

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        eot = np.array([self.eot], dtype=np.uint32)
        parts: list[np.ndarray] = []
        for encoding in self._hf.encode_batch(list(texts)):
            parts += [np.asarray(encoding.ids, dtype=np.uint32), eot]
        return np.concatenate(parts) if parts else eot[:0]


def train_bpe(texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
    """Train byte-level BPE on `texts`. Deterministic given the texts and their order (the
    library breaks ties between equally frequent pairs by the pair itself). A small corpus
    may yield fewer than `vocab_size` ids: `vocab_size` of the result says how many."""

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        # All 256 bytes from the start, so any text encodes, seen in training or not.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,  # a pair seen once is noise, not a unit of the language
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return BpeTokenizer(hf)


def load_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer saved at `path` by `Tokenizer.save`."""
    try:
        text = path.read_text(encoding="utf-8")
        saved = json.loads(text)
    except FileNotFoundError as exc:
        raise DataError(f"{path} not found; run the ingest stage first") from exc
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read the tokenizer {path}: {exc}; re-run ingest") from exc
    if saved.get("kind") == "bytes":
        return ByteTokenizer()
    if "model" not in saved:
        raise DataError(f"{path} is not a tokenizer gradline wrote; re-run the ingest stage")

    try:
        return BpeTokenizer(HFTokenizer.from_str(text))
    except Exception as exc:  # the library raises plain Exception on a bad file
        raise DataError(f"cannot load the BPE tokenizer {path}: {exc}; re-run ingest") from exc


def shard_tokenizer(shard_dir: Path, manifest: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a token shards folder, checked against its manifest."""
    info = manifest.get("tokenizer") or {}
    if info.get("file"):
        tokenizer = load_tokenizer(shard_dir / info["file"])
    elif info.get("kind") == "bytes":
        tokenizer = ByteTokenizer()
    else:
        raise DataError(f"{shard_dir} has no tokenizer in its manifest; re-run the shard stage")
    if (tokenizer.vocab_size, tokenizer.eot) != (manifest["vocab_size"], manifest["eot_token"]):
        raise DataError(
            f"the tokenizer in {shard_dir} ({tokenizer.vocab_size} ids, eot "
            f"{tokenizer.eot}) disagrees with its manifest ({manifest['vocab_size']} ids, eot "
            f"{manifest['eot_token']}); re-run the shard stage"
        )
    return tokenizer
