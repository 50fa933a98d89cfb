"""Which fault classes this checkout and this host can run: the ONE place
where the harness depends on work that is not merged yet.

* ``preflight_fail`` needs ``omni-preflight`` (branch ``preflight``): a
  ``preflight:`` section in the job config whose checks run before a
  replica group joins and exit :data:`EXIT_PREFLIGHT_FAILED`.
* Hang classes run on every checkout: on main a hang is detected by the
  collective timeouts (torchft's ``elastic.timeout_s``, gloo's
  ``MEGASCALE_DIST_TIMEOUT_S``); with the watchdog (branch ``watchdog``,
  a ``watchdog:`` section) the same classes are detected by it once the run
  passes ``watchdog.*`` overrides (:func:`watchdog_overrides`), and a stuck
  group exits :data:`EXIT_HUNG`.
* ``ckpt_enospc`` needs a size-limited tmpfs for the checkpoint directory
  (root, ``mount``); ``hang_data_worker`` a data-loader worker
  (``ChaosConfig.data_workers``, 1 by default).
* ``kill_scheduler`` needs the live scheduler in the run: ``omni-sched
  run`` keeps one of the job's groups (:mod:`megascale_omni.chaos.scheduled`)
  whenever the class is planned; it is always available.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from megascale_omni import errors

#: Exit code of a rank the watchdog tears down (megascale_omni/errors.py on branch watchdog).
EXIT_HUNG = getattr(errors, "EXIT_HUNG", 43)
#: Exit code of a group whose pre-flight failed (megascale_omni/errors.py on branch preflight).
EXIT_PREFLIGHT_FAILED = getattr(errors, "EXIT_PREFLIGHT_FAILED", 44)

NEEDS_PREFLIGHT = "needs omni-preflight (branch preflight)"
NEEDS_WATCHDOG = "needs the hang watchdog (branch watchdog)"
NEEDS_ROOT_MOUNT = "needs root and mount(8) for a size-limited tmpfs checkpoint directory"
NEEDS_DATA_WORKERS = "needs data.num_workers > 0 (there is no data worker to stop)"


def section_fields(section: str) -> list[str] | None:
    """Field names of config section ``section`` (None: the schema has no such section)."""
    from megascale_omni.config.schema import JobConfig

    for f in dataclasses.fields(JobConfig):
        if f.name == section:
            return [g.name for g in dataclasses.fields(f.default_factory())]
    return None


def has_watchdog() -> bool:
    return section_fields("watchdog") is not None


def has_preflight() -> bool:
    return section_fields("preflight") is not None


def can_mount_tmpfs() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def unavailable(data_workers: int) -> dict[str, str]:
    """Fault class -> why it cannot run here (classes not named can)."""
    out = {}
    if not has_preflight():
        out["preflight_fail"] = NEEDS_PREFLIGHT
    if not can_mount_tmpfs():
        out["ckpt_enospc"] = NEEDS_ROOT_MOUNT
    if data_workers < 1:
        out["hang_data_worker"] = NEEDS_DATA_WORKERS
    return out


def undetected() -> dict[str, str]:
    """Fault classes this checkout runs but does not detect: left out of
    the default plan (a run names them explicitly to measure that).
    Without the watchdog a stopped rank is never noticed: its group keeps
    heartbeating to the lighthouse, its healthy ranks wait in a pipeline
    receive with no deadline, and every quorum includes it, so the whole
    job stalls (measured: no commit for 240 s, until the harness's deadline
    killed the stopped rank)."""
    if has_watchdog():
        return {}
    return {"hang_rank": NEEDS_WATCHDOG, "hang_data_worker": NEEDS_WATCHDOG}


def watchdog_overrides(data_timeout_s: float, collective_timeout_s: float, elastic_timeout_s: float,
                       heartbeat_timeout_s: float) -> list[str]:
    """``watchdog.*`` overrides that make the watchdog detect the hang
    classes: ``enabled``, a 1 s poll, ``heartbeat_timeout_s`` (a stopped
    rank is named by its peers within it), ``collective_timeout_s`` (a group
    names its own stuck rank within it; above ``elastic.timeout_s``, as an
    elastic job requires), a step deadline above ``collective_timeout_s +
    elastic.timeout_s`` (a survivor outwaits the stuck group's own watchdog
    and torchft's abandon, as an elastic job requires) and
    ``data_timeout_s`` for the data wait. Empty without the watchdog: the
    collective timeouts detect hangs then."""
    fields = section_fields("watchdog")
    if fields is None:
        return []
    step_timeout_s = collective_timeout_s + elastic_timeout_s + 15
    named = {"collective_timeout_s": collective_timeout_s, "step_timeout_s": step_timeout_s,
             "heartbeat_timeout_s": heartbeat_timeout_s}
    limits = {f: named.get(f, data_timeout_s) for f in fields if f.endswith("_timeout_s")}
    poll = ["watchdog.poll_s=1"] if "poll_s" in fields else []
    return ["watchdog.enabled=true", *poll, *(f"watchdog.{f}={v:g}" for f, v in limits.items())]


def preflight_failing_overrides() -> list[str]:
    """Overrides that make one group's pre-flight fail for sure:
    ``preflight.enabled=true`` and a ``min_*`` threshold (a floor; the
    checkpoint write throughput when the section has it, a check that runs
    on every device) at a value no node reaches."""
    fields = section_fields("preflight") or []
    # The checkpoint-directory write floor runs on every device (CPU too); else any floor.
    floors = sorted((f for f in fields if f.startswith("min_")), key=lambda f: f != "min_checkpoint_write_mb_s")
    return ["preflight.enabled=true", *([f"preflight.{floors[0]}=1e15"] if floors else [])]
