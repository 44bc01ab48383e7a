"""Drift before retraining: PSI and Jensen-Shannon against hand-computed values, the data
profile's bins and counts, the policy (warn, block, accepted), and a real run: a
champion trained on a tiny table, then new data with one shifted feature, which is
flagged with its PSI; `block` stops before training and leaves the registry as it was,
`warn` trains and the gate's verdict names the drift."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.config import DataConfig
from training.config.sections import OrchestrateConfig
from training.data.drift import (
    EPSILON,
    compare,
    js_divergence,
    not_comparable,
    over_threshold,
    psi,
)
from training.data.ingest import ingest
from training.data.profile import (
    BinCounter,
    HashSample,
    Shape,
    profile_raw,
    quantile_edges,
)
from training.mlops.drift import decide

from .conftest import _gradline, copy_project

# ---- the measures, by hand ------------------------------------------------------------


def test_psi_equals_the_hand_computed_value() -> None:
    # shares 0.5/0.5 -> 0.9/0.1: 0.4 ln(0.9/0.5) + (-0.4) ln(0.1/0.5)
    expected = 0.4 * math.log(1.8) - 0.4 * math.log(0.2)
    assert psi([50, 50], [90, 10]) == pytest.approx(expected, rel=1e-12)
    assert psi([50, 50], [90, 10]) == pytest.approx(0.878890, abs=1e-6)


def test_psi_counts_an_empty_bin_as_epsilon() -> None:
    # The reference left bin 2 empty: its share counts as EPSILON, so the log stays finite
    # and the rows that moved there weigh heavily.
    expected = (0.5 - 1.0) * math.log(0.5 / 1.0) + (0.5 - EPSILON) * math.log(0.5 / EPSILON)
    assert psi([100, 0], [50, 50]) == pytest.approx(expected, rel=1e-12)
    assert psi([100, 0], [50, 50]) == pytest.approx(4.604318, abs=1e-6)


def test_psi_is_zero_for_the_same_shares_and_grows_with_the_shift() -> None:
    counts = [10, 30, 40, 20]
    assert psi(counts, counts) == 0.0
    assert psi(counts, [c * 7 for c in counts]) == pytest.approx(0.0, abs=1e-15)  # sizes differ
    small = psi(counts, [12, 30, 38, 20])
    large = psi(counts, [40, 30, 20, 10])
    assert 0 < small < 0.01 < 0.2 < large
    with pytest.raises(ValueError, match="bins differ"):
        psi([1, 2], [1, 2, 3])


def test_js_divergence_equals_the_hand_computed_values() -> None:
    assert js_divergence([1, 0], [0, 1]) == pytest.approx(1.0)  # disjoint: one bit
    # P = (1/2, 1/2), Q = (1, 0), M = (3/4, 1/4):
    # KL(P||M) = 1/2 log2(2/3) + 1/2 log2(2), KL(Q||M) = log2(4/3)
    by_hand = 0.5 * (0.5 * math.log2(2 / 3) + 0.5 + math.log2(4 / 3))
    assert js_divergence([5, 5], [7, 0]) == pytest.approx(by_hand, rel=1e-12)
    assert js_divergence([5, 5], [7, 0]) == pytest.approx(0.311278, abs=1e-6)
    assert js_divergence([5, 5], [7, 0]) == pytest.approx(js_divergence([7, 0], [5, 5]))
    assert js_divergence([3, 1, 0, 6], [30, 10, 0, 60]) == pytest.approx(0.0, abs=1e-15)


# ---- the profile's bins and counts ----------------------------------------------------


def test_quantile_edges_frame_the_deciles_and_keep_a_bin_each_side_of_a_constant() -> None:
    values = np.arange(1, 101, dtype=np.float32)
    sample = np.stack([values, np.full(100, 3.0, dtype=np.float32)], axis=1)
    varied, constant = quantile_edges(sample)
    # minimum, the deciles (actual values: inverted CDF), the next float above the maximum
    inner = [10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert varied.tolist() == [1.0, *map(float, inner), float(np.nextafter(np.float32(100), 1e9))]
    assert constant.tolist() == [3.0, float(np.nextafter(np.float32(3), np.float32(4)))]


def test_bin_counter_counts_each_value_in_its_half_open_bin() -> None:
    counter = BinCounter([np.array([0.0, 1.0, 2.0]), np.array([5.0])])
    counter.add(np.array([[-1.0, 4.0], [0.0, 5.0], [0.5, 6.0]], dtype=np.float32))
    counter.add(np.array([[1.0, 5.0], [2.0, 0.0], [9.0, 9.0]], dtype=np.float32))
    # column 0 bins: (-inf, 0) [0, 1) [1, 2) [2, inf); column 1: (-inf, 5) [5, inf)
    assert counter.counts() == [[1, 2, 1, 2], [2, 4]]
    assert counter.rows == 6


def test_the_hash_sample_does_not_depend_on_order_or_batching() -> None:
    rng = np.random.default_rng(0)
    keys = np.arange(5000, dtype=np.uint64)
    rows = rng.standard_normal((5000, 3)).astype(np.float32)
    whole = HashSample(300, 3)
    whole.add(keys, rows)
    order = rng.permutation(5000)
    pieces = HashSample(300, 3)
    for chunk in np.array_split(order, 17):  # the buffer fills and is cut many times
        pieces.add(keys[chunk], rows[chunk])
    assert len(whole.values()) == 300 and not whole.complete

    def by_key(sample):
        return sorted(map(tuple, sample.values().tolist()))

    assert by_key(whole) == by_key(pieces)


def _table(path: Path, first: int, rows: int, shift: float = 0.0, classes=(0, 1)) -> None:
    """A user's table: key, x0..x3 and a label (x0 + x1 > 0, or the classes given); x2
    moved by `shift`."""
    rng = np.random.default_rng(first)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    x[:, 2] += shift
    label = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    if classes != (0, 1):
        label = rng.choice(np.asarray(classes), rows)
    columns = {"key": np.arange(first, first + rows), **{f"x{i}": x[:, i] for i in range(4)}}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({**columns, "label": label}), path)


def _ingested(tmp_path: Path, name: str, **table) -> Path:
    source = tmp_path / f"{name}.parquet"
    _table(source, **table)
    cfg = DataConfig(source="parquet", path=str(source), key_column="key", num_classes=3)
    raw = tmp_path / name / "raw"
    ingest(cfg, tmp_path, raw, tmp_path / name / "q", tmp_path / name / "ingest.json")
    return raw


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("reference")
    raw = _ingested(base, "ref", first=0, rows=4000)
    profile, counted = profile_raw(raw)
    assert counted is None
    return base, profile


def test_a_profile_counts_every_row_of_every_feature_and_the_classes(reference) -> None:
    _, profile = reference
    assert profile["kind"] == "table" and profile["rows"] == 4000
    features = profile["features"]
    assert features["names"] == ["x0", "x1", "x2", "x3"]
    for edges, counts in zip(features["edges"], features["counts"], strict=True):
        assert len(counts) == len(edges) + 1 and sum(counts) == 4000
        assert counts[0] == 0 and counts[-1] == 0  # the sample is every row here
        assert all(350 <= c <= 450 for c in counts[1:-1])  # deciles: ~400 rows each
    assert sum(profile["label"]["classes"].values()) == 4000
    assert set(profile["label"]["classes"]) == {"0", "1"}


@pytest.mark.parametrize("sample_values", [1 << 22, 1024])
def test_counts_are_exact_whether_or_not_the_sample_holds_every_row(
    reference, monkeypatch, sample_values
) -> None:
    """Small tables are counted from the sample, larger ones in a second pass (here: a
    2,048-row sample of 4,000 rows); either way the counts are every row's."""
    import training.data.profile as profiling

    base, _ = reference
    monkeypatch.setattr(profiling, "SAMPLE_VALUES", sample_values)
    monkeypatch.setattr(profiling, "CACHE_VALUES", 64)  # counted in blocks of 16 rows
    raw = base / "ref" / "raw"
    profile, _ = profile_raw(raw)
    table = pq.read_table(raw)
    features = np.stack(table.column("features").to_numpy(zero_copy_only=False))
    for column, (edges, counts) in enumerate(
        zip(profile["features"]["edges"], profile["features"]["counts"], strict=True)
    ):
        bins = np.searchsorted(np.asarray(edges, np.float32), features[:, column], "right")
        assert counts == np.bincount(bins, minlength=len(edges) + 1).tolist()


def test_the_same_data_has_no_drift(tmp_path, reference) -> None:
    _, profile = reference
    raw = _ingested(tmp_path, "same", first=0, rows=4000)
    _, counted = profile_raw(raw, profile)
    drift = compare(profile, counted)
    assert drift["psi_max"] == 0.0 and drift["label_psi"] == 0.0
    assert over_threshold(drift, 0.2, 0.1) == []


def test_a_shifted_feature_is_the_most_drifted_and_alone_past_the_threshold(
    tmp_path, reference
) -> None:
    _, profile = reference
    # Other rows of the same distribution, but x2 moved by one standard deviation.
    raw = _ingested(tmp_path, "shifted", first=10_000, rows=3000, shift=1.0)
    _, counted = profile_raw(raw, profile)
    drift = compare(profile, counted)
    ranked = dict(drift["features"])
    assert drift["psi_max_feature"] == "x2" and drift["psi_max"] == ranked["x2"] > 0.5
    assert all(ranked[f] < 0.05 for f in ("x0", "x1", "x3")), ranked  # sampling noise only
    assert drift["label_psi"] < 0.05
    assert [name for name, _ in over_threshold(drift, 0.2, 0.1)] == ["x2"]
    # The PSI is the one of its counts on the reference's bins, recomputed here.
    x2 = profile["features"]["names"].index("x2")
    recomputed = psi(profile["features"]["counts"][x2], counted["features"]["counts"][x2])
    assert ranked["x2"] == pytest.approx(recomputed, abs=1e-6)


def test_a_new_class_is_label_drift(tmp_path, reference) -> None:
    _, profile = reference
    raw = _ingested(tmp_path, "classes", first=20_000, rows=2000, classes=(0, 1, 2))
    _, counted = profile_raw(raw, profile)
    drift = compare(profile, counted)
    assert drift["label_psi"] > 1.0  # class 2 never seen: its share against EPSILON
    assert ("label", drift["label_psi"]) in over_threshold(drift, 0.2, 0.1)


def test_other_features_are_not_comparable(tmp_path, reference) -> None:
    base, profile = reference
    source = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"key": [1, 2, 3], "a": [0.1, 0.2, 0.3], "label": [0, 1, 0]}), source)
    cfg = DataConfig(source="parquet", path=str(source), key_column="key", num_classes=2)
    ingest(cfg, tmp_path, tmp_path / "raw", tmp_path / "q", tmp_path / "r.json")
    why = not_comparable(Shape.of_profile(profile), Shape.of_raw(tmp_path / "raw"))
    assert why is not None and "the features changed" in why and "x0" in why
    assert not_comparable(Shape.of_profile(profile), Shape.of_raw(base / "ref" / "raw")) is None


def test_text_drift_is_the_js_divergence_of_byte_unigrams(tmp_path) -> None:
    def snapshot(name: str, text: str) -> Path:
        folder = tmp_path / name / "in"
        folder.mkdir(parents=True)
        (folder / "a.txt").write_text(text)
        cfg = DataConfig(source="text", path=str(folder))
        raw = tmp_path / name / "raw"
        ingest(cfg, tmp_path, raw, tmp_path / name / "q", tmp_path / name / "r.json", labels=None)
        return raw

    reference, _ = profile_raw(snapshot("a", "abab" * 50))
    assert reference["counts"][ord("a")] == reference["counts"][ord("b")] == 100
    _, counted = profile_raw(snapshot("b", "baba" * 50), reference)
    assert compare(reference, counted)["js"] == 0.0
    _, counted = profile_raw(snapshot("c", "aaaa" * 50), reference)
    drift = compare(reference, counted)
    # P = (1/2, 1/2) over {a, b}, Q = (1, 0): the hand-computed value above
    assert drift["js"] == pytest.approx(0.311278, abs=1e-6)
    assert [row[0] for row in drift["top"]] == ["'b'", "'a'"]
    assert over_threshold(drift, 0.2, 0.1) == [("text (byte unigrams)", drift["js"])]


# ---- the policy -----------------------------------------------------------------------


def _checked(psi_max: float) -> dict:
    return {
        "status": "checked",
        "message": "",
        "champion": {"version": "3"},
        "measure": "psi",
        "psi_max": psi_max,
        "psi_max_feature": "x3",
        "label_psi": 0.01,
        "features": [["x3", psi_max], ["x1", 0.02]],
    }


def test_warn_goes_on_block_stops_and_acceptance_lets_it_through() -> None:
    warn = OrchestrateConfig()
    block = OrchestrateConfig(drift="block")
    assert warn.drift == "warn" and warn.drift_psi_threshold == 0.2  # the defaults
    drifted = _checked(0.31)
    went_on = decide(drifted, warn, accepted=False)
    assert not went_on.blocked and went_on.drifted
    assert went_on.message.startswith("drift vs champion v3: max PSI 0.31 (feature x3)")
    stopped = decide(drifted, block, accepted=False)
    assert stopped.blocked
    for said in ("x3 0.31", "above the 0.2 threshold", "--accept-drift", "drift: warn"):
        assert said in stopped.message
    assert not decide(drifted, block, accepted=True).blocked
    assert not decide(_checked(0.05), block, accepted=False).blocked  # under the threshold
    higher = OrchestrateConfig(drift="block", drift_psi_threshold=0.5)
    assert not decide(drifted, higher, accepted=False).blocked


def test_no_champion_means_no_check_and_never_blocks() -> None:
    none_yet = {"status": "no_champion", "message": "no champion of m yet: no drift check"}
    decision = decide(none_yet, OrchestrateConfig(drift="block"), accepted=False)
    assert not decision.blocked and decision.message == none_yet["message"]
    assert not decide(None, OrchestrateConfig(drift="block"), accepted=False).blocked


# ---- the champion's reference in a real MLflow store ---------------------------------


def _champion_of(uri: str, data_version: str, artifacts: Path) -> str:
    """A run that trained on `data_version` and a model version of it holding champion
    (no model files: the drift check reads the run, never the model)."""
    from training.mlops.tracking import client, ensure_experiment

    mlflow = client(uri)
    experiment = ensure_experiment(uri, "drift", artifacts.as_uri())
    run_id = mlflow.create_run(experiment).info.run_id
    mlflow.set_tag(run_id, "gradline.data_version", data_version)
    mlflow.create_registered_model("gradline-digits")
    version = mlflow.create_model_version("gradline-digits", f"runs:/{run_id}/model", run_id)
    mlflow.set_registered_model_alias("gradline-digits", "champion", version.version)
    return run_id


def _lock(root: Path, md5: str) -> None:
    """dvc.lock as the ingest stage leaves it: the data version is data/raw's md5."""
    outs = [{"path": "data/raw", "md5": md5}]
    (root / "dvc.lock").write_text(json.dumps({"stages": {"ingest": {"outs": outs}}}))


def test_the_champion_reference_comes_from_its_run(tmp_path, monkeypatch) -> None:
    from training.config import Config
    from training.mlops.drift import check_new_data, drift_summary, record_drift
    from training.project import Project

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    project = Project(tmp_path)
    cfg = Config()
    raw = project.raw

    def ingested(**table) -> dict:
        source = tmp_path / "incoming.parquet"
        _table(source, **table)
        data = DataConfig(source="parquet", path=str(source), key_column="key", num_classes=2)
        ingest(data, tmp_path, raw, tmp_path / "q", project.ingest_report)
        drift = check_new_data(project, cfg, raw, project.profile)
        report = json.loads(project.ingest_report.read_text())
        project.ingest_report.write_text(json.dumps({**report, "drift": drift}))
        return drift

    # No store yet: no champion, no check, and the profile is written all the same.
    assert ingested(first=0, rows=3000)["status"] == "no_champion"
    assert json.loads(project.profile.read_text())["rows"] == 3000
    run_id = _champion_of(project.tracking_uri, "md5-a", tmp_path / "artifacts")
    # A champion whose run carries no profile (registered before drift checks).
    drift = ingested(first=0, rows=3000)
    assert drift["status"] == "no_reference" and drift["champion"]["version"] == "1"
    # Its registration records the profile of the data it trained on...
    _lock(tmp_path, "md5-a")
    assert "has no drift/profile.json" in record_drift(project, cfg, run_id)
    assert drift_summary(project.tracking_uri, run_id)["status"] == "no_reference"
    # ...which the next data version is compared with, even after data/ moved on.
    drift = ingested(first=5000, rows=2000, shift=2.0)
    assert drift["status"] == "checked" and drift["champion"]["data_version"] == "md5-a"
    assert drift["drifted"] == [["x2", drift["psi_max"]]]
    assert "above the 0.2 threshold: x2" in drift["message"]
    # A run trained on other data than the project's now records nothing.
    _lock(tmp_path, "md5-b")
    assert record_drift(project, cfg, run_id) == ""
    assert drift_summary(project.tracking_uri, run_id)["status"] == "no_reference"
    # Other features (accepted at ingest by listing them): not comparable, said so.
    source = tmp_path / "other.parquet"
    pq.write_table(pa.table({"key": [1, 2, 3], "a": [0.1, 0.2, 0.3], "label": [0, 1, 0]}), source)
    data = DataConfig(
        source="parquet", path=str(source), key_column="key", num_classes=2, feature_columns=["a"]
    )
    ingest(data, tmp_path, raw, tmp_path / "q", project.ingest_report)
    drift = check_new_data(project, cfg, raw, project.profile)
    assert drift["status"] == "incomparable" and "the features changed" in drift["message"]


# ---- a real run: DVC, MLflow, Prefect -------------------------------------------------

MODEL = "drift-tiny"
TINY = [
    "data.source=parquet",
    "data.path=data/incoming",
    "data.key_column=key",
    "data.num_classes=2",
    f"registry.model_name={MODEL}",
    "runtime.procs_per_node=1",
    "model.hidden=16",
    "train.epochs=2",
    "train.batch_size=32",
]


def _registry(client) -> tuple[list[str], str | None]:
    """(every version of the model, the one holding champion or None)."""
    versions = sorted(str(v.version) for v in client.search_model_versions(f"name='{MODEL}'"))
    champion = client.get_registered_model(MODEL).aliases.get("champion")
    return versions, None if champion is None else str(champion)


def _drift(root: Path) -> dict:
    return json.loads((root / "data" / "ingest.json").read_text())["drift"]


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_new_data_with_a_shifted_feature_is_flagged_blocked_and_then_trained(tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    from training.config import write_overrides

    root = copy_project(tmp_path / "gradline")
    write_overrides(root / "params.yaml", TINY)
    incoming = root / "data" / "incoming" / "table.parquet"
    _table(incoming, first=0, rows=600)

    first = _gradline(root, "run", timeout=500)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _drift(root) == {
        "status": "no_champion",
        "message": f"no champion of {MODEL} yet: no drift check",
    }
    store = f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    run_1 = json.loads((root / "result.json").read_text())["run_id"]
    # The champion's data profile went onto its run: the reference once data/ changes.
    artifacts = {a.path for a in client.list_artifacts(run_1, "drift")}
    assert artifacts == {"drift/profile.json", "drift/summary.json"}
    if _registry(client)[1] != "1":  # the gate is tested elsewhere: make v1 the champion
        client.set_registered_model_alias(MODEL, "champion", "1")
    before = _registry(client)
    assert before == (["1"], "1")

    # New data: other rows, x2 moved by 1.5 standard deviations.
    _table(incoming, first=10_000, rows=600, shift=1.5)
    blocked = _gradline(root, "run", "--set", "orchestrate.drift=block", timeout=500)
    assert blocked.returncode == 2, blocked.stdout[-3000:] + blocked.stderr[-3000:]
    drift = _drift(root)
    assert drift["status"] == "checked" and drift["champion"]["version"] == "1"
    assert drift["psi_max_feature"] == "x2" and drift["psi_max"] > 1.0
    assert drift["drifted"] == [["x2", drift["psi_max"]]]  # flagged with its PSI, alone
    # The CLI's last word: what drifted, by how much, and how to go on.
    (error,) = [line for line in blocked.stderr.splitlines() if line.startswith("gradline: error")]
    assert "drift vs champion v1: max PSI" in error and f"x2 {drift['psi_max']:.3g}" in error
    assert "--accept-drift" in error and "orchestrate.drift: warn" in error
    # Stopped before training: the registry and the last training result are as they were.
    assert _registry(client) == before
    assert json.loads((root / "result.json").read_text())["run_id"] == run_1

    warned = _gradline(root, "run", "--set", "orchestrate.drift=warn", timeout=500)
    assert warned.returncode == 0, warned.stdout[-3000:] + warned.stderr[-3000:]
    run_2 = json.loads((root / "result.json").read_text())["run_id"]
    assert run_2 != run_1
    gate_line = next(line for line in warned.stdout.splitlines() if "  gate  " in line)
    assert "drift vs champion v1: max PSI" in gate_line and "x2" in gate_line
    version = client.get_model_version(MODEL, "2")
    assert "drift vs champion v1: max PSI" in version.description
    run = client.get_run(run_2)
    assert run.data.metrics["drift_psi_max"] == pytest.approx(drift["psi_max"])
    assert run.data.metrics["drift_over_threshold"] == 1.0
    assert run.data.tags["gradline.drift.champion_version"] == "1"
    summary = json.loads(
        Path(client.download_artifacts(run_2, "drift/summary.json", str(tmp_path))).read_text()
    )
    assert summary["psi_max_feature"] == "x2" and summary["data_version"]
