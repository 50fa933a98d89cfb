"""Run every pre-flight check on every rank of a process group, gather the
results and decide for the group.

Order: the local checks (device, checkpoint directories, data), then the
collective ones (all-reduce bandwidth, clock skew), then one all-gather of
every rank's results, so every rank reaches the same verdict and either
goes on or raises :class:`~megascale_omni.errors.PreflightFailed` (exit 44
through :func:`megascale_omni.entry.run_cli`). A check that raises counts as
failed (a local one could otherwise leave its peers waiting in the next
collective). Rank 0 writes the JSON result file (:mod:`.result`), pass or fail.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megascale_omni.config import JobConfig
from megascale_omni.errors import PreflightFailed
from megascale_omni.platform import Platform
from megascale_omni.preflight.checkpoint_dir import check_checkpoint_dirs
from megascale_omni.preflight.clock import Clock, check_clock
from megascale_omni.preflight.collective import check_allreduce
from megascale_omni.preflight.data import check_data
from megascale_omni.preflight.device import check_device
from megascale_omni.preflight.result import CheckResult, PreflightReport, write_report

logger = logging.getLogger(__name__)

RESULT_FILENAME = "preflight.json"


def result_path(cfg: JobConfig) -> Path:
    """``preflight.result_file``, else ``<logging.output_dir>/preflight.json``."""
    return Path(cfg.preflight.result_file or Path(cfg.logging.output_dir) / RESULT_FILENAME)


def dataset_roots(cfg: JobConfig) -> list[str]:
    """The datasets whose ``train/`` split the job reads: the blend's sources, else ``data.path`` (if set)."""
    if cfg.data.blend:
        return [source.path for source in cfg.data.blend]
    return [cfg.data.path] if cfg.data.path else []


def _guarded(check: str, run: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - any error of a check is that check's failure
        return [CheckResult(check, "fail", detail=f"{type(exc).__name__}: {exc}")]


def rank_results(cfg: JobConfig, platform: Platform, clock: Clock) -> list[CheckResult]:
    """This rank's results of every check (every rank of the default group calls it)."""
    pf, device, rank = cfg.preflight, platform.device, dist.get_rank()
    tiers = [("checkpoint.dir", cfg.checkpoint.dir), ("checkpoint.local_dir", cfg.checkpoint.local_dir)]
    results = [
        *_guarded("device_matmul", lambda: check_device(pf, device)),
        *_guarded("checkpoint_write", lambda: check_checkpoint_dirs(pf, tiers, rank)),
        *_guarded("data", lambda: check_data(pf, dataset_roots(cfg), rank)),
        *_guarded("allreduce", lambda: check_allreduce(pf, device)),
        *_guarded("clock_skew", lambda: check_clock(pf, device, clock, rank)),
    ]
    if device.type == "cuda":  # the matmul operands and the all-reduce buffer go back to the job
        torch.cuda.empty_cache()
    host = socket.gethostname()
    return [dataclasses.replace(r, host=host, rank=rank) for r in results]


def run_preflight(cfg: JobConfig, platform: Platform, clock: Clock = time.time,
                  raise_on_failure: bool = True) -> PreflightReport:
    """Every check on every rank of the default process group (all call it).

    Returns the gathered report (the same on every rank); with
    ``raise_on_failure``, raises PreflightFailed (one line per failed check)
    on every rank instead when a check failed. Rank 0 writes
    :func:`result_path` either way.
    """
    mine = [dataclasses.asdict(r) for r in rank_results(cfg, platform, clock)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    report = PreflightReport([CheckResult(**r) for rank in gathered for r in rank], dist.get_world_size())
    if dist.get_rank() == 0:
        path = write_report(report, result_path(cfg))
        logger.info("preflight: %d checks on %d ranks, %d failed; results in %s",
                    len(report.results), report.world_size, len(report.failed), path)
    if raise_on_failure and not report.ok:
        raise PreflightFailed(report.failure_lines())
    return report


def preflight_before_training(cfg: JobConfig, platform: Platform) -> None:
    """:func:`run_preflight` when ``preflight.enabled`` (every rank, after the
    default process group exists, before the model, the data and any quorum)."""
    if cfg.preflight.enabled:
        run_preflight(cfg, platform)
