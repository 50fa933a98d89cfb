"""Which job to serve first when the remaining work is known: shortest
remaining work first, except a job on the makespan's critical path.

Called by the elastic policy once per tick on its snapshot (pure functions,
no state). Both rules act through the jobs' weights, so every planning step
that already weighs marginal gains by ``priority`` (the goodput water-fill,
the order of triggered grows, admission order, which job gives room to an
arriving core, which group a reclaim takes) follows them unchanged:

- **Shortest remaining work first.** A job's weight is its priority x
  ``mean remaining / its remaining samples``, so the water-fill maximises
  the summed rate at which jobs finish what is left of them (samples/s over
  remaining samples), not raw samples/s. This is Smith's rule (weight over
  remaining processing time), the rule that minimises mean completion time
  on one machine; with sublinear scaling the water-fill still gives a long
  job groups once a short job's next group adds little. Tiresias (Gu et al.,
  NSDI'19) and Optimus (Peng et al., EuroSys'18) order DL jobs by the same
  kind of remaining-work estimate.
- **The critical path.** Serving short jobs first can delay the makespan
  when a long job runs at its core: the cluster cannot finish earlier than
  that job at its largest useful size. A job whose remaining time at its
  largest useful size (:func:`~megascale_omni.scheduler.planning.worth_replicas`)
  is at least the time every known job's remaining work needs on the whole
  cluster at best efficiency (a lower bound on the makespan left) is
  critical: it weighs ``critical_factor`` times the largest other weight
  (the elastic policy's ``critical_path`` knob), so it ranks with the
  shortest job (1) or before every job (large).

Jobs whose remaining work is unknown (``remaining_samples`` None: the live
scheduler) keep their priority as it is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from megascale_omni.scheduler.model import JobView, Snapshot
from megascale_omni.scheduler.planning import usable_gpus, worth_replicas

#: A critical job's weight over the largest other weight that puts it before
#: every other job: its least worthwhile group (>= ``min_marginal_gain`` x its
#: per-GPU rate at its core, 1/10 by default) still outweighs any other
#: job's best group.
CRITICAL_FACTOR = 1e3


def work_bound_s(jobs: Sequence[JobView], capacity_gpus: float) -> float:
    """Seconds the known remaining work of ``jobs`` needs on ``capacity_gpus``
    GPUs if every GPU ran at its job's best samples/s per GPU: nothing can
    finish all of it sooner."""
    gpu_s = sum(j.remaining_samples / j.curve.best_per_replica * j.replica_gpus for j in jobs
                if j.remaining_samples is not None)
    return gpu_s / max(capacity_gpus, 1e-9)


def critical_jobs(jobs: Sequence[JobView], capacity_gpus: float, min_gain: float = 0.0) -> set[str]:
    """Names of the jobs whose remaining time at their largest useful size
    (``worth_replicas(job, min_gain)``, at most their demand) is at least
    :func:`work_bound_s` of all ``jobs``: they set the makespan."""
    bound = work_bound_s(jobs, capacity_gpus)
    out = set()
    for j in jobs:
        if not j.remaining_samples:
            continue
        top = min(worth_replicas(j, min_gain), max(j.min_replicas, math.ceil(j.demand_gpus / j.replica_gpus)))
        rate = j.curve(top)
        if rate > 0 and j.remaining_samples / rate >= bound:
            out.add(j.name)
    return out


def rank_by_remaining_work(snap: Snapshot, exponent: float = 1.0, critical_factor: float = CRITICAL_FACTOR,
                           min_gain: float = 0.0) -> Snapshot:
    """``snap`` with every job's ``priority`` replaced by its weight (module
    docstring): priority x (mean remaining / remaining) ** ``exponent``
    (0: remaining work ignored), and the critical jobs ``critical_factor``
    times the largest other weight (0: no critical path). Unchanged when no job
    has a known remaining amount of work."""
    known = [j for j in snap.jobs if j.remaining_samples]
    if not known or (exponent == 0 and not critical_factor):
        return snap
    mean = sum(j.remaining_samples for j in known) / len(known)
    weight = {j.name: j.priority * (mean / j.remaining_samples) ** exponent for j in known}
    critical = critical_jobs(known, usable_gpus(snap), min_gain) if critical_factor else set()
    top = max((w for name, w in weight.items() if name not in critical), default=1.0)
    for name in critical:
        weight[name] = critical_factor * top * max(next(j.priority for j in known if j.name == name), 1e-9)
    jobs = tuple(dataclasses.replace(j, priority=weight[j.name]) if j.name in weight else j for j in snap.jobs)
    return dataclasses.replace(snap, jobs=jobs)
