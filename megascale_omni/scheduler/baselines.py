"""The two baselines the elastic policy is compared with, on the same
snapshot -> decisions interface (see ``policy.py``).

- :class:`StaticPolicy`: peak allocation. A job starts only when all its
  ``max_replicas`` groups fit and holds them to the end. It is not elastic:
  any change of its groups is a full stop, checkpoint reload and restart
  (``costs.restart_s``). A VM reclaim makes it restart smaller before the
  deadline; it restarts at full size once its peak fits again.
- :class:`GreedyGoodputPolicy`: every tick, the goodput-maximising
  allocation for the demand measured now (a Pollux-like reallocation without
  batch-size tuning): no smoothing, no hysteresis, no cooldown.
"""

from __future__ import annotations

import logging

from megascale_omni.scheduler.model import Action, Decision, Snapshot
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
)

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
        decisions += admit(snap, free, full_size=True)
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
        admitted = admit(snap, free)
        decisions += admitted
        new = {d.job for d in admitted if d.action is Action.GROW}
        jobs = [j for j in snap.jobs if j.admitted]
        capacity = usable_gpus(snap) - sum(j.min_replicas * j.replica_gpus for j in snap.jobs if j.name in new)
        targets = goodput_targets(jobs, capacity, demand)
        size = {j.name: len([r for r in j.active if r.id not in drained]) for j in jobs}
        for job in jobs:
            if targets[job.name] < size[job.name]:
                decisions += shrink(snap, job, size[job.name] - targets[job.name],
                                    f"greedy: {size[job.name]} -> {targets[job.name]} groups", free, drained)
        for job in sorted(jobs, key=lambda j: -marginal_gain(j, size[j.name] + 1, demand[j.name])):
            if targets[job.name] > size[job.name]:
                decisions += grow(snap, job, targets[job.name] - size[job.name],
                                  f"greedy: {size[job.name]} -> {targets[job.name]} groups", free)
        for d in decisions:
            log.info("t=%g min %s", snap.time_min, d.describe())
        return decisions
