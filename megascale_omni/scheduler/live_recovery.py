"""What a restarted live scheduler takes over: the groups an earlier
scheduler process left running (it was killed, even with SIGKILL), and the
group numbers it used.

Two sources, because neither is complete alone:

- ``decisions.log``, replayed: the actuator writes a group's ``start`` line
  before it launches it, and every later fact about it (``adopt``, a drain
  sent, a join sent or pending, ``kill``, ``left`` / ``exited``), so the log
  names every group that may exist and what was last done to it;
- the launcher's :meth:`running_groups` (Slurm ``--comment`` tags, JobSet
  labels), for a group whose log line was lost.

The actuator then keeps the ones its launcher does not report as exited,
in the state their control socket reports (:meth:`LiveActuator.recover`), so
a restart neither grows a job again nor drains a group twice. Group numbers
continue after the highest one seen in the log, the launcher or the run
directories (``<out>/<job>/<job>-r<n>``), so ids never repeat (a leftover
``omni-A-r0`` of an earlier run is never mistaken for a new group).
Called once, by the live loop's constructor.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Iterable, Mapping, Optional

from megascale_omni.scheduler.launchers import GroupSpec

log = logging.getLogger(__name__)

_START = re.compile(r"^t=\S+ (\S+) start (\S+) on (\S+) \((warm standby|cold start)\)")
_ADOPT = re.compile(r"^t=\S+ (\S+) adopt (\S+) on (\S+) \((\w+)(, warm standby)?\)")
_DRAIN = re.compile(r"^t=\S+ (\S+) drain (\S+) \(leaves after step")
_JOIN = re.compile(r"^t=\S+ (\S+) grow: join standby (\S+) on \S+ (?:\(at step|once it stands by)")
_GONE = re.compile(r"^t=\S+ (\S+) (?:kill (\S+):|(\S+) (?:left after its drain|exited unexpectedly))")
_SERIAL = re.compile(r"-r(\d+)$")


def replay(lines: Iterable[str]) -> dict[str, dict]:
    """Groups that may still exist after ``lines`` of a decisions log: replica id ->
    ``{"job", "pool", "standby", "join_pending", "state"}`` (state ``draining`` once a drain was sent)."""
    groups: dict[str, dict] = {}
    for line in lines:
        if m := _START.match(line):
            groups[m[2]] = {"job": m[1], "pool": m[3], "standby": m[4] == "warm standby", "join_pending": False,
                            "state": "starting"}
        elif m := _ADOPT.match(line):
            groups[m[2]] = {"job": m[1], "pool": m[3], "standby": bool(m[5]), "join_pending": False,
                            "state": m[4]}
        elif (m := _DRAIN.match(line)) and m[2] in groups:
            groups[m[2]]["state"] = "draining"
        elif (m := _JOIN.match(line)) and m[2] in groups:
            groups[m[2]]["join_pending"] = True
        elif m := _GONE.match(line):
            groups.pop(m[2] or m[3], None)
    return groups


def candidates(decisions_path: str, launcher, nodes_per_group: Mapping[tuple[str, str], int],
               jobs: Iterable[str]) -> list[tuple[GroupSpec, dict]]:
    """``(spec, last known facts)`` for every group the log or the launcher names, of the configured ``jobs``."""
    known = set(jobs)
    try:
        with open(decisions_path, encoding="utf-8", errors="replace") as f:
            logged = replay(f)
    except FileNotFoundError:
        logged = {}
    out: dict[str, tuple[GroupSpec, dict]] = {}
    for rid, g in logged.items():
        nodes = nodes_per_group.get((g["job"], g["pool"]))
        if g["job"] in known and nodes is not None:
            out[rid] = (GroupSpec(g["job"], rid, g["pool"], nodes, g["standby"]), g)
    listing = getattr(launcher, "running_groups", None)
    try:
        running = listing() if listing is not None else None
    except Exception as e:  # noqa: BLE001 - the log alone still gives the groups; the launcher is a plug-in
        log.error("cannot list the launcher's running groups (%s: %s); taking over from decisions.log alone",
                  type(e).__name__, e)
        running = None
    for spec in running or ():
        if spec.job in known and spec.replica_id not in out:
            out[spec.replica_id] = (spec, {})
    return list(out.values())


def next_serials(out_dir: str, decisions_path: str, jobs: Iterable[str], used: Iterable[str]) -> dict[str, int]:
    """Per job, one past the highest ``<job>-r<n>`` among ``used`` ids, every id the decisions log names and the
    run directories under ``out_dir``."""
    try:
        with open(decisions_path, encoding="utf-8", errors="replace") as f:
            logged = f.read().split()
    except FileNotFoundError:
        logged = []
    used = [*used, *(word.rstrip(":,") for word in logged)]
    result = {}
    for job in jobs:
        ids = [rid for rid in used if rid.startswith(f"{job}-r")]
        run_dir = os.path.join(out_dir, job)
        if os.path.isdir(run_dir):
            ids += [name for name in os.listdir(run_dir) if name.startswith(f"{job}-r")]
        numbers = [_serial(rid) for rid in ids]
        result[job] = max((n for n in numbers if n is not None), default=-1) + 1
    return result


def _serial(rid: str) -> Optional[int]:
    m = _SERIAL.search(rid.removesuffix(".log").removesuffix(".pid"))
    return int(m[1]) if m else None
