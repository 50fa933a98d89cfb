"""The live scheduler loop behind ``omni-sched run`` (docs/scheduler.md, "Running live").

Every ``tick_s`` seconds, in one thread: observe every replica group
through its control socket (:meth:`LiveActuator.refresh`: status and the
last step record, retried with backoff; an unreachable group is reported,
never raised), read the availability file, build the policy's
:class:`~megascale_omni.scheduler.model.Snapshot` from both, ask the policy,
apply its decisions through the actuator; each pool's warm standbys are
kept before the policy runs (so a grow finds one to join) and after. Every decision is written with its reason to
``<out>/decisions.log`` (``t=<min> <job> <action> <what>: <reason>``), followed
by what the actuator did about it; ``<out>/state.json`` holds the groups and
pools after each tick (for operators and tests).

Scheduler time (``time_min``) is minutes since the loop started, by the wall
clock, because reclaim deadlines in the availability file are Unix times.

A scheduler started on an ``out`` directory an earlier one used (it was
killed) first takes over that one's groups (:mod:`.live_recovery`) and
numbers new groups after the old ones. If the loop stops on an error, every
group it knows is killed and the launcher removes what it started.
The policy's live inputs per job come from :mod:`.live_demand`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Mapping, Optional

from megascale_omni.scheduler.actuator import Backoff, LiveActuator
from megascale_omni.scheduler.launchers import JobTemplate, ReplicaLauncher
from megascale_omni.scheduler.live import Observation
from megascale_omni.scheduler.live_config import LiveConfig, PoolState, read_availability
from megascale_omni.scheduler.live_demand import DemandModel, JobLoad, job_load
from megascale_omni.scheduler.live_recovery import candidates, next_serials
from megascale_omni.scheduler.model import (
    JobView,
    PoolView,
    Reclaim,
    ReplicaView,
    Snapshot,
    apply,
)
from megascale_omni.utils.files import atomic_write_json

log = logging.getLogger(__name__)


def job_templates(cfg: LiveConfig) -> dict[str, JobTemplate]:
    """How each job's groups are started: run directories ``<out>/<job>/<replica>``, ledger ``<out>/<job>/ledger``."""
    out = {}
    for j in cfg.jobs:
        run_dir = os.path.join(cfg.out, j.name)
        out[j.name] = JobTemplate(name=j.name, config=j.config, run_dir=run_dir,
                                  lighthouse="" if j.lighthouse == "auto" else j.lighthouse,
                                  ledger_dir=os.path.join(run_dir, "ledger") if j.ledger else "", entry=j.entry,
                                  overrides=j.overrides, nproc_per_node=j.nproc_per_node)
    return out


class LiveScheduler:
    """One policy driving live jobs. ``policy`` has ``decide(Snapshot)``;
    ``wall`` gives Unix seconds. :meth:`tick` runs one round;
    :meth:`run` loops until ``stop()`` and then drains every group."""

    def __init__(self, cfg: LiveConfig, launcher: ReplicaLauncher, policy, *, token: Optional[str] = None,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.cfg, self.policy, self.wall, self.sleep = cfg, policy, wall, sleep
        self.jobs = {j.name: j for j in cfg.jobs}
        self.pools = {p.name: p for p in cfg.pools}
        os.makedirs(cfg.out, exist_ok=True)
        self.decisions_path = os.path.join(cfg.out, "decisions.log")
        self.started = wall()
        nodes = {(j.name, p.name): j.replica_gpus // p.gpus_per_node for j in cfg.jobs for p in cfg.pools}
        standbys = {(j.name, pool): n for j in cfg.jobs for pool, n in j.standby.items()}
        earlier = candidates(self.decisions_path, launcher, nodes, self.jobs) if not cfg.dry_run else []
        serials = next_serials(cfg.out, self.decisions_path, self.jobs, [spec.replica_id for spec, _ in earlier])
        self.actuator = LiveActuator(launcher, nodes, standbys, token=token,
                                     backoff=Backoff(cfg.attempts, cfg.backoff_s), command_timeout_s=cfg.timeout_s,
                                     drain_timeout_s=cfg.drain_timeout_s, sleep=sleep, record=self._record,
                                     first_serial=serials)
        self.availability: dict[str, PoolState] = {p.name: PoolState(p.nodes) for p in cfg.pools}
        self.demand = {j.name: DemandModel() for j in cfg.jobs}
        self.load: dict[str, JobLoad] = {j.name: JobLoad() for j in cfg.jobs}
        self.ticks = 0
        if earlier:
            self.actuator.recover(earlier)

    @property
    def now_min(self) -> float:
        return (self.wall() - self.started) / 60.0

    def tick(self) -> list:
        """One round: observe, read availability, decide, actuate, keep standbys. Returns the decisions."""
        t = self.now_min
        seen = self.actuator.refresh(t)
        reading, error = read_availability(self.cfg.availability, self.cfg.pools)
        if reading is None:
            self._record(f"availability not read (keeping the last reading): {error}")
        else:
            self.availability.update(reading)
        # Standbys first, so that a grow this tick finds one to join (joined as soon as it stands by).
        capacity = {name: s.nodes - s.reclaim_nodes for name, s in self.availability.items()}
        self.actuator.keep_standbys(capacity)
        snap = self.snapshot(t, seen)
        decisions = self.policy.decide(snap)
        for d in decisions:
            self._record(d.describe())
            apply(self.actuator, d)
        self.actuator.keep_standbys(capacity)
        self.ticks += 1
        self._write_state(snap)
        return decisions

    def snapshot(self, t: float, seen: Mapping[str, list[Observation]]) -> Snapshot:
        """The policy's view now: pools from the availability file, jobs from the actuator's groups and their step
        metrics."""
        groups = [g for g in self.actuator.groups.values() if g.member]
        reclaims, pools = [], []
        for name, spec in self.pools.items():
            state = self.availability[name]
            used = sum(g.spec.nodes for g in groups if g.spec.pool == name)
            if state.reclaim_nodes:
                reclaims.append(Reclaim(name, state.reclaim_nodes, (state.deadline - self.started) / 60.0))
            pools.append(PoolView(name, spec.kind, spec.gpus_per_node, state.nodes, used, state.reclaim_nodes))
        jobs = []
        for name, job in self.jobs.items():
            mine = [g for g in groups if g.spec.job == name]
            views = tuple(ReplicaView(g.spec.replica_id, g.spec.pool, g.state if g.state in ("running", "draining")
                                      else "joining", g.straggler_since_min) for g in mine)
            load = self.load[name] = job_load(seen.get(name, []), job.vision_token_cost)
            model = self.demand[name]
            model.update(load)
            for event in model.events:
                self._record(f"{name} {event}")
            model.events.clear()
            active = sum(1 for g in mine if g.state != "draining")
            configured = job.demand_gpus if job.demand_gpus is not None else job.max_replicas * job.replica_gpus
            jobs.append(JobView(name, job.priority, job.replica_gpus, job.min_replicas, job.max_replicas,
                                model.curve(job.max_replicas),
                                model.demand(configured, active, job.replica_gpus, load),
                                load.samples_per_s, admitted=active > 0, replicas=views))
        return Snapshot(t, tuple(pools), tuple(jobs), tuple(reclaims))

    def run(self, stop: Callable[[], bool], max_ticks: Optional[int] = None, drain_wait_s: float = 600.0) -> None:
        """Tick every ``tick_s`` until ``stop()`` (or ``max_ticks``); then drain every group and wait up to
        ``drain_wait_s`` for them to leave (the rest are killed). Blocks for the whole run."""
        try:
            while not stop() and (max_ticks is None or self.ticks < max_ticks):
                began = self.wall()
                self.tick()
                self._nap(began + self.cfg.tick_s, stop)
        except BaseException as e:
            if not self.cfg.dry_run:
                self.actuator.close(f"the scheduler stops on an error ({type(e).__name__}: {e})")
            self._write_state(None)
            raise
        self.actuator.shutdown("the scheduler stops")
        deadline = self.wall() + drain_wait_s
        while self.actuator.groups and self.wall() < deadline and not self.cfg.dry_run:
            self.actuator.refresh(self.now_min)
            self.sleep(min(1.0, self.cfg.tick_s))
        for rid, group in list(self.actuator.groups.items()):
            if not self.cfg.dry_run:
                self.actuator.kill(group.spec.job, [rid], f"still there {drain_wait_s:g} s after the final drain")
        if not self.cfg.dry_run:
            self.actuator.close("the scheduler stops")
        self._write_state(None)

    # ------------------------------------------------------------ internals
    def _record(self, line: str) -> None:
        stamped = f"t={self.now_min:.3f} {line}"
        with open(self.decisions_path, "a", encoding="utf-8") as f:
            f.write(stamped + "\n")

    def _write_state(self, snap: Optional[Snapshot]) -> None:
        state = {
            "tick": self.ticks, "time_min": self.now_min, "stopped": snap is None,
            "groups": {rid: {"job": g.spec.job, "pool": g.spec.pool, "state": g.state, "standby": g.standby,
                             "join_pending": g.join_pending} for rid, g in self.actuator.groups.items()},
            "pools": {p.name: {"nodes": p.nodes, "used": p.used, "reclaiming": p.reclaiming}
                      for p in (snap.pools if snap else ())},
            "unreachable": self.actuator.unreachable[-20:],
            "load": {job: dataclasses.asdict(load) for job, load in self.load.items()},
        }
        path = os.path.join(self.cfg.out, "state.json")
        atomic_write_json(path, state, indent=1)  # a snapshot, rewritten every tick: no fsync

    def _nap(self, until: float, stop: Callable[[], bool]) -> None:
        while not stop() and self.wall() < until:
            self.sleep(min(0.2, max(0.0, until - self.wall())))
