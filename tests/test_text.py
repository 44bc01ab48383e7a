"""The text data plane: sources, validation, tokenizers, token shards and window reading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch

from training.config import DataConfig, ShardConfig
from training.data.ingest import ingest
from training.data.loader import (
    LoaderPosition,
    RankLoader,
    epoch_permutation,
    open_reader,
    rank_slice,
)
from training.data.manifest import file_sha256, read_manifest, split_codes, split_shards
from training.data.shards import write_shards
from training.data.text import DOCUMENTS_FILE, QUARANTINE_FILE, list_files, paragraphs
from training.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    load_tokenizer,
    shard_tokenizer,
    train_bpe,
)
from training.data.tokens import TokenReader
from training.errors import DataError

SAMPLES = [
    "plain ascii",
    "héllo wörld, ünïcode — and 漢字 and an emoji 🤖\n",
    "def f(x):\n\treturn x  # tabs, \r\n windows line ends\n\n\nand blank lines",
    "text that mentions <|endoftext|> is only text",
    "",
]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "mu"]


def write_corpus(folder: Path, count: int, seed: int = 0) -> None:
    """`count` small files of distinct paragraphs: file i starts with its own name."""
    rng = random.Random(seed)
    for i in range(count):
        paras = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
            for _ in range(rng.randint(1, 4))
        ]
        path = folder / f"dir{i % 3}" / f"file{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"file {i}\n" + "\n\n".join(paras) + "\n")


def build(base: Path, data: DataConfig, shard: ShardConfig | None = None) -> Path:
    base.mkdir(parents=True, exist_ok=True)  # data.path may be relative to it, with ".."
    ingest(data, base, base / "raw", base / "quarantine", base / "ingest.json")
    shard = shard or ShardConfig(val_fraction=0.2, test_fraction=0.2)
    write_shards(shard, base / "raw", base / "shards", "v-test")
    return base / "shards"


def split_stream(shard_dir: Path, split: str) -> np.ndarray:
    """A split's whole token stream, read straight from its shards."""
    manifest = read_manifest(shard_dir)
    parts = []
    for info in split_shards(shard_dir, manifest, split):
        with pa.memory_map(str(info.path)) as source:
            parts.append(ipc.open_file(source).read_all().column(0).to_numpy())
    return np.concatenate(parts)


def split_documents(shard_dir: Path, split: str) -> list[str]:
    manifest = read_manifest(shard_dir)
    tokenizer = shard_tokenizer(shard_dir, manifest)
    stream = split_stream(shard_dir, split).tolist()
    docs, current = [], []
    for token in stream:
        if token == tokenizer.eot:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    assert current == []  # every document ends with eot
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("corpus")
    write_corpus(base / "incoming", 60)
    return base


@pytest.fixture(scope="module")
def stdlib_text() -> list[str]:
    cfg = DataConfig(source="stdlib")
    return [f.path.read_text(encoding="utf-8") for f in list_files(cfg, Path("."))[:40]]


# ---- tokenizers ----------------------------------------------------------------------


def test_bytes_tokenizer_round_trips(tmp_path) -> None:
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.eot) == (257, 256)
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text and max(ids, default=0) < 256
        assert tokenizer.token_bytes()[ids].sum() == len(text.encode("utf-8"))
    stream = tokenizer.encode_documents(SAMPLES)
    assert (stream == tokenizer.eot).sum() == len(SAMPLES)
    tokenizer.save(tmp_path / TOKENIZER_FILE)
    again = load_tokenizer(tmp_path / TOKENIZER_FILE)
    assert again.kind == "bytes" and again.encode(SAMPLES[1]) == tokenizer.encode(SAMPLES[1])


def test_bpe_tokenizer_round_trips_and_is_deterministic(tmp_path, stdlib_text) -> None:
    first = train_bpe(iter(stdlib_text), vocab_size=600)
    second = train_bpe(iter(stdlib_text), vocab_size=600)
    first.save(tmp_path / "a.json")
    second.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()

    loaded = load_tokenizer(tmp_path / "a.json")
    assert loaded.kind == "bpe" and loaded.vocab_size == 600
    counts = loaded.token_bytes()
    assert counts[loaded.eot] == 0 and counts.min() == 0 and counts.max() > 1
    for text in [*SAMPLES, stdlib_text[3]]:
        ids = loaded.encode(text)
        assert loaded.decode(ids) == text
        assert loaded.eot not in ids  # text never produces the end-of-document id
        assert counts[ids].sum() == len(text.encode("utf-8"))
    # Merges were learnt: real code takes fewer tokens than bytes.
    assert len(loaded.encode(stdlib_text[3])) < 0.6 * len(stdlib_text[3].encode())
    assert loaded.encode_documents(SAMPLES[:2]).tolist() == (
        [*loaded.encode(SAMPLES[0]), loaded.eot, *loaded.encode(SAMPLES[1]), loaded.eot]
    )


# ---- sources and validation ------------------------------------------------------------


def test_stdlib_source_respects_max_bytes_and_is_deterministic(tmp_path) -> None:
    cfg = DataConfig(source="stdlib", max_bytes=150_000)
    files = list_files(cfg, tmp_path)
    assert files and not any(
        part in ("test", "tests", "idle_test", "site-packages")
        for f in files
        for part in f.name.split("/")
    )
    # Whole files, in sorted order, up to the first that would exceed the budget.
    sizes = np.cumsum([f.path.stat().st_size for f in files])
    taken = int(np.searchsorted(sizes, cfg.max_bytes, side="right"))
    runs = []
    for name in ("a", "b"):
        base = tmp_path / name
        report = ingest(cfg, base, base / "raw", base / "q", base / "ingest.json")
        assert report.files_accepted == taken and report.bytes_accepted == sizes[taken - 1]
        assert report.bytes_accepted <= cfg.max_bytes < sizes[taken]
        runs.append(pq.read_table(base / "raw" / DOCUMENTS_FILE))
    assert runs[0].equals(runs[1])
    paths = runs[0].column("path").to_pylist()
    assert paths == [f.name for f in files[:taken]]
    assert not any(p.startswith("/") for p in paths)  # no machine path in the snapshot
    assert json.loads((tmp_path / "a" / "ingest.json").read_text())["files_accepted"] == taken


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"caf\xe9 latin-1, not UTF-8\n", "not UTF-8"),
        (b"", "empty"),
        (b" \n\t\n", "empty"),
        (b"PK\x03\x04\x00\x00binary zip header", "binary"),
        (bytes(range(1, 9)) * 10 + b"ab", "binary"),
    ],
)
def test_bad_file_is_named_in_the_error_and_can_be_quarantined(tmp_path, content, reason) -> None:
    write_corpus(tmp_path / "incoming", 4)
    bad = tmp_path / "incoming" / "dir1" / "bad.txt"
    bad.write_bytes(content)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "previous").write_text("kept")
    cfg = DataConfig(source="text", path="incoming")
    with pytest.raises(DataError) as failure:
        ingest(cfg, tmp_path, tmp_path / "raw", tmp_path / "q", tmp_path / "ingest.json")
    message = str(failure.value)
    assert "dir1/bad.txt" in message and reason in message
    assert "data.on_invalid: quarantine" in message
    # Nothing half-written: the previous snapshot is untouched.
    assert [p.name for p in (tmp_path / "raw").iterdir()] == ["previous"]
    assert not (tmp_path / "ingest.json").exists()

    cfg = DataConfig(source="text", path="incoming", on_invalid="quarantine")
    report = ingest(cfg, tmp_path, tmp_path / "raw", tmp_path / "q", tmp_path / "ingest.json")
    assert (report.files_in, report.files_accepted, report.files_quarantined) == (5, 4, 1)
    assert report.to_dict()["invalid_by_reason"] == {reason: 1}
    aside = pq.read_table(tmp_path / "q" / QUARANTINE_FILE).to_pylist()
    assert [(r["path"], r["reason"]) for r in aside] == [("dir1/bad.txt", reason)]
    stored = pq.read_table(tmp_path / "raw" / DOCUMENTS_FILE).column("path").to_pylist()
    assert "dir1/bad.txt" not in stored and len(stored) == 4


def test_empty_corpus_is_an_error(tmp_path) -> None:
    (tmp_path / "incoming").mkdir()
    (tmp_path / "incoming" / "blank.txt").write_text("  \n\n \n")
    cfg = DataConfig(source="text", path="incoming", on_invalid="quarantine")
    with pytest.raises(DataError, match=r"(?s)no usable text file.*blank\.txt"):
        ingest(cfg, tmp_path, *_outs(tmp_path))
    with pytest.raises(DataError, match="no files matching"):
        ingest(cfg.model_copy(update={"text_glob": "*.md"}), tmp_path, *_outs(tmp_path))
    (tmp_path / "incoming" / "big.txt").write_text("x" * 1000)
    with pytest.raises(DataError, match=r"raise data\.max_bytes"):
        ingest(cfg.model_copy(update={"max_bytes": 100}), tmp_path, *_outs(tmp_path))
    assert not (tmp_path / "raw").exists()


def _outs(base: Path) -> tuple[Path, Path, Path]:
    return base / "raw", base / "q", base / "r.json"


def test_paragraphs_split_on_blank_lines_and_keep_indentation() -> None:
    text = "\n\na\nb\n\n  \n    indented\n\n\n\nlast\n"
    assert paragraphs(text) == ["a\nb", "    indented", "last\n"]


# ---- shards --------------------------------------------------------------------------


@pytest.mark.parametrize("split_by", ["file", "document"])
def test_split_of_a_document_survives_added_files(tmp_path, split_by) -> None:
    write_corpus(tmp_path / "one" / "incoming", 40)
    write_corpus(tmp_path / "two" / "incoming", 40)
    extra = tmp_path / "two" / "incoming" / "dir0" / "added.txt"
    extra.write_text("an added file\n\nwith two paragraphs\n")
    cfg = DataConfig(source="text", path="incoming", split_by=split_by)
    splits = ("train", "val", "test")
    before = {s: split_documents(build(tmp_path / "one", cfg), s) for s in splits}
    after = {s: split_documents(build(tmp_path / "two", cfg), s) for s in splits}
    old = {d for docs in before.values() for d in docs}
    for split, docs in before.items():
        # Old documents stay in their split, in their order; only new ones join.
        assert [d for d in after[split] if d in old] == docs
    added = [d for docs in after.values() for d in docs if d not in old]
    assert len(added) == (1 if split_by == "file" else 2)


def test_token_manifest_describes_and_verifies_shards(corpus) -> None:
    shards = build(corpus / "manifest", DataConfig(source="text", path="../incoming"))
    manifest = read_manifest(shards)
    assert manifest["kind"] == "tokens" and manifest["schema"] == {"tokens": "uint16"}
    assert (manifest["vocab_size"], manifest["eot_token"]) == (257, 256)
    tokenizer = manifest["tokenizer"]
    assert (tokenizer["kind"], tokenizer["file"]) == ("bytes", TOKENIZER_FILE)
    assert tokenizer["sha256"] == file_sha256(shards / TOKENIZER_FILE)
    assert (shards / TOKENIZER_FILE).is_file()
    docs = 0
    for split, info in manifest["splits"].items():
        stream = split_stream(shards, split)
        assert info["tokens"] == len(stream) == sum(s["rows"] for s in info["shards"])
        assert info["documents"] == (stream == 256).sum() and stream.dtype == np.uint16
        docs += info["documents"]
    assert docs == 60


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_token_bytes_sum_to_the_test_splits_text(corpus, tokenizer) -> None:
    cfg = DataConfig(source="text", path="../incoming", tokenizer=tokenizer, vocab_size=300)
    shard_cfg = ShardConfig(val_fraction=0.2, test_fraction=0.2, target_shard_mb=0.001)
    shards = build(corpus / tokenizer, cfg, shard_cfg)
    manifest = read_manifest(shards)
    raw = pq.read_table(corpus / tokenizer / "raw" / DOCUMENTS_FILE)
    codes = split_codes(raw.column("row_id").to_numpy(), 0.2, 0.2)
    texts = [t for t, c in zip(raw.column("text").to_pylist(), codes, strict=True) if c == 2]
    expected = sum(len(t.encode("utf-8")) for t in texts)
    counts = shard_tokenizer(shards, manifest).token_bytes()
    assert manifest["splits"]["test"]["bytes"] == expected
    assert counts[split_stream(shards, "test")].sum() == expected
    assert split_documents(shards, "test") == texts


def test_an_empty_split_is_a_clear_error(tmp_path) -> None:
    write_corpus(tmp_path / "incoming", 1)
    cfg = DataConfig(source="text", path="incoming")
    with pytest.raises(DataError, match=r"is empty .*split_by: document"):
        build(tmp_path, cfg)
    assert not (tmp_path / "shards").exists()


# ---- reading windows -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_token_shards(corpus) -> Path:
    """Shards of about 60 tokens: windows cross one or several shard boundaries."""
    cfg = DataConfig(source="text", path="../incoming")
    shard_cfg = ShardConfig(val_fraction=0.2, test_fraction=0.2, target_shard_mb=120 / 2**20)
    return build(corpus / "tiny", cfg, shard_cfg)


@pytest.mark.parametrize("context", [1, 7, 50, 130])
def test_windows_are_the_stream_shifted_by_one_across_shards(tiny_token_shards, context) -> None:
    manifest = read_manifest(tiny_token_shards)
    stream = split_stream(tiny_token_shards, "train").astype(np.int64)
    reader = open_reader(tiny_token_shards, manifest, "train", context=context)
    assert isinstance(reader, TokenReader) and len(reader.shards) > 10
    assert reader.num_rows == (len(stream) - 1) // context
    order = np.random.default_rng(0).permutation(reader.num_rows)
    x, y = reader.gather(order)
    assert x.shape == y.shape == (reader.num_rows, context) and x.dtype == y.dtype == np.int64
    starts = np.arange(reader.num_rows) * context  # rows come back sorted
    assert np.array_equal(x, stream[starts[:, None] + np.arange(context)])
    assert np.array_equal(y, stream[starts[:, None] + np.arange(context) + 1])
    assert reader.row_bytes == x[0].nbytes + y[0].nbytes


def test_token_reader_refuses_what_it_cannot_read(tiny_token_shards) -> None:
    manifest = read_manifest(tiny_token_shards)
    with pytest.raises(ValueError, match="context"):
        open_reader(tiny_token_shards, manifest, "train")
    with pytest.raises(DataError, match="too few"):
        open_reader(tiny_token_shards, manifest, "test", context=10**7)


def test_rank_loader_over_tokens_is_world_size_free_and_resumes(tiny_token_shards) -> None:
    manifest = read_manifest(tiny_token_shards)
    reader = open_reader(tiny_token_shards, manifest, "train", context=16)
    global_batch = 8

    def steps_from(world: int, start: int) -> list[np.ndarray]:
        loaders = [
            RankLoader(reader, rank=r, world_size=world, global_batch=global_batch, seed=3)
            for r in range(world)
        ]
        per_rank = [list(ld.batches(epoch=1, start=start)) for ld in loaders]
        return [np.concatenate([b[0] for b in step]) for step in zip(*per_rank, strict=True)]

    # The global batch of step k is the k-th slice of the epoch's one permutation.
    order = epoch_permutation(reader.num_rows, seed=3, epoch=1)
    full = steps_from(1, 0)
    assert len(full) == reader.num_rows // global_batch
    for k in (0, 5, len(full) - 1):
        rows = np.sort(order[rank_slice(k, global_batch, 1, 0)])
        assert np.array_equal(full[k], reader.gather(rows)[0])
    k = 5
    state = LoaderPosition(epoch=1, batch_index=k).state_dict()
    resumed = LoaderPosition.from_state_dict(json.loads(json.dumps(state)))
    for world in (1, 2, 4):
        rest = steps_from(world, resumed.batch_index)
        assert len(rest) == len(full) - k
        for got, want in zip(rest, full[k:], strict=True):
            # Each rank's share is sorted by itself: compare a step's rows as a set.
            assert np.array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)])


@pytest.mark.timeout(120)
def test_dataloader_workers_rebuild_token_readers(tiny_token_shards) -> None:
    manifest = read_manifest(tiny_token_shards)
    reader = open_reader(tiny_token_shards, manifest, "train", context=16)
    loader = RankLoader(reader, rank=1, world_size=2, global_batch=8, seed=2)
    inline = list(loader.tensors(epoch=0, start=3))
    pooled = list(loader.tensors(epoch=0, start=3, workers=2))
    assert len(inline) == len(pooled) == loader.batches_per_epoch - 3
    for (xa, ya), (xb, yb) in zip(inline, pooled, strict=True):
        assert xa.shape == (4, 16) and torch.equal(xa, xb) and torch.equal(ya, yb)
