"""``omni-preflight``: the pre-flight health checks by hand, on every rank of a group.

    omni-preflight --config job.yaml [section.field=value ...]                  # one process
    torchrun --nproc-per-node 8 -m megascale_omni.preflight --config job.yaml   # one node's group
    omni-run --nnodes 2 --nproc-per-node 8 --rdzv-endpoint host:29500 -m megascale_omni.preflight --config job.yaml

Takes the job's own config: its checkpoint directories, datasets,
``platform.device`` and ``preflight.*`` thresholds (whatever
``preflight.enabled`` says). Rank 0 prints a table of every rank's results
and writes the JSON result file; a failed check prints one line each and
exits 44 (docs/preflight.md). Exit codes: 0 every check passed or was
skipped, 2 config error, 44 a check failed.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, Sequence

from megascale_omni.errors import PreflightFailed


def main(argv: Optional[Sequence[str]] = None, clock=time.time) -> int:
    """Parse, run every check on this rank, print and decide (every rank).
    ``clock`` is this rank's wall clock (tests plant an offset through it)."""
    from megascale_omni.config import load_job_config

    cfg = load_job_config(argv, description="omni-preflight: health checks of the job's devices, group, "
                                            "checkpoint directories, data and clocks")
    # Imported after parsing: a config error exits 2 before torch loads.
    import torch.distributed as dist

    from megascale_omni.platform import init_distributed, init_platform
    from megascale_omni.preflight.result import format_report
    from megascale_omni.preflight.runner import result_path, run_preflight

    platform = init_platform(cfg.platform.device, cpu_patches=False)  # builds no megatron object
    owns_group = not dist.is_initialized()
    init_distributed(platform, timeout_s=int(cfg.preflight.timeout_s))
    try:
        report = run_preflight(cfg, platform, clock, raise_on_failure=False)
        if dist.get_rank() == 0:
            sys.stdout.write(format_report(report) + f"results: {result_path(cfg)}\n")
    finally:
        if owns_group:
            dist.destroy_process_group()
    if not report.ok:
        raise PreflightFailed(report.failure_lines())
    return 0


def cli() -> None:
    """Console-script entry point (``omni-preflight``)."""
    from megascale_omni.entry import run_cli

    run_cli(main)
