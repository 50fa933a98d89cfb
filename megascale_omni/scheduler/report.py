"""Reports of simulator runs: the side-by-side table, a JSON summary, the
decision log and PNG plots per run.

Called by ``omni-sched simulate`` (and the benchmark script). matplotlib
(Agg backend) is imported only inside :func:`write_plots`, as in
``megascale_omni/report/``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from megascale_omni.scheduler.simulator import SimResult, decision_log

#: The PNGs of one run: GPUs allocated (line) vs demand (shaded) per job over
#: time; nodes used vs available per pool; cumulative moves per job.
PLOTS = ("allocation.png", "pools.png", "moves.png")


def _hours(minutes: float | None) -> str:
    return "-" if minutes is None else f"{minutes / 60:.2f}"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


#: Per-job completion columns are shown for traces with at most this many jobs.
MAX_JOB_COLUMNS = 6


def table(results: Sequence[SimResult]) -> str:
    """A markdown table, one row per policy: cluster and held utilisation,
    GPU-hours held, mean and p95 job completion time and queueing delay
    (hours), minutes jobs spent below their core, per-job completion (hours
    from arrival, ``-`` unfinished; small traces only), moves per hour,
    reclaims met and groups killed."""
    names = [j.name for j in results[0].jobs]
    per_job = names if len(names) <= MAX_JOB_COLUMNS else []
    head = (["policy", "cluster util.", "held util.", "GPU-hours held", "mean JCT (h)", "p95 JCT (h)",
             "mean queue (h)", "p95 queue (h)", "below min (min)"] + [f"{n} completion (h)" for n in per_job]
            + ["moves/hour", "reclaim deadlines met", "groups killed"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        by = {j.name: j for j in r.jobs}
        jct, queue = r.jct_min(), r.queue_min()
        mean_jct = _hours(sum(jct) / len(jct)) + (f" ({r.unfinished} unfinished)" if r.unfinished else "")
        cells = [r.policy, f"{r.cluster_utilisation:.3f}", f"{r.utilisation:.3f}", f"{r.gpu_hours:.0f}", mean_jct,
                 _hours(percentile(jct, 95)), _hours(sum(queue) / len(queue)), _hours(percentile(queue, 95)),
                 f"{sum(j.below_min_minutes for j in r.jobs):g}"]
        cells += [_hours(by[n].completion_min) for n in per_job]
        met = f"{r.reclaims_met}/{r.reclaim_events}" if r.reclaim_events else "no reclaims"
        cells += [f"{r.moves_per_hour:.2f}", met, str(r.groups_killed)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary(result: SimResult) -> dict:
    """The run's numbers as a JSON-able dict (no per-tick series); times in minutes."""
    jct, queue = result.jct_min(), result.queue_min()
    return {
        "policy": result.policy, "trace": result.trace, "end_min": result.end_min,
        "cluster_utilisation": result.cluster_utilisation, "held_utilisation": result.utilisation,
        "utilisation": result.utilisation, "gpu_hours_held": result.gpu_hours,
        "gpu_hours_useful": sum(j.useful_gpu_hours for j in result.jobs),
        "cluster_gpu_hours": result.cluster_gpu_hours,
        "jct_mean_min": sum(jct) / len(jct), "jct_p95_min": percentile(jct, 95),
        "queue_mean_min": sum(queue) / len(queue), "queue_p95_min": percentile(queue, 95),
        "unfinished": result.unfinished, "moves": result.moves, "moves_per_hour": result.moves_per_hour,
        "reclaim_events": result.reclaim_events, "reclaims_met": result.reclaims_met,
        "groups_killed": result.groups_killed, "jobs": [asdict(j) for j in result.jobs],
    }


def write_run(result: SimResult, out: Path) -> list[Path]:
    """Write ``summary.json``, ``decisions.log`` and the plots of one run into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary(result), indent=2) + "\n", encoding="utf-8")
    (out / "decisions.log").write_text("".join(line + "\n" for line in decision_log(result)), encoding="utf-8")
    return [out / "summary.json", out / "decisions.log", *write_plots(result, out)]


def write_plots(result: SimResult, out: Path) -> list[Path]:
    """The PNGs of :data:`PLOTS` for one run; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [t / 60 for t in result.times]
    title = f"{result.trace} - {result.policy}"
    written = []

    alloc, demand = _per_panel(result.alloc), _per_panel(result.demand)
    jobs = list(alloc)
    fig, axes = plt.subplots(len(jobs), 1, figsize=(10, 2.4 * len(jobs)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], jobs):
        ax.fill_between(hours, demand[name], step="post", alpha=0.3, color="tab:orange", label="demand")
        ax.step(hours, alloc[name], where="post", color="tab:blue", label="allocated")
        ax.set_ylabel(f"{name} GPUs")
        ax.legend(loc="upper right", fontsize=8)
    axes[0, 0].set_title(f"allocation vs demand - {title}")
    axes[-1, 0].set_xlabel("hours")
    written.append(_save(plt, fig, out / "allocation.png"))

    pools = list(result.pool_used)
    fig, axes = plt.subplots(len(pools), 1, figsize=(10, 2.4 * len(pools)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], pools):
        ax.step(hours, result.pool_nodes[name], where="post", color="black", label="available")
        ax.fill_between(hours, result.pool_used[name], step="post", alpha=0.4, label="used")
        ax.set_ylabel(f"{name} nodes")
        ax.legend(loc="upper right", fontsize=8)
    axes[0, 0].set_title(f"pool usage - {title}")
    axes[-1, 0].set_xlabel("hours")
    written.append(_save(plt, fig, out / "pools.png"))

    fig, ax = plt.subplots(figsize=(10, 3))
    for name in jobs:
        events = sorted((t, n) for t, job, n in result.move_times if name == ALL_JOBS or job == name)
        xs, ys, total = [0.0], [0], 0
        for t, n in events:
            total += n
            xs.append(t / 60)
            ys.append(total)
        xs.append(result.end_min / 60)
        ys.append(total)
        ax.step(xs, ys, where="post", label=f"{name} ({total})")
    ax.set_xlabel("hours")
    ax.set_ylabel("moves (cumulative)")
    ax.set_title(f"moves - {title} ({result.moves_per_hour:.2f}/hour)")
    ax.legend(loc="upper left", fontsize=8)
    written.append(_save(plt, fig, out / "moves.png"))
    return written


#: The panel that sums every job when a trace has more than MAX_JOB_COLUMNS jobs.
ALL_JOBS = "all jobs"


def _per_panel(series: dict[str, list[float]]) -> dict[str, list[float]]:
    """One series per job, or their sum under ALL_JOBS for many-job traces."""
    if len(series) <= MAX_JOB_COLUMNS:
        return series
    return {ALL_JOBS: [sum(values) for values in zip(*series.values())]}


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
