"""State shared by the server thread and the training thread.

The training thread publishes a snapshot at every step boundary and takes
queued ops; the server thread reads the snapshot and queues ops. Every
method holds one lock for a few dictionary operations, so neither thread
ever waits on the other for longer than that (the server thread never blocks
training, and training never blocks on a socket).
"""

from __future__ import annotations

import collections
import enum
import threading
from typing import Any, Callable, Optional

from megascale_omni.control.commands import MAX_METRIC_RECORDS, Op
from megascale_omni.control.protocol import RequestId

#: Sends one reply message to the client that asked (thread-safe, non-blocking).
Post = Callable[[dict], None]


class Pending:
    """A queued deferred command and where its replies go.

    Identical requests that arrive while it is queued join it (see
    :meth:`ControlState.enqueue`); every requester gets the same answer,
    each with its own request id.
    """

    def __init__(self, op: Op, request_id: RequestId, post: Post):
        self.op = op
        #: (request id, post) of every request this op answers, oldest first.
        #: Appended by the server thread under the state's lock while queued only.
        self.requesters: list[tuple[RequestId, Post]] = [(request_id, post)]

    def answer(self, make_reply: Callable[[RequestId], dict]) -> None:
        """Send ``make_reply(request_id)`` to every requester (any thread)."""
        for request_id, post in self.requesters:
            post(make_reply(request_id))


def conflicts(a: Op, b: Op) -> bool:
    """Whether applying ``a`` between two ``b`` could change the second's
    result: ``pause``/``resume`` against each other, ``config_set`` of the
    same field against each other."""
    hold = ("pause", "resume")
    if a.kind in hold and b.kind in hold:
        return True
    return a.kind == b.kind == "config_set" and a.field == b.field


class Enqueued(enum.Enum):
    """What :meth:`ControlState.enqueue` did with a request."""

    QUEUED = "queued"  # a new entry
    COALESCED = "coalesced"  # joined an identical queued op
    FULL = "full"  # refused: max_pending entries, or max_pending requesters on the identical one
    CLOSED = "closed"  # refused: the control plane is shutting down


class ControlState:
    """Snapshot (status fields, recent step records, config view) plus the op queue.

    The queue holds at most ``max_pending`` distinct ops, each answering at
    most ``max_pending`` requesters: memory and the delay of a newly queued
    op (``max_pending / MAX_OPS`` boundaries at most) stay bounded whatever
    clients send.
    """

    def __init__(self, status: dict[str, Any], config: dict[str, Any], max_pending: int = 64):
        self.max_pending = max_pending
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
    def enqueue(self, op: Op, request_id: RequestId, post: Post) -> Enqueued:
        """Queue a deferred command (server thread).

        An op equal to a queued one (same kind, field and value) joins it
        instead, unless an op queued after that one conflicts with it (see
        :func:`conflicts`): ``pause, resume, pause`` stays three entries,
        since merging the two pauses would end the sequence running.
        """
        with self._lock:
            if self._closed:
                return Enqueued.CLOSED
            same = self._coalesce_target(op)
            if same is not None:
                if len(same.requesters) >= self.max_pending:
                    return Enqueued.FULL
                same.requesters.append((request_id, post))
                return Enqueued.COALESCED
            if len(self._queue) >= self.max_pending:
                return Enqueued.FULL
            self._queue.append(Pending(op, request_id, post))
            self._arrived.set()
            return Enqueued.QUEUED

    def _coalesce_target(self, op: Op) -> Optional[Pending]:
        for pending in reversed(self._queue):
            if pending.op == op:
                return pending
            if conflicts(pending.op, op):
                return None
        return None

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {**self._status, "pending_commands": len(self._queue)}

    def records(self, last: int) -> list[dict]:
        with self._lock:
            return list(self._records)[-last:]

    def config(self) -> dict[str, Any]:
        with self._lock:
            return self._config
