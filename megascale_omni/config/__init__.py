"""Typed job configuration: dataclass sections, YAML + overrides, validation."""

from megascale_omni.config.cli import load_job_config, parse_job_config
from megascale_omni.config.errors import ConfigError
from megascale_omni.config.loader import apply_overrides, coerce_field, from_dict, load_yaml, to_dict
from megascale_omni.config.schema import (
    CheckpointConfig,
    ControlConfig,
    DataConfig,
    DitConfig,
    ElasticConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    MoeConfig,
    ParallelConfig,
    PreflightConfig,
    TrainConfig,
    VisionConfig,
    WatchdogConfig,
)
from megascale_omni.config.validate import (
    control_socket_path,
    data_parallel_size,
    load_control_token,
    validate_job,
    validate_platform,
)

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "ControlConfig",
    "DataConfig",
    "ElasticConfig",
    "DitConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoeConfig",
    "ParallelConfig",
    "PreflightConfig",
    "TrainConfig",
    "VisionConfig",
    "WatchdogConfig",
    "apply_overrides",
    "coerce_field",
    "control_socket_path",
    "data_parallel_size",
    "from_dict",
    "load_control_token",
    "load_job_config",
    "load_yaml",
    "parse_job_config",
    "to_dict",
    "validate_job",
    "validate_platform",
]
