"""When to save: signals, timers and requests, agreed by every rank.

Triggers arrive on one rank at a time (a signal, the control-socket thread,
a wall clock), but a save is collective. Each rank turns its local view into
a few flags; one small MAX all-reduce per step on a dedicated gloo group makes
the decision identical everywhere, at the same step boundary.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Flag slots of the per-step agreement vector.
_BUSY, _SIGTERM, _SIGUSR1, _REQUEST, _TIMER = range(5)


@dataclass(frozen=True)
class Decision:
    """What every rank does at this step boundary."""

    #: Some rank's writer is still writing the in-flight save.
    writer_busy: bool
    #: Save now for this reason ("" = no save).
    save_reason: str
    #: Stop training after the save (SIGTERM).
    stop: bool


class Triggers:
    """Local trigger state of one rank plus the collective that agrees on it."""

    def __init__(self, interval_steps: int, interval_minutes: float, group: dist.ProcessGroup):
        self.interval_steps = interval_steps
        self.interval_s = interval_minutes * 60.0
        self.group = group
        self._lock = threading.Lock()
        self._sigterm = False
        self._sigusr1 = False
        self._requested: str = ""
        self._last_save = time.monotonic()
        self._previous_handlers: dict[int, object] = {}

    # ------------------------------------------------------------ local side
    def install_signal_handlers(self) -> None:
        """SIGTERM: save, then stop. SIGUSR1: save, keep training (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in ((signal.SIGTERM, self._on_sigterm), (signal.SIGUSR1, self._on_sigusr1)):
            self._previous_handlers[sig] = signal.signal(sig, handler)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def _on_sigusr1(self, signum, frame) -> None:
        self._sigusr1 = True

    def request(self, reason: str = "api") -> None:
        """Ask for a save at the next step boundary (thread-safe; any rank)."""
        with self._lock:
            self._requested = reason or "api"

    def saved(self) -> None:
        self._last_save = time.monotonic()

    # ------------------------------------------------------------ collective
    def agree(self, step: int, writer_busy: bool) -> Decision:
        """Combine every rank's flags (every rank, once per step boundary)."""
        with self._lock:
            requested, self._requested = self._requested, ""
        sigusr1, self._sigusr1 = self._sigusr1, False
        timer_due = self.interval_s > 0 and time.monotonic() - self._last_save >= self.interval_s
        flags = torch.tensor(
            [writer_busy, self._sigterm, sigusr1, bool(requested), timer_due], dtype=torch.int32
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        f = [bool(x) for x in flags.tolist()]
        if f[_SIGTERM]:
            reason = "sigterm"
        elif f[_REQUEST]:
            reason = requested or "api"
        elif f[_SIGUSR1]:
            reason = "sigusr1"
        elif self.interval_steps and step % self.interval_steps == 0:
            reason = "interval"
        elif f[_TIMER]:
            reason = "timer"
        else:
            reason = ""
        return Decision(writer_busy=f[_BUSY], save_reason=reason, stop=f[_SIGTERM])
