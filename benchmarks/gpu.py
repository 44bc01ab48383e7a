"""MFU of gradline's GPT on one device, to compare with the field (llm.c: about 40 % for
GPT-2 124M on an H100).

The model is training.models.gpt (SDPA attention, causal), counted by the engine's own
FLOP counter (training/engine/flops.py: 3 x the forward, attention included) and divided
by the device peak the jobs use (the GPU table, or this host's measured matmul rate).
On CUDA: bf16 autocast, fused AdamW, TF32 allowed, torch.compile unless --no-compile.
Random tokens: the arithmetic, not the data, is measured.

Defaults are GPT-2 small (12 layers, 768 wide, 12 heads, context 1024, vocabulary
50304). On a CPU use a small shape, e.g.
  python -m benchmarks.gpu --layers 2 --width 128 --heads 4 --context 128 --batch 8
Prints `key value` lines: mfu, tokens_per_s, model_tflops_per_s, peak_tflops, ...
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from training.engine.flops import device_peak_flops, training_flops_per_sample
from training.models.gpt import GPT


def build_gpt(args: argparse.Namespace) -> GPT:
    return GPT(
        args.vocab,
        layers=args.layers,
        heads=args.heads,
        width=args.width,
        context=args.context,
        dropout=0.0,
        tied_embeddings=True,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace) -> dict[str, float]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = build_gpt(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=on_gpu)
    tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            logits = model(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    # The loss compiled with the model: the cross-entropy over a 50k vocabulary then runs
    # fused instead of as eager passes over the (batch x context x vocab) logits.
    step_loss = torch.compile(forward_loss) if args.compile and on_gpu else forward_loss

    def step() -> None:
        loss = step_loss(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # compilation, autotuning, allocator warm-up
        step()
    _sync(device)
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        _sync(device)
        seconds.append((time.perf_counter() - started) / args.steps)
    per_step = statistics.median(seconds)
    flops_per_window = training_flops_per_sample(
        lambda: build_gpt(args), torch.zeros(1, args.context, dtype=torch.long)
    )
    peak = device_peak_flops(device, on_gpu, args.peak_tflops)
    model_flops = flops_per_window * args.batch / per_step
    return {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "step_ms": per_step * 1e3,
        "tokens_per_s": args.batch * args.context / per_step,
        "flops_per_token_m": flops_per_window / args.context / 1e6,
        "model_tflops_per_s": model_flops / 1e12,
        "peak_tflops": peak / 1e12,
        "mfu": model_flops / peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)  # 50257 padded to 128
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--cpu", action="store_true", help="the CPU even where CUDA is")
    parser.add_argument("--peak-tflops", type=float, default=None)
    for key, value in measure(parser.parse_args()).items():
        print(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")


if __name__ == "__main__":
    main()
