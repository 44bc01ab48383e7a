"""MFU's parts: the model's FLOPs per sample, the device peak, and what an interval logs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.engine import flops
from training.engine.flops import (
    Throughput,
    cpu_peak_flops,
    cpu_probe_side,
    device_peak_flops,
    gpu_peak_tflops,
    training_flops_per_sample,
)
from training.models.gpt import GPT


def test_an_mlp_counts_three_times_two_flops_per_weight() -> None:
    sizes = [(64, 128), (128, 32), (32, 10)]

    def build() -> nn.Module:
        layers = []
        for fan_in, fan_out in sizes:
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    flops = training_flops_per_sample(build, torch.zeros(5, 64))
    assert flops == 3 * sum(2 * fan_in * fan_out for fan_in, fan_out in sizes)


def test_a_gpt_counts_its_attention_as_the_palm_formula_does() -> None:
    """Per token: 6 x the matmul weights (the blocks and the output head) plus 12 L T d
    for attention's scores and weighted sum, forward and backward."""
    layers, width, context, vocab = 2, 64, 32, 101

    def build() -> nn.Module:
        return GPT(
            vocab, layers=layers, heads=4, width=width, context=context, dropout=0.0,
            tied_embeddings=True,
        )  # fmt: skip

    per_window = training_flops_per_sample(build, torch.zeros(3, context, dtype=torch.long))
    model = build()
    blocks = sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear)
    )  # the tied head included: its weight is the token embedding
    palm = 6 * blocks + 12 * layers * context * width
    assert per_window / context == pytest.approx(palm, rel=1e-6)


def test_a_model_that_reads_values_has_no_count_and_no_mfu() -> None:
    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * float(x.sum().item() > 0)  # needs real values

    flops = training_flops_per_sample(ReadsValues, torch.zeros(2, 4))
    assert math.isnan(flops)
    assert "mfu" not in Throughput(flops, 1e12, None).metrics(100.0)


def test_known_gpus_by_name_and_dtype() -> None:
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert gpu_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert gpu_peak_tflops("NVIDIA H200", "tf32") == 494.7
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert gpu_peak_tflops("NVIDIA L40S", "bf16") == 362.1  # not read as an L4
    assert gpu_peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 there
    assert gpu_peak_tflops("Some Future GPU", "bf16") is None


def test_the_cpu_peak_is_measured_and_an_override_wins() -> None:
    measured = cpu_peak_flops()
    assert 1e8 < measured < 1e13  # a real host's matmul rate, per rank's threads
    assert device_peak_flops(torch.device("cpu"), False, 2.5) == 2.5e12


def test_the_cpu_probe_grows_with_the_threads() -> None:
    sides = [cpu_probe_side(threads) for threads in (1, 2, 4, 8, 16, 64)]
    assert sides[0] == 384 and sides == sorted(sides)
    assert all(side % 128 == 0 for side in sides)
    assert sides[3] ** 3 >= 6 * 384**3  # 8 threads: about 8 times the work of one


def test_the_cpu_peak_is_measured_with_a_probe_for_this_process_s_threads(monkeypatch) -> None:
    asked: list[int] = []

    def side(threads: int) -> int:
        asked.append(threads)
        return 64

    monkeypatch.setattr(flops, "cpu_probe_side", side)
    assert cpu_peak_flops() > 0
    assert asked == [torch.get_num_threads()]


def test_an_interval_turns_samples_per_second_into_tokens_and_mfu() -> None:
    throughput = Throughput(flops_per_sample=6e6, peak_flops=4e9, tokens_per_sample=128)
    metrics = throughput.metrics(samples_per_s=200.0)
    assert metrics == {"model_flops_per_s": 1.2e9, "tokens_per_s": 25600.0, "mfu": 0.3}
    unknown_peak = Throughput(6e6, float("nan"), None).metrics(200.0)
    assert unknown_peak == {"model_flops_per_s": 1.2e9}
