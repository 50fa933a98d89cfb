"""Typed job configuration: dataclass sections, YAML + overrides, validation."""

from megascale_omni.config.cli import parse_job_config, run_cli
from megascale_omni.config.errors import ConfigError
from megascale_omni.config.loader import apply_overrides, from_dict, load_yaml, to_dict
from megascale_omni.config.schema import (
    CheckpointConfig,
    DataConfig,
    ElasticConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    VisionConfig,
)
from megascale_omni.config.validate import data_parallel_size, validate_job, validate_platform

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "ElasticConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "VisionConfig",
    "apply_overrides",
    "data_parallel_size",
    "from_dict",
    "load_yaml",
    "parse_job_config",
    "run_cli",
    "to_dict",
    "validate_job",
    "validate_platform",
]
