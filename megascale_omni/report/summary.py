"""The one-page summary (``summary.md``) of a run's report: headline
numbers, step-time shares, checkpoints, membership, what the run lacks and
the plots written. Reads a :class:`~megascale_omni.report.run.Run`; no matplotlib.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from megascale_omni.report.run import (
    REMAINDER,
    Run,
    _is_step_number,
    _number,
    breakdown,
    fmt,
    median,
    membership_changes,
    percentile,
)


def summary_markdown(run: Run, plots: list[tuple[str, str]], notes: list[str]) -> str:
    """The one-page summary (markdown) of ``run``: headline numbers, step-time shares,
    checkpoints, membership, what the run lacks and the plots written."""
    steps = run.step_numbers.astype(int)
    rows: list[tuple[str, str]] = []
    lacks: list[str] = []

    def row(name: str, value: str) -> None:
        rows.append((name, value))

    step_note = f"{len(steps)} ({steps[0]} to {steps[-1]})"
    if run.superseded:
        step_note += (f"; {run.superseded} earlier record(s) of re-run steps replaced by the later ones "
                      f"({run.resumes} resume(s))")
    row("steps recorded", step_note)
    loss = run.values("loss")
    if np.isfinite(loss).any():
        ok = np.flatnonzero(np.isfinite(loss))
        first, last, low = ok[0], ok[-1], ok[np.argmin(loss[ok])]
        row("first loss", f"{fmt(loss[first])} (step {steps[first]})")
        row("last loss", f"{fmt(loss[last])} (step {steps[last]})")
        row("min loss", f"{fmt(loss[low])} (step {steps[low]})")
    else:
        lacks.append("loss: no finite value")
    if run.evals:
        ev = run.evals[-1]
        vals = ", ".join(f"{k} {fmt(_number(v))}" for k, v in sorted(ev.items())
                         if k.startswith("eval/") and math.isfinite(_number(v)))
        row(f"last evaluation (step {ev['step']})", vals or "-")
    else:
        lacks.append("evaluation: no eval/* records")
    skipped = [int(s) for s, r in zip(steps, run.steps) if r.get("skipped") is True]
    row("skipped steps", f"{len(skipped)}" + (f" (steps {_list(skipped)})" if skipped else ""))
    step_s = run.values("step_s")
    if run.has("step_s"):
        row("median step time", f"{fmt(median(step_s))} s")
        row("p90 step time", f"{fmt(percentile(step_s, 90))} s")
        row("total time in steps", f"{fmt(float(np.nansum(step_s)))} s")
    else:
        lacks.append("step time: no step_s")
    for key, name in (("tokens_per_s", "median tokens/s"), ("samples_per_s", "median samples/s"),
                      ("images_per_s", "median images/s"), ("tflops_per_device", "median model TFLOP/s per device"),
                      ("mfu", "median MFU")):
        if run.has(key):
            row(name, fmt(median(run.values(key))))
        else:
            lacks.append(f"{name[len('median '):]}: no {key}")
    mem = [k for k in ("mem_peak_gib", "mem_reserved_gib", "mem_allocated_gib", "rss_gib") if run.has(k)]
    for key in mem:
        v = run.values(key)
        i = int(np.nanargmax(v))
        row(f"max {key}", f"{fmt(v[i])} GiB (step {steps[i]})")
    if run.has("mem_fragmentation"):
        row("median mem_fragmentation", fmt(median(run.values("mem_fragmentation"))))
    if not mem:
        lacks.append("memory: no mem_allocated_gib / mem_reserved_gib / mem_peak_gib / rss_gib")
    if run.has("busy_s_max") and run.has("busy_s_median"):
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = run.values("busy_s_max") / run.values("busy_s_median")
        row("median slowest-rank / median-rank busy time", fmt(median(ratio)))
    flagged = sum(1 for r in run.steps if isinstance(r.get("stragglers"), list) and r["stragglers"])
    if any("stragglers" in r for r in run.steps):
        ranks = Counter(r["slowest_rank"] for r in run.steps if _is_step_number(r.get("slowest_rank")))
        row("steps with stragglers flagged", f"{flagged}" + (
            f"; most often slowest: rank {ranks.most_common(1)[0][0]}" if ranks else ""))
    else:
        lacks.append("stragglers: no busy_s_median / busy_s_max / stragglers")
    rows += _moe_rows(run)
    if run.checkpoints:
        blocking = np.array([_number(c.get("blocking_s")) for c in run.checkpoints])
        total = np.array([_number(c.get("total_s")) for c in run.checkpoints])
        reasons = Counter(str(c.get("reason", "?")) for c in run.checkpoints)
        row("checkpoints", f"{len(run.checkpoints)} (steps {_list([c['step'] for c in run.checkpoints])}; "
            + ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())) + ")")
        row("median checkpoint blocking time", f"{fmt(median(blocking))} s")
        if np.isfinite(total).any():
            row("median checkpoint total time", f"{fmt(median(total))} s")
    else:
        row("checkpoints", "0" + ("" if run.checkpoint_log else " (no checkpoints.jsonl)"))
    if run.has("participants"):
        changes = membership_changes(run)
        text = "; ".join(f"step {s}: {a:g} -> {b:g} participants" for s, a, b in changes)
        row("membership changes", f"{len(changes)}" + (f" ({text})" if changes else ""))
        row("steps that healed from a peer", f"{sum(1 for r in run.steps if r.get('healed') is True)}")
    else:
        lacks.append("membership: no participants (not an elastic run)")

    lines = [f"# Run report: {run.path.name}", "", f"Run directory: `{run.path}`", ""]
    sources = [f"`metrics.jsonl`: {len(run.steps)} step records, {len(run.evals)} evaluation records"]
    if run.malformed["metrics.jsonl"]:
        sources.append(f"{run.malformed['metrics.jsonl']} malformed line(s) skipped")
    if run.ignored:
        sources.append(f"{run.ignored} other record(s) ignored")
    text = "; ".join(sources)
    if run.checkpoint_log:
        text += f". `checkpoints.jsonl`: {len(run.checkpoints)} record(s)"
        if run.malformed["checkpoints.jsonl"]:
            text += f"; {run.malformed['checkpoints.jsonl']} malformed line(s) skipped"
    lines += [text + ".", "", "| quantity | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]

    parts, how = breakdown(run)
    if parts:
        lines += ["", "## Step time breakdown", "",
                  f"Median over steps of each component's share of step_s; components: {how}.", "",
                  "| component | median share of step_s | median (s) |", "|---|---|---|"]
        with np.errstate(invalid="ignore", divide="ignore"):
            for name, v in parts.items():
                share = median(np.where(step_s > 0, v / step_s, np.nan))
                shown = "other (step_s - the rest)" if name == REMAINDER else name
                pct = f"{100 * share:.1f}%" if share is not None else "-"
                lines.append(f"| {shown} | {pct} | {fmt(median(v))} |")
    lines += ["", "## Not in this run", "", "Fields absent from every record:", ""]
    lines += [f"- {x}" for x in lacks] or ["- none"]
    lines += ["", "Plots and series left out:", ""]
    lines += [f"- {x}" for x in notes] or ["- none"]
    lines += ["", "## Plots", ""] + [f"- [{name}]({name}): {what}" for name, what in plots]
    return "\n".join(lines) + "\n"


def _moe_rows(run: Run) -> list[tuple[str, str]]:
    """Routing of an MoE model (docs/moe.md): expert load, dropped choices, router losses; none for a dense run."""
    routed = [(int(r["step"]), [float(v) for v in r["moe_load_max"]]) for r in run.steps
              if isinstance(r.get("moe_load_max"), list) and r["moe_load_max"]]
    if not routed:
        return []
    mean_load = [float(np.mean(v)) for _, v in routed]
    last_step, last = routed[-1]
    worst = int(np.argmax(last))
    rows = [("MoE expert load max/mean (mean over MoE layers)",
             f"first {fmt(mean_load[0])} (step {routed[0][0]}), median {fmt(median(np.array(mean_load)))}, "
             f"last {fmt(mean_load[-1])} (step {last_step}; busiest layer {worst}: {fmt(last[worst])})")]
    dropped = [sum(r["moe_tokens_dropped"]) for r in run.steps if isinstance(r.get("moe_tokens_dropped"), list)]
    if dropped:
        rows.append(("MoE routing choices dropped (capacity)",
                     f"{sum(dropped)} over {len(dropped)} steps ({sum(1 for d in dropped if d)} steps with drops)"))
    for key in ("moe_aux_loss", "moe_z_loss"):
        if run.has(key):
            rows.append((f"median {key}", fmt(median(run.values(key)))))
    return rows


def _list(values: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")
