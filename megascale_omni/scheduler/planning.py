"""Pure planning steps every policy shares: marginal gains, the goodput
water-fill, placement on pools, which replica groups to drain, reclaims and
admission.

Called by the policies (``policy.py``, ``baselines.py``) on a
:class:`~megascale_omni.scheduler.model.Snapshot`; nothing here keeps state
or touches an actuator. ``free`` maps pool name -> nodes a grow may still
take this round and is updated in place as decisions are planned.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterable, Sequence

from megascale_omni.scheduler.model import BARE_METAL, VM, Action, Decision, JobView, ReplicaView, Snapshot

#: Minutes before a reclaim's deadline (beyond the interval between policy
#: calls) at which its drain is issued: a drain takes one step (seconds).
RECLAIM_MARGIN_MIN = 1.0


def weighted_throughput(job: JobView, replicas: float, demand_gpus: float) -> float:
    """``priority`` x samples/s the job would reach with ``replicas`` groups
    when it can keep ``demand_gpus`` GPUs busy (groups beyond that add nothing)."""
    return job.priority * job.curve(min(replicas, demand_gpus / job.replica_gpus))


def marginal_gain(job: JobView, n: int, demand_gpus: float) -> float:
    """Weighted samples/s per GPU that the ``n``-th replica group adds."""
    return (weighted_throughput(job, n, demand_gpus) - weighted_throughput(job, n - 1, demand_gpus)) / job.replica_gpus


def gain_floor(job: JobView, min_gain: float) -> float:
    """The least weighted samples/s per GPU a group of ``job`` must add to be
    worth its GPUs: ``min_gain`` x the per-GPU rate of its core (0: any gain)."""
    core = job.min_replicas
    return min_gain * weighted_throughput(job, core, math.inf) / (core * job.replica_gpus)


def worth_replicas(job: JobView, min_gain: float = 0.0) -> int:
    """The most groups (``min_replicas``..``max_replicas``) whose every group
    beyond the core adds more than :func:`gain_floor` samples/s per GPU by the
    job's throughput curve: past it GPUs buy (almost) nothing."""
    floor = max(gain_floor(job, min_gain), 1e-12)
    n = job.min_replicas
    while n < job.max_replicas and marginal_gain(job, n + 1, math.inf) > floor:
        n += 1
    return n


def goodput_targets(jobs: Sequence[JobView], capacity_gpus: float, demand: dict[str, float],
                    min_gain: float = 0.0) -> dict[str, int]:
    """Replica groups per admitted job that maximise the summed weighted
    throughput on ``capacity_gpus`` GPUs: every job starts at its core, then
    the group with the largest marginal gain per GPU is added until gains
    fall to the job's :func:`gain_floor` (``min_gain`` 0: zero), jobs reach
    their maximum, or capacity runs out. ``demand`` is the GPUs each job can
    use (already divided by any target load)."""
    targets = {j.name: j.min_replicas for j in jobs}
    floors = [max(gain_floor(j, min_gain), 1e-12) for j in jobs]
    left = capacity_gpus - sum(j.min_replicas * j.replica_gpus for j in jobs)
    heap = [(-marginal_gain(j, j.min_replicas + 1, demand[j.name]), i) for i, j in enumerate(jobs)
            if j.min_replicas < j.max_replicas]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        job = jobs[i]
        if -neg_gain <= floors[i] or job.replica_gpus > left:
            continue
        targets[job.name] += 1
        left -= job.replica_gpus
        if targets[job.name] < job.max_replicas:
            heapq.heappush(heap, (-marginal_gain(job, targets[job.name] + 1, demand[job.name]), i))
    return targets


def free_nodes(snap: Snapshot) -> dict[str, int]:
    """Nodes per pool a grow may take now (not used, not announced for reclaim)."""
    return {p.name: p.free for p in snap.pools}


def reclaim_lead(last_call_min: float | None, now_min: float, margin_min: float) -> float:
    """How far ahead a policy called at ``now_min`` (previously at
    ``last_call_min``; None: first call) must act on a reclaim so the drain
    is done by the deadline: the interval to its next call, assumed equal to
    the last one, plus ``margin_min``. Everything on the first call."""
    return math.inf if last_call_min is None else (now_min - last_call_min) + margin_min


def usable_gpus(snap: Snapshot) -> int:
    """GPUs the admitted jobs may share: every pool's nodes minus announced reclaims."""
    return sum((p.nodes - p.reclaiming) * p.gpus_per_node for p in snap.pools)


def place(snap: Snapshot, free: dict[str, int], job: JobView, count: int, kinds: Iterable[str] = (VM, BARE_METAL)
          ) -> list[tuple[str, int]]:
    """Put up to ``count`` new groups of ``job`` on pools of ``kinds``, in
    that order of preference (elastic groups go to borrowed VMs first, so
    bare metal stays free for the cores of arriving jobs). Returns
    ``[(pool, groups)]``; ``free`` is reduced."""
    out = []
    for kind in kinds:
        for p in snap.pools:
            if p.kind != kind or count <= 0:
                continue
            per = job.nodes_per_replica(p.gpus_per_node)
            k = min(count, free[p.name] // per)
            if k > 0:
                free[p.name] -= k * per
                count -= k
                out.append((p.name, k))
    return out


def drain_order(snap: Snapshot, job: JobView, exclude: set[str] = frozenset()) -> list[ReplicaView]:
    """The job's active groups, the first to drain first: flagged
    stragglers, then groups still joining (nothing to lose), then VM before
    bare metal, then the newest."""
    kinds = {p.name: p.kind for p in snap.pools}
    return sorted((r for r in job.active if r.id not in exclude),
                  key=lambda r: (r.straggler_since_min is None, r.state != "joining", kinds[r.pool] != VM,
                                 -_ordinal(r.id)))


def shrink(snap: Snapshot, job: JobView, count: int, reason: str, free: dict[str, int],
           exclude: set[str] = frozenset()) -> list[Decision]:
    """Drain ``count`` groups of ``job`` (never below its core); their nodes return to ``free``.

    ``exclude``: ids already leaving this round (drained, moved or killed by
    an earlier step); they are not picked again nor counted as members. When
    it is a mutable set, the victims are added to it, so a later step of the
    same round (a rebalance after a triggered shrink) never drains them twice
    nor returns their nodes to ``free`` twice."""
    staying = [r for r in job.active if r.id not in exclude]
    count = min(count, len(staying) - job.min_replicas)
    victims = drain_order(snap, job, exclude)[:max(count, 0)]
    if not victims:
        return []
    if isinstance(exclude, set):
        exclude.update(r.id for r in victims)
    for r in victims:
        free[r.pool] += job.nodes_per_replica(snap.pool(r.pool).gpus_per_node)
    return [Decision(job.name, Action.DRAIN, reason, count=len(victims), replica_ids=tuple(r.id for r in victims))]


def grow(snap: Snapshot, job: JobView, count: int, reason: str, free: dict[str, int],
         kinds: Iterable[str] = (VM, BARE_METAL)) -> list[Decision]:
    """Start up to ``count`` groups of ``job`` where ``free`` allows."""
    return [Decision(job.name, Action.GROW, reason, count=k, pool=pool)
            for pool, k in place(snap, free, job, count, kinds)]


def reclaim_drains(snap: Snapshot, demand: dict[str, float], lead_min: float = math.inf,
                   free: dict[str, int] | None = None) -> tuple[list[Decision], set[str]]:
    """Drain enough groups from every VM pool with an announced reclaim due
    within ``lead_min`` that the pool fits its post-reclaim size by the
    deadline. Draining as late as is safe keeps the groups working through
    the notice; the caller picks ``lead_min`` to cover the time until its
    next call plus a margin for the drain itself (one step). Victims: flagged
    stragglers first, then the job whose last group adds the least weighted
    throughput. Drained even below a job's core: the deadline is hard, and a
    drain loses no work where a kill at the deadline loses the step in flight.

    A reclaim still in the snapshot at or after its deadline (live: a drain
    that hung, the nodes not yet taken) is overdue: whatever still exceeds the
    pool, groups still draining first, is killed. With ``free`` (nodes a grow
    may take, updated in place), a victim whose departure would leave its job
    below its core is re-placed first: it is moved to bare metal where a node
    is free instead of drained. Returns the decisions and the ids drained,
    moved or killed."""
    decisions: list[Decision] = []
    drained: set[str] = set()
    for pool in snap.pools:
        pending = [r for r in snap.reclaims if r.pool == pool.name and r.deadline_min - snap.time_min <= lead_min]
        if not pending:
            continue
        overdue = any(r.deadline_min <= snap.time_min for r in pending)
        leaving = sum(r.nodes for r in pending)
        excess = pool.used - (pool.nodes - leaving)
        if overdue:  # draining groups still hold their nodes
            excess += sum(j.nodes_per_replica(pool.gpus_per_node) for j in snap.jobs for r in j.replicas
                          if r.pool == pool.name and r.state == "draining")
        deadline = min(r.deadline_min for r in pending)
        picks: dict[str, list[str]] = {}
        while excess > 0:
            candidates = []
            for job in snap.jobs:
                left = [r for r in job.replicas if overdue and r.state == "draining" and r.pool == pool.name
                        and r.id not in drained]
                left += [r for r in drain_order(snap, job, drained) if r.pool == pool.name]
                if left:
                    n = len(job.active) - len(picks.get(job.name, []))
                    gain = (-2.0 if left[0].state == "draining" else -1.0 if left[0].straggler_since_min is not None
                            else marginal_gain(job, n, demand.get(job.name, job.demand_gpus)))
                    candidates.append((gain, job.name, left[0], job))
            if not candidates:
                break
            _, name, replica, job = min(candidates, key=lambda c: (c[0], c[1]))
            drained.add(replica.id)
            picks.setdefault(name, []).append(replica.id)
            excess -= job.nodes_per_replica(pool.gpus_per_node)
        for name, ids in picks.items():
            job = next(j for j in snap.jobs if j.name == name)
            if free is not None and not overdue:
                ids = _replace_core(snap, free, job, ids, deadline, decisions)
                if not ids:
                    continue
            if overdue:
                reason = (f"reclaim deadline t={deadline:g} min on {pool.name} passed with the group(s) still "
                          f"there: kill")
            else:
                reason = (f"reclaim: {leaving} node(s) of {pool.name} leave at t={deadline:g} min "
                          f"({deadline - snap.time_min:g} min left); drain before the deadline")
            decisions.append(Decision(name, Action.KILL if overdue else Action.DRAIN, reason, count=len(ids),
                                      replica_ids=tuple(ids)))
    return decisions, drained


def _replace_core(snap: Snapshot, free: dict[str, int], job: JobView, ids: list[str], deadline: float,
                  decisions: list[Decision]) -> list[str]:
    """Of the reclaim victims ``ids`` of ``job``, move those the job's core
    needs (it would fall below ``min_replicas`` without them) to bare metal
    where ``free`` has room, appending the moves to ``decisions``. Returns the
    victims left to drain."""
    staying = len(job.active) - len(ids)
    short = min(len(ids), job.min_replicas - staying)
    if short <= 0:
        return ids
    moved = 0
    for pool, k in place(snap, free, job, short, (BARE_METAL,)):
        for rid in ids[moved:moved + k]:
            decisions.append(Decision(job.name, Action.MOVE, f"reclaim at t={deadline:g} min would leave "
                                      f"{job.name} below its core of {job.min_replicas}: re-place on {pool}",
                                      count=1, pool=pool, replica_ids=(rid,)))
        moved += k
    return ids[moved:]


def admit(snap: Snapshot, free: dict[str, int], full_size: bool = False, drained: set[str] | None = None
          ) -> list[Decision]:
    """Admit waiting jobs (highest priority first, then trace order) whose
    core fits on bare metal, draining other jobs' elastic groups from bare
    metal when that makes room. With ``full_size`` (the static baseline) a job
    starts only with all ``max_replicas`` groups placed (core on bare metal,
    the rest anywhere). ``drained``: ids already leaving this round, never
    picked again; the groups drained here are added to it."""
    drained = set() if drained is None else drained
    decisions: list[Decision] = []
    waiting = sorted((j for j in snap.jobs if not j.admitted), key=lambda j: -j.priority)
    for job in waiting:
        bm = [p for p in snap.pools if p.kind == BARE_METAL]
        need = job.min_replicas
        room = sum(free[p.name] // job.nodes_per_replica(p.gpus_per_node) for p in bm)
        extra = job.max_replicas - job.min_replicas if full_size else 0
        if full_size:
            trial = dict(free)
            core = sum(k for _, k in place(snap, trial, job, need, (BARE_METAL,)))
            if core < need or sum(k for _, k in place(snap, trial, job, extra)) < extra:
                continue
        if room < need:
            decisions += _make_room(snap, free, job, need, drained)
            room = sum(free[p.name] // job.nodes_per_replica(p.gpus_per_node) for p in bm)
            if room < need:
                continue
        decisions += grow(snap, job, need, f"admit: core of {need} group(s) on bare metal", free, (BARE_METAL,))
        if extra:
            decisions += grow(snap, job, extra, f"static: peak allocation, {job.max_replicas} groups", free)
    return decisions


def _make_room(snap: Snapshot, free: dict[str, int], job: JobView, groups: int, drained: set[str]
               ) -> list[Decision]:
    """Drain elastic groups of admitted jobs from bare metal until ``groups``
    groups of ``job`` fit there in all; plans nothing unless that is reached.
    Groups in ``drained`` are not picked; those picked are added to it."""
    plan: list[tuple[JobView, ReplicaView]] = []
    trial = dict(free)
    for other in sorted((j for j in snap.jobs if j.admitted), key=lambda j: j.priority):
        # Only groups beyond the other job's own core on bare metal are elastic there.
        staying = [r for r in other.active if r.id not in drained]
        spare = sum(snap.pool(r.pool).kind == BARE_METAL for r in staying) - other.min_replicas
        for r in drain_order(snap, other, drained):
            pool = snap.pool(r.pool)
            if spare <= 0 or pool.kind != BARE_METAL:
                continue
            if sum(trial[p.name] // job.nodes_per_replica(p.gpus_per_node) for p in snap.pools
                   if p.kind == BARE_METAL) >= groups:
                break
            trial[r.pool] += other.nodes_per_replica(pool.gpus_per_node)
            plan.append((other, r))
            spare -= 1
    if sum(trial[p.name] // job.nodes_per_replica(p.gpus_per_node) for p in snap.pools
           if p.kind == BARE_METAL) < groups:
        return []
    free.update(trial)
    drained.update(r.id for _, r in plan)
    out = []
    for other in {o.name: o for o, _ in plan}.values():
        ids = tuple(r.id for o, r in plan if o.name == other.name)
        out.append(Decision(other.name, Action.DRAIN, f"make room on bare metal for the core of {job.name}",
                            count=len(ids), replica_ids=ids))
    return out


def _ordinal(replica_id: str) -> int:
    """The number after the last ``r`` of ``<job>-r<n>`` (creation order)."""
    tail = replica_id.rsplit("-r", 1)[-1]
    return int(tail) if tail.isdigit() else 0
