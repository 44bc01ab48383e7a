"""Recommendation: the dlrm model, the click task, the clicks source, categorical columns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.config import ModelConfig
from training.data.spec import DataSpec
from training.errors import ConfigError
from training.models.dlrm import DLRM
from training.models.embedding_tables import EmbeddingTables
from training.models.registry import build_model, check_buildable
from training.models.standardize import Standardized

# Three id columns (user, item, category) then two dense features.
CLICK_DATA = DataSpec(
    "table",
    (5,),
    2,
    feature_mean=(0.0, 0.0, 0.0, 12.0, 3.0),
    feature_std=(1.0, 1.0, 1.0, 6.0, 2.0),
    feature_names=("user_id", "item_id", "category", "hour", "position"),
    categorical_columns=("user_id", "item_id", "category"),
    categorical_distinct=(90, 40, 5),
    categorical_bound=(100, 50, 5),
)


def dlrm_cfg(**options) -> ModelConfig:
    return ModelConfig(name="dlrm", embedding_dim=4, bottom=[8], top=[8], **options)


def rows(n: int = 6, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, [100, 50, 5], size=(n, 3))
    dense = rng.normal([12.0, 3.0], [6.0, 2.0], size=(n, 2))
    return torch.from_numpy(np.hstack([ids, dense]).astype(np.float32))


# --- the dlrm model --------------------------------------------------------------------


def test_dlrm_shapes_and_one_embedding_module():
    model = DLRM([100, 50, 5], 2, 1, embedding_dim=4, bottom=[8], top=[16, 8])
    out = model(rows())
    assert out.shape == (6, 1)
    # Every table lives in one EmbeddingTables submodule: the seam the sharding swaps.
    tables = [m for m in model.modules() if isinstance(m, EmbeddingTables)]
    assert len(tables) == 1 and tables[0].rows == (100, 50, 5)
    assert not [
        m
        for m in model.modules()
        if type(m) is torch.nn.Embedding and m not in set(tables[0].tables)
    ]
    # 4 vectors (dense + 3 ids): 6 pairwise dots + the bottom's 4 values into the top MLP.
    assert model.top[0].in_features == 6 + 4


def test_dlrm_without_dense_features_interacts_ids_only():
    model = DLRM([10, 7], 0, 1, embedding_dim=3, bottom=[4], top=[4])
    assert model.bottom is None and model.top[0].in_features == 1
    assert model(torch.tensor([[3.0, 5.0], [9.0, 6.0]])).shape == (2, 1)


def test_dlrm_output_depends_on_ids_and_gradients_reach_the_tables():
    model = DLRM([100, 50, 5], 2, 1, embedding_dim=4, bottom=[8], top=[8])
    x = rows()
    y = x.clone()
    y[:, 1] = (y[:, 1] + 1) % 50  # another item for every row
    assert not torch.allclose(model(x), model(y))
    model(x).sum().backward()
    item_grad = model.embeddings.tables[1].weight.grad
    touched = set(x[:, 1].long().tolist())
    assert {int(i) for i in item_grad.abs().sum(1).nonzero().flatten()} == touched


def test_build_dlrm_sizes_tables_from_data_and_leaves_ids_unscaled():
    model = build_model(dlrm_cfg(), "classification", CLICK_DATA)
    assert isinstance(model, Standardized)
    # Dense ids: a row each (bound <= 4x distinct).
    assert model.model.embeddings.rows == (100, 50, 5)
    assert model.feature_mean.tolist()[:3] == [0.0, 0.0, 0.0]
    assert model.feature_std.tolist()[:3] == [1.0, 1.0, 1.0]
    check_buildable(dlrm_cfg(), "classification", CLICK_DATA)


def test_table_rows_hash_into_fewer_rows():
    assert build_model(
        dlrm_cfg(table_rows=20), "classification", CLICK_DATA
    ).model.embeddings.rows == (20, 20, 5)
    sized = build_model(dlrm_cfg(table_rows=[30, 10, 2]), "classification", CLICK_DATA)
    assert sized.model.embeddings.rows == (30, 10, 2)


def test_hashed_ids_get_four_rows_per_distinct_value():
    hashed = DataSpec(
        "table", (2,), 2, categorical_columns=("a", "b"),
        categorical_distinct=(1000, 3), categorical_bound=(16_000_000, 15_000_000),
    )  # fmt: skip
    assert hashed.default_table_rows() == (4000, 12)


def test_wrong_table_rows_length_is_a_config_error():
    with pytest.raises(ConfigError, match=r"table_rows lists 2 sizes.*3 id columns"):
        build_model(dlrm_cfg(table_rows=[30, 10]), "classification", CLICK_DATA)


def test_dlrm_on_data_without_ids_is_a_config_error():
    plain = DataSpec("table", (5,), 2)
    with pytest.raises(ConfigError, match=r"data\.categorical_columns"):
        build_model(dlrm_cfg(), "classification", plain)


def test_dlrm_options_are_validated():
    with pytest.raises(ValueError, match="table_rows"):
        ModelConfig(name="dlrm", table_rows=[10, 0])
    with pytest.raises(ValueError, match="not a key of model dlrm"):
        ModelConfig(name="dlrm", hidden=3)


def test_data_spec_round_trips_categorical_fields():
    assert DataSpec.from_dict(CLICK_DATA.to_dict()) == CLICK_DATA
    example = CLICK_DATA.example(8)
    ids = example[:, :3]
    assert (ids == np.round(ids)).all() and (ids >= 0).all() and (ids < [100, 50, 5]).all()
