"""State shared by the server thread and the training thread.

The training thread publishes a snapshot at every step boundary and takes
queued ops; the server thread reads the snapshot and queues ops. Every
method holds one lock for a few dictionary operations, so neither thread
ever waits on the other for longer than that (the server thread never blocks
training, and training never blocks on a socket).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megascale_omni.control.commands import MAX_METRIC_RECORDS, Op
from megascale_omni.control.protocol import RequestId

#: Sends one reply message to the client that asked (thread-safe, non-blocking).
Post = Callable[[dict], None]


@dataclass(frozen=True)
class Pending:
    """A queued deferred command and where its reply goes."""

    op: Op
    request_id: RequestId
    post: Post


class ControlState:
    """Snapshot (status fields, recent step records, config view) plus the op queue."""

    def __init__(self, status: dict[str, Any], config: dict[str, Any]):
        self._lock = threading.Lock()
        self._status = dict(status)
        self._config = config
        self._records: collections.deque[dict] = collections.deque(maxlen=MAX_METRIC_RECORDS)
        self._queue: collections.deque[Pending] = collections.deque()
        self._arrived = threading.Event()
        self._closed = False

    # --------------------------------------------------- training thread side
    def publish(self, record: Optional[dict] = None, config: Optional[dict] = None, **status: Any) -> None:
        """Update status fields, append a step record, replace the config view."""
        with self._lock:
            self._status.update(status)
            if record is not None:
                self._records.append(record)
            if config is not None:
                self._config = config

    def take(self, max_ops: int) -> list[Pending]:
        """Remove and return up to ``max_ops`` queued commands, oldest first."""
        with self._lock:
            n = min(max_ops, len(self._queue))
            taken = [self._queue.popleft() for _ in range(n)]
            if not self._queue:
                self._arrived.clear()
            return taken

    def wait_for_command(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until a command is queued (rank 0 while paused)."""
        self._arrived.wait(timeout_s)

    def close(self) -> list[Pending]:
        """Refuse new commands; return the ones never applied (to answer them)."""
        with self._lock:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            return left

    # ----------------------------------------------------- server thread side
    def enqueue(self, pending: Pending) -> bool:
        """Queue a deferred command; False once closed."""
        with self._lock:
            if self._closed:
                return False
            self._queue.append(pending)
            self._arrived.set()
            return True

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {**self._status, "pending_commands": len(self._queue)}

    def records(self, last: int) -> list[dict]:
        with self._lock:
            return list(self._records)[-last:]

    def config(self) -> dict[str, Any]:
        with self._lock:
            return self._config
