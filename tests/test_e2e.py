"""End to end, as a user runs it: the real `gradline` CLI in a fresh copy of the project,
with the ephemeral Prefect API, DVC and the SQLite MLflow store; then `dvc repro`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.host_client import STAGE_HOST_ENV

from .conftest import (
    WebhookReceiver,
    _assert_alerted_iff_champion,
    _client,
    _env,
    _gradline,
    _run,
    copy_project,
)
from .servers import SharedStageHost

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    proc = _run(root, sys.executable, "-m", "dvc", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_bad_params_fail_naming_the_key_and_write_nothing(tmp_path: Path) -> None:
    project = copy_project(tmp_path / "gradline")
    params = project / "params.yaml"
    original = params.read_text()
    params.write_text(original.replace("  epochs: 30", "  epochs: 30\n  epoch: 3"))
    proc = _gradline(project, "run")
    assert proc.returncode == 2
    assert "train.epoch: unknown key" in proc.stderr
    params.write_text(original)
    proc = _gradline(project, "run", "--set", "optim.lr=fast")
    assert proc.returncode == 2 and "optim.lr" in proc.stderr
    for output in ("data/raw", "data/shards", "checkpoints", "model", "mlflow/mlflow.db"):
        assert not (project / output).exists(), output
    assert params.read_text() == original


def test_run_trains_evaluates_and_registers(first_run) -> None:
    project, proc, run_id = first_run
    assert "gradline run complete" in proc.stdout and "gradline ui" in proc.stdout
    assert "(baseline " in proc.stdout  # the model's metric beside its baseline's

    params = yaml.safe_load((project / "params.yaml").read_text())
    assert params["data"]["max_rows"] == 500 and params["train"]["epochs"] == 8

    client = _client(project)
    (version,) = client.search_model_versions(f"name='gradline-digits' and run_id='{run_id}'")
    run = client.get_run(run_id)
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    raw_md5 = next(o["md5"] for o in lock["stages"]["ingest"]["outs"] if o["path"] == "data/raw")
    assert run.data.tags["gradline.data_version"] == raw_md5
    assert run.data.tags["gradline.prefect_flow_run_id"]
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40
    assert run.data.params["train.epochs"] == "8"
    assert "runtime.procs_per_node" not in run.data.params  # how it ran: a tag, not a param
    assert run.data.tags["gradline.runtime.procs_per_node"] == "2"
    (dataset,) = [d.dataset for d in run.inputs.dataset_inputs]
    assert dataset.digest == raw_md5 and dataset.name == "digits-raw"
    assert json.loads(dataset.source)["uri"].endswith("/data/raw")
    metrics = run.data.metrics
    assert metrics["test_accuracy"] > 0.8
    for key in ("test_macro_f1", "test_loss", "val_accuracy", "samples_per_s"):
        assert key in metrics
    # MFU every interval: the MLP's counted FLOPs against both ranks' measured peak.
    mfu = client.get_metric_history(run_id, "mfu")
    assert len(mfu) == len(client.get_metric_history(run_id, "samples_per_s")) >= 1
    assert all(0 < m.value < 1 for m in mfu) and "tokens_per_s" not in metrics
    assert 0.5 < metrics["baseline_test_accuracy"] <= 1.0
    # The first version is champion only if it beats its baseline (logistic regression)
    # on the same split; the gate's verdict at the time is tagged on the version.
    beats = metrics["test_accuracy"] > metrics["baseline_test_accuracy"]
    gated = client.get_model_version("gradline-digits", version.version).tags["gradline.gate"]
    assert gated == ("champion" if beats else "challenger")
    steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
    assert steps == sorted(set(steps)) and len(steps) > 10
    artifacts = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    assert artifacts, "no checkpoint recorded on the run"
    assert {a.path for a in client.list_artifacts(run_id, "evaluation")} == {
        "evaluation/confusion_matrix.png",
        "evaluation/details.json",  # what the model card reads (tests/test_model_card.py)
        "evaluation/loss_curves.png",
    }
    # The registered model takes raw rows through pyfunc and predicts classes.
    import mlflow.pyfunc
    import numpy as np

    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow' / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model(f"models:/gradline-digits/{version.version}")
    predicted = np.asarray(model.predict(np.zeros((3, 8, 8), dtype=np.float32)))
    assert predicted.shape == (3,) and set(predicted.tolist()) <= set(range(10))
    # The data version was pushed to the DVC remote.
    assert any((project / ".dvcstore").rglob("*"))


def test_the_registered_model_is_the_best_validation_steps(first_run) -> None:
    """train.select: best (the default): the model registered and scored is the weights of
    the step whose validation accuracy was the best, recomputed here from its checkpoint."""
    from training.config import load_config
    from training.engine.checkpoint import find_at, load_model_weights
    from training.evaluation import TestData
    from training.models.registry import build_model

    project, _, run_id = first_run
    result = json.loads((project / "result.json").read_text())
    final = result["final"]
    selected, best_step = final["selected_step"], final["best_step"]
    assert final["select"] == "best" and selected == best_step <= final["step"]
    run = _client(project).get_run(run_id)
    assert run.data.tags["gradline.selected_step"] == str(selected)
    assert run.data.metrics["best_val_accuracy"] == pytest.approx(final["best_value"])
    # The best accuracy seen; among the steps that reached it, the lowest validation loss.
    client = _client(project)
    accuracy = {m.step: m.value for m in client.get_metric_history(run_id, "val_accuracy")}
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "val_loss")}
    top = max(accuracy.values())
    assert top == pytest.approx(final["best_value"])
    assert min((s for s in accuracy if accuracy[s] == top), key=lambda s: (loss[s], s)) == selected

    cfg = load_config(project / "params.yaml")
    test = TestData.open(cfg, project / "data" / "shards")
    model = build_model(cfg.model, cfg.task.type, test.data)
    path, _ = find_at(project / "checkpoints" / result["job"], selected)
    load_model_weights(path, model)
    recomputed = test.score(model, cfg.evaluate.batch_size).metrics
    assert recomputed["test_accuracy"] == pytest.approx(run.data.metrics["test_accuracy"])
    assert recomputed["test_loss"] == pytest.approx(run.data.metrics["test_loss"])


def test_dvc_agrees_with_the_flow(first_run) -> None:
    project, _, _ = first_run
    assert "up to date" in _dvc(project, "status").stdout
    assert "Running stage" not in _dvc(project, "repro").stdout

    params = project / "params.yaml"
    original = params.read_text()
    try:
        # How the job runs is not what it computes: nothing becomes stale.
        params.write_text(original.replace("log_every_steps: 50", "log_every_steps: 7"))
        assert "up to date" in _dvc(project, "status").stdout
        params.write_text(original.replace("lr: 0.005", "lr: 0.002"))
        stale = json.loads(_dvc(project, "status", "--json").stdout)
        assert set(stale) == {"train"}  # and evaluate after it, on its new outputs
    finally:
        params.write_text(original)


def test_an_unchanged_rerun_skips_without_starting_prefect_and_still_pushes(first_run) -> None:
    """No Prefect server configured: the up-to-date check runs before one would start,
    the push still puts back what the remote lost, and nothing becomes stale."""
    project, _, _ = first_run
    remote = Path(_dvc(project, "config", "remote.local.url").stdout.strip())
    remote = remote if remote.is_absolute() else (project / ".dvc" / remote).resolve()
    lost = next(p for p in sorted(remote.rglob("*")) if p.is_file())
    lost.unlink()
    proc = _gradline(project, "run", shared_server=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = json.loads((project / "result.json").read_text())["run_id"]
    assert f"nothing changed, up to date with run {run_id}" in proc.stdout
    assert '"status": "skipped"' in proc.stdout
    assert "temporary server" not in proc.stdout + proc.stderr  # no Prefect server started
    assert lost.is_file()  # pushed again
    assert "up to date" in _dvc(project, "status").stdout


def test_second_run_adds_a_version_and_gates_the_champion(first_run) -> None:
    """A new job (another seed), trained sharded (FSDP2 over both ranks): registered,
    gated and loadable like any other; the layout is a tag of its run."""
    import mlflow.pyfunc
    import numpy as np

    project, _, first_id = first_run
    with WebhookReceiver() as hook:
        proc = _gradline(
            project, "run", "--set", "train.seed=1", "--set", "parallel.dp_shard=2",
            env={"TEAM_WEBHOOK": hook.url},
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    second_id = json.loads((project / "result.json").read_text())["run_id"]
    client = _client(project)
    scores = {run_id: client.get_run(run_id).data.metrics for run_id in (first_id, second_id)}
    versions = {
        v.run_id: int(v.version) for v in client.search_model_versions("name='gradline-digits'")
    }
    assert set(versions) >= {first_id, second_id}
    second = client.get_model_version("gradline-digits", str(versions[second_id]))
    new, old = scores[second_id], scores[first_id]
    beats_baseline = new["test_accuracy"] > new["baseline_test_accuracy"]
    old_champion = old["test_accuracy"] > old["baseline_test_accuracy"]
    wins = beats_baseline and (not old_champion or new["test_accuracy"] > old["test_accuracy"])
    assert ("champion" in second.aliases) == wins
    _assert_alerted_iff_champion(hook, wins, versions[second_id], second_id)
    assert f"test_accuracy {new['test_accuracy']:.4f}" in second.description
    assert "up to date" in _dvc(project, "status").stdout
    tags = client.get_run(second_id).data.tags
    assert tags["gradline.parallel.dp_shard"] == "2"
    assert "parallel.dp_shard" not in client.get_run(second_id).data.params
    mlflow.set_tracking_uri(f"sqlite:///{project / 'mlflow' / 'mlflow.db'}")
    mlflow.set_registry_uri(f"sqlite:///{project / 'mlflow' / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model(f"models:/gradline-digits/{versions[second_id]}")
    predicted = np.asarray(model.predict(np.zeros((3, 8, 8), dtype=np.float32)))
    assert predicted.shape[0] == 3


def _example_project(tmp_path: Path, example: str, *overrides: str) -> tuple[Path, str]:
    """A fresh copy running one of `gradline example --list`, made smaller by overrides."""
    project = copy_project(tmp_path / "gradline")
    proc = _gradline(project, "example", example)
    assert proc.returncode == 0, proc.stderr
    proc = _gradline(project, "run", *(f"--set={o}" for o in overrides))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return project, json.loads((project / "result.json").read_text())["run_id"]


def _pyfunc(project: Path, name: str):
    import mlflow.pyfunc

    store = f"sqlite:///{project / 'mlflow' / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)
    return mlflow.pyfunc.load_model(f"models:/{name}/1")


def test_regression_example_scores_against_its_linear_baseline(tmp_path: Path) -> None:
    import pandas as pd
    from sklearn.datasets import load_diabetes

    project, run_id = _example_project(tmp_path, "diabetes-regression", "train.epochs=40")
    metrics = _client(project).get_run(run_id).data.metrics
    for name in ("rmse", "mae", "r2"):
        assert f"test_{name}" in metrics and f"baseline_test_{name}" in metrics
    assert metrics["test_r2"] > 0.0 and metrics["baseline_test_r2"] > 0.0
    evaluation = {a.path for a in _client(project).list_artifacts(run_id, "evaluation")}
    assert "evaluation/predicted_vs_actual.png" in evaluation
    # The registered model takes raw rows by column name and predicts in the label's units.
    bunch = load_diabetes(scaled=False)
    rows = pd.DataFrame(bunch.data[:5], columns=bunch.feature_names)
    predicted = _pyfunc(project, "gradline-diabetes").predict(rows)
    values = pd.DataFrame(predicted).to_numpy().ravel()
    assert values.shape == (5,) and 25 < values.mean() < 350


def test_language_model_example_samples_text_and_generates_through_pyfunc(tmp_path) -> None:
    import pandas as pd

    small = (
        "data.max_bytes=400000",
        "data.split_by=document",  # a few files: split by paragraph, not by file
        "train.max_steps=80",  # beats the unigram by ~0.5 nats already (~0.8 at 150)
        "optim.warmup_steps=10",
        "runtime.eval_every_steps=40",
        "model.layers=2",
        "model.width=64",
        "model.context=64",
        "evaluate.max_new_tokens=20",
        "parallel.tp=2",  # tensor parallel over both ranks: heads and MLP split in two
    )
    project, run_id = _example_project(tmp_path, "stdlib-gpt", *small)
    client = _client(project)
    assert client.get_run(run_id).data.tags["gradline.parallel.tp"] == "2"
    metrics = client.get_run(run_id).data.metrics
    for name in ("loss", "perplexity", "bits_per_token", "bits_per_byte"):
        assert f"test_{name}" in metrics and f"baseline_test_{name}" in metrics
    assert metrics["test_loss"] < metrics["baseline_test_loss"]  # beats a unigram already
    # Tokens/s is samples/s times the context; MFU of both ranks' measured matmul peak.
    assert metrics["tokens_per_s"] == pytest.approx(64 * metrics["samples_per_s"])
    assert 0 < metrics["mfu"] < 1
    samples = {a.path for a in client.list_artifacts(run_id, "samples")}
    # At every validation: every 40 steps, and at the end of each epoch.
    assert {"samples/step-00000040.txt", "samples/step-00000080.txt"} <= samples
    text = client.download_artifacts(run_id, "evaluation/samples.txt", str(tmp_path))
    assert "=== sample 1, prompt 'def ' ===" in Path(text).read_text()
    generated = _pyfunc(project, "gradline-stdlib-gpt").predict(
        pd.DataFrame({"prompt": ["import ", "def main("]}), params={"max_new_tokens": 10}
    )
    assert list(generated.columns) == ["text"] and len(generated) == 2
    assert all(isinstance(text, str) for text in generated["text"])
    assert any(generated["text"])  # (a continuation may end at once, on end-of-document)
    lineage = _gradline(project, "lineage", "gradline-stdlib-gpt/1")
    assert lineage.returncode == 0, lineage.stderr
    assert f"run {run_id}" in lineage.stdout or run_id in lineage.stdout
    assert "data version" in lineage.stdout


def test_a_user_model_trains_registers_and_loads_through_pyfunc(tmp_path: Path) -> None:
    import numpy as np

    from training.config import update_params_file

    project = copy_project(tmp_path / "gradline")
    model = {"name": None, "target": "tests.user_models:tiny_net", "hidden": 32}
    update_params_file(project / "params.yaml", {"model": model}, replace=frozenset({"model"}))
    proc = _gradline(project, "run", "--set", "data.max_rows=600", "--set", "train.epochs=5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = json.loads((project / "result.json").read_text())["run_id"]
    assert _client(project).get_run(run_id).data.params["model.target"] == model["target"]
    (version,) = _client(project).search_model_versions("name='gradline-digits'")
    assert version.run_id == run_id and "gradline.gate" in version.tags
    predicted = np.asarray(
        _pyfunc(project, "gradline-digits").predict(np.zeros((4, 8, 8), dtype=np.float32))
    )
    assert predicted.shape == (4,) and set(predicted.tolist()) <= set(range(10))


_REGISTER_IN_HOST = """
import json, sys
from pathlib import Path
from tasks.registry import register_in_host
from training.project import Project
root = Path(sys.argv[1])
try:
    summary = register_in_host(root, Project(root).config(), print)
    outcome = {"run_id": summary.run_id, "version": summary.version}
except Exception as exc:
    outcome = {"error": f"{type(exc).__name__}: {exc}", "retryable": exc.retryable}
heavy = sorted(m for m in ("mlflow", "torch", "pandas") if m in sys.modules)
print(json.dumps({**outcome, "imported": heavy}))
"""


def _register_in_host(root: Path) -> dict:
    """The flow's register step, run as the flow runs it (the test process's stage host
    named), in a process of its own: what it returned, and what heavy modules it imported."""
    env = _env(root, shared_server=False)
    env[STAGE_HOST_ENV] = SharedStageHost.socket()
    done = subprocess.run(
        [sys.executable, "-c", _REGISTER_IN_HOST, str(root)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_register_step_runs_in_the_stage_host_and_its_errors_come_back(
    first_run, tmp_path
) -> None:
    """The flow's process registers through a fork of the stage host and imports neither
    MLflow, torch nor pandas; registering the same run again reports its version. A step
    that fails there fails here with the stage's own message, marked not worth retrying
    when the stage says so."""
    root = first_run[0]  # other tests of its project may have added runs since
    trained = json.loads((root / "result.json").read_text())["run_id"]
    versions = _client(root).search_model_versions("name='gradline-digits'")
    (registered,) = [v for v in versions if v.run_id == trained]
    again = _register_in_host(root)
    assert again == {"run_id": trained, "version": int(registered.version), "imported": []}
    assert len(_client(root).search_model_versions("name='gradline-digits'")) == len(versions)
    untrained = copy_project(tmp_path / "untrained")  # no result.json: nothing to register
    failed = _register_in_host(untrained)
    assert failed["imported"] == [] and failed["retryable"] is False, failed
    assert failed["error"].startswith("StageFailed: `gradline stage register` failed"), failed
    assert "result.json not found; run the train stage first" in failed["error"], failed
