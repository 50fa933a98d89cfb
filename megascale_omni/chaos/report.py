"""The chaos run's numbers: per fault class count, detection and recovery
times, steps lost and seconds stalled; the run's effective-training-time
ratio (ETTR) and where the rest of the wall time went; the printed table and
the JSON result."""

from __future__ import annotations

import statistics
from typing import Optional

from megascale_omni.chaos.checks import qualified_lines
from megascale_omni.chaos.plan import FAULT_CLASSES
from megascale_omni.elastic.ledger import committed_quorums, live_lines


def uncommitted_attempts(ledger: list[dict]) -> dict[int, int]:
    """Ledger step -> number of (step, quorum) attempts whose update did not
    survive: never committed, or committed in a timeline a fall-back to a
    checkpoint rolled back (:func:`~megascale_omni.elastic.ledger.superseded`)."""
    lines = qualified_lines(ledger)
    committed = {(r["step"], r["quorum"]) for r in live_lines(lines) if r["event"] == "commit" and r["committed"]}
    try:  # attempts whose outcome line was lost with their group, committed by inference
        committed |= set(committed_quorums(lines).items())
    except ValueError:  # a step committed twice: ledger_problems reports it
        pass
    attempts = {(r["step"], r["quorum"]) for r in lines if r["event"] == "attempt"}
    out: dict[int, int] = {}
    for step, _ in attempts - committed:
        out[step] = out.get(step, 0) + 1
    return out


def steps_lost(fault: dict, lost: dict[int, int]) -> int:
    """Uncommitted attempts of the steps from the one committed when
    ``fault`` fired through the one that ended its recovery (ledger steps
    are step records minus one): the work the fault threw away."""
    first, last = fault.get("step_fired"), fault.get("step_recovered")
    if first is None:
        return 0
    last = last if last is not None else max(lost, default=first)
    return sum(n for s, n in lost.items() if first - 1 <= s <= last)


def ettr(step_times: list[float], span_s: float) -> tuple[float, float]:
    """(ETTR, the typical step time) of committed steps whose own
    ``step_s`` are ``step_times`` and whose commits span ``span_s`` seconds
    (first commit to last): committed steps times the median ``step_s``
    (what the committed work costs without faults, at this run's load) over
    the wall time from the first step's start (one typical step before its
    commit) to the last commit. Stalls, retried attempts, waits for quorums
    and heals are what makes it less than 1."""
    if not step_times:
        return 0.0, 0.0
    typical = statistics.median(step_times)
    return min(len(step_times) * typical / (span_s + typical), 1.0), typical


def stalls(commit_times: list[float], typical: float, windows: list[tuple[int, float, float]],
           min_stall_s: float = 2.0) -> tuple[dict[int, float], float]:
    """Where the wall time without commits went. ``commit_times``: when
    each committed step was first seen (monotonic s, ascending);
    ``windows``: ``(fault index, fired, settled)`` on the same clock. A gap
    between two commits longer than ``max(min_stall_s, 5 x typical)`` is a
    stall: the gap less one typical step is lost, split evenly among the
    faults whose window overlaps it. Returns (fault index -> seconds
    stalled, seconds stalled with no fault active)."""
    by_fault: dict[int, float] = {}
    unclaimed = 0.0
    threshold = max(min_stall_s, 5 * typical)
    for a, b in zip(commit_times, commit_times[1:]):
        if b - a <= threshold:
            continue
        lost = b - a - typical
        active = [i for i, fired, settled in windows if fired < b and settled > a]
        if not active:
            unclaimed += lost
        for i in active:
            by_fault[i] = by_fault.get(i, 0.0) + lost / len(active)
    return by_fault, unclaimed


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def class_table(faults: list[dict], skipped: dict[str, str]) -> list[dict]:
    """One row per fault class: count, recovered count, detection and
    recovery seconds (mean and max over its faults), steps lost; skipped
    classes with their reason."""
    rows = []
    for name in FAULT_CLASSES:
        mine = [f for f in faults if f["kind"] == name]
        if not mine:
            if name in skipped:
                rows.append({"class": name, "count": 0, "skipped": skipped[name]})
            continue
        det = [f["detected_s"] for f in mine if f["detected_s"] is not None]
        rec = [f["recovered_s"] for f in mine if f["recovered_s"] is not None]
        rows.append({
            "class": name, "count": len(mine), "recovered": len(rec),
            "detect_mean_s": statistics.mean(det) if det else None, "detect_max_s": max(det, default=None),
            "recover_mean_s": statistics.mean(rec) if rec else None, "recover_max_s": max(rec, default=None),
            "steps_lost": sum(f["steps_lost"] for f in mine),
            "stalled_s": sum(f.get("stalled_s", 0.0) for f in mine),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    """The per-class table as Markdown (printed, and pasted into BENCHMARKS.md)."""
    lines = ["| fault class | count | recovered | detection s (mean / max) | recovery s (mean / max) | steps lost "
             "| stalled s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["count"] == 0:
            lines.append(f"| {r['class']} | 0 | skipped: {r['skipped']} | | | | |")
            continue
        lines.append(f"| {r['class']} | {r['count']} | {r['recovered']} | {_fmt(r['detect_mean_s'])} / "
                     f"{_fmt(r['detect_max_s'])} | {_fmt(r['recover_mean_s'])} / {_fmt(r['recover_max_s'])} | "
                     f"{r['steps_lost']} | {r.get('stalled_s', 0.0):.1f} |")
    return "\n".join(lines)
