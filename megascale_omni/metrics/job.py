"""The job's view of a step: the replica groups' records side by side.

Each replica group's loss rank writes its own ``metrics.jsonl`` (an elastic
job runs one output directory per group; Prometheus scrapes one endpoint per
group). Replica groups of a synchronous job wait for each other in the
cross-replica reduction, so their step times agree; what tells a slow
replica group apart is its *replica busy time*, ``step_s - cross_replica_s``:
everything it did before it started waiting for the others. The slowest
replica group is flagged by the same rule as a slow rank inside a group
(:class:`~megascale_omni.metrics.replica_group.SlowTracker`).

Used by ``tools/report.py`` on a job directory; pure functions of the
records, so an external scheduler can apply them to what it reads from the
control sockets.
"""

from __future__ import annotations

import statistics
from typing import Mapping, Sequence

from megascale_omni.metrics.replica_group import SlowTracker

#: Job-step fields: name -> (unit, meaning).
JOB_FIELDS: dict[str, tuple[str, str]] = {
    "step": ("", "committed optimizer steps"),
    "replica_groups": ("", "replica groups that recorded the step"),
    "participants": ("", "replica groups in the quorum (largest reported)"),
    "loss": ("", "mean of the groups' losses (equal when reduced across groups)"),
    "step_s": ("s", "the job's step time: the slowest group's step_s"),
    "tokens_per_s": ("tokens/s", "the job's tokens per step / step_s"),
    "samples_per_s": ("samples/s", "the job's samples per step / step_s"),
    "replica_busy_s_median": ("s", "median over groups of step_s - cross_replica_s"),
    "replica_busy_s_max": ("s", "the slowest group's step_s - cross_replica_s"),
    "slowest_replica": ("", "the group with the largest replica busy time"),
    "straggling_replicas": ("", "groups flagged slow (list)"),
    "rank_stragglers": ("", "groups with a rank flagged slow inside them (list)"),
}


def replica_busy_s(record: Mapping) -> float:
    """Seconds a replica group worked before waiting for the other groups."""
    return float(record["step_s"]) - float(record.get("cross_replica_s", 0.0) or 0.0)


def aggregate_job(groups: Mapping[str, Sequence[dict]], factor: float = 2.0, patience: int = 3,
                  min_excess_s: float = 0.01) -> list[dict]:
    """One job record per step any group recorded, ascending (fields:
    :data:`JOB_FIELDS`). ``groups`` maps a replica group's name to its step
    records (each with ``step``, ``step_s``, ``tokens``, ``samples``; one per
    step). ``factor``/``patience``/``min_excess_s``: the straggler rule of
    ``logging.straggler_*`` applied across groups."""
    by_step: dict[int, dict[str, dict]] = {}
    for name in sorted(groups):
        for record in groups[name]:
            by_step.setdefault(int(record["step"]), {})[name] = record
    tracker = SlowTracker(factor, patience, min_excess_s)
    out = []
    for step in sorted(by_step):
        records = by_step[step]
        busy = {name: replica_busy_s(r) for name, r in records.items()}
        step_s = max(float(r["step_s"]) for r in records.values())
        tokens = max(int(r.get("tokens", 0)) for r in records.values())
        samples = max(int(r.get("samples", 0)) for r in records.values())
        losses = [float(r["loss"]) for r in records.values() if isinstance(r.get("loss"), (int, float))]
        slowest = max(busy, key=busy.__getitem__)
        out.append({
            "step": step,
            "replica_groups": len(records),
            "participants": max(int(r.get("participants", 1) or 1) for r in records.values()),
            **({"loss": statistics.fmean(losses)} if losses else {}),
            "step_s": step_s,
            "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "samples_per_s": samples / step_s if step_s > 0 else 0.0,
            "replica_busy_s_median": statistics.median(busy.values()),
            "replica_busy_s_max": busy[slowest],
            "slowest_replica": slowest,
            "straggling_replicas": tracker.update(busy),
            "rank_stragglers": [name for name, r in records.items() if r.get("straggler_count")],
        })
    return out
