"""Fixed-tick trace simulator: runs any policy against a trace and implements
:class:`~megascale_omni.scheduler.model.Actuator` with the latencies of
``trace.costs``.

Each tick of ``trace.tick_min`` minutes: replica groups whose drain finished
leave; reclaim deadlines that have come kill whatever still exceeds the
pool's new size (a missed deadline); jobs arrive; the policy decides on a
snapshot and the decisions are applied; then every job progresses by
``curve(min(productive groups, demand))`` samples/s over the tick. A group is
productive from its join latency on (standby or cold); an elastic job's
survivors lose ``join_disruption_s`` per join and one step per kill; a
non-elastic job (static baseline) stops for ``restart_s`` at any change.

Useful GPU-minutes count a job's groups only as far as they add samples/s:
the samples/s the job reaches (its throughput curve at its productive groups
up to its demand, times its straggler slowdown and the share of the tick not
lost to joins) divided by the curve's best samples/s per group
(``ThroughputCurve.best_per_replica``). A group past a flat curve, a slowed
job and a poorly scaling size all count for what they produce. **Cluster utilisation** = useful
GPU-minutes / the GPU-minutes every pool had available until the last job
finished; **held utilisation** = useful / GPU-minutes held by jobs (groups
joining, running or draining). Called by ``omni-sched simulate``, the
benchmark and the tests; single process.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Sequence

from megascale_omni.scheduler.model import (
    VM,
    JobSpec,
    JobView,
    PoolView,
    Reclaim,
    ReplicaView,
    Snapshot,
    Trace,
    apply,
)

log = logging.getLogger(__name__)


@dataclass
class _Replica:
    id: str
    pool: str
    nodes: int
    joined_min: float
    ready_min: float
    leave_min: float = math.inf
    draining: bool = False
    slow: float = 1.0
    slow_since: float = math.inf
    slow_until: float = math.inf


@dataclass
class _Job:
    spec: JobSpec
    replicas: dict[str, _Replica] = field(default_factory=dict)
    serial: int = 0
    admitted_min: float | None = None
    done: float = 0.0
    finish_min: float | None = None
    moves: int = 0
    restarts: int = 0
    restart_until: float = -math.inf
    lost_s: float = 0.0
    standby_ready: list[float] = field(default_factory=list)
    demand: float = 0.0
    speed: float = 0.0
    held_gpu_min: float = 0.0
    useful_gpu_min: float = 0.0
    below_min_minutes: float = 0.0


@dataclass(frozen=True)
class ReclaimEvent:
    pool: str
    nodes: int
    deadline_min: float
    notice_min: float


@dataclass
class JobResult:
    """Per-job outcome. ``completion_min`` is finish - arrival (None: unfinished
    at the horizon); ``queue_min`` admission - arrival (None: never admitted);
    ``below_min_minutes`` the minutes the admitted job had fewer member groups
    (joining or running) than its ``min_replicas``."""

    name: str
    arrive_min: float
    completion_min: float | None
    samples: float
    mean_samples_per_s: float
    moves: int
    restarts: int
    gpu_hours: float
    queue_min: float | None = None
    useful_gpu_hours: float = 0.0
    below_min_minutes: float = 0.0


@dataclass
class SimResult:
    """One policy on one trace: the summary numbers and the per-tick series for plots.

    ``utilisation`` is the held utilisation (useful / held GPU-minutes),
    ``cluster_utilisation`` useful / available GPU-minutes (module docstring)."""

    policy: str
    trace: str
    end_min: float
    utilisation: float
    jobs: list[JobResult]
    moves: int
    moves_per_hour: float
    reclaim_events: int
    reclaims_met: int
    groups_killed: int
    times: list[float] = field(default_factory=list)
    alloc: dict[str, list[float]] = field(default_factory=dict)
    demand: dict[str, list[float]] = field(default_factory=dict)
    pool_used: dict[str, list[float]] = field(default_factory=dict)
    pool_nodes: dict[str, list[float]] = field(default_factory=dict)
    move_times: list[tuple[float, str, int]] = field(default_factory=list)
    decisions: list[tuple[float, str]] = field(default_factory=list)
    cluster_utilisation: float = 0.0
    cluster_gpu_hours: float = 0.0

    @property
    def reclaims_met_fraction(self) -> float:
        return self.reclaims_met / self.reclaim_events if self.reclaim_events else 1.0

    @property
    def gpu_hours(self) -> float:
        """GPU-hours held by all jobs."""
        return sum(j.gpu_hours for j in self.jobs)

    def jct_min(self) -> list[float]:
        """Every job's completion time; an unfinished one counts as end - arrival (a lower bound)."""
        return [j.completion_min if j.completion_min is not None else max(0.0, self.end_min - j.arrive_min)
                for j in self.jobs]

    def queue_min(self) -> list[float]:
        """Every job's queueing delay; one never admitted counts as end - arrival (a lower bound)."""
        return [j.queue_min if j.queue_min is not None else max(0.0, self.end_min - j.arrive_min)
                for j in self.jobs]

    @property
    def unfinished(self) -> int:
        return sum(j.completion_min is None for j in self.jobs)


class Simulator:
    """One run of ``policy`` (anything with ``decide(Snapshot)`` and ``elastic``) on ``trace``.

    ``noise`` scales each job's demand every tick by an independent uniform
    factor in [1 - noise, 1 + noise], the same draw for every policy (seeded
    by ``seed``, the job and the tick).
    """

    def __init__(self, trace: Trace, policy, noise: float = 0.0, seed: int = 0):
        self.trace = trace
        self.policy = policy
        self.noise = noise
        self.seed = seed
        self.now = 0.0
        self.jobs = {j.name: _Job(j, standby_ready=[0.0] * j.standby) for j in trace.jobs}
        self.pools = {p.name: p for p in trace.pools}
        self.events = _reclaim_events(trace)
        self._done_events: set[int] = set()
        self._useful = self._held = 0.0
        self._killed = self._met = 0
        self.result = SimResult(policy.name, trace.name, 0.0, 0.0, [], 0, 0.0, len(self.events), 0, 0)

    # ------------------------------------------------------------ the loop
    def run(self) -> SimResult:
        tr, res = self.trace, self.result
        tick_index = 0
        while self.now < tr.horizon_min and any(j.finish_min is None for j in self.jobs.values()):
            self._leave()
            self._deadlines()
            self._stragglers()
            visible = [j for j in self.jobs.values() if j.spec.arrive_min <= self.now and j.finish_min is None]
            for job in visible:
                job.demand = self._demand(job, tick_index)
            for decision in self.policy.decide(self._snapshot(visible)):
                res.decisions.append((self.now, decision.describe()))
                apply(self, decision)
            self._record(visible)
            self._progress(visible)
            self.now += tr.tick_min
            tick_index += 1
        return self._finish()

    def _demand(self, job: _Job, tick_index: int) -> float:
        base = job.spec.demand.at(self.now - job.spec.arrive_min)
        if self.noise:
            base *= 1 + random.Random(f"{self.seed}:{job.spec.name}:{tick_index}").uniform(-self.noise, self.noise)
        return max(0.0, min(base, job.spec.max_replicas * job.spec.replica_gpus))

    def _snapshot(self, visible: list[_Job]) -> Snapshot:
        reclaims = tuple(Reclaim(e.pool, e.nodes, e.deadline_min) for e in self.events
                         if e.notice_min <= self.now < e.deadline_min)
        used = self._nodes_used(active_only=True)
        pools = [PoolView(p.name, p.kind, p.gpus_per_node, p.available(self.now), used[p.name],
                          sum(r.nodes for r in reclaims if r.pool == p.name)) for p in self.trace.pools]
        jobs = []
        for j in visible:
            s = j.spec
            views = tuple(ReplicaView(r.id, r.pool, "draining" if r.draining else
                                      "joining" if r.ready_min > self.now else "running",
                                      r.slow_since if r.slow_since <= self.now < r.slow_until else None)
                          for r in j.replicas.values())
            jobs.append(JobView(s.name, s.priority, s.replica_gpus, s.min_replicas, s.max_replicas, s.curve,
                                j.demand, j.speed, j.admitted_min is not None, views,
                                max(0.0, s.work_samples - j.done)))
        return Snapshot(self.now, tuple(pools), tuple(jobs), reclaims)

    # ------------------------------------------------------------ Actuator
    def grow(self, job: str, pool: str, count: int, reason: str) -> Sequence[str]:
        j, spec = self.jobs[job], self.pools[pool]
        nodes = j.spec.replica_gpus // spec.gpus_per_node
        used = self._nodes_used(active_only=True)[pool]
        reclaiming = sum(e.nodes for e in self.events
                         if e.pool == pool and e.notice_min <= self.now < e.deadline_min)
        fits = max(0, (spec.available(self.now) - reclaiming - used) // nodes)
        if fits < count:
            log.warning("t=%g min %s grow on %s: %d group(s) asked, %d fit", self.now, job, pool, count, fits)
            count = fits
        initial = j.admitted_min is None or j.admitted_min == self.now
        if j.admitted_min is None:
            j.admitted_min = self.now
        ids = []
        c = self.trace.costs
        for _ in range(count):
            warm = next((i for i, at in enumerate(j.standby_ready) if at <= self.now), None)
            if warm is not None and not initial:
                latency = c.standby_join_s
                j.standby_ready[warm] = self.now + c.cold_join_s / 60  # its replacement starts cold, off the path
            else:
                latency = c.cold_join_s
            j.serial += 1
            rid = f"{job}-r{j.serial}"
            j.replicas[rid] = _Replica(rid, pool, nodes, self.now, self.now + latency / 60)
            ids.append(rid)
            if not initial:
                j.lost_s += c.join_disruption_s if self.policy.elastic else 0.0
        if not initial and ids:
            j.moves += len(ids)
            self.result.move_times.append((self.now, job, len(ids)))
            self._restart(j)
        return ids

    def drain(self, job: str, replica_ids: Sequence[str], reason: str) -> None:
        j = self.jobs[job]
        for rid in replica_ids:
            r = j.replicas[rid]
            if not r.draining:
                r.draining = True
                r.leave_min = min(r.leave_min, self.now + self.trace.costs.drain_s / 60)
        j.moves += len(replica_ids)
        self.result.move_times.append((self.now, job, len(replica_ids)))
        self._restart(j)

    def kill(self, job: str, replica_ids: Sequence[str], reason: str) -> None:
        j = self.jobs[job]
        for rid in replica_ids:
            j.replicas[rid].leave_min = self.now
            j.replicas[rid].draining = True
        j.lost_s += self.trace.costs.drain_s  # the step in flight is retried without them
        j.moves += len(replica_ids)
        self.result.move_times.append((self.now, job, len(replica_ids)))
        self._restart(j)
        log.warning("t=%g min %s kill %s: %s", self.now, job, ",".join(replica_ids), reason)

    def _restart(self, j: _Job) -> None:
        if not self.policy.elastic:
            j.restarts += 1
            j.restart_until = self.now + self.trace.costs.restart_s / 60

    # ------------------------------------------------------------ tick parts
    def _leave(self) -> None:
        for j in self.jobs.values():
            for rid in [rid for rid, r in j.replicas.items() if r.leave_min <= self.now]:
                del j.replicas[rid]

    def _deadlines(self) -> None:
        """Reclaims whose deadline has come: kill what the pool cannot hold any more."""
        for i, e in enumerate(self.events):
            if i in self._done_events or e.deadline_min > self.now:
                continue
            self._done_events.add(i)
            capacity = self.pools[e.pool].available(self.now)
            present = [(j, r) for j in self.jobs.values() for r in j.replicas.values() if r.pool == e.pool]
            excess = sum(r.nodes for _, r in present) - capacity
            victims = []
            for j, r in sorted(present, key=lambda jr: (not jr[1].draining, -jr[1].joined_min)):
                if excess <= 0:
                    break
                victims.append((j, r))
                excess -= r.nodes
            for j, r in victims:
                self.kill(j.spec.name, [r.id], f"reclaim deadline t={e.deadline_min:g} min on {e.pool} passed")
                del j.replicas[r.id]
            self._killed += len(victims)
            self._met += not victims

    def _stragglers(self) -> None:
        for ev in self.trace.stragglers:
            if not self.now <= ev.at_min < self.now + self.trace.tick_min:
                continue
            j = self.jobs[ev.job]
            running = [r for r in j.replicas.values() if not r.draining and r.ready_min <= self.now]
            if running:
                r = max(running, key=lambda r: r.joined_min)
                r.slow, r.slow_since, r.slow_until = ev.slowdown, ev.at_min, ev.until_min

    def _record(self, visible: list[_Job]) -> None:
        res = self.result
        res.times.append(self.now)
        # By name: ``j in visible`` would compare every field of the dataclasses (most of a long run's time).
        shown = {j.spec.name for j in visible}
        for j in self.jobs.values():
            seen = j.spec.name in shown
            live = seen and j.admitted_min is not None
            res.alloc.setdefault(j.spec.name, []).append(
                sum(j.spec.replica_gpus for r in j.replicas.values() if not r.draining) if live else 0.0)
            res.demand.setdefault(j.spec.name, []).append(j.demand if seen else 0.0)
            if live and j.finish_min is None:
                members = sum(not r.draining for r in j.replicas.values())
                if members < j.spec.min_replicas:
                    j.below_min_minutes += self.trace.tick_min
        used = self._nodes_used(active_only=False)
        for p in self.trace.pools:
            res.pool_used.setdefault(p.name, []).append(used[p.name])
            res.pool_nodes.setdefault(p.name, []).append(p.available(self.now))

    def _nodes_used(self, active_only: bool) -> dict[str, int]:
        """Nodes per pool held by replica groups (not draining ones with ``active_only``)."""
        used = dict.fromkeys(self.pools, 0)
        for j in self.jobs.values():
            for r in j.replicas.values():
                if not (active_only and r.draining):
                    used[r.pool] += r.nodes
        return used

    def _progress(self, visible: list[_Job]) -> None:
        tick, t0 = self.trace.tick_min, self.now
        t1 = t0 + tick
        for j in visible:
            if j.admitted_min is None:
                continue
            held = productive = 0.0
            slow = 1.0
            for r in j.replicas.values():
                held += max(0.0, min(t1, r.leave_min) - max(t0, r.joined_min)) / tick
                a, b = max(t0, r.ready_min, j.restart_until), min(t1, r.leave_min)
                if b > a:
                    productive += (b - a) / tick
                    if r.slow_since <= t0 < r.slow_until:
                        slow = min(slow, r.slow)
            d_groups = j.demand / j.spec.replica_gpus
            lost = min(1.0, j.lost_s / (tick * 60))
            j.lost_s = 0.0
            j.speed = j.spec.curve(min(productive, d_groups)) * slow * (1 - lost)
            useful = j.speed / j.spec.curve.best_per_replica if j.speed > 0 else 0.0
            gained = j.speed * tick * 60
            frac = 1.0
            if gained > 0 and j.done + gained >= j.spec.work_samples:
                frac = (j.spec.work_samples - j.done) / gained
                j.finish_min = t0 + frac * tick
                for r in j.replicas.values():  # released at the end: not a move
                    r.leave_min = min(r.leave_min, j.finish_min)
            j.done += gained * frac
            gpu = j.spec.replica_gpus * tick * frac
            self._useful += useful * gpu
            self._held += held * gpu
            j.held_gpu_min += held * gpu
            j.useful_gpu_min += useful * gpu

    def _finish(self) -> SimResult:
        res = self.result
        finishes = [j.finish_min for j in self.jobs.values() if j.finish_min is not None]
        res.end_min = max(finishes) if len(finishes) == len(self.jobs) else self.now
        res.utilisation = self._useful / self._held if self._held else 0.0
        cluster = 0.0  # GPU-minutes the pools had, tick by tick, until the end
        for k, t in enumerate(res.times):
            span = min(self.trace.tick_min, res.end_min - t)
            if span > 0:
                cluster += span * sum(res.pool_nodes[p.name][k] * p.gpus_per_node for p in self.trace.pools)
        res.cluster_gpu_hours = cluster / 60
        res.cluster_utilisation = self._useful / cluster if cluster else 0.0
        for j in self.jobs.values():
            s = j.spec
            span = ((j.finish_min if j.finish_min is not None else res.end_min) - s.arrive_min) * 60
            res.jobs.append(JobResult(
                s.name, s.arrive_min, None if j.finish_min is None else j.finish_min - s.arrive_min, j.done,
                j.done / span if span > 0 else 0.0, j.moves, j.restarts, j.held_gpu_min / 60,
                None if j.admitted_min is None else j.admitted_min - s.arrive_min, j.useful_gpu_min / 60,
                j.below_min_minutes))
        res.moves = sum(j.moves for j in self.jobs.values())
        res.moves_per_hour = res.moves / (res.end_min / 60) if res.end_min else 0.0
        res.reclaims_met, res.groups_killed = self._met, self._killed
        # Events whose deadline lies past the end never came due: they are not counted.
        res.reclaim_events = len(self._done_events)
        return res


def _reclaim_events(trace: Trace) -> list[ReclaimEvent]:
    """Every drop of a VM pool's availability within the horizon, with its notice time."""
    out = []
    for p in trace.pools:
        if p.kind != VM or p.availability is None:
            continue
        before = p.availability.at(0)
        for change in p.availability.changes(trace.horizon_min):
            if change.value < before:
                out.append(ReclaimEvent(p.name, int(before - change.value), change.at_min,
                                        max(0.0, change.at_min - p.reclaim_notice_min)))
            before = change.value
    return out


def simulate(trace: Trace, policy, noise: float = 0.0, seed: int = 0) -> SimResult:
    """Run ``policy`` on ``trace`` to the last job's completion or the horizon."""
    return Simulator(trace, policy, noise, seed).run()


def decision_log(result: SimResult) -> list[str]:
    """One line per decision: ``t=<min> <job> <action> <what>: <reason>``."""
    return [f"t={t:g} {text}" for t, text in result.decisions]

