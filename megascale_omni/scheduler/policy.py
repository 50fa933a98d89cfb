"""The elastic policy: triggered resizes with hysteresis, a per-job cooldown,
a periodic global rebalance, straggler moves, and reclaims drained by their
deadline.

The policy sees a :class:`~megascale_omni.scheduler.model.Snapshot` and
returns :class:`~megascale_omni.scheduler.model.Decision` values; it never
actuates. The simulator and a live scheduler call :meth:`ElasticPolicy.decide`
once per tick (every ``tick_min`` minutes) with a fresh snapshot; the policy
remembers only what hysteresis needs (recent demand, when a threshold was
crossed, each job's last resize).

The load signal is ``demand / allocation`` per job: demand is the GPUs a job
can keep busy (the simulator reads it from the trace; live, from the step
metrics: data wait and busy time say how much of the allocation is used, the
throughput per group says what one more would add). Load above 1 means the
job is short of GPUs, below 1 that some of its groups idle.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, fields

from megascale_omni.errors import ConfigError
from megascale_omni.scheduler.model import BARE_METAL, VM, Action, Costs, Decision, JobView, Snapshot
from megascale_omni.scheduler.planning import (
    RECLAIM_MARGIN_MIN,
    admit,
    free_nodes,
    goodput_targets,
    grow,
    marginal_gain,
    place,
    reclaim_drains,
    reclaim_lead,
    shrink,
    usable_gpus,
    weighted_throughput,
    worth_replicas,
)
from megascale_omni.scheduler.urgency import rank_by_remaining_work

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Knobs:
    """Elastic policy settings (the trace's ``policy:`` section or ``--config``)."""

    grow_above: float = 1.05
    """Grow a job whose smoothed load stays above this (it is short of GPUs)."""
    shrink_below: float = 0.85
    """Shrink a job whose smoothed load stays below this (groups idle)."""
    target_load: float = 1.0
    """A resize sizes the job to smoothed demand / target_load, rounded up to whole groups."""
    window_min: float = 5.0
    """Minutes of measured demand averaged into the smoothed demand."""
    confirm_min: float = 3.0
    """Minutes the smoothed load must stay beyond a threshold before a resize."""
    cooldown_min: float = 15.0
    """After a resize, minutes before the job may be resized in the opposite direction."""
    rebalance_min: float = 30.0
    """Minutes between global rebalances (goodput water-fill over all jobs)."""
    rebalance_gain: float = 0.02
    """A rebalance acts only if it raises the summed weighted throughput by this fraction."""
    straggler_patience_min: float = 5.0
    """Minutes a group stays flagged as a straggler before it is moved to another node."""
    min_marginal_gain: float = 0.1
    """A group is worth adding only while it adds more than this fraction of the samples/s per GPU
    the job reaches at its core (its throughput curve's marginal gain): resizes and rebalances
    stop there even if the demand asks for more (0: while it adds anything)."""
    remaining_work_exponent: float = 1.0
    """Where a job's remaining work is known (the simulator), weigh its marginal gains by
    (mean remaining / its remaining) ** this: 1 serves the shortest remaining work first (Smith's
    rule), 0 ignores remaining work (``urgency.py``)."""
    critical_path: float = 1.0
    """A job that sets the makespan (its remaining time at its largest useful size is at least the
    time the whole cluster needs for all remaining work at best efficiency) weighs this many times
    the largest other job's weight: 1 ranks it with the shortest job, 1000 serves it before
    everyone; 0: no critical path (``urgency.py``)."""
    reclaim_margin_min: float = RECLAIM_MARGIN_MIN
    """Drain for a VM reclaim once its deadline is this close, plus the interval between
    ticks; covers the drain itself (one step; seconds). Until then the groups keep working."""

    @classmethod
    def from_dict(cls, raw: dict, where: str = "policy") -> "Knobs":
        """Validated knobs; raises ConfigError naming ``<where>.<knob>``."""
        if not isinstance(raw, dict):
            raise ConfigError(where, raw, "must be a mapping of knob: value")
        known = {f.name for f in fields(cls)}
        for key, value in raw.items():
            if key not in known:
                raise ConfigError(f"{where}.{key}", value, f"unknown knob; known: {sorted(known)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{where}.{key}", value, "must be a number >= 0")
        knobs = cls(**{k: float(v) for k, v in raw.items()})
        if not 0 < knobs.shrink_below < knobs.target_load < knobs.grow_above:
            raise ConfigError(f"{where}.shrink_below", knobs.shrink_below,
                              f"need 0 < shrink_below < target_load ({knobs.target_load}) < grow_above "
                              f"({knobs.grow_above}): the gap is the hysteresis band")
        for name in ("window_min", "rebalance_min"):
            if getattr(knobs, name) <= 0:
                raise ConfigError(f"{where}.{name}", getattr(knobs, name), "must be > 0")
        return knobs


class ElasticPolicy:
    """Hysteresis + cooldown + periodic rebalance (seed §2.3, §5.2)."""

    name = "elastic"
    #: Jobs survive membership changes (survivors keep stepping; see docs/elastic.md).
    elastic = True

    def __init__(self, knobs: Knobs | None = None, costs: Costs | None = None):
        """``costs``: what a join costs (the trace's, or the cost model's); a
        rebalance acts only when its gain until the next one pays for its
        joins. None: joins are free (only ``rebalance_gain`` applies)."""
        self.knobs = knobs or Knobs()
        self.costs = costs
        self._demand: dict[str, deque[tuple[float, float]]] = {}
        self._beyond: dict[str, tuple[int, float]] = {}  # job -> (direction, since_min)
        self._resized: dict[str, tuple[int, float]] = {}  # job -> (direction, at_min)
        self._next_rebalance = self.knobs.rebalance_min
        self._last_call: float | None = None

    def decide(self, snap: Snapshot) -> list[Decision]:
        """Decisions for this tick; every one is logged with its reason."""
        t = snap.time_min
        snap = rank_by_remaining_work(snap, self.knobs.remaining_work_exponent, self.knobs.critical_path,
                                      self.knobs.min_marginal_gain)
        smoothed = self._observe(snap)
        free = free_nodes(snap)
        lead = reclaim_lead(self._last_call, t, self.knobs.reclaim_margin_min)
        self._last_call = t
        decisions, drained = reclaim_drains(snap, smoothed, lead, free)
        decisions += self._stragglers(snap, free, drained)
        admitted = admit(snap, free, drained=drained)
        decisions += admitted
        new = {d.job for d in admitted if d.action is Action.GROW}
        jobs = [j for j in snap.jobs if j.admitted]
        size = {j.name: len([r for r in j.active if r.id not in drained]) for j in jobs}
        grows = []
        for job in jobs:
            direction, load = self._trigger(job, size[job.name], smoothed[job.name], t)
            if direction == 0:
                continue
            target = self._size_for(job, smoothed[job.name])
            if direction < 0 and target < size[job.name]:
                reason = (f"load {load:.2f} < {self.knobs.shrink_below} for "
                          f"{t - self._beyond[job.name][1]:g} min: {size[job.name]} -> {target} groups")
                planned = shrink(snap, job, size[job.name] - target, reason, free, drained)
                decisions += planned
                self._resized_now(job.name, -1, t)
                size[job.name] -= sum(d.count for d in planned)
            elif direction > 0 and target > size[job.name]:
                grows.append((marginal_gain(job, size[job.name] + 1, smoothed[job.name]), job, target, load))
        for _, job, target, load in sorted(grows, key=lambda g: -g[0]):
            reason = (f"load {load:.2f} > {self.knobs.grow_above} for {t - self._beyond[job.name][1]:g} min: "
                      f"{size[job.name]} -> {target} groups")
            planned = grow(snap, job, target - size[job.name], reason, free)
            if planned:
                decisions += planned
                self._resized_now(job.name, +1, t)
                size[job.name] += sum(d.count for d in planned)
        if t >= self._next_rebalance:
            self._next_rebalance = t + self.knobs.rebalance_min
            capacity = usable_gpus(snap) - sum(j.min_replicas * j.replica_gpus for j in snap.jobs if j.name in new)
            decisions += self._rebalance(snap, jobs, size, smoothed, capacity, free, drained)
        for d in decisions:
            log.info("t=%g min %s", t, d.describe())
        return decisions

    # ------------------------------------------------------------ internals
    def _observe(self, snap: Snapshot) -> dict[str, float]:
        """Record this tick's measured demand; return each job's mean over the window."""
        out = {}
        for job in snap.jobs:
            hist = self._demand.setdefault(job.name, deque())
            hist.append((snap.time_min, job.demand_gpus))
            while hist and hist[0][0] <= snap.time_min - self.knobs.window_min:
                hist.popleft()
            out[job.name] = sum(d for _, d in hist) / len(hist)
        return out

    def _size_for(self, job: JobView, demand_gpus: float) -> int:
        """Groups for ``demand_gpus`` at ``target_load``, no more than the throughput curve makes worth it."""
        groups = math.ceil(demand_gpus / self.knobs.target_load / job.replica_gpus - 1e-9)
        return max(job.min_replicas, min(worth_replicas(job, self.knobs.min_marginal_gain), groups))

    def _trigger(self, job: JobView, size: int, demand: float, t: float) -> tuple[int, float]:
        """(+1 grow | -1 shrink | 0, load) once the load has stayed beyond a
        threshold for ``confirm_min`` and the cooldown allows it."""
        k = self.knobs
        load = demand / max(size * job.replica_gpus, 1e-9)
        direction = 1 if load > k.grow_above else -1 if load < k.shrink_below else 0
        if self._beyond.get(job.name, (None, 0.0))[0] != direction:
            self._beyond[job.name] = (direction, t)
        if direction == 0 or t - self._beyond[job.name][1] < k.confirm_min:
            return 0, load
        last = self._resized.get(job.name)
        if last is not None:
            wait = k.cooldown_min if last[0] != direction else k.confirm_min
            if t - last[1] < wait:
                return 0, load
        return direction, load

    def _resized_now(self, job: str, direction: int, t: float) -> None:
        self._resized[job] = (direction, t)
        self._beyond[job] = (0, t)

    def _stragglers(self, snap: Snapshot, free: dict[str, int], drained: set[str]) -> list[Decision]:
        """Move a group flagged slow for ``straggler_patience_min`` to another
        node; with no node free, drain it if the job stays at or above its core.
        A replacement the core needs (the job would be below ``min_replicas``
        without the straggler) goes to bare metal first, where no reclaim can
        take it; other replacements go to VMs first."""
        out = []
        for job in snap.jobs:
            for r in job.active:
                since = r.straggler_since_min
                if since is None or r.id in drained or snap.time_min - since < self.knobs.straggler_patience_min:
                    continue
                reason = f"straggler since t={since:g} min slows every group of the job"
                staying = len([o for o in job.active if o.id not in drained and o.id != r.id])
                kinds = (BARE_METAL, VM) if staying < job.min_replicas else (VM, BARE_METAL)
                spot = place(snap, free, job, 1, kinds)
                drained.add(r.id)
                free[r.pool] += job.nodes_per_replica(snap.pool(r.pool).gpus_per_node)
                if spot:
                    out.append(Decision(job.name, Action.MOVE, reason + "; replace it", count=1, pool=spot[0][0],
                                        replica_ids=(r.id,)))
                elif staying >= job.min_replicas:
                    out.append(Decision(job.name, Action.DRAIN, reason + "; no free node, drop it", count=1,
                                        replica_ids=(r.id,)))
                else:
                    drained.discard(r.id)
                    free[r.pool] -= job.nodes_per_replica(snap.pool(r.pool).gpus_per_node)
        return out

    def _join_price(self, jobs: list[JobView], size: dict[str, int], targets: dict[str, int],
                    demand: dict[str, float]) -> float:
        """Weighted samples a plan's joins cost (0 without ``costs``): a job's
        new groups produce nothing for a cold join, and its running groups
        lose ``join_disruption_s`` per join (the heal holds the synchronous step)."""
        if self.costs is None:
            return 0.0
        price = 0.0
        for job in jobs:
            joins = targets[job.name] - size[job.name]
            if joins > 0:
                before = weighted_throughput(job, size[job.name], demand[job.name])
                after = weighted_throughput(job, targets[job.name], demand[job.name])
                price += (after - before) * self.costs.cold_join_s + before * self.costs.join_disruption_s * joins
        return price

    def _rebalance(self, snap: Snapshot, jobs: list[JobView], size: dict[str, int], smoothed: dict[str, float],
                   capacity: float, free: dict[str, int], drained: set[str]) -> list[Decision]:
        """Periodic global pass: the goodput water-fill over every admitted
        job, applied only if it gains at least ``rebalance_gain``."""
        if not jobs:
            return []
        demand = {j.name: smoothed[j.name] / self.knobs.target_load for j in jobs}
        targets = goodput_targets(jobs, capacity, demand, self.knobs.min_marginal_gain)
        now = sum(weighted_throughput(j, size[j.name], demand[j.name]) for j in jobs)
        then = sum(weighted_throughput(j, targets[j.name], demand[j.name]) for j in jobs)
        if then - now < self.knobs.rebalance_gain * max(now, 1e-9):
            return []
        price = self._join_price(jobs, size, targets, demand)
        if (then - now) * self.knobs.rebalance_min * 60 <= price:
            log.debug("t=%g min rebalance skipped: gain %.0f samples/s for %g min does not pay %.0f samples of "
                      "joins", snap.time_min, then - now, self.knobs.rebalance_min, price)
            return []
        reason = f"rebalance: weighted goodput {now:.0f} -> {then:.0f} samples/s"
        out = []
        for job in jobs:
            if targets[job.name] < size[job.name]:
                out += shrink(snap, job, size[job.name] - targets[job.name], reason, free, drained)
                self._resized_now(job.name, -1, snap.time_min)
        for job in sorted(jobs, key=lambda j: -marginal_gain(j, size[j.name] + 1, demand[j.name])):
            if targets[job.name] > size[job.name]:
                planned = grow(snap, job, targets[job.name] - size[job.name], reason, free)
                if planned:
                    out += planned
                    self._resized_now(job.name, +1, snap.time_min)
        return out
