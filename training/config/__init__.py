"""The one typed config schema, loaded from params.yaml plus `section.key=value` overrides.

sections  optim, train, update, runtime, parallel, evaluate, registry, orchestrate
          (data/shard, task and model belong to training.data.options,
          training.objectives and training.models.options)
schema    Config: every section, and the checks between them
jobspec   what each key is for: the job key, DVC stage params, MLflow params and tags
loading   load_config, overrides, write_overrides, keys that moved
"""

from training.config.loading import (
    MOVED_KEYS,
    load_config,
    parse_override,
    read_yaml_mapping,
    update_params_file,
    validate,
    write_overrides,
)
from training.config.schema import OPEN_SECTIONS, SECTIONS, Config
from training.config.sections import (
    MESH_DIMS,
    EvaluateConfig,
    OptimConfig,
    OrchestrateConfig,
    ParallelConfig,
    RegistryConfig,
    RuntimeConfig,
    TrainConfig,
    UpdateConfig,
)
from training.data.options import DataConfig, ShardConfig
from training.models.options import ModelConfig
from training.objectives import TaskConfig

__all__ = [
    "MESH_DIMS",
    "MOVED_KEYS",
    "OPEN_SECTIONS",
    "SECTIONS",
    "Config",
    "DataConfig",
    "EvaluateConfig",
    "ModelConfig",
    "OptimConfig",
    "OrchestrateConfig",
    "ParallelConfig",
    "RegistryConfig",
    "RuntimeConfig",
    "ShardConfig",
    "TaskConfig",
    "TrainConfig",
    "UpdateConfig",
    "load_config",
    "parse_override",
    "read_yaml_mapping",
    "update_params_file",
    "validate",
    "write_overrides",
]
