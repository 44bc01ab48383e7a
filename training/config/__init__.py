"""The one typed config schema, loaded from params.yaml plus `section.key=value` overrides.

    sections  optim, train, update, runtime, parallel, evaluate, registry, orchestrate
              (data/shard, task and model belong to training.data.options,
              training.objectives and training.models.options)
    schema    Config: every section, and the checks between them
    jobspec   what each key is for: the job key, DVC stage params, MLflow params and tags
    loading   load_config, overrides, write_overrides, keys that moved

The names most callers need are here; the rest are in their modules.
"""

from training.config.loading import (
    load_config,
    parse_override,
    read_yaml_mapping,
    update_params_file,
    write_overrides,
)
from training.config.schema import Config
from training.config.sections import (
    MESH_DIMS,
    OptimConfig,
    ParallelConfig,
    RuntimeConfig,
    UpdateConfig,
)
from training.data.options import DataConfig, ShardConfig
from training.models.options import ModelConfig

__all__ = [
    "MESH_DIMS",
    "Config",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "ShardConfig",
    "UpdateConfig",
    "load_config",
    "parse_override",
    "read_yaml_mapping",
    "update_params_file",
    "write_overrides",
]
