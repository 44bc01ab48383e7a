"""Parallel layouts without processes: the mesh in the config, rank coordinates, the
model's own split (pipeline stages and tensor-parallel plan), communication counting."""

from __future__ import annotations

import copy

import pytest
import torch

from training.config import Config
from training.data.spec import DataSpec
from training.engine.comm import ring_bytes
from training.engine.pipeline import stage_indices
from training.engine.topology import Topology
from training.errors import ConfigError
from training.models.gpt import GPT
from training.models.registry import build_model, check_buildable

GPT_JOB = {
    "data": {"source": "stdlib"},
    "task": {"type": "language_modeling"},
    "model": {
        "name": "gpt",
        "layers": 4,
        "heads": 4,
        "width": 32,
        "context": 16,
        "tied_embeddings": False,
    },
    "train": {"batch_size": 16},
}


def _gpt_config(world: int, parallel: dict, model: dict | None = None, train: dict | None = None):
    spec = copy.deepcopy(GPT_JOB)
    spec["model"].update(model or {})
    spec["train"].update(train or {})
    runtime = {"procs_per_node": world}
    return Config.model_validate({**spec, "runtime": runtime, "parallel": parallel})


@pytest.mark.parametrize(
    ("world", "parallel", "mesh"),
    [
        (2, {}, {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 1}),
        (4, {"dp_shard": 2}, {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 1}),
        (4, {"dp_shard": -1}, {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}),
        (
            8,
            {"pp": 2, "tp": 2, "dp_shard": -1},
            {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2},
        ),
    ],
)
def test_mesh_sizes_resolve_against_the_world_size(world, parallel, mesh) -> None:
    assert _gpt_config(world, parallel).layout() == mesh


@pytest.mark.parametrize(
    ("world", "parallel", "model", "train", "message"),
    [
        (
            2,
            {"tp": 2},
            {"heads": 3, "width": 33},
            {},
            r"parallel\.tp=2 needs model\.heads divisible by 2",
        ),
        (4, {"pp": 4}, {"layers": 3}, {}, r"needs at least 4 blocks"),
        (2, {"pp": 2}, {"tied_embeddings": True}, {}, r"set model\.tied_embeddings: false"),
        (2, {"pp": 2}, {}, {"grad_accum_steps": 2}, r"pp_microbatches"),
        (2, {"pp": 2, "pp_microbatches": 3}, {}, {}, r"must divide"),
        (4, {"dp_shard": 3}, {}, {}, r"does not fit the job's 4 workers"),
        (2, {"dp_shard": -1, "tp": -1}, {}, {}, r"only one mesh size may be -1"),
        (2, {"param_dtype": "bf16"}, {}, {}, r"apply to sharded parameters"),
        (2, {"tp": 2}, {}, {"compile": True}, r"train\.compile works with plain data parallelism"),
    ],
)
def test_layouts_that_cannot_work_fail_naming_the_keys(world, parallel, model, train, message):
    with pytest.raises(ValueError, match=message):
        _gpt_config(world, parallel, model, train)


def test_a_user_model_without_plans_cannot_be_split() -> None:
    from training.config import ModelConfig

    data = DataSpec(kind="tokens", feature_shape=(), vocab_size=50)
    model_cfg = ModelConfig(name=None, target="tests.user_models:tiny_language_model", context=8)
    check_buildable(model_cfg, "language_modeling", data, {"tp": 1, "pp": 1})
    with pytest.raises(ConfigError, match=r"no tensor_parallel_plan\(\).*parallel\.tp=2"):
        check_buildable(model_cfg, "language_modeling", data, {"tp": 2, "pp": 1})
    with pytest.raises(ConfigError, match=r"no pipeline_stage\(\).*parallel\.pp=2"):
        check_buildable(model_cfg, "language_modeling", data, {"tp": 1, "pp": 2})


def test_rank_coordinates_put_tp_innermost_and_share_rows_within_tp_and_pp() -> None:
    mesh = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
    topos = [Topology(r, 8, r, "gloo", torch.device("cpu")).with_shape(mesh) for r in range(8)]
    assert [t.coordinate("tp") for t in topos] == [0, 1] * 4
    assert [t.coordinate("pp") for t in topos] == [0] * 4 + [1] * 4
    assert [t.dp_rank for t in topos] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert {t.dp_size for t in topos} == {2}
    # One rank per data-parallel share reports losses: tp rank 0 of the last stage.
    assert [t.rank for t in topos if t.reports] == [4, 6]


def test_pipeline_stages_compose_to_the_whole_model() -> None:
    torch.manual_seed(0)
    whole = GPT(40, layers=5, heads=2, width=16, context=8, dropout=0.0, tied_embeddings=False)
    ids = torch.randint(0, 40, (3, 8))
    expected = whole(ids)
    names = set(whole.state_dict())
    stages = [copy.deepcopy(whole).pipeline_stage(i, 3) for i in range(3)]
    assert [list(s.blocks) for s in stages] == [["0", "1"], ["2", "3"], ["4"]]
    # Every parameter lives on exactly one stage, under the whole model's name.
    kept = [set(s.state_dict()) for s in stages]
    assert set().union(*kept) == names and sum(map(len, kept)) == len(names)
    x = ids
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, expected)


def test_interleaved_stages_go_round_the_pipeline_ranks() -> None:
    assert stage_indices(0, 2, 4) == [0, 2] and stage_indices(1, 2, 4) == [1, 3]
    assert stage_indices(1, 2, 2) == [1]


def test_gpt_plan_names_its_linears() -> None:
    data = DataSpec(kind="tokens", feature_shape=(), vocab_size=50)
    model = build_model(_gpt_config(2, {}).model, "language_modeling", data)
    names = dict(model.named_modules())
    import fnmatch

    for pattern in model.tensor_parallel_plan():
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern


def test_ring_model_bytes() -> None:
    assert ring_bytes("allreduce_", 100, 4) == 150
    assert ring_bytes("_allgather_base_", 25, 4) == 75  # the input is one shard
    assert ring_bytes("_reduce_scatter_base_", 100, 4) == 75
    assert ring_bytes("send", 10, 2) == 10 and ring_bytes("recv_", 10, 2) == 0
    assert ring_bytes("allreduce_", 100, 1) == 0
