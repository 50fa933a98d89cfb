"""``omni-sched run``: wire a live config to a launcher, the elastic policy and
the loop, and run until SIGINT / SIGTERM (or ``--ticks``); then drain every
group. Blocks in the calling (main) thread; installs signal handlers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import signal
import sys
from typing import Optional

from megascale_omni.errors import ConfigError
from megascale_omni.scheduler.cluster_launchers import KubernetesLauncher, SlurmLauncher
from megascale_omni.scheduler.launchers import LocalLauncher
from megascale_omni.scheduler.live_config import LiveConfig, load_live_config
from megascale_omni.scheduler.live_loop import LiveScheduler, job_templates
from megascale_omni.scheduler.policy import ElasticPolicy, Knobs

log = logging.getLogger(__name__)


def build_launcher(cfg: LiveConfig):
    """The launcher ``cfg.launcher`` names, with its section's settings; raises ConfigError."""
    templates = job_templates(cfg)
    gpus = {p.name: p.gpus_per_node for p in cfg.pools}
    if cfg.launcher != "local":
        for job in cfg.jobs:
            if job.lighthouse == "auto":
                raise ConfigError(f"jobs.{job.name}.lighthouse", "auto", f"the {cfg.launcher} launcher needs the "
                                  "address of a running lighthouse: http://host:port")
    if cfg.launcher == "local":
        launcher = LocalLauncher(templates, python=sys.executable)
        for job in cfg.jobs:
            if job.lighthouse == "auto":
                launcher.start_lighthouse(job.name)
        return launcher
    if cfg.launcher == "slurm":
        known = {"partitions", "srun_args", "request_gpus"}
        _known("slurm", cfg.slurm, known)
        request_gpus = cfg.slurm.get("request_gpus", True)
        if not isinstance(request_gpus, bool):
            raise ConfigError("slurm.request_gpus", request_gpus, "must be true or false (false: a CPU cluster)")
        return SlurmLauncher(templates, gpus, partitions=cfg.slurm.get("partitions") or {},
                             srun_args=cfg.slurm.get("srun_args") or (), dry_run=cfg.dry_run,
                             request_gpus=request_gpus)
    known = {"image", "namespace", "node_selectors", "token_secret", "volumes", "volume_mounts"}
    _known("kubernetes", cfg.kubernetes, known)
    if not isinstance(cfg.kubernetes.get("image"), str):
        raise ConfigError("kubernetes.image", cfg.kubernetes.get("image"), "give the trainer's container image")
    return KubernetesLauncher(templates, gpus_per_node=gpus, dry_run=cfg.dry_run, **cfg.kubernetes)


def _known(section: str, raw: dict, known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{section}.{unknown[0]}", raw[unknown[0]], f"unknown key; known: {sorted(known)}")


def run_live(path: str, ticks: Optional[int] = None, dry_run: bool = False) -> list[str]:
    """Load ``path`` and run the live loop; returns the lines to print (a dry
    run's commands, then a summary). Raises ConfigError before anything starts."""
    cfg = load_live_config(path)
    if dry_run:
        if cfg.launcher == "local":
            raise ConfigError("--dry-run", True, "the local launcher has no dry run; use launcher: slurm or kubernetes")
        cfg = dataclasses.replace(cfg, dry_run=True)
    if ticks is not None and ticks < 1:
        raise ConfigError("--ticks", ticks, "must be >= 1")
    knobs = Knobs.from_dict(cfg.policy, "policy")
    launcher = build_launcher(cfg)
    stopping: list[int] = []

    def on_signal(signum, _frame) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    scheduler = LiveScheduler(cfg, launcher, ElasticPolicy(knobs), token=os.environ.get("MEGASCALE_CONTROL_TOKEN"))
    try:
        scheduler.run(lambda: bool(stopping), max_ticks=ticks)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if isinstance(launcher, LocalLauncher):
            launcher.close()
    lines = []
    if cfg.dry_run:
        lines = [shlex.join(argv) if stdin is None else f"{shlex.join(argv)} <<'EOF'\n{stdin}EOF"
                 for argv, stdin in launcher.runner.commands]
    return lines + [f"{scheduler.ticks} tick(s); decisions in {scheduler.decisions_path}"]
