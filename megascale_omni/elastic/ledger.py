"""Sample ledger: which samples each committed elastic step consumed.

One JSONL file per (replica group, inner DP rank), written by that DP rank's
first-stage process of TP rank 0 and CP rank 0. Two kinds of line::

    {"event": "attempt", "step": s, "quorum": q, "replica": "r1",
     "participant": p, "participants": P, "dp_rank": d, "dp_size": D,
     "samples": [ids...]}
    {"event": "commit", "step": s, "quorum": q, "replica": "r1", "committed": true|false}

An attempt is written *before* its gradients leave the process, so a
replica killed mid-step still has its contribution on record. Step ``s``
counts as committed under quorum ``q`` if any replica wrote a ``commit`` line
with ``committed: true`` for ``(s, q)``; the samples it consumed are the union
of all attempts of ``(s, q)``. :func:`consumed_samples` computes exactly that,
so a test can check each committed step took its global batch exactly once
and that uncommitted attempts count for nothing.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional, Sequence


class SampleLedger:
    """Appends attempt/commit lines (the writing rank only; others get None)."""

    def __init__(self, directory: str, replica_id: str, dp_rank: int):
        os.makedirs(directory, exist_ok=True)
        self.path = Path(directory) / f"ledger-{replica_id}-dp{dp_rank}.jsonl"
        self.replica_id = replica_id
        # Line-buffered: each line reaches the OS before the step's gradients
        # are sent, so SIGKILL cannot lose an attempt that contributed.
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")

    def attempt(
        self, step: int, quorum: int, participant: Optional[int], participants: int,
        dp_rank: Optional[int], dp_size: int, samples: Sequence[int],
    ) -> None:
        self._write({
            "event": "attempt", "step": step, "quorum": quorum, "replica": self.replica_id,
            "participant": participant, "participants": participants, "dp_rank": dp_rank, "dp_size": dp_size,
            "samples": [int(s) for s in samples],
        })

    def commit(self, step: int, quorum: int, committed: bool) -> None:
        self._write({"event": "commit", "step": step, "quorum": quorum, "replica": self.replica_id,
                     "committed": committed})

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


def consumed_samples(records: Iterable[dict]) -> dict[int, list[int]]:
    """Committed step -> sample ids its update consumed (with repeats, in
    participant order), from :func:`read_ledger` records.

    Raises ValueError if a step committed under two different quorums (the
    same update applied twice would be a torchft bug, not a data issue).
    """
    records = list(records)
    committed_quorum: dict[int, int] = {}
    for r in records:
        if r["event"] == "commit" and r["committed"]:
            q = committed_quorum.setdefault(r["step"], r["quorum"])
            if q != r["quorum"]:
                raise ValueError(f"step {r['step']} committed under quorums {q} and {r['quorum']}")
    attempts: dict[tuple[int, int], dict[tuple[str, int], list[int]]] = defaultdict(dict)
    for r in records:
        if r["event"] == "attempt" and r["participant"] is not None:
            # A repeated attempt of the same (step, quorum) by one writer has
            # the same split; keep one.
            attempts[(r["step"], r["quorum"])][(r["replica"], r["dp_rank"])] = r["samples"]
    out = {}
    for step, quorum in sorted(committed_quorum.items()):
        shares = attempts.get((step, quorum), {})
        out[step] = [s for key in sorted(shares, key=lambda k: k[1]) for s in shares[key]]
    return out
