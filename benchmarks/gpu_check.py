"""The engine's CUDA path on one GPU, checked by hand on a machine that has one.

The test suite runs on CPU/gloo; this runs the same jobs through the train stage's
lifecycle (tracking off: a GPU machine may have only torch, pyarrow and the config's
few packages) on the GPU and prints one line per check, then key=value figures:
- bf16:   a small GPT on the standard library's bytes, bf16 autocast on CUDA; its
          validation loss beats the unigram baseline (about 3.26 nats) and stays finite;
- nan:    the same job with a NaN loss injected at step 5: that step is skipped, the
          weights of every checkpoint stay finite and the job still learns;
- resume: stopped on request at step 20 (a preemption notice), run again: it resumes
          from the signed checkpoint of step 20 and finishes; the final weights equal
          an uninterrupted run's to bf16 rounding.
All of them start their workers from the server a train stage forked from the stage host
starts (`worker_server`, checked first: on a CUDA build a new interpreter, not a fork of
a process that has queried CUDA).
Usage: python -m benchmarks.gpu_check [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.common import use_throwaway_signing_key
from training.config import Config, DataConfig, ShardConfig
from training.data.ingest import ingest
from training.data.shards import write_shards
from training.engine.checkpoint import list_checkpoints, verify
from training.engine.worker_start import cpu_only_torch
from training.errors import GradlineError
from training.mlops.jobs import JobRequest, run_job

UNIGRAM_NATS = 3.26  # byte-level unigram cross-entropy of the stdlib (ENVIRONMENT.md)


def gpt_job(steps: int) -> dict:
    return {
        "data": {"source": "stdlib", "max_bytes": 2_000_000, "tokenizer": "bytes"},
        "task": {"type": "language_modeling"},
        "evaluate": {"prompts": ["def "], "max_new_tokens": 8},
        "model": {"name": "gpt", "layers": 4, "heads": 4, "width": 256, "context": 128},
        "optim": {"lr": 0.002, "warmup_steps": 10},
        "train": {"epochs": 1, "max_steps": steps, "batch_size": 64},
        "runtime": {
            "procs_per_node": 1,
            "checkpoint_every_steps": 10,
            "eval_every_steps": steps,
            "log_every_steps": 10,
            "control_every_steps": 1,
            "max_restarts": 0,
        },
    }


def gpt2_job(steps: int) -> dict:
    """GPT-2 small's shape (12 layers, 768 wide, context 1024) on bytes, compiled, bf16:
    the MFU the engine logs for a job of that size (the head is small: 256 tokens)."""
    job = gpt_job(steps)
    job["model"].update(layers=12, heads=12, width=768, context=1024)
    job["train"].update(batch_size=16, compile=True)
    job["runtime"].update(checkpoint_every_steps=steps, log_every_steps=10)
    return job


def text_shards(folder: Path) -> Path:
    data = DataConfig(source="stdlib", max_bytes=2_000_000, split_by="document")
    raw = folder / "raw"
    ingest(data, folder, raw, folder / "quarantine", folder / "ingest.json", labels=None)
    write_shards(ShardConfig(), raw, folder / "shards", "gpu-check")
    return folder / "shards"


def run(job: dict, shards: Path, work: Path, faults: str | None = None):
    request = JobRequest(
        Config.model_validate(job),
        shards,
        work / "ckpt",
        work / "model",
        root=work,
        log_model=False,
        faults=faults or "",
    )
    return run_job(request)


def all_finite(job_dir: Path) -> bool:
    """Every tensor of every kept checkpoint is finite (each verified, then read)."""
    for path in list_checkpoints(job_dir):
        verify(path)
        tensors = [t for t in _tensors(_flat(path)) if t.is_floating_point()]
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return False
    return True


def skipped_steps(job_dir: Path) -> float:
    """The job's count of skipped non-finite steps, from its newest checkpoint."""
    train_state = verify(list_checkpoints(job_dir)[0])
    return train_state.get("totals", {}).get("nonfinite_steps", float("nan"))


def _flat(path: Path) -> dict:
    """A (verified) checkpoint as one plain state dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, flat)
    try:
        return torch.load(flat, weights_only=True)
    finally:
        flat.unlink()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def worker_server_forked() -> bool:
    """Start the workers' server as a train stage forked from the stage host does (this
    process imported the engine, runs one thread and asked for CUDA): whether it is a
    fork of this process. It must not be: CUDA's first query here marks every later
    fork unable to use it. Every job below starts its CUDA workers from that server.
    (On a CPU-only torch it is a fork, as in every train stage there.)"""
    import multiprocessing.forkserver

    import training.engine.worker  # noqa: F401  (what the stage host preloads)
    from training.engine.worker_start import start_worker_server

    start_worker_server()
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    command = Path(f"/proc/{pid}/cmdline").read_bytes()
    return pid is not None and b"forkserver import main" not in command


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cpu", action="store_true", help="a dry run of the script here")
    parser.add_argument("--gpt2-steps", type=int, default=0, help="also a GPT-2-small job")
    args = parser.parse_args()
    if not args.cpu:
        assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
    use_throwaway_signing_key()
    # Never a fork on a CUDA build (its workers could not use CUDA); on a CPU-only torch
    # (the --cpu dry run here) the server is a fork of this process, as in a train stage.
    forked = worker_server_forked()
    expected = cpu_only_torch(torch)
    report("worker_server", forked == expected, "forked" if forked else "a new interpreter")
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shards = text_shards(folder / "data")
        job = gpt_job(args.steps)
        if args.cpu:  # a dry run of the script: a model this host trains in seconds
            job["model"].update(width=32, layers=1, heads=2, context=32)
            job["train"]["batch_size"] = 8

        plain = run(job, shards, folder / "plain")
        loss = plain.final["val_loss"]
        window = job["train"]["batch_size"] * job["model"]["context"]
        tokens = plain.final["loop_steps"] * window
        figures["tokens_per_s"] = tokens / plain.final["loop_seconds"]
        figures["val_loss"] = loss
        # What the job logged for its last interval (the engine's own FLOP count and peak).
        figures["job_mfu"] = plain.final.get("mfu", float("nan"))
        figures["job_tokens_per_s"] = plain.final.get("tokens_per_s", float("nan"))
        report("bf16", loss < UNIGRAM_NATS, f"val_loss {loss:.3f} vs unigram {UNIGRAM_NATS}")

        nan = run(job, shards, folder / "nan", faults="nan:rank=0:step=5")
        finite = all_finite(nan.job.job_dir.path)
        skipped = skipped_steps(nan.job.job_dir.path)
        report(
            "nan",
            finite and skipped == 1 and nan.final["val_loss"] < UNIGRAM_NATS,
            f"skipped {skipped}, checkpoints finite {finite}, val_loss {nan.final['val_loss']:.3f}",
        )

        stopped_at = None
        try:
            run(job, shards, folder / "resume", faults="term:rank=0:step=20")
        except GradlineError as exc:
            stopped_at = str(exc)
        resumed = run(job, shards, folder / "resume")
        health = resumed.job.job_dir.health / "resumed.json"
        record = json.loads(health.read_text()) if health.is_file() else {}
        same = _weights_close(plain.job.job_dir.path, resumed.job.job_dir.path)
        report(
            "resume",
            stopped_at is not None and record.get("step", 0) > 20 and same,
            f"stopped: {stopped_at!r:.80}; resumed record {record}; final weights close {same}",
        )
        if args.gpt2_steps:
            big = run(gpt2_job(args.gpt2_steps), shards, folder / "gpt2")
            figures["gpt2_job_mfu"] = big.final.get("mfu", float("nan"))
            figures["gpt2_job_tokens_per_s"] = big.final.get("tokens_per_s", float("nan"))
            report(
                "gpt2",
                big.final["val_loss"] < UNIGRAM_NATS,
                f"val_loss {big.final['val_loss']:.3f}",
            )
    print(" ".join(f"{k}={v:.6g}" for k, v in figures.items()))


def _weights_close(a: Path, b: Path) -> bool:
    states = [_flat(list_checkpoints(job_dir)[0])["model"] for job_dir in (a, b)]
    return all(
        torch.allclose(states[0][k].float(), states[1][k].float(), atol=2e-2, rtol=0)
        for k in states[0]
    )


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


if __name__ == "__main__":
    main()
