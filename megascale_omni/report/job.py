"""The job-level part of the report (``tools/report.py``): several replica groups' runs side by side.

An elastic job writes one run directory per replica group (its
``logging.output_dir``). Given the job directory above them,
``tools/report.py`` reports every group as usual, into ``OUT/<group>/``,
and adds ``job.png`` and ``job.md``: the job's step time and throughput,
each group's replica busy time (``step_s - cross_replica_s``, the work it
did before waiting for the others), the slowest and straggling groups
(:func:`megascale_omni.metrics.job.aggregate_job`) and membership changes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megascale_omni.config import ConfigError
from megascale_omni.config.runtime_sections import LoggingConfig
from megascale_omni.metrics.job import aggregate_job, replica_busy_s
from megascale_omni.report.run import Run, fmt, load_run


@dataclass
class Job:
    """The replica groups' runs of one job and the job's per-step records."""

    path: Path
    runs: dict[str, Run]
    steps: list[dict]


def group_dirs(job_dir: Path) -> list[Path]:
    """Sub-directories of ``job_dir`` holding a ``metrics.jsonl``, by name."""
    if not job_dir.is_dir():
        return []
    return sorted(p for p in job_dir.iterdir() if p.is_dir() and (p / "metrics.jsonl").is_file())


def load_job(job_dir: Path) -> Job:
    """Every replica group's run under ``job_dir`` and their aggregate, with the
    default straggler rule of ``logging.straggler_*``. Raises ConfigError when a
    group's metrics.jsonl has no valid step record."""
    runs = {d.name: load_run(d) for d in group_dirs(job_dir)}
    if not runs:
        raise ConfigError("RUN_DIR", str(job_dir), "has no metrics.jsonl and no replica-group directory with one")
    rule = LoggingConfig()
    steps = aggregate_job({name: run.steps for name, run in runs.items()}, rule.straggler_factor,
                          rule.straggler_patience, rule.straggler_min_excess_s)
    return Job(job_dir.resolve(), runs, steps)


def write_job_plot(job: Job, out: Path) -> bool:
    """``job.png``: replica busy time per group with the job's step time, and the
    job's throughput with the number of groups per step. False if nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not job.steps:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    steps = np.array([j["step"] for j in job.steps])
    top.plot(steps, [j["step_s"] for j in job.steps], color="black", lw=1.5, label="job step time")
    for name, run in job.runs.items():
        top.plot([r["step"] for r in run.steps], [replica_busy_s(r) for r in run.steps], lw=1,
                 label=f"{name} busy")
    flagged = [(j["step"], j["replica_busy_s_max"]) for j in job.steps if j["straggling_replicas"]]
    if flagged:
        top.scatter(*zip(*flagged), color="red", marker="x", zorder=3, label="straggling group flagged")
    top.set_ylabel("s")
    top.set_title(f"replica groups: step time and busy time (step_s - cross_replica_s) - {job.path.name}")
    top.legend(fontsize=8)
    bottom.plot(steps, [j["tokens_per_s"] for j in job.steps], color="tab:blue", label="job tokens/s")
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("step")
    groups = bottom.twinx()
    groups.step(steps, [j["replica_groups"] for j in job.steps], where="post", color="tab:green",
                label="replica groups")
    groups.set_ylabel("replica groups")
    groups.set_ylim(0, max(j["replica_groups"] for j in job.steps) + 1)
    bottom.set_title("job throughput and replica groups per step")
    fig.tight_layout()
    fig.savefig(out / "job.png", dpi=100)
    plt.close(fig)
    return True


def job_markdown(job: Job, plotted: bool) -> str:
    """``job.md``: headline numbers of the job and one row per replica group."""
    steps = job.steps
    step_s = np.array([j["step_s"] for j in steps])
    lines = [f"# Job report: {job.path.name}", "", f"Replica groups: {', '.join(job.runs)}.", "",
             "| | |", "|---|---|",
             f"| steps recorded | {len(steps)} ({steps[0]['step']} to {steps[-1]['step']}) |",
             f"| median job step time | {fmt(float(np.median(step_s)))} s |",
             f"| median job tokens/s | {fmt(float(np.median([j['tokens_per_s'] for j in steps])))} |"]
    changes = [(b["step"], a["replica_groups"], b["replica_groups"]) for a, b in zip(steps, steps[1:])
               if a["replica_groups"] != b["replica_groups"]]
    lines.append("| replica-group changes | " + ("; ".join(f"step {s}: {a} -> {b}" for s, a, b in changes[:20])
                                                  or "none") + " |")
    flagged = [j for j in steps if j["straggling_replicas"]]
    lines.append(f"| steps with a straggling replica group | {len(flagged)}"
                 + (f" (first at step {flagged[0]['step']}: {', '.join(flagged[0]['straggling_replicas'])})"
                    if flagged else "") + " |")
    slowest = Counter(j["slowest_replica"] for j in steps)
    straggling = Counter(name for j in steps for name in j["straggling_replicas"])
    rank_flags = Counter(name for j in steps for name in j["rank_stragglers"])
    lines += ["", "| replica group | steps | median step time | median busy time | slowest in | flagged slow in "
              "| a rank flagged in |", "|---|---|---|---|---|---|---|"]
    for name, run in job.runs.items():
        busy = [replica_busy_s(r) for r in run.steps]
        lines.append(f"| {name} | {len(run.steps)} | {fmt(float(np.median(run.values('step_s'))))} s | "
                     f"{fmt(float(np.median(busy)))} s | {slowest[name]} steps | {straggling[name]} steps | "
                     f"{rank_flags[name]} steps |")
    lines += ["", "Busy time = step_s - cross_replica_s: the work a group did before waiting for the others. A group "
              "busier than 2x the others' median for 3 steps in a row is flagged (logging.straggler_* defaults).",
              "", "Plots: " + ("`job.png` (busy and step time per group, job throughput)" if plotted else "none")
              + "; one report per group in its sub-directory.", ""]
    return "\n".join(lines)
