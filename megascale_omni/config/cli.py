"""Command-line front end shared by every entry point.

``python pretrain_x.py --config file.yaml [section.field=value ...]``
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence, TypeVar

from megascale_omni.config.errors import ConfigError
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


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; a ConfigError becomes one stderr line and exit code 2,
    a DataQualityError one line and exit code 3, a CheckpointError one line
    and exit code 4 (no traceback)."""
    from megascale_omni.checkpoint.errors import CheckpointError
    from megascale_omni.data.errors import DataQualityError

    from megascale_omni.platform.logging_setup import silence_import_warnings

    silence_import_warnings()
    rank = os.environ.get("RANK", "0")
    try:
        main()
    except ConfigError as e:
        if rank == "0":
            sys.stderr.write(f"{e}\n")
        sys.exit(2)
    except DataQualityError as e:
        if rank == "0":
            sys.stderr.write(f"data error: {e}\n")
        sys.exit(3)
    except CheckpointError as e:
        if rank == "0":
            sys.stderr.write(f"checkpoint error: {e}\n")
        sys.exit(4)
