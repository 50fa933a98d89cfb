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

Records and ledger lines may carry an ``epoch`` (default 0): the lighthouse
incarnation their group trained under. When every group is lost at once (a
lighthouse kill ends every group's quorum request on torchft 0.2.0), the
job falls back to its newest checkpoint and trains the steps after it again
under the next epoch, whose quorum ids start over: for each step only its
latest epoch counts, and :func:`rolled_back_steps` counts the steps redone.
Leftover processes: :func:`megascale_omni.chaos.supervisor.processes_of_run`.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Iterable

from megascale_omni.elastic.ledger import consumed_samples

#: Actions a run may log without anyone intervening: the supervisor's and the fault plan's.
ALLOWED_ACTIONS = frozenset({"start lighthouse", "lighthouse exited", "start group", "group exited",
                             "join standby", "fault", "fault over", "stop"})


def _latest_epoch(items: Iterable[dict], committed) -> dict[int, int]:
    """Step -> the latest epoch in which ``committed(item)`` items have it."""
    out: dict[int, int] = {}
    for r in items:
        if committed(r):
            out[r["step"]] = max(out.get(r["step"], 0), r.get("epoch", 0))
    return out


def rolled_back_steps(records: Iterable[dict]) -> int:
    """Steps committed in more than one epoch (redone after a fall-back to a checkpoint)."""
    epochs: dict[int, set[int]] = {}
    for r in records:
        epochs.setdefault(r["step"], set()).add(r.get("epoch", 0))
    return sum(len(e) > 1 for e in epochs.values())


def merge_step_records(groups: Iterable[list[dict]]) -> tuple[dict[int, dict], list[str]]:
    """Step -> first record seen of it in its latest epoch, over every group
    incarnation's committed step records; problems: two groups disagreeing
    on one step's loss in one epoch (relative 1e-12: one quorum reduces one
    loss), a gap in 1..last, a non-finite loss."""
    everything = [r for records in groups for r in records]
    latest = _latest_epoch(everything, lambda r: True)
    merged: dict[int, dict] = {}
    problems = []
    for r in everything:
        if r.get("epoch", 0) != latest[r["step"]]:
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


def worst_loss_difference(merged: dict[int, dict], reference: dict[int, float]) -> float:
    """Largest relative loss difference over the steps both runs have (0.0 if none)."""
    diffs = [abs(merged[s]["loss"] - reference[s]) / abs(reference[s]) for s in merged if s in reference and reference[s]]
    return max(diffs, default=0.0)


def latest_epoch_lines(ledger: list[dict]) -> list[dict]:
    """The ledger lines of each step's latest epoch with a committed line
    (all of a step's lines when none has one), their ``quorum`` made
    ``(epoch, quorum)``: quorum ids start over with each lighthouse epoch,
    and the tuples order as the ledger's inference needs (later epoch first,
    then greater id; :mod:`megascale_omni.elastic.ledger`)."""
    latest = _latest_epoch(ledger, lambda r: r["event"] == "commit" and r["committed"])
    return [{**r, "quorum": (r.get("epoch", 0), r["quorum"])} for r in ledger
            if r.get("epoch", 0) == latest.get(r["step"], r.get("epoch", 0))]


def ledger_problems(chaos: list[dict], reference: list[dict], last_step: int) -> list[str]:
    """Exactly-once: ledger lines (:func:`~megascale_omni.elastic.ledger.read_ledger`)
    of the chaos run against the reference run's, over ledger steps
    ``0 .. last_step - 1`` (step record ``s`` is ledger step ``s - 1``).
    Names each committed step whose consumed samples lack one of the
    reference's (lost) or hold one more often (repeated), a step committed
    twice in one epoch, and a step missing from either ledger."""
    chaos = latest_epoch_lines(chaos)
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
