"""A rank's heartbeat: which step and phase its training thread is in, since when.

The training thread writes it (:meth:`Heartbeat.enter` at the loop's own
seams, and the step's phase clock through the listener methods, see
:meth:`megascale_omni.metrics.clock.PhaseClock.listen`); the watchdog
thread reads it. A write is one tuple assignment (atomic under the GIL),
so the training thread pays a few hundred nanoseconds per phase change and
never blocks on the watchdog. What is published to the peers is a
:class:`Beat`, built by the watchdog thread from :meth:`Heartbeat.read`.

Phases (the names in the log lines and docs/hang-detection.md):

=========================== =============================================== ==============================
phase                       where                                           limit
=========================== =============================================== ==============================
``quorum``                  elastic quorum and heal before the step         ``step_timeout_s`` (torchft's
                                                                            ``elastic.quorum_timeout_s``)
``data-start``              this process's first micro-batches (its data-   ``step_timeout_s``
                            loader workers start: no hang)
``data-wait``               this rank's micro-batches                       ``data_wait_timeout_s``
``forward-backward``        compute inside megatron's schedule              ``step_timeout_s``
``pipeline-wait``           a pipeline send/receive                         ``collective_timeout_s``
``grad-sync``               DP gradient reduction (elastic: the per-bucket  ``collective_timeout_s``
                            cross-replica sums too)
``cross-replica-allreduce`` elastic loss sums and the commit vote           ``collective_timeout_s``
``optimizer``               clip and optimizer step                         ``step_timeout_s``
``step-boundary``           record, metrics exchange, control commands      ``step_timeout_s``
``checkpoint``              the checkpointer at the boundary, final save    ``step_timeout_s``
``evaluation``              evaluation between steps                        ``step_timeout_s``
``paused``                  held by ``omni-ctl pause`` (published only)     none
``exited``                  the loop is over (published only)               none
=========================== =============================================== ==============================

``step_timeout_s`` also applies in every phase but ``paused`` and
``exited``: no step ended (committed or not) for that long.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

#: Phases in which a rank waits for its peers (a collective).
WAITING = frozenset({"pipeline-wait", "grad-sync", "cross-replica-allreduce"})
#: Phases without any limit.
UNLIMITED = frozenset({"paused", "exited"})
#: Phase -> the watchdog setting that limits the time spent in it (beyond ``step_timeout_s``).
PHASE_LIMIT = {"data-wait": "data_wait_timeout_s", **{p: "collective_timeout_s" for p in WAITING}}

#: The phase clock's timed phases (metrics/clock.py PHASE_NAMES) -> heartbeat phase.
_CLOCK_PHASES = {"pipeline_wait": "pipeline-wait", "grad_sync": "grad-sync", "cross_replica": "cross-replica-allreduce"}
#: The phase clock's marks -> the phase that follows the span they end.
_CLOCK_MARKS = {"fwd_bwd": "optimizer", "optimizer": "step-boundary"}


class Heartbeat:
    """This rank's progress (training thread writes, watchdog thread reads).

    ``clock``: seconds on a monotonic clock (``time.monotonic``; a fake in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        now = clock()
        #: (committed step, phase, phase entered at, last step ended at): replaced whole.
        self._state: tuple[int, str, float, float] = (0, "quorum", now, now)
        #: The span phase the step's timed phases return to.
        self._span = "forward-backward"

    def enter(self, phase: str, step: int | None = None) -> None:
        """The training thread enters ``phase`` (at committed step ``step``, default unchanged)."""
        old = self._state
        self._state = (old[0] if step is None else step, phase, self._clock(), old[3])

    def step_ended(self, step: int) -> None:
        """A step attempt ended (committed or not: the loop is alive); ``step`` committed steps so far."""
        now = self._clock()
        self._state = (step, "step-boundary", now, now)

    def refresh(self) -> None:
        """Restart the clocks without changing the phase: the job is held on
        purpose (paused); called by the watchdog thread."""
        step, phase, _, _ = self._state
        now = self._clock()
        self._state = (step, phase, now, now)

    def read(self) -> tuple[int, str, float, float]:
        """``(step, phase, seconds in phase, seconds since a step ended)`` now."""
        step, phase, entered, ended = self._state
        now = self._clock()
        return step, phase, now - entered, now - ended

    # The step's phase clock (PhaseClock.listen): spans and timed phases.
    def step_started(self) -> None:
        self._span = "forward-backward"
        self.enter("forward-backward")

    def marked(self, name: str) -> None:
        self._span = _CLOCK_MARKS.get(name, self._span)
        self.enter(self._span)

    def phase_entered(self, name: str) -> None:
        self.enter(_CLOCK_PHASES.get(name, name))

    def phase_left(self, name: str) -> None:
        self.enter(self._span)


@dataclass(frozen=True)
class Beat:
    """One rank's published heartbeat (JSON in the group's store). Times
    are durations measured on the publisher's own clock, so no two hosts'
    clocks are ever compared."""

    rank: int
    #: ``elastic.replica_id``, or ``job`` for a fixed group.
    group: str
    host: str
    pid: int
    #: The process's start time (``psutil``), so a kill never hits a reused pid.
    pid_start: float
    step: int
    phase: str
    in_phase_s: float
    since_step_s: float
    #: Increases with every publication: a peer whose ``seq`` stops changing does not run.
    seq: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Beat":
        return cls(**json.loads(data))

    def who(self) -> str:
        """``rank 3 (replica group r1, host h)``."""
        return f"rank {self.rank} (replica group {self.group}, host {self.host})"
