"""The fault-free reference of a chaos run, re-anchored on the job's own
checkpoints so that each comparison spans a bounded number of steps
(docs/operations.md, "The reference").

fp32 summation order differs between membership layouts (a step summed over
two groups adds the same per-sample gradients in another order than one
group), and Adam carries that 1e-7-per-step difference forward: against one
uninterrupted reference the loss drifted past 1e-4 after ~650 steps of a
soak. So the harness copies a complete checkpoint of the job every
``anchor_every`` steps (as it appears, off the size-limited checkpoint
tmpfs, to ``<run dir>/anchors``) and the reference is a chain of
**segments**: from scratch to the first anchor, then from each anchor (one
fixed group resumed from it) to the next, the last one to the job's last
step. Each committed step is compared with the segment that covers it only,
so no comparison spans more than ``anchor_every`` plus one checkpoint
interval of steps, whatever the run's length.

Segments run one at a time at ``nice 19``, during the run as soon as both
ends are known (they take the CPU the job leaves idle: quorum waits, heals,
start-ups), the last one after the fault window.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megascale_omni.elastic.ledger import read_ledger
from megascale_omni.utils.processes import kill_process_tree


@dataclass(frozen=True)
class Segment:
    """Reference steps ``start + 1 .. end`` (step records), resumed from the anchor at ``start`` (0: from
    scratch). Ledger steps are one less: ``start .. end - 1``."""

    start: int
    end: int

    def covers(self, step: int) -> bool:
        return self.start < step <= self.end


def segments(anchors: list[int], last: int) -> list[Segment]:
    """The chain of segments covering steps ``1 .. last`` (pure): scratch to the
    first anchor, anchor to anchor, the last anchor to ``last``. Anchors
    outside ``(0, last)`` and repeats are ignored; ``last <= 0`` gives none."""
    if last <= 0:
        return []
    points = [0, *sorted({a for a in anchors if 0 < a < last}), last]
    return [Segment(a, b) for a, b in zip(points, points[1:])]


def anchor_due(step: int, anchors: list[int], every: int) -> bool:
    """Whether a complete checkpoint of ``step`` becomes the next anchor: ``every`` steps past the last one."""
    return every > 0 and step >= (max(anchors) if anchors else 0) + every


def step_losses(metrics: Path, seg: Segment) -> dict[int, float]:
    """Step -> loss of the records in ``metrics`` (a metrics.jsonl) that ``seg`` covers."""
    out = {}
    try:
        text = metrics.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r and seg.covers(r["step"]):
            out.setdefault(r["step"], r["loss"])
    return out


@dataclass
class _Running:
    seg: Segment
    proc: subprocess.Popen
    out: Path
    open_end: bool  # started before its end was known


@dataclass
class ReferenceRuns:
    """The segments of one run. ``argv(seg, out, anchor)`` is the command of a
    segment (``anchor``: the checkpoint to resume, None from scratch;
    output to ``out``), with the job's ``train.steps``: the step count is
    part of the sample plan, so a segment is stopped once past its end
    rather than told where to stop; ``spawn(argv, log)`` starts it (the run's marker).
    Driven by the harness's thread: :meth:`tick` while the job runs,
    :meth:`finish` at the end."""

    run_dir: Path
    argv: Callable[[Segment, Path, Optional[Path]], list[str]]
    spawn: Callable[[list[str], Path], subprocess.Popen]
    anchor_every: int = 500
    segment_timeout_s: float = 900.0
    anchors: list[int] = field(default_factory=list)
    done: dict[Segment, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    running: Optional[_Running] = None

    def __post_init__(self) -> None:
        self.anchor_dir = self.run_dir / "anchors"
        self.anchor_dir.mkdir(parents=True, exist_ok=True)

    # --------------------------------------------------------------- anchors
    def copy_anchor(self, ckpt_dir: Path) -> Optional[int]:
        """Copy the job's newest complete checkpoint if it is due as an anchor; its step, or None."""
        from megascale_omni.checkpoint import layout

        complete = [c for c in layout.scan_tier(ckpt_dir, str(ckpt_dir)) if c.complete] if ckpt_dir.is_dir() else []
        if not complete:
            return None
        newest = max(complete, key=lambda c: c.step)
        if not anchor_due(newest.step, self.anchors, self.anchor_every):
            return None
        dest = self.anchor_dir / Path(newest.path).name
        tmp = dest.with_name(dest.name + ".copying")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(newest.path, tmp)
            tmp.rename(dest)
        except OSError:  # pruned by the job while copied: the next one will do
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        info = layout.step_info(dest)
        if info is None or layout.verify(info, True):
            shutil.rmtree(dest, ignore_errors=True)
            return None
        self.anchors.append(newest.step)
        return newest.step

    # -------------------------------------------------------------- segments
    def _start(self, seg: Segment, open_end: bool) -> None:
        out = self.run_dir / "reference" / f"seg-{seg.start:08d}"
        out.mkdir(parents=True, exist_ok=True)
        anchor = self.anchor_dir / f"step_{seg.start:08d}" if seg.start else None
        self.running = _Running(seg, self.spawn(self.argv(seg, out, anchor), out.with_suffix(".log")), out, open_end)
        self.started_at = time.monotonic()

    def _last_step(self) -> int:
        steps = step_losses(self.running.out / "metrics.jsonl", Segment(0, 1 << 60))
        return max(steps, default=0)

    def _advance(self, last: Optional[int]) -> None:
        """Settle the running segment (its end known and reached, or it exited) and start the next one whose
        ends are known (with ``last``: the tail too)."""
        if self.running is not None:
            r = self.running
            if r.open_end and self.anchors and self.anchors[0] > r.seg.start:
                r.seg = Segment(r.seg.start, min(a for a in self.anchors if a > r.seg.start))
                r.open_end = False
            if r.open_end and last is not None:
                r.seg, r.open_end = Segment(r.seg.start, last), False
            # One step past its end: the ledger's commit line of step ``end`` is written before that record.
            reached = not r.open_end and self._last_step() > r.seg.end
            exited = r.proc.poll() is not None
            overdue = time.monotonic() - self.started_at > self.segment_timeout_s and last is not None
            if reached or exited or overdue:
                kill_process_tree(r.proc)
                if not reached and not self._last_step() >= r.seg.end:
                    self.problems.append(f"reference segment {r.seg.start}-{r.seg.end} ended at step "
                                         f"{self._last_step()} (exit {r.proc.returncode}); see {r.out}.log")
                self.done[r.seg] = r.out
                self.running = None
        if self.running is None:
            chain = segments(self.anchors, last) if last is not None else \
                [s for s in segments(self.anchors, (max(self.anchors) if self.anchors else 0) + 1)][:-1]
            todo = [s for s in chain if not any(d.start == s.start for d in self.done)]
            if todo:
                self._start(todo[0], open_end=False)
            elif not self.done and last is None:
                self._start(Segment(0, 1 << 60), open_end=True)  # from scratch, its end not known yet

    def tick(self, ckpt_dir: Path, every_s: float = 2.0) -> None:
        """While the job runs (at most every ``every_s``): copy a due anchor, settle and start segments."""
        if time.monotonic() < getattr(self, "_next_tick", 0.0):
            return
        self._next_tick = time.monotonic() + every_s
        self.copy_anchor(ckpt_dir)
        self._advance(None)

    def finish(self, last: int, deadline_s: float = 1800.0) -> tuple[dict[int, float], list[dict]]:
        """Run what is left of the chain up to ``last``; (step -> reference loss, reference ledger lines),
        each step from the one segment that covers it. Failures go to :attr:`problems`."""
        self.anchors = [a for a in self.anchors if a < last]
        deadline = time.monotonic() + deadline_s
        self.started_at = time.monotonic()  # a segment's own time limit counts from now at the earliest
        while time.monotonic() < deadline:
            self._advance(last)
            if self.running is None and all(any(d.start == s.start for d in self.done)
                                            for s in segments(self.anchors, last)):
                break
            time.sleep(0.5)
        self.close()
        losses: dict[int, float] = {}
        ledger: list[dict] = []
        for seg in segments(self.anchors, last):
            out = next((o for d, o in self.done.items() if d.start == seg.start), None)
            if out is None:
                self.problems.append(f"reference segment {seg.start}-{seg.end} did not run")
                continue
            losses.update(step_losses(out / "metrics.jsonl", seg))
            ledger += [r for r in read_ledger(out / "ledger") if seg.start <= r["step"] < seg.end]
        return losses, ledger

    def close(self) -> None:
        if self.running is not None:
            kill_process_tree(self.running.proc)
            self.done.setdefault(self.running.seg, self.running.out)
            self.running = None
