"""What every entry point shares: parse + validate for one model family, and
turn the errors a user can fix into one line and an exit code.

    python pretrain_x.py --config file.yaml [section.field=value ...]

Exit codes: 2 config error, 3 data error (too many bad samples), 4
checkpoint error (none intact), 44 failed pre-flight check
(docs/preflight.md); 43 comes from the hang watchdog's own thread
(``EXIT_HUNG``, docs/hang-detection.md). Everything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

from megascale_omni.config import JobConfig, load_job_config
from megascale_omni.tasks.registry import ModelFamily, get_family


def parse_for_family(
    family: str, argv: Optional[Sequence[str]] = None, description: str = "", world_size: Optional[int] = None
) -> tuple[JobConfig, ModelFamily]:
    """The job config and its family declaration, validated for ``world_size``
    ranks (default: torchrun's ``WORLD_SIZE``). Raises ConfigError; never
    starts a process group or imports megatron's models."""
    cfg = load_job_config(argv, description=description)
    spec = get_family(family)
    spec.validate(cfg, int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size)
    return cfg, spec


def train_family(family: str, description: str = "") -> list[dict]:
    """Entry-point body: parse, build, train (every rank)."""
    cfg, spec = parse_for_family(family, description=description)
    # Imported after parsing so a config error exits before megatron loads.
    from megascale_omni.training.trainer import run_training

    return run_training(cfg, spec)


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; a ConfigError becomes one stderr line (on rank 0, or on
    the rank that raised it when it is ``rank_local``) and exit code 2,
    a DataQualityError one line and exit code 3, a CheckpointError one line
    and exit code 4, a PreflightFailed one line per failed check and exit
    code 44 (no traceback)."""
    from megascale_omni.checkpoint.errors import CheckpointError
    from megascale_omni.config import ConfigError
    from megascale_omni.data.errors import DataQualityError
    from megascale_omni.errors import EXIT_PREFLIGHT_FAILED, PreflightFailed
    from megascale_omni.platform.logging_setup import silence_import_warnings

    silence_import_warnings()
    rank = os.environ.get("RANK", "0")
    try:
        main()
    except ConfigError as e:
        if rank == "0" or e.rank_local:
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
    except PreflightFailed as e:
        if rank == "0":
            sys.stderr.write("".join(f"{line}\n" for line in e.lines))
        sys.exit(EXIT_PREFLIGHT_FAILED)
