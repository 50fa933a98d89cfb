"""Command-line front end shared by every entry point.

``python pretrain_x.py --config file.yaml [section.field=value ...]``
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence, TypeVar

from megascale_omni.config.loader import apply_overrides, from_dict, load_yaml
from megascale_omni.config.schema import JobConfig
from megascale_omni.config.validate import validate_job

C = TypeVar("C")


def parse_job_config(
    argv: Sequence[str] | None = None,
    cls: type[C] = JobConfig,  # type: ignore[assignment]
    description: str = "",
    world_size: int | None = None,
) -> C:
    """Parse ``--config`` + overrides into ``cls`` and validate for the world size.

    ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (1 under plain python).
    Raises ConfigError; never starts a process group.
    """
    cfg = load_job_config(argv, cls, description)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_job(cfg, world_size)  # type: ignore[arg-type]
    return cfg


def load_job_config(
    argv: Sequence[str] | None = None,
    cls: type[C] = JobConfig,  # type: ignore[assignment]
    description: str = "",
) -> C:
    """Parse ``--config`` + overrides into ``cls`` with per-section checks only
    (no world-size validation; see :func:`parse_job_config`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config file (see examples/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.field=value", help="override any config field, e.g. train.steps=20"
    )
    args = parser.parse_args(argv)
    raw = load_yaml(args.config) if args.config else {}
    raw = apply_overrides(raw, args.overrides)
    return from_dict(cls, raw)
