"""Back-pressure of the control socket: a bad-input matrix per category.

- pending commands: floods, coalescing, the ``max_pending`` bound;
- slow clients: silent, partial or trickled requests (``request_timeout_s``);
- oversized frames;
- the connection bound.

Real sockets, one process. Nothing here asserts a duration: the slow-client
cases run the server on a hand-driven clock, and every wait is a generous
deadline for something that must happen.
"""

from __future__ import annotations

import json
import select
import threading
import time

import pytest

from megascale_omni.config import ConfigError, ControlConfig, JobConfig, from_dict
from megascale_omni.control import ControlClient
from megascale_omni.control.commands import Op
from megascale_omni.control.handlers import RequestHandler
from megascale_omni.control.plane import ControlPlane
from megascale_omni.control.protocol import MAX_MESSAGE_BYTES, ErrorCode
from megascale_omni.control.server import ControlServer
from megascale_omni.control.state import ControlState, Enqueued
from tests.unit.test_control_server import TOKEN, Raw, _request

pytestmark = pytest.mark.timeout(60)
MAX_PENDING = 4
MAX_CONNECTIONS = 4


def _cfg(tmp_path, **control) -> JobConfig:
    return from_dict(JobConfig, {"train": {"steps": 1000}, "logging": {"output_dir": str(tmp_path / "run")},
                                 "control": {"pause_poll_s": 0.02, "max_pending": MAX_PENDING,
                                             "max_connections": MAX_CONNECTIONS, **control}})


def _wait(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


@pytest.fixture
def plane(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CONTROL_TOKEN", TOKEN)
    p = ControlPlane(_cfg(tmp_path, tcp_port=0), {})
    p.step_boundary(0, None)
    yield p
    p.close()


def _unix(plane) -> str:
    return plane._server.addresses["unix"]


def _tcp(plane) -> tuple[str, int]:
    host, port = plane._server.addresses["tcp"].rsplit(":", 1)
    return host, int(port)


def _send(raw: Raw, data: bytes) -> None:
    try:
        raw.send(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may close before we finish sending


def _pending(plane) -> int:
    return plane.state.status()["pending_commands"]


class Boundary:
    """One step boundary in a thread (it holds there while paused)."""

    def __init__(self, plane, step: int):
        self.result: list[bool] = []
        self.thread = threading.Thread(target=lambda: self.result.append(plane.step_boundary(step, None)),
                                       daemon=True)
        self.thread.start()

    def join(self) -> bool:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the boundary never returned"
        return self.result[0]


def _release(plane, boundary: Boundary) -> None:
    with ControlClient(_unix(plane)) as c:
        assert c.call("resume")["state"] == "running"
    assert boundary.join() is True


# ------------------------------------------------ pending commands: the queue
A, B = "train.eval_interval", "logging.log_interval"
PAUSE, RESUME, DRAIN, CKPT, JOIN = (Op(k) for k in ("pause", "resume", "drain", "checkpoint", "join"))

# (ops enqueued in order, queue after: [(kind, field, value, requesters)], outcome of each enqueue)
Q, C, F = Enqueued.QUEUED, Enqueued.COALESCED, Enqueued.FULL
COALESCING = {
    "pause x3 -> one op": ([PAUSE] * 3, [("pause", None, None, 3)], [Q, C, C]),
    "drain x2 -> one op": ([DRAIN] * 2, [("drain", None, None, 2)], [Q, C]),
    "join x2 -> one op": ([JOIN] * 2, [("join", None, None, 2)], [Q, C]),
    "checkpoint across a pause": ([CKPT, PAUSE, CKPT], [("checkpoint", None, None, 2), ("pause", None, None, 1)],
                                  [Q, Q, C]),
    "pause resume pause kept in order": ([PAUSE, RESUME, PAUSE],
                                         [("pause", None, None, 1), ("resume", None, None, 1),
                                          ("pause", None, None, 1)], [Q, Q, Q]),
    "config same value -> one op": ([Op("config_set", A, 5)] * 2, [("config_set", A, 5, 2)], [Q, C]),
    "config other value kept": ([Op("config_set", A, 5), Op("config_set", A, 6)],
                                [("config_set", A, 5, 1), ("config_set", A, 6, 1)], [Q, Q]),
    "config back to a value kept": ([Op("config_set", A, 5), Op("config_set", A, 6), Op("config_set", A, 5)],
                                    [("config_set", A, 5, 1), ("config_set", A, 6, 1), ("config_set", A, 5, 1)],
                                    [Q, Q, Q]),
    "config across another field": ([Op("config_set", A, 5), Op("config_set", B, 7), Op("config_set", A, 5)],
                                    [("config_set", A, 5, 2), ("config_set", B, 7, 1)], [Q, Q, C]),
    "flood of 2000 resumes, then pause": ([RESUME] * 2000 + [PAUSE],
                                          [("resume", None, None, MAX_PENDING), ("pause", None, None, 1)],
                                          [Q] + [C] * (MAX_PENDING - 1) + [F] * (2000 - MAX_PENDING) + [Q]),
    "distinct ops past the bound": ([Op("config_set", A, v) for v in range(1, MAX_PENDING + 2)] + [
        Op("config_set", A, MAX_PENDING)],
        [("config_set", A, v, 2 if v == MAX_PENDING else 1) for v in range(1, MAX_PENDING + 1)],
        [Q] * MAX_PENDING + [F, C]),
}


@pytest.mark.parametrize("case", list(COALESCING))
def test_queue_coalesces_and_bounds(case):
    ops, expected, outcomes = COALESCING[case]
    state = ControlState({}, {}, max_pending=MAX_PENDING)
    got = [state.enqueue(op, i, lambda message: None) for i, op in enumerate(ops)]
    assert got == outcomes
    taken = state.take(100)
    assert [(p.op.kind, p.op.field, p.op.value, len(p.requesters)) for p in taken] == expected


def test_taken_op_is_not_joined_and_closed_queue_refuses():
    state = ControlState({}, {}, max_pending=MAX_PENDING)
    assert state.enqueue(PAUSE, 1, lambda m: None) is Q
    state.take(8)  # on its way to the ranks: a new pause is a new op
    assert state.enqueue(PAUSE, 2, lambda m: None) is Q
    assert [p.requesters[0][0] for p in state.close()] == [2]
    assert state.enqueue(PAUSE, 3, lambda m: None) is Enqueued.CLOSED


def test_coalesced_requesters_get_the_same_result_with_their_own_ids(plane):
    clients = [Raw(_unix(plane)) for _ in range(3)]
    for i, raw in enumerate(clients):
        raw.send(json.dumps({"version": 1, "id": f"c{i}", "cmd": "pause"}).encode() + b"\n")
    _wait(lambda: len(plane.state._queue) == 1 and len(plane.state._queue[0].requesters) == 3,
          "three pauses joined into one queued op")
    boundary = Boundary(plane, 1)
    replies = [raw.reply() for raw in clients]
    assert [r["id"] for r in replies] == ["c0", "c1", "c2"]
    assert all(r["ok"] and r["result"] == {"state": "paused", "step": 1, "changed": True} for r in replies)
    _release(plane, boundary)
    for raw in clients:
        raw.close()


def test_flood_of_noops_then_a_real_pause_applies_at_the_next_boundary(plane):
    flooder = Raw(_unix(plane))
    _send(flooder, b"".join(_request("resume") for _ in range(2000)))  # running: each is a no-op
    busy = flooder.reply()
    assert busy["error"]["code"] == ErrorCode.BUSY and busy["error"]["hint"].startswith("retry")
    assert flooder.closed()
    flooder.close()
    assert _pending(plane) == 1  # the resumes that got in share one op
    real = Raw(_unix(plane))
    real.send(_request("pause"))
    _wait(lambda: _pending(plane) == 2, "the pause queued behind the one coalesced resume")
    boundary = Boundary(plane, 1)
    assert real.reply()["result"] == {"state": "paused", "step": 1, "changed": True}
    real.close()
    _release(plane, boundary)


def test_full_queue_answers_busy_and_closes_then_drains(plane):
    flooder = Raw(_unix(plane))
    _send(flooder, b"".join(_request("config", args={"action": "set", "field": A, "value": v})
                            for v in range(1, 100)))
    assert flooder.reply()["error"]["code"] == ErrorCode.BUSY
    assert flooder.closed()
    flooder.close()
    assert _pending(plane) == MAX_PENDING
    late = Raw(_unix(plane))
    late.send(_request("pause"))  # a new op while full
    assert late.reply()["error"]["code"] == ErrorCode.BUSY
    assert late.closed()
    late.close()
    assert plane.step_boundary(1, None) is True  # up to 8 ops per boundary: the queue empties
    assert _pending(plane) == 0 and plane.cfg.train.eval_interval == MAX_PENDING
    late = Raw(_unix(plane))  # room again
    late.send(_request("pause"))
    _wait(lambda: _pending(plane) == 1, "the pause queued once the queue emptied")
    boundary = Boundary(plane, 2)
    assert late.reply()["result"] == {"state": "paused", "step": 2, "changed": True}
    late.close()
    _release(plane, boundary)


def test_alternating_pause_resume_applies_in_order(plane):
    raw = Raw(_unix(plane))
    raw.send(b"".join(_request(cmd) for cmd in ("pause", "resume", "pause", "resume")))
    _wait(lambda: _pending(plane) == 4, "four ops queued, none merged")
    assert plane.step_boundary(1, None) is True  # ends running: the last command wins
    assert [raw.reply()["result"]["state"] for _ in range(4)] == ["paused", "running", "paused", "running"]
    raw.close()


# ------------------------------------------------------------- slow clients
class _Clock:
    """The server's clock, advanced by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


TIMEOUT_S = 0.2  # real seconds only set how often the server loop looks; the clock is fake


@pytest.fixture
def slow(tmp_path):
    """A server on a hand-driven clock: deadlines pass only when a test says so."""
    clock = _Clock()
    state = ControlState({"state": "running", "step": 0}, {}, max_pending=MAX_PENDING)
    handler = RequestHandler(state, _cfg(tmp_path), checkpointing=False, started_at=0.0)
    server = ControlServer(handler, str(tmp_path / "c.sock"), max_connections=MAX_CONNECTIONS,
                           idle_timeout_s=1e9, request_timeout_s=TIMEOUT_S, clock=clock)
    server.start()
    yield server, clock, state
    server.stop()


def _reply_while_time_passes(raw: Raw, clock: _Clock, trickle: bool = False) -> dict | None:
    """Advance the server clock a second at a time (sending one more byte each
    time when ``trickle``) until ``raw`` has something to read; then read it."""
    deadline = time.monotonic() + 30.0
    while not raw.buf and not select.select([raw.sock], [], [], 0.02)[0]:
        assert time.monotonic() < deadline, "the server never answered"
        if trickle:
            _send(raw, b" ")
        clock.now += 1.0
    return raw.reply()


# What a slow client sends before it stalls, and the replies it gets first.
SLOW = {
    "silent after connecting": (b"", []),
    "partial request": (b'{"version": 1, "cmd": "pa', []),
    "blank lines then partial": (b"\n\r\n{", []),
    "large partial under the limit": (b'{"pad": "' + b"x" * (MAX_MESSAGE_BYTES - 100), []),
    "complete request then partial": (_request("status") + b'{"vers', [True]),
    "two complete requests then partial": (_request("status") * 2 + b"{", [True, True]),
}


@pytest.mark.parametrize("case", list(SLOW) + ["trickle, one byte per second"])
def test_slow_client_gets_request_timeout_and_is_closed(slow, case):
    server, clock, state = slow
    data, first = SLOW.get(case, (b"{", []))
    raw = Raw(server.addresses["unix"])
    if data:
        raw.send(data)
    assert [raw.reply()["ok"] for _ in first] == first
    reply = _reply_while_time_passes(raw, clock, trickle=case.startswith("trickle"))
    assert reply["error"]["code"] == ErrorCode.REQUEST_TIMEOUT, reply
    assert raw.closed()
    raw.close()
    assert state.status()["pending_commands"] == 0


def test_slow_client_with_a_queued_command_keeps_the_command(slow):
    server, clock, state = slow
    raw = Raw(server.addresses["unix"])
    raw.send(_request("pause") + b'{"version": 1')
    assert _reply_while_time_passes(raw, clock)["error"]["code"] == ErrorCode.REQUEST_TIMEOUT
    assert raw.closed()
    raw.close()
    assert [p.op.kind for p in state.take(8)] == ["pause"]  # applied at the next boundary all the same


def test_silent_clients_cannot_hold_every_slot(slow):
    server, clock, _ = slow
    holders = [Raw(server.addresses["unix"]) for _ in range(MAX_CONNECTIONS)]
    for raw in holders:
        assert _reply_while_time_passes(raw, clock)["error"]["code"] == ErrorCode.REQUEST_TIMEOUT
        assert raw.closed()
        raw.close()
    with ControlClient(server.addresses["unix"]) as c:
        assert c.call("status")["state"] == "running"


def test_idle_client_between_requests_keeps_its_slot(slow):
    server, clock, _ = slow
    idle = Raw(server.addresses["unix"])
    idle.send(_request("status"))
    assert idle.reply()["ok"]
    silent = Raw(server.addresses["unix"])  # its deadline passes while `idle` idles
    assert _reply_while_time_passes(silent, clock)["error"]["code"] == ErrorCode.REQUEST_TIMEOUT
    silent.close()
    idle.send(_request("status"))
    assert idle.reply()["ok"]
    idle.close()


# ---------------------------------------------------------- oversized frames
_DRAIN_HEAD = b'{"version": 1, "cmd": "drain", "args": {"pad": "'
OVERSIZED = {
    "max+1 bytes with newline": b"x" * (MAX_MESSAGE_BYTES + 1) + b"\n",
    "10x max with newline": _DRAIN_HEAD + b"x" * (10 * MAX_MESSAGE_BYTES) + b'"}}\n',
    "no newline at all": _DRAIN_HEAD + b"x" * (2 * MAX_MESSAGE_BYTES),
    "after a valid request": _request("status") + _DRAIN_HEAD + b"x" * (MAX_MESSAGE_BYTES + 1) + b"\n",
    "oversized then a valid drain": b"x" * (MAX_MESSAGE_BYTES + 1) + b"\n" + _request("drain"),
}


@pytest.mark.parametrize("transport", ["unix", "tcp"])
@pytest.mark.parametrize("case", list(OVERSIZED) + ["4 KiB chunks"])
def test_oversized_frame_is_answered_and_closed(plane, case, transport):
    data = OVERSIZED.get(case, _DRAIN_HEAD + b"x" * (MAX_MESSAGE_BYTES + 1) + b'"}}\n')
    if transport == "tcp":  # a token keeps the valid request valid
        data = data.replace(b'"cmd": "status"', f'"token": "{TOKEN}", "cmd": "status"'.encode())
    raw = Raw(_unix(plane) if transport == "unix" else _tcp(plane))
    if case == "4 KiB chunks":
        for at in range(0, len(data), 4096):
            _send(raw, data[at:at + 4096])
    else:
        _send(raw, data)
    reply = raw.reply()
    if case == "after a valid request":
        assert reply["ok"] is True, reply
        reply = raw.reply()
    assert reply["error"]["code"] == ErrorCode.MESSAGE_TOO_LARGE, reply
    assert raw.closed()
    raw.close()
    assert plane.step_boundary(1, None) is True and not plane.draining and _pending(plane) == 0


def test_exactly_max_is_accepted(plane):
    head = b'{"version":1,"id":"big","cmd":"status","args":{},"token":"'
    line = head + b"t" * (MAX_MESSAGE_BYTES - len(head) - 2) + b'"}'
    raw = Raw(_unix(plane))
    raw.send(line + b"\n")
    assert raw.reply()["ok"] is True
    raw.close()


# -------------------------------------------------------- connection bound
@pytest.mark.parametrize("extra", ["unix", "tcp"])
@pytest.mark.parametrize("held", ["unix", "tcp", "mixed"])
def test_connection_over_the_bound_gets_busy_then_close_and_a_freed_slot_serves(plane, held, extra):
    def connect(kind):
        raw = Raw(_unix(plane) if kind == "unix" else _tcp(plane))
        raw.send(_request("status", token=TOKEN))  # the server has accepted it once it answers
        assert raw.reply()["ok"] is True
        return raw

    kinds = {"unix": ["unix"] * MAX_CONNECTIONS, "tcp": ["tcp"] * MAX_CONNECTIONS,
             "mixed": ["unix", "tcp"] * (MAX_CONNECTIONS // 2)}[held]
    holders = [connect(kind) for kind in kinds]
    over = Raw(_unix(plane) if extra == "unix" else _tcp(plane))
    assert over.reply()["error"]["code"] == ErrorCode.BUSY
    assert over.closed()
    over.close()
    holders.pop().close()

    def served() -> bool:  # the server may not have seen the close yet: then busy, try again
        raw = Raw(_unix(plane) if extra == "unix" else _tcp(plane))
        try:
            _send(raw, _request("status", token=TOKEN))
            reply = raw.reply()
            return reply is not None and reply["ok"]
        finally:
            raw.close()

    _wait(served, "a freed slot serves a new client")
    for raw in holders:
        raw.close()


# ------------------------------------------------------------------- config
@pytest.mark.parametrize("name, value", [("max_pending", 0), ("max_pending", -3), ("request_timeout_s", 0.0),
                                         ("request_timeout_s", -1.0)])
def test_backpressure_settings_are_validated(name, value):
    with pytest.raises(ConfigError) as e:
        ControlConfig(**{name: value})
    assert e.value.field == f"control.{name}" and e.value.hint == "must be > 0"
