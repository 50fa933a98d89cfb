"""The proofs at the end of a chaos run (pure functions of what the run
left on disk, so each can be tested with a planted failure).

* :func:`merge_step_records`: the groups' committed step records agree
  (groups of one quorum report the same loss) and the steps run 1..last.
* :func:`loss_mismatches`: every committed step's loss equals the
  fault-free reference run's within a relative tolerance.
* :func:`ledger_problems`: every committed step consumed exactly the
  samples the reference consumed at that step: none lost, none repeated.
* :func:`checkpoint_problems`: every complete checkpoint left behind
  verifies (sizes and sha256 against its commit marker, as
  ``tools/ckpt.py verify``).
* :func:`intervention_problems`: the run's action log holds nothing but the
  planned faults and the supervisor's restarts.

Quorum ids start over with each lighthouse incarnation (epoch), so quorums
are compared as ``(epoch, quorum)``. A line's or record's epoch is the
lighthouse incarnation that answered its quorum: :func:`with_epochs` finds
it from its ``quorum_t`` (wall time of the answer) and the lighthouse start
times; lines of ledgers written before ``quorum_t`` existed keep the
``epoch`` their reader gave them (default 0). Groups ride a lighthouse
restart out and train on (docs/operations.md). When every group is lost at
once (survivors torn down while a peer hangs, or a lighthouse down longer
than ``elastic.quorum_timeout_s``), the job falls back to its newest
checkpoint and trains the steps after it again, under the same lighthouse
or the next: the ledger's replay rule
(:func:`megascale_omni.elastic.ledger.superseded`) drops the lost
timeline's lines and step records, and :func:`rolled_back_steps` counts
the steps redone.
Leftover processes: :func:`megascale_omni.chaos.supervisor.processes_of_run`.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from pathlib import Path
from typing import Iterable

from megascale_omni.elastic.ledger import consumed_samples, superseded

#: Actions a run may log without anyone intervening: the supervisor's and the fault plan's.
ALLOWED_ACTIONS = frozenset({"start lighthouse", "lighthouse exited", "start group", "group exited",
                             "join standby", "fault", "fault over", "stop", "start scheduler", "scheduler exited"})


def epoch_at(t: float, lighthouse_starts: list[float]) -> int:
    """The lighthouse incarnation (0, 1, ...) running at wall time ``t``,
    given each incarnation's start (``time.time()``, ascending)."""
    return max(bisect.bisect_right(lighthouse_starts, t) - 1, 0)


def with_epochs(records: Iterable[dict], lighthouse_starts: list[float]) -> list[dict]:
    """``records`` (ledger lines or step records), each with ``epoch`` set
    from its own ``quorum_t`` (:func:`epoch_at`); one without ``quorum_t``
    (a fixed group's, or written before it existed) keeps its ``epoch``.
    Per line, not per group: one group process trains on across a lighthouse
    restart, and a group started before a restart gets its quorums from the
    restarted lighthouse."""
    return [{**r, "epoch": epoch_at(r["quorum_t"], lighthouse_starts)} if r.get("quorum_t") is not None else r
            for r in records]


def _quorum(r: dict) -> tuple[int, int]:
    """A line's or record's quorum, qualified by its lighthouse epoch (records of a fixed group have none: 0)."""
    return r.get("epoch", 0), r.get("quorum", 0)


def _record_points(records: list[dict]) -> list[tuple[int, tuple]]:
    """Replay points of step records: a participating (not healing) record
    of step ``s`` (steps committed after it) under ``q0`` proves the job had
    committed ``s - 1`` steps at ``q0``: the point ``(s - 1, q0)`` in ledger
    numbering (:func:`~megascale_omni.elastic.ledger.superseded`)."""
    first: dict[tuple, int] = {}
    for r in records:
        if not r.get("healed", False):
            q = _quorum(r)
            first[q] = min(first.get(q, r["step"] - 1), r["step"] - 1)
    return [(s, q) for q, s in first.items()]


def _replayed(records: list[dict]) -> list[bool]:
    """For each step record, whether a replay superseded it."""
    points = _record_points(records)
    return [superseded(points, r["step"] - 1, _quorum(r)) for r in records]


def rolled_back_steps(records: Iterable[dict]) -> int:
    """Steps committed in a timeline that a fall-back to a checkpoint rolled back (and so redone)."""
    records = list(records)
    return len({r["step"] for r, gone in zip(records, _replayed(records)) if gone})


def merge_step_records(groups: Iterable[list[dict]]) -> tuple[dict[int, dict], list[str]]:
    """Step -> first record seen of it in the surviving timeline (records a
    replay superseded dropped), over every group incarnation's committed
    step records; problems: two groups disagreeing on one step's loss
    (relative 1e-12: one quorum reduces one loss), a gap in 1..last, a
    non-finite loss."""
    everything = [r for records in groups for r in records]
    merged: dict[int, dict] = {}
    problems = []
    for r, gone in zip(everything, _replayed(everything)):
        if gone:
            continue
        seen = merged.setdefault(r["step"], r)
        if not math.isclose(r["loss"], seen["loss"], rel_tol=1e-12):
            problems.append(f"step {r['step']}: groups report losses {seen['loss']!r} and {r['loss']!r}")
    if merged and sorted(merged) != list(range(1, max(merged) + 1)):
        missing = sorted(set(range(1, max(merged) + 1)) - set(merged))
        problems.append(f"committed steps have gaps: missing {missing[:20]}")
    problems += [f"step {s}: loss {r['loss']!r} is not finite" for s, r in merged.items() if not math.isfinite(r["loss"])]
    return merged, problems


def loss_mismatches(merged: dict[int, dict], reference: dict[int, float], rtol: float) -> list[str]:
    """One line per committed step whose loss differs from ``reference``
    (step -> loss of the fault-free run) by more than ``rtol`` relative, or
    that the reference lacks."""
    out = []
    for step in sorted(merged):
        if step not in reference:
            out.append(f"step {step}: not in the reference run")
            continue
        ref, got = reference[step], merged[step]["loss"]
        rel = abs(got - ref) / abs(ref) if ref else abs(got)
        if not rel <= rtol:
            out.append(f"step {step}: loss {got!r} vs reference {ref!r} (relative {rel:.1e} > {rtol:.0e})")
    return out


def loss_difference_profile(merged: dict[int, dict], reference: dict[int, float],
                            span: int = 250) -> list[tuple[int, int, float]]:
    """``(first step, last step, worst relative loss difference)`` per
    ``span`` committed steps: fp32 summation-order noise grows smoothly
    through Adam over a long run, while a lost, repeated or foreign sample
    moves one step's loss by 1e-2 or more (see ``run.RTOL``)."""
    out = []
    steps = sorted(s for s in merged if s in reference and reference[s])
    for i in range(0, len(steps), span):
        chunk = steps[i:i + span]
        worst = max(abs(merged[s]["loss"] - reference[s]) / abs(reference[s]) for s in chunk)
        out.append((chunk[0], chunk[-1], worst))
    return out


def worst_loss_difference(merged: dict[int, dict], reference: dict[int, float]) -> float:
    """Largest relative loss difference over the steps both runs have (0.0 if none)."""
    diffs = [abs(merged[s]["loss"] - reference[s]) / abs(reference[s]) for s in merged if s in reference and reference[s]]
    return max(diffs, default=0.0)


def qualified_lines(ledger: list[dict]) -> list[dict]:
    """The ledger lines with ``quorum`` made ``(epoch, quorum)``: quorum ids
    start over with each lighthouse epoch, and the tuples order as the
    ledger's rules need (a later epoch's quorums after every earlier one's;
    :mod:`megascale_omni.elastic.ledger`)."""
    return [{**r, "quorum": _quorum(r)} for r in ledger]


def ledger_problems(chaos: list[dict], reference: list[dict], last_step: int) -> list[str]:
    """Exactly-once: ledger lines (:func:`~megascale_omni.elastic.ledger.read_ledger`)
    of the chaos run against the reference run's, over ledger steps
    ``0 .. last_step - 1`` (step record ``s`` is ledger step ``s - 1``).
    Names each committed step whose consumed samples lack one of the
    reference's (lost) or hold one more often (repeated), a step committed
    twice in one timeline, and a step missing from either ledger. Lines a
    replay superseded do not count (:func:`~megascale_omni.elastic.ledger.superseded`)."""
    chaos = qualified_lines(chaos)
    try:
        got = consumed_samples(chaos)
    except ValueError as exc:  # one step's update applied twice
        return [f"chaos ledger: {exc}"]
    want = consumed_samples(reference)
    out = []
    for step in range(last_step):
        if step not in want:
            out.append(f"ledger step {step}: not committed in the reference ledger")
            continue
        if step not in got:
            out.append(f"ledger step {step}: no committed consumption in the chaos ledger (its samples lost)")
            continue
        g, w = Counter(got[step]), Counter(want[step])
        lost = sorted((w - g).elements())
        repeated = sorted((g - w).elements())
        if lost:
            out.append(f"ledger step {step}: samples lost {lost[:10]}")
        if repeated:
            out.append(f"ledger step {step}: samples repeated or foreign {repeated[:10]}")
    beyond = sorted(s for s in got if s >= last_step)
    if beyond:
        out.append(f"ledger steps {beyond[:10]} committed but past the last step record {last_step}")
    return out


def checkpoint_problems(tier: Path, checksums: bool = True) -> tuple[int, list[str]]:
    """(complete checkpoints found, one line per one that does not verify
    or whose commit marker cannot be read) under checkpoint tier ``tier``.
    Unfinished saves (no commit marker) are not checkpoints: a resume skips
    them and ``tools/ckpt.py clean`` removes them."""
    from megascale_omni.checkpoint import layout

    if not tier.is_dir():
        return 0, []
    infos = layout.scan_tier(tier, str(tier))
    out = [f"{c.path}: {problem}" for c in infos if (problem := layout.commit_problem(c.path))]
    complete = [c for c in infos if c.complete and not layout.commit_problem(c.path)]
    for c in complete:
        problems = layout.verify(c, checksums=checksums)
        if problems:
            out.append(f"{c.path}: BROKEN: {'; '.join(problems)}")
    return len(complete), out


def intervention_problems(actions: list[dict]) -> list[str]:
    """Actions in the run's log other than :data:`ALLOWED_ACTIONS`."""
    return [f"unplanned action: {a}" for a in actions if a.get("action") not in ALLOWED_ACTIONS]
