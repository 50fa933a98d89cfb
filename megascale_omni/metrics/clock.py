"""One clock for a training step's spans and phases: CUDA events on CUDA, the host's timer elsewhere.

On CUDA the host only queues kernels; a host timer around a forward pass
measures the launches, and the compute lands wherever the host next waits
(a ``.item()``, the optimizer's gradient norm). So the step's marks are
events recorded on the training thread's current stream, and they are
resolved once, at the end of the step, after one synchronisation on the
last of them. An event's time is when the stream reached it: when the work
queued before it had finished, or when the host recorded it if the stream
was idle (a host-side wait, such as the elastic commit, therefore still
counts). On the host (CPU, gloo) every call is synchronous and the marks
are ``time.perf_counter()`` readings.

The step (:func:`megascale_omni.training.step.train_step`) marks its spans
(forward/backward, optimizer) with :meth:`PhaseClock.mark`; the seams into
megatron (:mod:`megascale_omni.metrics.breakdown`) time their phases with
:meth:`PhaseClock.phase` on the same clock. The step record, the breakdown
and straggler detection (``busy_s``) all read what :meth:`PhaseClock.read`
returns. Training thread only.

A listener (:meth:`PhaseClock.listen`; the hang watchdog's heartbeat) hears
of every mark and outermost phase as it happens, so a stuck step shows
where it is stuck without waiting for :meth:`PhaseClock.read`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Protocol

import torch

#: Phases timed inside a step's forward/backward (see metrics/breakdown.py).
PHASE_NAMES = ("pipeline_wait", "moe_dispatch", "grad_sync", "cross_replica")


class EventSource(Protocol):
    """Where the clock's timestamps come from (training thread)."""

    def record(self) -> Any:
        """An opaque timestamp of this point in the stream of work."""

    def synchronize(self, event: Any) -> None:
        """Block until ``event`` and everything recorded before it happened."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (both already synchronised)."""


class HostEvents:
    """Host timestamps (``time.perf_counter``); nothing to synchronise."""

    def record(self) -> float:
        return time.perf_counter()

    def synchronize(self, event: float) -> None:
        return None

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEvents:
    """CUDA events recorded on the current stream. ``synchronize`` waits for
    that one event only, not the device: work on other streams (the pending
    parameter all-gather of ``parallel.overlap_param_gather``) keeps overlapping."""

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3  # milliseconds


def events_for(device: torch.device) -> EventSource:
    """The event source of ``device``: CUDA events on CUDA, host timestamps elsewhere."""
    return CudaEvents() if device.type == "cuda" else HostEvents()


class PhaseListener(Protocol):
    """Hears the clock's marks and phases as they happen (training thread; must be cheap)."""

    def step_started(self) -> None:
        """:meth:`PhaseClock.start` ran."""

    def marked(self, name: str) -> None:
        """Span ``name`` ended (:meth:`PhaseClock.mark`)."""

    def phase_entered(self, name: str) -> None:
        """Outermost phase ``name`` began."""

    def phase_left(self, name: str) -> None:
        """Outermost phase ``name`` ended."""


class _NoListener:
    def step_started(self) -> None:
        pass

    def marked(self, name: str) -> None:
        pass

    def phase_entered(self, name: str) -> None:
        pass

    def phase_left(self, name: str) -> None:
        pass


@dataclass(frozen=True)
class ClockReading:
    """One step's times, seconds. ``spans``: from the previous mark (the
    step's start for the first) to each mark, by mark name; ``phases``: the
    total of each phase of :data:`PHASE_NAMES`."""

    spans: dict[str, float]
    phases: dict[str, float]


class PhaseClock:
    """Marks and phases of the current step, resolved once per step (training thread)."""

    def __init__(self, events: Optional[EventSource] = None) -> None:
        self.events: EventSource = events or HostEvents()
        self.listener: PhaseListener = _NoListener()
        self._depth = 0
        self._clear()

    def _clear(self) -> None:
        self._marks: list[tuple[str, Any]] = []
        self._phases: list[tuple[str, Any, Any]] = []
        self._last: Any = None

    def use(self, events: EventSource) -> EventSource:
        """Take timestamps from ``events`` from now on; returns the previous source."""
        previous, self.events = self.events, events
        self._clear()
        return previous

    def listen(self, listener: Optional[PhaseListener]) -> None:
        """Tell ``listener`` of every mark and phase from now on (None: nobody)."""
        self.listener = listener if listener is not None else _NoListener()

    def _record(self) -> Any:
        self._last = self.events.record()
        return self._last

    def start(self) -> None:
        """Begin a step: forget the previous one's marks and phases (and any
        recorded between steps, e.g. by evaluation) and mark the start."""
        self._clear()
        self._marks.append(("start", self._record()))
        self.listener.step_started()

    def mark(self, name: str) -> Any:
        """Mark the end of span ``name`` (it began at the previous mark); returns the opaque event."""
        event = self._record()
        self._marks.append((name, event))
        self.listener.marked(name)
        return event

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name``. Nested phases count once, in the
        outermost (a cross-replica reduction inside grad sync is grad sync
        unless timed separately outside it)."""
        if self._depth:
            yield
            return
        self._depth += 1
        self.listener.phase_entered(name)
        begin = self._record()
        try:
            yield
        finally:
            self._phases.append((name, begin, self._record()))
            self._depth -= 1
            self.listener.phase_left(name)

    def stamp(self) -> Any:
        """An opaque timestamp for :meth:`interval` (e.g. from an autograd
        backward, where a ``with`` block cannot span the work)."""
        return self._record()

    def interval(self, name: str, begin: Any, end: Any) -> None:
        """Count ``begin`` to ``end`` (two :meth:`stamp` values) as phase ``name``;
        ignored inside another phase, as a nested :meth:`phase` is."""
        if not self._depth:
            self._phases.append((name, begin, end))

    def read(self) -> ClockReading:
        """The step's spans and phase totals: one synchronisation, on the last
        event recorded, then every interval is read (call once, after the
        step's last mark)."""
        if self._last is not None:
            self.events.synchronize(self._last)
        seconds = self.events.seconds
        spans = {name: seconds(prev, event) for (_, prev), (name, event) in zip(self._marks, self._marks[1:])}
        phases = dict.fromkeys(PHASE_NAMES, 0.0)
        for name, begin, end in self._phases:
            phases[name] += seconds(begin, end)
        return ClockReading(spans, phases)
