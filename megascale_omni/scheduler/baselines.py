"""The baselines the elastic policy is compared with, on the same
snapshot -> decisions interface (see ``policy.py``).

- :class:`StaticPolicy`: peak allocation. A job starts only when all its
  ``max_replicas`` groups fit and holds them to the end. It is not elastic:
  any change of its groups is a full stop, checkpoint reload and restart
  (``costs.restart_s``). A VM reclaim makes it restart smaller before the
  deadline; it restarts at full size once its peak fits again.
- :class:`GreedyGoodputPolicy`: every tick, the goodput-maximising
  allocation for the demand measured now (a Pollux-like reallocation without
  batch-size tuning): no smoothing, no hysteresis, no cooldown.
- :class:`PolluxLikePolicy`: the same water-fill every tick, but a change
  of a job's allocation is charged for, with Pollux's re-allocation factor
  (Qiao et al., OSDI'21, section 4.2): a job of age ``T`` reallocated ``R``
  times before keeps ``(T - (R + 1) d) / (T + d)`` of its new throughput in
  the comparison, ``d`` being the cost of one reallocation. The plan is
  applied only if it beats the current allocation after the charge; else
  only the grows that fit in free capacity and pay for themselves are.
  Pollux searches allocations with a genetic algorithm and also tunes the
  batch size; neither is modelled here.
"""

from __future__ import annotations

import logging

from megascale_omni.scheduler.model import Action, Decision, JobView, Snapshot, Trace
from megascale_omni.scheduler.planning import (
    RECLAIM_MARGIN_MIN,
    admit,
    free_nodes,
    goodput_targets,
    grow,
    marginal_gain,
    reclaim_drains,
    reclaim_lead,
    shrink,
    usable_gpus,
    weighted_throughput,
)
from megascale_omni.scheduler.policy import ElasticPolicy, Knobs

log = logging.getLogger(__name__)


class StaticPolicy:
    """Peak allocation, non-elastic jobs (called once per tick like every policy)."""

    name = "static"
    elastic = False

    def __init__(self) -> None:
        self._last_call: float | None = None

    def decide(self, snap: Snapshot) -> list[Decision]:
        free = free_nodes(snap)
        lead = reclaim_lead(self._last_call, snap.time_min, RECLAIM_MARGIN_MIN)
        self._last_call = snap.time_min
        decisions, drained = reclaim_drains(snap, {j.name: j.demand_gpus for j in snap.jobs}, lead)
        decisions = [Decision(d.job, d.action, d.reason + " (static job: restart smaller)", d.count, d.pool,
                              d.replica_ids) for d in decisions]
        decisions += admit(snap, free, full_size=True, drained=drained)
        for job in snap.jobs:
            size = len([r for r in job.active if r.id not in drained])
            missing = job.max_replicas - size
            if not job.admitted or missing <= 0 or drained & {r.id for r in job.replicas}:
                continue
            trial = dict(free)
            if sum(d.count for d in grow(snap, job, missing, "", trial)) == missing:
                decisions += grow(snap, job, missing, f"peak fits again: restart at {job.max_replicas} groups", free)
        for d in decisions:
            log.info("t=%g min %s", snap.time_min, d.describe())
        return decisions


class GreedyGoodputPolicy:
    """Reallocate every tick to maximise summed weighted throughput."""

    name = "greedy"
    elastic = True

    def __init__(self) -> None:
        self._last_call: float | None = None

    def decide(self, snap: Snapshot) -> list[Decision]:
        demand = {j.name: j.demand_gpus for j in snap.jobs}
        free = free_nodes(snap)
        lead = reclaim_lead(self._last_call, snap.time_min, RECLAIM_MARGIN_MIN)
        self._last_call = snap.time_min
        decisions, drained = reclaim_drains(snap, demand, lead, free)
        admitted = admit(snap, free, drained=drained)
        decisions += admitted
        new = {d.job for d in admitted if d.action is Action.GROW}
        jobs = [j for j in snap.jobs if j.admitted]
        capacity = usable_gpus(snap) - sum(j.min_replicas * j.replica_gpus for j in snap.jobs if j.name in new)
        targets = goodput_targets(jobs, capacity, demand)
        size = {j.name: len([r for r in j.active if r.id not in drained]) for j in jobs}
        decisions += resize_to(snap, jobs, size, targets, demand, free, drained, "greedy")
        for d in decisions:
            log.info("t=%g min %s", snap.time_min, d.describe())
        return decisions


class PolluxLikePolicy:
    """Goodput water-fill every tick, charged for reallocation (module docstring).

    ``realloc_s``: what one reallocation costs a job, in seconds (the
    simulator's cold join is the natural value: a changed job waits for its
    new groups to start and heal)."""

    name = "pollux"
    elastic = True

    def __init__(self, realloc_s: float) -> None:
        self.realloc_min = realloc_s / 60
        self._last_call: float | None = None
        self._admitted: dict[str, float] = {}
        self._reallocs: dict[str, int] = {}

    def factor(self, job: str, now_min: float) -> float:
        """Pollux's re-allocation factor for one more reallocation of ``job`` now (<= 0: never worth it)."""
        age = now_min - self._admitted.get(job, now_min)
        d = self.realloc_min
        return (age - (self._reallocs.get(job, 0) + 1) * d) / (age + d) if age + d > 0 else 0.0

    def decide(self, snap: Snapshot) -> list[Decision]:
        t = snap.time_min
        demand = {j.name: j.demand_gpus for j in snap.jobs}
        free = free_nodes(snap)
        lead = reclaim_lead(self._last_call, t, RECLAIM_MARGIN_MIN)
        self._last_call = t
        decisions, drained = reclaim_drains(snap, demand, lead, free)
        admitted = admit(snap, free, drained=drained)
        decisions += admitted
        new = {d.job for d in admitted if d.action is Action.GROW}
        for name in new:
            self._admitted.setdefault(name, t)
        jobs = [j for j in snap.jobs if j.admitted]
        for j in jobs:
            self._admitted.setdefault(j.name, t)
        capacity = usable_gpus(snap) - sum(j.min_replicas * j.replica_gpus for j in snap.jobs if j.name in new)
        targets = goodput_targets(jobs, capacity, demand)
        size = {j.name: len([r for r in j.active if r.id not in drained]) for j in jobs}
        changed = [j for j in jobs if targets[j.name] != size[j.name]]

        def charged(job: JobView, n: int) -> float:
            return weighted_throughput(job, n, demand[job.name]) * self.factor(job.name, t)

        now = sum(weighted_throughput(j, size[j.name], demand[j.name]) for j in changed)
        then = sum(charged(j, targets[j.name]) for j in changed)
        if then <= now:  # the plan does not pay for its moves: keep free-capacity grows that do
            for j in changed:
                if targets[j.name] < size[j.name] or charged(j, targets[j.name]) <= weighted_throughput(
                        j, size[j.name], demand[j.name]):
                    targets[j.name] = size[j.name]
        planned = resize_to(snap, jobs, size, targets, demand, free, drained, "pollux")
        for name in {d.job for d in planned}:
            self._reallocs[name] = self._reallocs.get(name, 0) + 1
        decisions += planned
        for d in decisions:
            log.info("t=%g min %s", t, d.describe())
        return decisions


def resize_to(snap: Snapshot, jobs: list[JobView], size: dict[str, int], targets: dict[str, int],
              demand: dict[str, float], free: dict[str, int], drained: set[str], label: str) -> list[Decision]:
    """Drains then grows that take every job from ``size`` to ``targets``
    groups; grows go to the job with the largest marginal gain first."""
    out = []
    for job in jobs:
        if targets[job.name] < size[job.name]:
            out += shrink(snap, job, size[job.name] - targets[job.name],
                          f"{label}: {size[job.name]} -> {targets[job.name]} groups", free, drained)
    for job in sorted(jobs, key=lambda j: -marginal_gain(j, size[j.name] + 1, demand[j.name])):
        if targets[job.name] > size[job.name]:
            out += grow(snap, job, targets[job.name] - size[job.name],
                        f"{label}: {size[job.name]} -> {targets[job.name]} groups", free)
    return out


def make_policy(name: str, trace: Trace, knobs: Knobs | None = None):
    """A fresh policy by name (``elastic`` with ``knobs``, its rebalances
    charged the trace's join costs; ``static``, ``greedy``, ``pollux``
    charged the trace's cold join per reallocation)."""
    if name == "elastic":
        return ElasticPolicy(knobs, trace.costs)
    if name == "pollux":
        return PolluxLikePolicy(trace.costs.cold_join_s)
    return {"static": StaticPolicy, "greedy": GreedyGoodputPolicy}[name]()
