"""Command-line front end shared by every entry point.

``python pretrain_x.py --config file.yaml [--config more.yaml ...] [section.field=value ...]``

Several ``--config`` files merge in order, field by field (a later file's
``model.hidden_size`` replaces an earlier one's, other fields stay), e.g. a
job config followed by the ``model.yaml`` that tools/hf_import.py writes.
Overrides apply last.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence, TypeVar

from megascale_omni.config.loader import apply_overrides, from_dict, load_yaml, merge_sections
from megascale_omni.config.schema import JobConfig
from megascale_omni.config.validate import validate_job, validate_paths

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
    validate_paths(cfg)  # type: ignore[arg-type]
    return cfg


def load_job_config(
    argv: Sequence[str] | None = None,
    cls: type[C] = JobConfig,  # type: ignore[assignment]
    description: str = "",
) -> C:
    """Parse ``--config`` + overrides into ``cls`` with per-section checks only
    (no world-size validation; see :func:`parse_job_config`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", action="append", default=[],
                        help="YAML config file (see examples/); repeat to merge several, later ones win")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.field=value", help="override any config field, e.g. train.steps=20"
    )
    args = parser.parse_args(argv)
    raw: dict = {}
    for path in args.config:
        raw = merge_sections(raw, load_yaml(path))
    raw = apply_overrides(raw, args.overrides)
    return from_dict(cls, raw)
