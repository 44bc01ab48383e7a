"""Early stopping and the best checkpoint: the verdict per validation, the best step's
checkpoint kept past runtime.keep_checkpoints, and the model consolidated from it."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from training.config import Config
from training.engine.checkpoint import Checkpointer, find_at, list_checkpoints
from training.engine.launch import launch_workers
from training.engine.selection import Selection
from training.evaluation import TestData
from training.models.folder import load_model_dir
from training.models.registry import build_model

from .conftest import train_job
from .test_distributed import _config


def _selection(**train) -> Selection:
    return Selection.for_config(Config.model_validate({"train": train}))


def test_the_gates_metric_is_watched_unless_another_is_named() -> None:
    assert (_selection().metric, _selection().higher_is_better) == ("val_accuracy", True)
    watched = _selection(early_stopping_metric="val_loss")
    assert (watched.metric, watched.higher_is_better) == ("val_loss", False)
    regression = Config.model_validate(
        {"data": {"source": "diabetes"}, "task": {"type": "regression"}}
    )
    assert Selection.for_config(regression).metric == "val_rmse"


def test_an_unknown_metric_is_refused_naming_the_tasks_metrics() -> None:
    with pytest.raises(ValidationError, match=r"train\.early_stopping_metric") as refused:
        Config.model_validate({"train": {"early_stopping_metric": "val_rmse"}})
    assert "val_accuracy, val_macro_f1, val_loss" in str(refused.value)


def test_patience_counts_validations_without_an_improvement_above_min_delta() -> None:
    sel = _selection(early_stopping_patience=2, early_stopping_min_delta=0.01)
    verdicts = [
        sel.observe({"val_accuracy": value}, step)
        for step, value in [(10, 0.50), (20, 0.70), (30, 0.705), (40, float("nan"))]
    ]
    # +0.005 is under min_delta, so patience runs on, but it is still the best model seen;
    # NaN never counts.
    assert verdicts == [True, True, True, False]
    assert (sel.best_step, sel.best_value, sel.waited, sel.should_stop) == (30, 0.705, 2, True)
    assert sel.selected_step(last_step=40) == 30


def test_a_tie_on_the_metric_goes_to_the_lower_validation_loss() -> None:
    # Accuracy saturates on a small validation split; the first step to reach the top is
    # the least trained, so a tie with a lower loss takes the selection over.
    sel = _selection(early_stopping_patience=2)
    seen = [
        sel.observe({"val_accuracy": acc, "val_loss": loss}, step)
        for step, acc, loss in [
            (10, 0.9, 0.50),
            (20, 0.95, 0.30),
            (30, 0.95, 0.20),
            (40, 0.95, 0.25),
        ]
    ]
    assert seen == [True, True, True, False]
    assert (sel.best_step, sel.best_value, sel.best_loss) == (30, 0.95, 0.20)
    # A tie is no improvement: patience still ran out at step 40.
    assert sel.waited == 2 and sel.should_stop
    resumed = _selection(early_stopping_patience=2)
    resumed.restore(json.loads(json.dumps(sel.state_dict())))
    assert (resumed.best_step, resumed.best_loss, resumed.improved_value) == (30, 0.20, 0.95)


def test_lower_is_better_for_a_loss_and_last_selects_the_final_step() -> None:
    sel = _selection(early_stopping_metric="val_loss", select="last")
    assert sel.observe({"val_loss": 2.0}, 5) and sel.observe({"val_loss": 1.0}, 10)
    assert not sel.observe({"val_loss": 1.5}, 15)
    assert sel.best_step == 10 and not sel.should_stop  # no patience: never stops early
    assert sel.selected_step(last_step=15) == 15


def test_a_resumed_job_continues_the_count_from_the_checkpoint() -> None:
    before = _selection(early_stopping_patience=3)
    before.observe({"val_accuracy": 0.9}, 10)
    before.observe({"val_accuracy": 0.8}, 20)
    after = _selection(early_stopping_patience=3)
    after.restore(json.loads(json.dumps(before.state_dict())))  # as a checkpoint holds it
    assert (after.best_step, after.best_value, after.waited) == (10, 0.9, 1)
    after.observe({"val_accuracy": 0.85}, 30)
    after.observe({"val_accuracy": 0.85}, 40)
    assert after.should_stop


def test_the_pinned_best_checkpoint_outlives_keep(tmp_path) -> None:
    writer = Checkpointer(tmp_path, keep=2, asynchronous=False, is_main=True)
    state = {"model": {"w": torch.zeros(2)}}
    for step in (10, 20, 30, 40, 50):
        if step == 20:
            writer.pinned = 20
        writer.save(step, state, {"step": step}, {})
    writer.close()
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000050",
        "step-00000040",
        "step-00000020",
    ]


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_plateau_stops_the_job_and_the_best_step_becomes_the_model(tiny_shards, tmp_path):
    # A constant learning rate too large to settle: validation loss stops falling after a
    # few epochs, two validations without a new low stop the job, and the lowest one
    # (necessarily two validations back) becomes the model, its checkpoint kept besides
    # the newest one although keep_checkpoints is 1.
    cfg = _config(
        optim={"lr": 0.05, "warmup_steps": 0, "lr_schedule": "constant"},
        train={"epochs": 10, "early_stopping_patience": 2, "early_stopping_metric": "val_loss"},
        runtime={"keep_checkpoints": 1, "checkpoint_every_steps": 5},
    )
    result = launch_workers(train_job(tiny_shards, tmp_path, cfg), 2, max_restarts=0)
    per_epoch = 13
    best = result["best_step"]
    assert result["stopped_early"] is True and result["watched_metric"] == "val_loss"
    assert result["step"] == best + 2 * per_epoch < 10 * per_epoch
    assert result["selected_step"] == best and best % per_epoch == 0
    ckpt = tmp_path / "ckpt"
    assert [p.name for p in list_checkpoints(ckpt)] == [
        f"step-{result['step']:08d}",
        f"step-{best:08d}",
    ]
    # The consolidated model holds the weights of the best step's checkpoint, not the last.
    model, spec = load_model_dir(tmp_path / "model")
    chosen = build_model(cfg.model, cfg.task.type, spec.data_spec)
    path, _ = find_at(ckpt, best)
    from training.engine.checkpoint import load_model_weights

    load_model_weights(path, chosen)
    assert _weights_equal(model, chosen)
    final = build_model(cfg.model, cfg.task.type, spec.data_spec)
    load_model_weights(list_checkpoints(ckpt)[0], final)
    assert not _weights_equal(model, final)
    # And what it scores on the test split is what that step's weights score.
    test = TestData.open(cfg, tiny_shards)
    assert test.score(model, 256).metrics == test.score(chosen, 256).metrics
