"""The live scheduler in a chaos run (``kill_scheduler``; docs/operations.md).

``omni-sched run`` (:mod:`megascale_omni.scheduler.live_run`) with its local
launcher keeps ``groups`` replica groups of the chaos job: same training
config and overrides as the harness's own groups, the harness's lighthouse
(``lighthouse: http://...``), the job's ledger and checkpoint directory, one
bare-metal pool exactly as large as its core (``replicas: {min: n, max:
n}``), so its policy starts the core, regrows it when a group exits (a
lighthouse kill ends every group) and otherwise only observes. Its groups
train in the same quorums as the harness's; the plan's group faults target
the harness's slots only.

The harness plays the scheduler's own supervisor (a systemd unit, a
Deployment): :meth:`SchedulerProcess.poll` restarts it on the same ``out``
directory when it exits. A restarted scheduler takes its groups over from
``decisions.log`` and their ``<id>.pid`` files
(:mod:`megascale_omni.scheduler.live_recovery`); :func:`recovery` reads
whether it did so without starting any of them twice and ticked again.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megascale_omni.utils.processes import kill_process_tree

#: The job's name in the live config (group ids ``chaos-r<n>``).
JOB = "chaos"
_START = re.compile(r"^t=\S+ (\S+) start (\S+) on ")
_ADOPT = re.compile(r"^t=\S+ (\S+) adopt (\S+) on ")


def live_config(out: Path, config: str, overrides: list[str], lighthouse: str, groups: int, nproc: int,
                entry: str = "pretrain_llava.py") -> dict:
    """The ``omni-sched run`` config (docs/scheduler.md, "The live config") for ``groups`` groups of ``nproc``
    ranks of the chaos job: a fixed core on one bare-metal pool of ``groups`` nodes, no standby (the harness
    keeps the job's), 0.5 s ticks, the job's own ledger (in ``overrides``)."""
    return {
        "version": 1, "out": str(out), "tick_s": 0.5, "launcher": "local",
        "control": {"attempts": 2, "backoff_s": 0.5, "timeout_s": 30, "drain_timeout_s": 180},
        "pools": [{"name": "bare-metal", "kind": "bare_metal", "gpus_per_node": 1, "nodes": groups}],
        "jobs": [{"name": JOB, "config": config, "overrides": list(overrides), "entry": entry,
                  "nproc_per_node": nproc, "replica_gpus": 1, "replicas": {"min": groups, "max": groups},
                  "lighthouse": lighthouse, "ledger": False}],
        "policy": {"confirm_min": 0, "window_min": 0.05, "cooldown_min": 0.5},
    }


def recovery(before: set[str], decisions_since_kill: list[str], state: Optional[dict]) -> tuple[bool, str]:
    """Whether a scheduler restarted after a kill has recovered (pure; the kill_scheduler fault's criterion).

    ``before``: the group ids the killed scheduler's ``state.json`` held;
    ``decisions_since_kill``: the lines its successor wrote to
    ``decisions.log``; ``state``: the successor's ``state.json`` (None: not
    written yet). Recovered when every group of ``before`` still running
    was adopted (``adopt <id>``), no group was started while all of them
    live (a ``start`` beside a full set of adopted groups is a duplicate),
    and the successor completed a tick that lists the adopted groups.
    Returns ``(recovered, note)``; the note names a duplicate start."""
    adopted = {m[2] for line in decisions_since_kill if (m := _ADOPT.match(line))}
    started = [m[2] for line in decisions_since_kill if (m := _START.match(line))]
    if started and before <= adopted:
        return False, f"started {started} beside the adopted {sorted(adopted)}: a duplicate group"
    if not before <= adopted:
        return False, f"not adopted yet: {sorted(before - adopted)}"
    if state is None or state.get("stopped") or state.get("tick", 0) < 1:
        return False, f"adopted {sorted(adopted)}; no tick yet"
    groups = set(state.get("groups", {}))
    if not before <= groups:
        return False, f"adopted {sorted(adopted)} but its state lists {sorted(groups)}"
    return True, f"adopted {sorted(adopted)}, started none again"


@dataclass
class ScheduledGroup:
    """A group the scheduler started, as the harness's progress reader sees one (``replica_id``, ``output_dir``)."""

    replica_id: str
    output_dir: str
    started: float


class SchedulerProcess:
    """One ``omni-sched run`` process of the run and its restarts. ``spawn``
    is the supervisor's (the run's marker, its own session), ``actions`` its
    action log. Called from the harness's single thread."""

    def __init__(self, out: Path, config: dict, spawn, actions: list[dict], python: str):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.config_path = out / "live.json"  # JSON is YAML: omni-sched reads it
        self.config_path.write_text(json.dumps(config, indent=1))
        # Every pool as the config has it (read each tick; without the file every tick reports it missing).
        (out / "availability.yaml").write_text(json.dumps({p["name"]: {"nodes": p["nodes"]} for p in config["pools"]}))
        self.spawn, self.actions, self.python = spawn, actions, python
        self.proc: Optional[subprocess.Popen] = None
        self.starts: list[float] = []
        self.groups: dict[str, ScheduledGroup] = {}
        self.stopping = False

    @property
    def decisions(self) -> Path:
        return self.out / "decisions.log"

    def start(self) -> None:
        self.proc = self.spawn([self.python, "-m", "megascale_omni.scheduler.cli", "-v", "run", "--config",
                                str(self.config_path)], self.out / "omni-sched.log")
        self.starts.append(time.monotonic())
        self.actions.append({"t": self.starts[-1], "action": "start scheduler", "pid": self.proc.pid})

    def poll(self) -> list[ScheduledGroup]:
        """Restart the scheduler if it exited; returns its groups (every one it ever started, by run directory)."""
        if self.proc is not None and self.proc.poll() is not None and not self.stopping:
            self.actions.append({"t": time.monotonic(), "action": "scheduler exited", "code": self.proc.returncode})
            self.start()
        for d in sorted((self.out / JOB).glob(f"{JOB}-r*")):
            if d.is_dir() and d.name not in self.groups:
                self.groups[d.name] = ScheduledGroup(d.name, str(d), time.monotonic())
        return list(self.groups.values())

    def state(self) -> Optional[dict]:
        """Its ``state.json`` (None: not written or torn)."""
        try:
            return json.loads((self.out / "state.json").read_text())
        except (OSError, ValueError):
            return None

    def kill(self) -> int:
        """SIGKILL the scheduler process alone (its groups run in sessions of their own and keep training)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.pid

    def terminate(self) -> None:
        """SIGTERM: the scheduler drains its groups and exits (``omni-sched run``'s shutdown); no restart after."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.stopping = True

    def stop(self, timeout_s: float = 120.0) -> None:
        """:meth:`terminate`, then wait up to ``timeout_s`` for it to exit; kill what is left."""
        self.terminate()
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_process_tree(self.proc)

    def close(self) -> None:
        """Kill the scheduler and every group it started (their pid files name them)."""
        import psutil

        if self.proc is not None:
            kill_process_tree(self.proc)
        for g in self.groups.values():
            try:
                proc = psutil.Process(int(Path(f"{g.output_dir}.pid").read_text()))
                if f"elastic.replica_id={g.replica_id}" in proc.cmdline():
                    kill_process_tree(proc)  # type: ignore[arg-type]
            except (OSError, ValueError, psutil.Error):
                continue
