"""Text sources: read text files, validate them, snapshot their documents in data/raw/.

`text` reads UTF-8 files under data.path that match data.text_glob; `stdlib` reads the
running interpreter's own standard library source, a real corpus on every machine. Both
take whole files in sorted order until the byte budget (data.max_bytes) would be
exceeded, so the corpus is a pure function of the files and the config.

A file that is not UTF-8, is empty or holds binary content fails the ingest with its
name and the fix, or with data.on_invalid: quarantine is set aside (listed with its
reason in data/quarantine/). The snapshot is Parquet of documents (row_id, path, text)
plus the tokenizer (trained here for BPE), written aside and swapped in only on success.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from training.atomic import atomic_dir, write_json
from training.data.options import DataConfig
from training.data.hashing import keys_from_column
from training.data.sources import ROW_KEY
from training.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenizer, train_bpe
from training.errors import DataError
from training.progress import Progress

DOCUMENTS_FILE = "documents.parquet"
QUARANTINE_FILE = "quarantined_files.parquet"
PATH, TEXT = "path", "text"
DOCUMENT_SCHEMA = pa.schema(
    [
        pa.field(ROW_KEY, pa.uint64(), nullable=False),
        pa.field(PATH, pa.string(), nullable=False),
        pa.field(TEXT, pa.large_string(), nullable=False),
    ]
)
QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field(PATH, pa.string()),
        pa.field("reason", pa.string()),
        pa.field("detail", pa.string()),
        pa.field("size_bytes", pa.int64()),
    ]
)
# Folders of the standard library that are not the library itself: test suites (some
# hold deliberately broken files) and installed third-party packages.
STDLIB_SKIPPED_FOLDERS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
BINARY_CONTROL_SHARE = 0.3  # above this share of control characters a file is binary
# ASCII control bytes but whitespace. In UTF-8 they never occur inside another character,
# so counting bytes counts characters.
_CONTROL_BYTES = bytes(b for b in range(32) if chr(b) not in "\t\n\r\f\v")
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*(?:\n[ \t\r\f\v]*)*\n")
_ROWS_PER_BATCH_BYTES = 16 << 20  # documents buffered before a Parquet row group
HINTS = {
    "not UTF-8": "convert it to UTF-8 (e.g. iconv -t UTF-8)",
    "empty": "remove it or give it text",
    "binary": "it is not text: remove it or narrow data.text_glob",
}


@dataclass(frozen=True)
class TextFile:
    name: str  # the path relative to the source's folder, with "/": stable across machines
    path: Path


@dataclass
class TextReport:
    """What ingest read and kept: files in = files accepted + files quarantined."""

    source: str
    tokenizer: str = ""
    vocab_size: int = 0
    files_in: int = 0
    files_accepted: int = 0
    files_quarantined: int = 0
    documents: int = 0
    bytes_accepted: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add_rejected(self, reason: str, where: str) -> None:
        self.files_quarantined += 1
        self.reasons[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < 5:
            shown.append(where)

    def describe(self) -> str:
        lines = [f"{self.files_in} files read, {self.files_quarantined} not usable as text:"]
        for reason, hint in HINTS.items():
            if count := self.reasons.get(reason):
                examples = "; ".join(self.examples[reason])
                lines.append(f"  {reason}: {count} files, e.g. {examples} ({hint})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "files_in": self.files_in,
            "files_accepted": self.files_accepted,
            "files_quarantined": self.files_quarantined,
            "documents": self.documents,
            "bytes": self.bytes_accepted,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "invalid_by_reason": dict(sorted(self.reasons.items())),
        }


# ---- listing ------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _sorted_files(folder: Path, pattern: str, skipped: frozenset[str]) -> list[TextFile]:
    """Files under `folder` whose relative path matches `pattern` (from the right, as
    pathlib's match: "*.txt" at any depth), sorted by relative path. Hidden entries (.git,
    .dvc, ...) and folders named in `skipped` are not even walked."""
    found = []
    for current, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skipped]
        for name in names:
            rel = PurePosixPath(Path(current, name).relative_to(folder).as_posix())
            if not name.startswith(".") and rel.match(pattern):
                found.append(TextFile(str(rel), Path(current, name)))
    return sorted(found, key=lambda f: f.name)


def list_files(cfg: DataConfig, root: Path) -> list[TextFile]:
    """Every candidate file of the source, in the order the budget takes them."""
    if cfg.source == "stdlib":
        folder = stdlib_root()
        # Empty files (a package's bare __init__.py) are not text to learn from.
        files = _sorted_files(folder, "*.py", STDLIB_SKIPPED_FOLDERS)
        files = [f for f in files if f.path.stat().st_size]
        if not files:
            raise DataError(f"no Python source found in this interpreter's stdlib ({folder})")
        return files
    if cfg.source != "text":
        raise ValueError(f"not a text source: {cfg.source}")
    location = root / cfg.path
    if location.is_file():
        return [TextFile(location.name, location)]
    if not location.is_dir():
        raise DataError(f"data.path {cfg.path!r} does not exist; put text files there")
    files = _sorted_files(location, cfg.text_glob, frozenset())
    if not files:
        raise DataError(
            f"no files matching {cfg.text_glob!r} under {cfg.path!r}; add text files or set "
            "data.text_glob (e.g. '*.md')"
        )
    return files


# ---- validation ---------------------------------------------------------------------


def decode_text(data: bytes) -> tuple[str | None, str, str]:
    """(text, "", "") for usable text, else (None, reason, detail). A UTF-8 byte-order mark
    is dropped: it is an encoding marker, not text."""
    if not data:
        return None, "empty", "0 bytes"
    if b"\0" in data:
        return None, "binary", f"NUL byte at offset {data.index(0)}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, "not UTF-8", f"byte 0x{data[exc.start]:02x} at offset {exc.start}"
    text = text.removeprefix("\ufeff")
    if not text.strip():
        return None, "empty", "only white space"
    controls = len(data) - len(data.translate(None, _CONTROL_BYTES))
    if controls > BINARY_CONTROL_SHARE * len(text):
        return None, "binary", f"{controls} of {len(text)} characters are control characters"
    return text, "", ""


# ---- documents ----------------------------------------------------------------------


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, without blank ones (indentation is kept)."""
    return [p for p in _BLANK_LINES.split(text) if p.strip()]


def documents_of(file: TextFile, text: str, split_by: str) -> tuple[np.ndarray, list[str]]:
    """(keys, texts) of one file's documents. A key hashes the file's relative path (and
    the paragraph's index), so a document's split never depends on other files."""
    if split_by == "file":
        return keys_from_column(pa.array([file.name])), [text]
    texts = paragraphs(text)
    # NUL cannot occur in a path: path and index cannot run into each other.
    names = [f"{file.name}\0{i}" for i in range(len(texts))]
    return keys_from_column(pa.array(names, pa.string())), texts


class _DocumentWriter:
    """Documents into one Parquet file, a row group per ~16 MB of text."""

    def __init__(self, path: Path) -> None:
        self._writer = pq.ParquetWriter(path, DOCUMENT_SCHEMA)
        self._keys: list[np.ndarray] = []
        self._paths: list[str] = []
        self._texts: list[str] = []
        self._bytes = 0

    def add(self, name: str, keys: np.ndarray, texts: list[str], size: int) -> None:
        self._keys.append(keys)
        self._paths += [name] * len(texts)
        self._texts += texts
        self._bytes += size
        if self._bytes >= _ROWS_PER_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._texts:
            return
        columns = [
            pa.array(np.concatenate(self._keys), pa.uint64()),
            pa.array(self._paths, pa.string()),
            pa.array(self._texts, pa.large_string()),
        ]
        self._writer.write_table(pa.Table.from_arrays(columns, schema=DOCUMENT_SCHEMA))
        self._keys, self._paths, self._texts, self._bytes = [], [], [], 0

    def close(self) -> None:
        self.flush()
        self._writer.close()


def read_documents(raw_dir: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The snapshot's documents, in stored order (sorted path, then paragraph)."""
    path = raw_dir / DOCUMENTS_FILE
    if not path.is_file():
        raise DataError(f"{path} not found; run the ingest stage first")
    yield from pq.ParquetFile(path).iter_batches(batch_size=4096, columns=columns)


def is_text_snapshot(raw_dir: Path) -> bool:
    return (raw_dir / DOCUMENTS_FILE).is_file()


# ---- ingest -------------------------------------------------------------------------


def _build_tokenizer(cfg: DataConfig, raw_dir: Path) -> Tokenizer:
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    texts = (
        text for batch in read_documents(raw_dir, [TEXT]) for text in batch.column(0).to_pylist()
    )
    return train_bpe(texts, cfg.vocab_size)


def ingest_text(
    cfg: DataConfig, root: Path, raw_dir: Path, quarantine_dir: Path, report_path: Path
) -> TextReport:
    """Validate the text source and snapshot its documents and tokenizer into `raw_dir`.
    On any failure `raw_dir` and `quarantine_dir` stay exactly as they were."""
    files = list_files(cfg, root)
    report = TextReport(source=cfg.source)
    rejected: list[dict] = []
    with (
        Progress(f"ingest {cfg.source}", len(files), "files") as progress,
        atomic_dir(raw_dir) as raw_stage,
        atomic_dir(quarantine_dir) as q_stage,
    ):
        writer = _DocumentWriter(raw_stage / DOCUMENTS_FILE)
        used = 0  # bytes of accepted files: the budget counts text kept, not files refused
        try:
            for file in files:
                size = file.path.stat().st_size
                if cfg.max_bytes is not None and used + size > cfg.max_bytes:
                    break  # whole files in order: stop at the first that does not fit
                report.files_in += 1
                progress.advance()
                try:
                    data = file.path.read_bytes()
                except OSError as exc:
                    raise DataError(f"cannot read {file.name}: {exc}") from exc
                text, reason, detail = decode_text(data)
                if text is None:
                    report.add_rejected(reason, f"{file.name} ({detail})")
                    rejected.append(
                        {
                            PATH: file.name,
                            "reason": reason,
                            "detail": detail,
                            "size_bytes": len(data),
                        }
                    )
                    continue
                used += len(data)
                keys, texts = documents_of(file, text, cfg.split_by)
                writer.add(file.name, keys, texts, len(data))
                report.files_accepted += 1
                report.documents += len(texts)
                report.bytes_accepted += sum(len(t.encode("utf-8")) for t in texts)
        finally:
            writer.close()
        if report.files_quarantined and cfg.on_invalid == "fail":
            raise DataError(
                f"files under {_where(cfg)} that are not usable text, nothing was written.\n"
                f"{report.describe()}\n"
                "Fix or remove them, or set data.on_invalid: quarantine to set them aside "
                "(listed in data/quarantine/)"
            )
        if report.documents == 0:
            raise DataError(_empty_corpus_message(cfg, files, report))
        quarantined = pa.Table.from_pylist(rejected, schema=QUARANTINE_SCHEMA)
        pq.write_table(quarantined, q_stage / QUARANTINE_FILE)
        tokenizer = _build_tokenizer(cfg, raw_stage)
        tokenizer.save(raw_stage / TOKENIZER_FILE)
        report.tokenizer, report.vocab_size = tokenizer.kind, tokenizer.vocab_size
    write_json(report_path, report.to_dict())
    return report


def _where(cfg: DataConfig) -> str:
    return "the stdlib source" if cfg.source == "stdlib" else f"data.path {cfg.path!r}"


def _empty_corpus_message(cfg: DataConfig, files: list[TextFile], report: TextReport) -> str:
    where = _where(cfg)
    if report.files_in == 0:
        first = files[0]
        return (
            f"{where} gave no text: its first file {first.name} alone is "
            f"{first.path.stat().st_size} bytes, above data.max_bytes ({cfg.max_bytes}); "
            "raise data.max_bytes"
        )
    return f"{where} has no usable text file.\n{report.describe()}"
