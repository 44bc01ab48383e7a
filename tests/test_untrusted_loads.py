"""Nothing gradline loads can run code: executable pickles planted in a checkpoint (DCP's
.metadata, a .distcp shard, the train state), in PowerSGD or async state, or in a model
folder never run. An attacker who can write the checkpoint folder has no key, so a
planted checkpoint fails its signature or its checksums, is reported and skipped, and
resume falls back to the previous good one; honest checkpoints still resume bitwise.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from training.engine.checkpoint import (
    MANIFEST,
    Checkpointer,
    CorruptCheckpoint,
    NoTrustedCheckpoint,
    UntrustedCheckpoint,
    checkpoint_dir,
    find_latest,
    load_into,
    load_model_weights,
    verify,
)
from training.engine.compression import GradientReducer
from training.engine.replicas import AsyncState
from training.models.folder import MODEL_WEIGHTS, UnsafeModelFile, load_model_dir
from training.signing import SIGNING_KEY_ENV, SigningKeyError, key_file, signing_key

REPO = Path(__file__).resolve().parents[1]

# Saves without a process group are single-process saves; DCP says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Exploit:
    """Unpickling this creates the marker file: proof that code ran on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _poison(marker: Path) -> bytes:
    return pickle.dumps({"model": Exploit(marker)})


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _state(value: float) -> dict:
    # A non-tensor item too: DCP stores it as pickled bytes inside a .distcp shard.
    extra = io.BytesIO()
    torch.save({"n": int(value)}, extra)
    return {"model": {"w": torch.full((3,), value)}, "extra": extra}


def _save(directory: Path, step: int) -> Path:
    writer = Checkpointer(directory, keep=5, asynchronous=False, is_main=True)
    writer.save(step, _state(step), {"step": step}, {})
    writer.close()
    return checkpoint_dir(directory, step)


def _loaded(path: Path) -> float:
    target = {"model": {"w": torch.zeros(3)}, "extra": io.BytesIO()}
    load_into(path, target)
    return float(target["model"]["w"][0])


def _plant_metadata(path: Path, marker: Path) -> None:
    (path / ".metadata").write_bytes(_poison(marker))


def _plant_distcp(path: Path, marker: Path) -> None:
    (shard,) = path.glob("*.distcp")
    shard.write_bytes(shard.read_bytes() + _poison(marker))


def _plant_train_state(path: Path, marker: Path) -> None:
    (path / "train_state.json").write_text(json.dumps({"step": 99, "format": 3}))


def _rewrite_manifest(path: Path) -> None:
    """The attacker updates every checksum to match the planted files, keeps the old
    signature (they cannot make a new one without the key)."""
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"] = {p.name: _sha256(p) for p in path.iterdir() if p.name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps(manifest))


def _strip_signature(path: Path) -> None:
    """The attacker writes a manifest of the old, unsigned format, matching every file."""
    files = {p.name: _sha256(p) for p in path.iterdir() if p.name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps(files))


PLANTS = {"metadata": _plant_metadata, "distcp": _plant_distcp, "train_state": _plant_train_state}
MANIFEST_EDITS = {
    "manifest_left_alone": (lambda path: None, "file checksum mismatch"),
    "checksums_rewritten": (_rewrite_manifest, "signature mismatch"),
    "signature_stripped": (_strip_signature, "unsigned"),
}


def test_the_planted_metadata_runs_code_when_read_unchecked(tmp_path) -> None:
    """The control: the plant is real. DCP itself unpickles .metadata with no check,
    so the tests below fail if verification stops coming first."""
    path = _save(tmp_path, 1)
    marker = tmp_path / "ran"
    _plant_metadata(path, marker)
    with pytest.raises(CheckpointException):  # it then finds no Metadata object in it
        dcp.load({"model": {"w": torch.zeros(3)}}, checkpoint_id=path, no_dist=True)
    assert marker.exists()


@pytest.mark.parametrize("plant", list(PLANTS))
@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_a_planted_checkpoint_runs_nothing_and_resume_falls_back(
    tmp_path, caplog, plant, edit
) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    marker = tmp_path / "ran"
    PLANTS[plant](newest, marker)
    change_manifest, reason = MANIFEST_EDITS[edit]
    change_manifest(newest)

    with pytest.raises(CorruptCheckpoint) as refused:
        verify(newest)
    assert refused.value.reason == reason
    for load in (_loaded, lambda p: load_model_weights(p, torch.nn.Linear(1, 1))):
        with pytest.raises(CorruptCheckpoint):
            load(newest)  # every load path verifies before DCP reads the folder
    with caplog.at_level(logging.WARNING):
        path, train_state = find_latest(tmp_path)
    assert path.name == "step-00000001" and train_state["step"] == 1
    assert f"skipping checkpoint {newest}: {reason}" in caplog.text
    assert _loaded(path) == 1.0
    assert not marker.exists()


def test_a_signed_checkpoint_renamed_to_a_newer_step_is_refused(tmp_path) -> None:
    old = _save(tmp_path, 1)
    renamed = old.rename(checkpoint_dir(tmp_path, 7))
    with pytest.raises(UntrustedCheckpoint, match="signature mismatch"):
        verify(renamed)


def test_another_key_is_a_signature_mismatch(tmp_path, monkeypatch) -> None:
    path = _save(tmp_path, 1)
    monkeypatch.setenv(SIGNING_KEY_ENV, "another-key-" + "x" * 40)
    with pytest.raises(UntrustedCheckpoint, match="signature mismatch"):
        verify(path)


def test_only_untrusted_checkpoints_stop_the_job_with_what_to_do(tmp_path) -> None:
    """Old unsigned checkpoints are refused; the job does not silently start afresh."""
    path = _save(tmp_path, 1)
    _strip_signature(path)
    with pytest.raises(NoTrustedCheckpoint, match=f"deleting {tmp_path}") as refused:
        find_latest(tmp_path)
    assert "unsigned" in str(refused.value)
    assert refused.value.exit_code == 2 and not refused.value.retryable


def test_an_unlisted_file_in_a_checkpoint_is_refused(tmp_path) -> None:
    path = _save(tmp_path, 1)
    (path / "__9_0.distcp").write_bytes(b"planted")
    with pytest.raises(CorruptCheckpoint, match="unsigned files"):
        verify(path)


def test_powersgd_state_runs_nothing(tmp_path) -> None:
    marker = tmp_path / "ran"
    reducer = GradientReducer(world_size=2, compression="powersgd", rank=2)
    with pytest.raises(pickle.UnpicklingError):
        reducer.load_state_dict({"powersgd": io.BytesIO(_poison(marker))})
    assert not marker.exists()


def test_powersgd_state_round_trips_as_tensors_only() -> None:
    reducer = GradientReducer(world_size=2, compression="powersgd", rank=2)
    reducer.powersgd.iter = 5
    reducer.powersgd.rng.randn(3)  # an odd count leaves a cached gaussian in the state
    saved = reducer.state_dict()["powersgd"]
    restored = GradientReducer(world_size=2, compression="powersgd", rank=2)
    restored.load_state_dict({"powersgd": io.BytesIO(saved.getvalue())})
    assert restored.powersgd.iter == 5
    assert (restored.powersgd.rng.randn(4) == reducer.powersgd.rng.randn(4)).all()


def test_async_state_runs_nothing(tmp_path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError):
        AsyncState(None, is_main=False).load_state_dict({"async": io.BytesIO(_poison(marker))})
    assert not marker.exists()


def test_a_poisoned_model_file_is_a_clear_error(tmp_path) -> None:
    from training.data.spec import DataSpec
    from training.models.folder import ModelSpec, save_model_dir
    from training.models.options import ModelConfig
    from training.models.registry import build_model

    data = DataSpec(kind="table", feature_shape=(4,), num_classes=3)
    cfg = ModelConfig.model_validate({"name": "mlp", "hidden": 8, "depth": 1})
    model = build_model(cfg, "classification", data)
    spec = ModelSpec("classification", cfg.model_dump(), data.to_dict())
    save_model_dir(model, spec, tmp_path / "model")
    load_model_dir(tmp_path / "model")  # the honest folder loads

    marker = tmp_path / "ran"
    weights = tmp_path / "model" / MODEL_WEIGHTS
    torch.save({"weight": Exploit(marker)}, weights)
    with pytest.raises(UnsafeModelFile, match=str(weights)) as refused:
        load_model_dir(tmp_path / "model")
    assert "(Unsupported global: GLOBAL io.open)" in str(refused.value)
    assert refused.value.exit_code == 2
    assert not marker.exists()


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name):
                yield node, f"{owner.id}.{node.func.attr}"


def test_the_package_never_loads_a_pickle_unchecked() -> None:
    """Every torch.load in training/ passes weights_only=True; no pickle.load(s) or
    Unpickler; no weights_only=False anywhere."""
    offenders = []
    for source in sorted((REPO / "training").rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        where = source.relative_to(REPO)
        if "weights_only=False" in text:
            offenders.append(f"{where}: weights_only=False")
        for call, name in _calls(ast.parse(text)):
            if name in ("pickle.load", "pickle.loads", "pickle.Unpickler", "dill.load"):
                offenders.append(f"{where}:{call.lineno}: {name}")
            if name == "torch.load":
                strict = any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True
                    for k in call.keywords
                )
                if not strict:
                    offenders.append(f"{where}:{call.lineno}: torch.load without weights_only")
    assert not offenders, offenders


def test_the_project_key_file_is_made_once_private_and_shared(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(SIGNING_KEY_ENV)
    for marker in ("params.yaml", "dvc.yaml"):
        (tmp_path / marker).write_text("")
    job = tmp_path / "checkpoints" / "job"
    job.mkdir(parents=True)
    first = signing_key(job)
    path = key_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert signing_key(job) == first == path.read_bytes()  # every rank reads the same
    assert len(first) >= 32
    assert [p.name for p in path.parent.iterdir()] == ["signing.key"]  # no temp left

    # A project checkpoint signs and verifies with it; another project key refuses it.
    saved = _save(job, 1)
    assert verify(saved)["step"] == 1
    path.write_text("f" * 64)
    with pytest.raises(UntrustedCheckpoint, match="signature mismatch"):
        verify(saved)

    os.chmod(path, 0o644)
    with pytest.raises(SigningKeyError, match="chmod 600"):
        signing_key(job)


def test_the_key_folder_is_git_ignored() -> None:
    assert "/.gradline/" in (REPO / ".gitignore").read_text().splitlines()


def test_no_key_outside_a_project_is_an_error_saying_what_to_set(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(SIGNING_KEY_ENV)
    with pytest.raises(SigningKeyError, match=SIGNING_KEY_ENV):
        signing_key(tmp_path)
    monkeypatch.setenv(SIGNING_KEY_ENV, "short")
    with pytest.raises(SigningKeyError, match="shorter than 32"):
        signing_key(tmp_path)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_resume_skips_a_planted_checkpoint_and_ends_bitwise_equal(tiny_shards, tmp_path) -> None:
    """Two ranks train 8 steps (checkpoints at 4 and 8). The attacker plants an
    executable .metadata in step 8 and rewrites its checksums. Run again: nothing runs,
    the job resumes from step 4, and its final weights equal the honest run's bitwise."""
    from training.config import Config
    from training.engine.launch import launch_workers

    from .conftest import train_job

    cfg = Config.model_validate(
        {
            "model": {"name": "mlp", "hidden": 16, "depth": 1},
            "optim": {"lr": 0.01, "warmup_steps": 2},
            "train": {"epochs": 1, "max_steps": 8, "batch_size": 32},
            "runtime": {"checkpoint_every_steps": 4, "async_checkpoint": False},
        }
    )
    job = train_job(tiny_shards, tmp_path, cfg)
    assert launch_workers(job, 2, 0)["step"] == 8
    honest = load_model_dir(tmp_path / "model")[0].state_dict()

    ckpt, marker = tmp_path / "ckpt", tmp_path / "ran"
    newest = checkpoint_dir(ckpt, 8)
    _plant_metadata(newest, marker)
    _rewrite_manifest(newest)
    # A fresh start would save step 4 again: a new folder in its place.
    step_4 = checkpoint_dir(ckpt, 4).stat().st_ino

    assert launch_workers(job, 2, 0)["step"] == 8
    assert not marker.exists()
    # Resumed from step 4 (its folder untouched) and saved step 8 anew, signed.
    assert checkpoint_dir(ckpt, 4).stat().st_ino == step_4
    assert verify(newest)["step"] == 8
    resumed = load_model_dir(tmp_path / "model")[0].state_dict()
    assert resumed.keys() == honest.keys()
    assert all(torch.equal(resumed[k], honest[k]) for k in honest)


def _copy_shards(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def test_a_shard_changed_after_sharding_is_named_when_first_opened(tiny_shards, tmp_path) -> None:
    from training.data.integrity import CorruptShard, forget_checked
    from training.data.loader import open_reader
    from training.data.manifest import read_manifest, split_shards

    shards = _copy_shards(tiny_shards, tmp_path / "shards")
    manifest = read_manifest(shards)
    victim = split_shards(shards, manifest, "train")[-1].path
    forget_checked()
    open_reader(shards, manifest, "train").open_all()  # intact: opens
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte; Arrow would still read the file
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(1, 1))  # a new mtime: the copy in place is checked again
    with pytest.raises(CorruptShard, match=f"shard {victim} fails its checksum") as refused:
        open_reader(shards, manifest, "train").open_all()
    assert refused.value.exit_code == 2


def test_each_shard_is_hashed_once_per_process(tiny_shards, tmp_path, monkeypatch) -> None:
    import hashlib

    from training.data import integrity
    from training.data.loader import open_reader
    from training.data.manifest import read_manifest, split_shards

    hashed: list[str] = []
    file_digest = hashlib.file_digest

    def counting(handle, name):
        hashed.append(handle.name)
        return file_digest(handle, name)

    monkeypatch.setattr(integrity.hashlib, "file_digest", counting)
    shards = _copy_shards(tiny_shards, tmp_path / "shards")
    manifest = read_manifest(shards)
    integrity.forget_checked()
    for _ in range(3):
        open_reader(shards, manifest, "train").open_all()
    files = [str(s.path) for s in split_shards(shards, manifest, "train")]
    assert sorted(hashed) == sorted(files)
