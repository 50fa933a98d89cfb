"""What the harness sees of a running job: committed step records as they
appear in each group incarnation's ``metrics.jsonl``, with the monotonic
time the harness first saw each step, and new lines of the groups' logs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Commit:
    """Step ``step`` first seen committed at ``t`` (monotonic s) in ``replica_id``'s records."""

    t: float
    step: int
    participants: int
    replica_id: str


class Progress:
    """Incremental reader of every incarnation's step records (the harness's thread)."""

    def __init__(self) -> None:
        self.commits: dict[int, Commit] = {}
        self.records: dict[str, list[dict]] = {}
        self._offsets: dict[str, int] = {}
        #: Every (t, step, participants, replica_id) seen, in order: a step is seen once per group.
        self.seen: list[Commit] = []

    def scan(self, incarnations) -> list[Commit]:
        """Read new complete lines of each incarnation's metrics.jsonl; returns the new sightings."""
        now = time.monotonic()
        new = []
        for inc in incarnations:
            path = Path(inc.output_dir) / "metrics.jsonl"
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(inc.replica_id, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1  # a half-written last line waits for the next scan
            self._offsets[inc.replica_id] = self._offsets.get(inc.replica_id, 0) + end
            for line in chunk[:end].splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "loss" not in r:
                    continue
                self.records.setdefault(inc.replica_id, []).append(r)
                c = Commit(now, r["step"], r.get("participants", 1), inc.replica_id)  # a fixed group has none
                self.commits.setdefault(r["step"], c)
                self.seen.append(c)
                new.append(c)
        return new

    def last_step(self) -> int:
        return max(self.commits, default=0)

    def commits_after(self, t: float) -> list[Commit]:
        return [c for c in self.seen if c.t > t]


class LogTail:
    """New text of a set of log files since :meth:`mark` (for a fault's detection line)."""

    def __init__(self) -> None:
        self._marks: dict[Path, int] = {}

    def mark(self, paths) -> None:
        self._marks = {Path(p): (Path(p).stat().st_size if Path(p).exists() else 0) for p in paths}

    def grep(self, paths, needle: str) -> bool:
        for p in map(Path, paths):
            if not p.exists():
                continue
            with open(p, "rb") as f:
                f.seek(self._marks.get(p, 0))
                if needle.encode() in f.read():
                    return True
        return False
