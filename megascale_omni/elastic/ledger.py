"""Sample ledger: which samples each committed elastic step consumed.

One JSONL file per (replica group, inner DP rank), written by that DP rank's
first-stage process of TP rank 0 and CP rank 0. Two kinds of line::

    {"event": "attempt", "step": s, "quorum": q, "replica": "r1",
     "participant": p, "participants": P, "dp_rank": d, "dp_size": D,
     "samples": [ids...], "t": T, "quorum_t": Tq}
    {"event": "commit", "step": s, "quorum": q, "replica": "r1", "dp_rank": i, "committed": true|false,
     "t": T, "quorum_t": Tq}

(``dp_rank`` of a commit line is the writer's inner DP rank, which names its
file; that of an attempt is its DP rank over all participants. ``t`` is the
wall time the line was written, ``quorum_t`` the wall time the lighthouse's
answer with quorum ``q`` arrived, both ``time.time()`` seconds; a fixed
group's lines have no ``quorum_t``, ledgers written before 2026-12-02 have
neither: readers default them.)

Order and durability (elastic groups, :mod:`.service`): the attempt line of
step ``s`` is written as soon as the step's quorum ``q`` is known, before the
first cross-replica collective of the step, and is flushed and fsynced
before the call returns; the commit line follows the commit decision
(flushed, not fsynced). So a group killed at any point after its gradients
entered the cross-replica sum has its share on record, also if its node
went down (fsync); a missing commit line is what readers infer (below). A
fixed group (no cross-replica sum) writes both lines after its step.

Committed, precisely (:func:`consumed_samples`): step ``s`` committed under
quorum ``q`` if

1. some replica wrote ``commit`` with ``committed: true`` for ``(s, q)``
   (torchft's commit is a vote of all participants: one line speaks for the
   quorum); or
2. no replica wrote ``committed: true`` for step ``s`` under any quorum,
   some line of a later step ``s' > s`` exists (the step a group attempts
   is its committed-step count, so step ``s`` committed somewhere), and
   ``q`` is the greatest quorum id among the quorums of step ``s`` with an
   attempt left without outcome: some writer has more attempt lines than
   commit lines for ``(s, q)`` (it was killed before writing the outcome;
   a step retried in an unchanged quorum, whose id torchft keeps, writes
   one attempt line per try). Quorum ids of one lighthouse increase with
   each new quorum, so the greatest is the latest try, the one whose
   update survived.

Otherwise step ``s`` did not commit (an attempt without outcome and
without later steps is the last, interrupted step of the ledger). The
samples step ``s`` consumed are the union of all attempts of ``(s, q)``.

Replays, precisely (:func:`superseded`, applied before the rules above):
when every replica group is lost at once, the job falls back to its newest
checkpoint, step ``S``, and runs steps ``S, S+1, ...`` again; lines of the
lost timeline, committed or not, are then superseded. The rule needs no
extra line: a *participating* attempt (``participant`` not None) of step
``S`` under quorum ``q0`` proves that at ``q0`` the job had committed
exactly ``S`` steps, because a quorum agrees on one step and a group behind
it heals forward before it participates. So every line of a step ``s >=
S`` under a quorum ``q < q0`` belongs to a timeline that was rolled back:
superseded, whatever its outcome. In normal operation nothing is
superseded (a step committed under ``q`` is followed only by attempts of
later steps under quorums ``>= q``); a step retried after a failed attempt
supersedes that attempt, which did not commit. The rule assumes torchft's
quorum is never split (two live timelines, e.g. a group cut off from the
lighthouse that keeps stepping alone, are not told apart).
Quorum ids start over when the lighthouse restarts (the groups ride the
restart out and train on, :mod:`.membership`); torchft 0.2.0 shows a
manager no incarnation of its lighthouse (``QuorumResult`` has none), so a
reader that spans lighthouse restarts qualifies ``quorum`` itself with the
lighthouse epoch each line's ``quorum_t`` falls in, as ``(epoch, quorum)``
tuples (:func:`megascale_omni.chaos.checks.with_epochs`).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence


def _times(quorum_t: Optional[float]) -> dict:
    """A line's wall times: now, and when its quorum was answered (if it has one)."""
    return {"t": time.time()} if quorum_t is None else {"t": time.time(), "quorum_t": quorum_t}


class SampleLedger:
    """Appends attempt/commit lines (the writing rank only; others get None)."""

    def __init__(self, directory: str, replica_id: str, dp_rank: int):
        os.makedirs(directory, exist_ok=True)
        self.path = Path(directory) / f"ledger-{replica_id}-dp{dp_rank}.jsonl"
        self.replica_id = replica_id
        self.dp_rank = dp_rank
        # Line-buffered: each line reaches the OS when written, so SIGKILL
        # of this process cannot lose a line written before it.
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")

    def attempt(
        self, step: int, quorum: int, participant: Optional[int], participants: int,
        dp_rank: Optional[int], dp_size: int, samples: Sequence[int], quorum_t: Optional[float] = None,
    ) -> None:
        """Record an attempt; returns once the line is on disk (fsync).

        fsync, once per step and writer: the attempt is the line readers
        cannot infer, and SIGKILL is not the only fault (a node that goes
        down loses what is only in its page cache). One fsync of a short
        append per step costs far less than a training step."""
        self._write({
            "event": "attempt", "step": step, "quorum": quorum, "replica": self.replica_id,
            "participant": participant, "participants": participants, "dp_rank": dp_rank, "dp_size": dp_size,
            "samples": [int(s) for s in samples], **_times(quorum_t),
        })
        os.fsync(self._file.fileno())

    def commit(self, step: int, quorum: int, committed: bool, quorum_t: Optional[float] = None) -> None:
        """Record the outcome of ``(step, quorum)`` (flushed; a lost one is inferred)."""
        self._write({"event": "commit", "step": step, "quorum": quorum, "replica": self.replica_id,
                     "dp_rank": self.dp_rank, "committed": committed, **_times(quorum_t)})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_ledger(directory: str | Path) -> list[dict]:
    """Every line of every ledger file under ``directory`` (a torn last line
    of a killed writer is skipped)."""
    records = []
    for path in sorted(Path(directory).glob("ledger-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def superseded(points: Iterable[tuple[int, Any]], step: int, quorum: Any) -> bool:
    """Whether a line of ``step`` under ``quorum`` is superseded by a replay:
    some ``(S, q0)`` of ``points`` (participating attempts: step, quorum) has
    ``S <= step`` and ``q0 > quorum`` (module docstring, "Replays")."""
    return any(s <= step and q0 > quorum for s, q0 in points)


def replay_points(records: Iterable[dict]) -> list[tuple[int, Any]]:
    """(step, quorum) of each participating attempt, the earliest step per
    quorum: what :func:`superseded` compares with."""
    first: dict[Any, int] = {}
    for r in records:
        if r["event"] == "attempt" and r["participant"] is not None:
            first[r["quorum"]] = min(first.get(r["quorum"], r["step"]), r["step"])
    return [(s, q) for q, s in first.items()]


def live_lines(records: Iterable[dict]) -> list[dict]:
    """``records`` without the lines a replay superseded (:func:`superseded`)."""
    records = list(records)
    points = replay_points(records)
    return [r for r in records if not superseded(points, r["step"], r["quorum"])]


def committed_quorums(records: Iterable[dict]) -> dict[int, Any]:
    """Committed step -> the quorum it committed under, by the module
    docstring's rules (replayed lines superseded; recorded outcome, else
    inferred from later steps).

    Raises ValueError if a step committed under two different quorums of
    one timeline (the same update applied twice would be a torchft bug, not
    a data issue).
    """
    records = live_lines(records)
    out: dict[int, Any] = {}
    # (step, quorum, replica, writer's inner DP rank) -> attempt lines minus outcome lines.
    open_tries: Counter = Counter()
    for r in records:
        if r["event"] == "commit":
            open_tries[(r["step"], r["quorum"], r["replica"], r.get("dp_rank"))] -= 1
            if r["committed"]:
                q = out.setdefault(r["step"], r["quorum"])
                if q != r["quorum"]:
                    raise ValueError(f"step {r['step']} committed under quorums {q} and {r['quorum']}")
        elif r["participant"] is not None:
            inner = None if r["dp_rank"] is None else r["dp_rank"] % (r["dp_size"] // r["participants"])
            open_tries[(r["step"], r["quorum"], r["replica"], inner)] += 1
    last_step = max((r["step"] for r in records), default=-1)
    unresolved: dict[int, set] = defaultdict(set)
    for (step, quorum, _, _), n in open_tries.items():
        if n > 0 and step not in out and step < last_step:
            unresolved[step].add(quorum)
    for step, quorums in unresolved.items():
        out[step] = max(quorums)
    return out


def consumed_samples(records: Iterable[dict]) -> dict[int, list[int]]:
    """Committed step -> sample ids its update consumed (with repeats, in
    participant order), from :func:`read_ledger` records; committed as
    :func:`committed_quorums` decides (raises its ValueError)."""
    records = live_lines(records)
    attempts: dict[tuple[int, Any], dict[tuple[str, int], list[int]]] = defaultdict(dict)
    for r in records:
        if r["event"] == "attempt" and r["participant"] is not None:
            # A repeated attempt of the same (step, quorum) by one writer has
            # the same split; keep one.
            attempts[(r["step"], r["quorum"])][(r["replica"], r["dp_rank"])] = r["samples"]
    out = {}
    for step, quorum in sorted(committed_quorums(records).items()):
        shares = attempts.get((step, quorum), {})
        out[step] = [s for key in sorted(shares, key=lambda k: k[1]) for s in shares[key]]
    return out
