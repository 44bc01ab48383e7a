"""Data plane: stable splits, verifiable shards, and rank assignment as a pure function."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.config import ShardConfig
from training.data.loader import (
    LoaderPosition,
    RankLoader,
    ShardReader,
    batches_per_epoch,
    epoch_permutation,
    open_reader,
    rank_slice,
    strided_rows,
)
from training.data.manifest import (
    MANIFEST_VERSION,
    file_sha256,
    read_manifest,
    split_codes,
    split_shards,
)
from training.data.shards import RunningMoments, write_shards
from training.data.sources import RawLayout, to_table
from training.errors import DataError


def test_split_is_deterministic_and_proportional() -> None:
    keys = np.arange(200_000, dtype=np.uint64)
    codes = split_codes(keys, 0.15, 0.10)
    assert np.array_equal(codes, split_codes(keys.copy(), 0.15, 0.10))
    assert np.mean(codes == 2) == pytest.approx(0.10, abs=0.005)
    assert np.mean(codes == 1) == pytest.approx(0.15, abs=0.005)
    # Pinned values: the split of a key must never change across versions.
    pinned = [0, 2, 2, 1, 1, 1, 0, 2, 0, 0, 2, 1]
    assert split_codes(np.arange(12, dtype=np.uint64), 0.3, 0.3).tolist() == pinned


CLASSES = RawLayout("synthetic", (4,), "int64", 3)


def _raw(tmp_path, n: int, name: str = "part.parquet"):
    import pyarrow.parquet as pq

    rng = np.random.default_rng(n)
    table = to_table(np.arange(n), rng.random((n, 4)), rng.integers(0, 3, n), CLASSES)
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    pq.write_table(table, raw / name)
    return raw


def _split_by_key(shard_dir) -> dict[str, str]:
    manifest = read_manifest(shard_dir)
    found = {}
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            table = ipc.open_file(pa.memory_map(str(shard_dir / shard["file"]))).read_all()
            found.update({k: split for k in table.column("row_id").to_pylist()})
    return found


def test_split_of_a_row_survives_appended_data(tmp_path) -> None:
    cfg = ShardConfig(target_shard_mb=0.002)
    raw = _raw(tmp_path, 500)
    write_shards(cfg, raw, tmp_path / "a", "v1")
    before = _split_by_key(tmp_path / "a")
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    extra = to_table(
        np.arange(10**6, 10**6 + 300), rng.random((300, 4)), rng.integers(0, 3, 300), CLASSES
    )
    pq.write_table(extra, raw / "zz-appended.parquet")
    write_shards(cfg, raw, tmp_path / "b", "v2")
    after = _split_by_key(tmp_path / "b")
    assert len(after) == 800
    assert {k: after[k] for k in before} == before


def test_manifest_describes_and_verifies_shards(tiny_shards) -> None:
    manifest = json.loads((tiny_shards / "manifest.json").read_text())
    assert manifest["data_version"] == "test-md5"
    assert manifest["feature_shape"] == [8, 8] and manifest["num_classes"] == 10
    total = 0
    for info in manifest["splits"].values():
        assert info["rows"] == sum(s["rows"] for s in info["shards"])
        assert len(info["shards"]) >= 2 or info["rows"] < 100
        for shard in info["shards"]:
            assert file_sha256(tiny_shards / shard["file"]) == shard["sha256"]
        total += info["rows"]
    assert total == 600


def test_shards_are_uncompressed_single_batch_ipc(tiny_shards) -> None:
    manifest = read_manifest(tiny_shards)
    path = tiny_shards / manifest["splits"]["train"]["shards"][0]["file"]
    reader = ipc.open_file(pa.memory_map(str(path)))
    assert reader.num_record_batches == 1
    # Zero-copy: the feature view points into the memory-mapped file.
    features = reader.get_batch(0).column(1).flatten().to_numpy(zero_copy_only=True)
    assert not features.flags.owndata


def test_failed_shard_leaves_previous_output(tmp_path) -> None:
    raw = _raw(tmp_path, 200)
    out = tmp_path / "shards"
    write_shards(ShardConfig(target_shard_mb=0.002), raw, out, "v1")
    before = sorted(p.name for p in out.iterdir())
    (raw / "part.parquet").write_bytes(b"not parquet")
    with pytest.raises(pa.ArrowInvalid):
        write_shards(ShardConfig(target_shard_mb=0.002), raw, out, "v2")
    assert sorted(p.name for p in out.iterdir()) == before
    assert read_manifest(out)["data_version"] == "v1"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shards")]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5000),
    world=st.sampled_from([1, 2, 3, 4, 8, 16, 64, 176]),
    per_rank=st.integers(1, 16),
    epoch=st.integers(0, 5),
)
def test_every_sample_at_most_once_and_equal_batches(rows, world, per_rank, epoch) -> None:
    global_batch = world * per_rank
    perm = epoch_permutation(rows, seed=3, epoch=epoch)
    n_batches = batches_per_epoch(rows, global_batch)
    seen = []
    for rank in range(world):
        mine = [perm[rank_slice(k, global_batch, world, rank)] for k in range(n_batches)]
        assert all(len(b) == per_rank for b in mine)  # equal batches on every rank
        seen.extend(np.concatenate(mine) if mine else [])
    # Exactly once for all but the dropped tail (< one global batch).
    assert len(seen) == len(set(seen)) == n_batches * global_batch
    assert rows - len(seen) < global_batch


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 3000), world=st.sampled_from([1, 2, 3, 7, 32, 176]))
def test_evaluation_rows_cover_split_exactly_once(rows, world) -> None:
    parts = [strided_rows(rows, world, r) for r in range(world)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(rows))


def test_global_batches_do_not_depend_on_world_size() -> None:
    perm = epoch_permutation(1000, seed=0, epoch=2)
    for k in range(3):
        one = perm[rank_slice(k, 64, 1, 0)]
        four = np.concatenate([perm[rank_slice(k, 64, 4, r)] for r in range(4)])
        assert np.array_equal(one, four)


def test_loader_resumes_mid_epoch_on_another_world_size(tiny_shards) -> None:
    manifest = read_manifest(tiny_shards)
    reader = open_reader(tiny_shards, manifest, "train")

    def rows_from(world: int, start: int) -> list[np.ndarray]:
        loaders = [
            RankLoader(reader, rank=r, world_size=world, global_batch=16, seed=5)
            for r in range(world)
        ]
        per_rank = [list(ld.batches(epoch=1, start=start)) for ld in loaders]
        steps = []
        for step in zip(*per_rank, strict=True):
            # The global batch of a step as a set of rows (order inside it is storage order).
            x = np.concatenate([b[0] for b in step])
            steps.append(x[np.lexsort(x.T[::-1])])
        return steps

    full = rows_from(2, 0)
    k = 7
    state = LoaderPosition(epoch=1, batch_index=k).state_dict()
    resumed = LoaderPosition.from_state_dict(json.loads(json.dumps(state)))
    for world in (1, 2, 4):
        rest = rows_from(world, resumed.batch_index)
        assert len(rest) == len(full) - k
        assert all(np.array_equal(a, b) for a, b in zip(rest, full[k:], strict=True))


def test_loader_state_of_another_version_is_refused() -> None:
    with pytest.raises(DataError, match="cannot resume"):
        LoaderPosition.from_state_dict({"version": 99, "epoch": 0, "batch_index": 0})


def test_reader_gathers_across_shards(tiny_shards) -> None:
    manifest = read_manifest(tiny_shards)
    reader = open_reader(tiny_shards, manifest, "train")
    assert isinstance(reader, ShardReader) and reader.num_rows > 200
    idx = np.array([0, reader.num_rows - 1, 150, 99, 100])
    x, y = reader.gather(idx)
    assert x.shape == (5, 64) and x.dtype == np.float32 and y.dtype == np.int64
    # Rows come back in storage order, each exactly the row at its index.
    singles = [reader.gather(np.array([i])) for i in sorted(idx)]
    assert np.array_equal(x, np.concatenate([s[0] for s in singles]))
    assert np.array_equal(y, np.concatenate([s[1] for s in singles]))


@pytest.mark.timeout(120)
def test_dataloader_workers_yield_the_same_batches_in_order(tiny_shards) -> None:
    manifest = read_manifest(tiny_shards)
    loader = RankLoader(
        open_reader(tiny_shards, manifest, "train"), rank=1, world_size=2, global_batch=32, seed=2
    )
    inline = list(loader.tensors(epoch=3, start=2))
    pooled = list(loader.tensors(epoch=3, start=2, workers=2))
    assert len(inline) == len(pooled) == loader.batches_per_epoch - 2
    for (xa, ya), (xb, yb) in zip(inline, pooled, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_small_batches_gathered_in_groups_are_the_batches_gathered_one_by_one(
    tiny_shards, monkeypatch
) -> None:
    """The loader gathers small batches several at a time (one gather's fixed cost
    amortised): the same rows in the same order as one gather per batch."""
    import training.data.loader as loader_module

    manifest = read_manifest(tiny_shards)
    reader = open_reader(tiny_shards, manifest, "train")
    loader = RankLoader(reader, rank=0, world_size=2, global_batch=16, seed=5)

    def batches(small_batch_bytes: int) -> list:
        monkeypatch.setattr(loader_module, "SMALL_BATCH_BYTES", small_batch_bytes)
        return list(loader.batches(epoch=1, start=1, every=2))

    grouped, single = batches(1 << 30), batches(0)
    assert len(grouped) == len(single) == len(range(1, loader.batches_per_epoch, 2))
    for (xa, ya), (xb, yb) in zip(grouped, single, strict=True):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_manifest_of_images_describes_classes_without_statistics(tiny_shards) -> None:
    manifest = read_manifest(tiny_shards)
    assert manifest["version"] == MANIFEST_VERSION
    assert manifest["kind"] == "image" and manifest["label_type"] == "int64"
    assert manifest["feature_stats"] is None and manifest["label_stats"] is None
    assert manifest["feature_names"] is None


REGRESSION = RawLayout("parquet", (3,), "float32", None, ("wide", "constant", "shifted"))


def _regression_raw(tmp_path, n: int = 3000):
    import pyarrow.parquet as pq

    rng = np.random.default_rng(7)
    features = np.c_[rng.normal(0, 1000, n), np.full(n, 5.0), rng.normal(1e4, 0.01, n)]
    labels = rng.normal(40, 3, n)
    raw = tmp_path / "raw"
    raw.mkdir()
    # Two files, so the statistics are merged across files and batches.
    pq.write_table(
        to_table(np.arange(n // 2), features[: n // 2], labels[: n // 2], REGRESSION),
        raw / "part-00000.parquet",
    )
    pq.write_table(
        to_table(np.arange(n // 2, n), features[n // 2 :], labels[n // 2 :], REGRESSION),
        raw / "part-00001.parquet",
    )
    return raw


def _split_arrays(shard_dir, manifest, split):
    tables = [
        ipc.open_file(pa.memory_map(str(s.path))).read_all()
        for s in split_shards(shard_dir, manifest, split)
    ]
    table = pa.concat_tables(tables)
    x = table.column("features").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    return x.astype(np.float64), table.column("label").to_numpy().astype(np.float64)


def test_table_statistics_come_from_the_train_split(tmp_path) -> None:
    raw = _regression_raw(tmp_path)
    out = tmp_path / "shards"
    manifest = write_shards(ShardConfig(target_shard_mb=0.01), raw, out, "v1", batch_rows=256)
    assert manifest["kind"] == "table" and manifest["label_type"] == "float32"
    assert manifest["num_classes"] is None
    assert manifest["feature_names"] == ["wide", "constant", "shifted"]
    x, y = _split_arrays(out, manifest, "train")
    stats = manifest["feature_stats"]
    assert np.allclose(stats["mean"], x.mean(axis=0), rtol=1e-12)
    assert np.allclose([stats["std"][0], stats["std"][2]], x.std(axis=0)[[0, 2]], rtol=1e-9)
    assert stats["std"][1] == 1.0  # a constant column is divided by 1, not by ~0
    assert manifest["label_stats"]["mean"] == pytest.approx(y.mean(), rel=1e-12)
    assert manifest["label_stats"]["std"] == pytest.approx(y.std(), rel=1e-9)
    # Not the statistics of every row: val and test rows stay unseen.
    all_y = np.concatenate([y] + [_split_arrays(out, manifest, s)[1] for s in ("val", "test")])
    assert manifest["label_stats"]["mean"] != pytest.approx(all_y.mean(), rel=1e-9)


def test_reader_returns_labels_in_the_shards_type(tmp_path) -> None:
    raw = _regression_raw(tmp_path, 400)
    manifest = write_shards(ShardConfig(target_shard_mb=0.002), raw, tmp_path / "s", "v1")
    reader = open_reader(tmp_path / "s", manifest, "train")
    x, y = reader.gather(np.arange(reader.num_rows))
    assert x.dtype == np.float32 and y.dtype == np.float32
    assert reader.row_bytes == 3 * 4 + 4
    assert np.array_equal(y, _split_arrays(tmp_path / "s", manifest, "train")[1].astype(np.float32))


def test_manifest_of_another_version_is_refused(tiny_shards, tmp_path) -> None:
    manifest = read_manifest(tiny_shards)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    with pytest.raises(DataError, match="re-run the shard stage"):
        read_manifest(tmp_path)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    cuts=st.lists(st.integers(0, 300), max_size=6),
    scale=st.sampled_from([1e-3, 1.0, 1e6]),
    offset=st.sampled_from([0.0, 1e8]),
)
def test_running_moments_agree_with_numpy_however_rows_are_batched(rows, cuts, scale, offset):
    values = np.random.default_rng(rows).normal(offset, scale, (rows, 2)).astype(np.float32)
    values[:, 1] = 3.0  # constant
    moments = RunningMoments()
    bounds = sorted({0, rows, *(c for c in cuts if c < rows)})
    for start, stop in itertools.pairwise(bounds):
        moments.add(values[start:stop])
    mean, std = moments.result()
    exact = values.astype(np.float64)
    assert np.allclose(mean, exact.mean(axis=0), rtol=1e-12, atol=1e-9 * scale)
    expected_std = exact.std(axis=0)
    if expected_std[0] >= 1e-6:
        assert std[0] == pytest.approx(expected_std[0], rel=1e-6)
    assert std[1] == 1.0
