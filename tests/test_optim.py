"""`optim.name`: the optimizer every layout builds per model part (engine/state.py)."""

from __future__ import annotations

import torch
from torch import nn

from training.config import OptimConfig
from training.engine.state import OptimizerGroup


def test_adamw_is_the_default_and_sgd_takes_momentum_with_nesterov() -> None:
    parts = [nn.Linear(3, 2), nn.Linear(2, 1)]
    adamw = OptimizerGroup(parts, OptimConfig(lr=0.01, weight_decay=0.1))
    assert [type(o) for o in adamw.optimizers] == [torch.optim.AdamW] * 2
    assert adamw.param_groups[0]["weight_decay"] == 0.1
    sgd = OptimizerGroup(parts, OptimConfig(name="sgd", lr=0.1, momentum=0.8))
    group = sgd.param_groups[0]
    assert type(sgd.optimizers[0]) is torch.optim.SGD
    assert (group["momentum"], group["nesterov"]) == (0.8, True)
    plain = OptimizerGroup(parts, OptimConfig(name="sgd", momentum=0.0))
    assert plain.param_groups[0]["nesterov"] is False  # Nesterov needs momentum
    sgd.set_lr(0.05)
    assert {g["lr"] for g in sgd.param_groups} == {0.05}


def test_sgd_with_momentum_fits_a_linear_target() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    model = nn.Linear(4, 1)
    group = OptimizerGroup([model], OptimConfig(name="sgd", lr=0.05, momentum=0.9))

    def loss() -> torch.Tensor:
        return nn.functional.mse_loss(model(x).squeeze(1), y)

    first = loss().item()
    for _ in range(100):
        group.zero_grad()
        loss().backward()
        group.step()
    assert loss().item() < first / 100


def test_a_tensor_parallel_model_steps_where_torch_would_pick_foreach_kernels(
    tmp_path, monkeypatch
) -> None:
    """The tensor plan leaves embeddings, norms and the head plain tensors beside DTensor
    weights; on CUDA torch picks its foreach kernels, which refuse that mix (every step of
    parallel.tp without dp_shard failed on an H200). Forced here as CUDA would choose."""
    import importlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from training.engine.sharding import apply_tensor_parallel
    from training.models.gpt import GPT

    for name in ("torch.optim.adam", "torch.optim.sgd"):  # AdamW runs Adam's code
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "_default_to_fused_or_foreach", lambda *a, **k: (False, True))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = GPT(32, layers=1, heads=2, width=16, context=8, dropout=0.0, tied_embeddings=False)
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
        for optim in (OptimConfig(), OptimConfig(name="sgd", momentum=0.9)):
            group = OptimizerGroup([model], optim)
            model(torch.randint(0, 32, (2, 8))).sum().backward()
            group.step()  # raised "got mixed torch.Tensor and DTensor" before
            group.zero_grad()
    finally:
        dist.destroy_process_group()
