"""The report's PNG plots of a run (matplotlib, the ``report`` extra:
``pip install -e '.[report]'``; imported only inside :func:`write_plots`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from megascale_omni.report.run import (
    MEMORY_GIB,
    RATES,
    REMAINDER,
    Run,
    _number,
    breakdown,
    label,
    membership_changes,
    moving_average,
    time_at_steps,
    unit,
    wall_time,
)

#: Most bars drawn in the step-time plot; longer runs are shown as means over equal bins of steps.
MAX_BARS = 600
PlotFn = Callable[..., Optional[object]]


def write_plots(run: Run, out: Path, smooth: int) -> tuple[list[tuple[str, str]], list[str]]:
    """Write every plot the run's fields allow into ``out`` as PNG.

    Returns ``(written, notes)``: (file name, what it shows) per plot, and
    one sentence per plot or series left out for lack of data.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    notes: list[str] = []
    written = []
    plots: list[tuple[str, str, PlotFn]] = [
        ("loss.png", "training loss per step" + (f", moving average over {smooth} steps" if smooth > 1 else "")
         + (", eval/loss" if any("eval/loss" in r for r in run.evals) else ""), _plot_loss),
        ("throughput.png", "throughput per step (and MFU)", _plot_throughput),
        ("step_time.png", "stacked step-time breakdown per step, step_s as a line", _plot_step_time),
        ("memory.png", "memory per step", _plot_memory),
        ("timeline.png", "loss and step time over wall time, checkpoints and membership changes marked",
         _plot_timeline),
    ]
    for name, what, fn in plots:
        fig = fn(plt, run, notes, smooth=smooth)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append((name, what))
    return written, notes


def _title(ax, text: str, run: Run) -> None:
    ax.set_title(f"{text} - {run.path.name}")


def _plot_loss(plt, run: Run, notes: list[str], smooth: int):
    loss = run.values("loss")
    if not np.isfinite(loss).any():
        notes.append("loss.png: no finite loss value in any step record")
        return None
    x = run.step_numbers
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(x, loss, lw=1, alpha=0.35 if smooth > 1 else 1.0, color="C0", label="loss")
    if smooth > 1:
        ax.plot(x, moving_average(loss, smooth), lw=1.8, color="C0", label=f"loss, mean of last {smooth} steps")
    ev = [(r["step"], _number(r.get("eval/loss"))) for r in run.evals]
    ev = [(s, v) for s, v in ev if math.isfinite(v)]
    if ev:
        ax.plot(*zip(*ev), "o-", color="C3", ms=4, label="eval/loss (held-out)")
    else:
        notes.append("loss.png: no eval/loss records, training loss only")
    skipped = [s for s, r in zip(x, run.steps) if r.get("skipped") is True]
    for i, s in enumerate(skipped):
        ax.axvline(s, color="red", ls=":", lw=0.8, label="skipped step" if i == 0 else None)
    ax.set_xlabel(label("step"))
    ax.set_ylabel(label("loss"))
    _title(ax, "Loss", run)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def _plot_throughput(plt, run: Run, notes: list[str], **_):
    rates = [k for k in RATES if run.has(k)]
    missing = [k for k in RATES if k not in rates]
    if not rates:
        notes.append(f"throughput.png: none of {', '.join(RATES)} in the step records")
        return None
    if missing:
        notes.append(f"throughput.png: no {', '.join(missing)} series (absent from the step records)")
    x = run.step_numbers
    fig, axes = plt.subplots(len(rates), 1, figsize=(9, 1.2 + 2.6 * len(rates)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for i, (ax, key) in enumerate(zip(axes, rates)):
        ax.plot(x, run.values(key), lw=1, color=f"C{i}", label=key)
        ax.set_ylabel(label(key))
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if i == 0 and run.has("mfu"):
            twin = ax.twinx()
            twin.plot(x, run.values("mfu"), lw=1, color="C5", ls="--", label="mfu")
            twin.set_ylabel(label("mfu"))
            h2, l2 = twin.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, loc="best")
    if not run.has("mfu"):
        notes.append("throughput.png: no MFU axis (mfu absent)")
    _title(axes[0], "Throughput", run)
    axes[-1].set_xlabel(label("step"))
    return fig


def _binned(x: np.ndarray, series: list[np.ndarray], max_points: int) -> tuple[np.ndarray, list[np.ndarray], int]:
    """(x, series) unchanged when short enough, else means over equal bins of consecutive steps
    (NaN-aware: a bin with no value stays NaN); also returns the bin width in steps."""
    width = max(1, math.ceil(x.size / max_points))
    if width == 1:
        return x, series, 1
    edges = list(range(0, x.size, width))

    def bin_mean(a):
        out = np.full(len(edges), np.nan)
        for j, lo in enumerate(edges):
            chunk = a[lo:lo + width]
            if np.isfinite(chunk).any():
                out[j] = np.nanmean(chunk)
        return out

    return bin_mean(x), [bin_mean(a) for a in series], width


def _plot_step_time(plt, run: Run, notes: list[str], **_):
    if not run.has("step_s"):
        notes.append("step_time.png: no step_s in the step records")
        return None
    parts, how = breakdown(run)
    lines = [k for k in ("step_s", "busy_s_median", "busy_s_max") if run.has(k)]
    x, ys, width = _binned(run.step_numbers, [*parts.values(), *(run.values(k) for k in lines)], MAX_BARS)
    bars, curves = ys[:len(parts)], ys[len(parts):]
    fig, ax = plt.subplots(figsize=(10, 5))
    bottom = np.zeros_like(x)
    for i, (name, h) in enumerate(zip(parts, bars)):
        lab = "other (step_s - the rest)" if name == REMAINDER else name
        ax.bar(x, h, bottom=bottom, width=0.9 if width == 1 else width, color=f"C{i}", lw=0, label=lab)
        bottom = bottom + np.nan_to_num(h, nan=0.0)
    styles = {"step_s": ("black", "-"), "busy_s_median": ("dimgray", ":"), "busy_s_max": ("red", "--")}
    for key, y in zip(lines, curves):
        color, ls = styles[key]
        ax.plot(x, y, color=color, ls=ls, lw=1.3,
                label={"busy_s_median": "busy time, replica-group median", "busy_s_max": "busy time, slowest rank"}
                .get(key, key))
    if "busy_s_max" not in lines:
        notes.append("step_time.png: no straggler lines (busy_s_median / busy_s_max absent)")
    ax.set_xlabel(label("step") + (f", means over {width}-step bins" if width > 1 else ""))
    top = max([float(np.nanmax(bottom)), *(float(np.nanmax(y)) for y in curves if np.isfinite(y).any())])
    ax.set_ylim(0, 1.35 * top if top > 0 else 1.0)  # headroom for the legend
    ax.set_ylabel(f"time per step ({unit('step_s')})")
    _title(ax, "Step time breakdown", run)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncol=2, loc="upper right")
    return fig


def _plot_memory(plt, run: Run, notes: list[str], **_):
    gib = [k for k in MEMORY_GIB if run.has(k)]
    frag = run.has("mem_fragmentation")
    if not gib and not frag:
        notes.append(f"memory.png: no memory fields ({', '.join(MEMORY_GIB)}, mem_fragmentation) in the step records")
        return None
    x = run.step_numbers
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, key in enumerate(gib):
        ax.plot(x, run.values(key), lw=1.2, color=f"C{i}", label=key)
    ax.set_ylabel(f"memory ({unit('mem_allocated_gib')})")
    handles, labels = ax.get_legend_handles_labels()
    if frag:
        twin = ax.twinx()
        twin.plot(x, run.values("mem_fragmentation"), lw=1, ls="--", color="C7",
                  label="mem_fragmentation")
        twin.set_ylabel(label("mem_fragmentation"))
        h2, l2 = twin.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8)
    ax.set_xlabel(label("step"))
    ax.grid(alpha=0.3)
    _title(ax, "Memory", run)
    return fig


def _time_unit(total_s: float) -> tuple[str, float]:
    if total_s >= 3 * 3600:
        return "h", 3600.0
    if total_s >= 3 * 60:
        return "min", 60.0
    return "s", 1.0


def _plot_timeline(plt, run: Run, notes: list[str], **_):
    if not run.has("step_s"):
        notes.append("timeline.png: no step_s, so no wall-time axis")
        return None
    t = wall_time(run)
    name, scale = _time_unit(float(t[-1]))
    missing = int(np.isnan(run.values("step_s")).sum())
    if missing:
        notes.append(f"timeline.png: {missing} step(s) without step_s count as 0 s on the wall-time axis")
    panels = [k for k in ("loss", "step_s") if run.has(k)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.5 + 2.8 * len(panels)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    for ax, key in zip(axes, panels):
        ax.plot(t / scale, run.values(key), lw=1, color="C0", label=key)
        ax.set_ylabel(label(key))
        ax.grid(alpha=0.3)
    ckpt_steps = [c["step"] for c in run.checkpoints]
    ckpt_t = time_at_steps(run, ckpt_steps)
    placed = [(c, tc) for c, tc in zip(run.checkpoints, ckpt_t) if tc is not None]
    if len(placed) < len(run.checkpoints):
        notes.append(f"timeline.png: {len(run.checkpoints) - len(placed)} checkpoint(s) after the last recorded "
                     "step not marked")
    for i, (c, tc) in enumerate(placed):
        for ax in axes:
            ax.axvline(tc / scale, color="green", ls="--", lw=0.9, alpha=0.7,
                       label="checkpoint" if i == 0 and ax is axes[0] else None)
    blocking = [(tc / scale, _number(c.get("blocking_s"))) for c, tc in placed]
    blocking = [(a, b) for a, b in blocking if math.isfinite(b)]
    if blocking and "step_s" in panels:
        axes[-1].plot(*zip(*blocking), "D", color="green", ms=5, label="checkpoint blocking_s (s)")
    changes = membership_changes(run)
    change_t = time_at_steps(run, [s for s, _, _ in changes])
    for i, ((step, before, after), tc) in enumerate(zip(changes, change_t)):
        for ax in axes:
            ax.axvline(tc / scale, color="purple", lw=1.2,
                       label="participants change" if i == 0 and ax is axes[0] else None)
        axes[0].annotate(f"{before:g}->{after:g}", (tc / scale, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(2, -12), textcoords="offset points", color="purple", fontsize=8)
    if not run.checkpoints:
        notes.append("timeline.png: no checkpoints to mark (" +
                     ("checkpoints.jsonl is empty)" if run.checkpoint_log else "no checkpoints.jsonl)"))
    if not run.has("participants"):
        notes.append("timeline.png: no membership changes to mark (participants absent: not an elastic run)")
    for ax in axes:
        ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel(f"wall time inside steps, cumulative step_s ({name})")
    _title(axes[0], "Timeline", run)
    return fig


# ------------------------------------------------------------------ summary
