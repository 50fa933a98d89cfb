"""The control server and ControlPlane in one process (world size 1, real
sockets): every bad input gets an error reply or a closed connection and
changes nothing; valid commands apply at step boundaries."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from megascale_omni.config import ConfigError, JobConfig, from_dict
from megascale_omni.control import ControlClient, ControlError
from megascale_omni.control.client import endpoint_of_run
from megascale_omni.control.plane import ControlPlane
from megascale_omni.control.protocol import MAX_MESSAGE_BYTES, ErrorCode

pytestmark = pytest.mark.timeout(60)
TOKEN = "0123456789abcdef0123456789abcdef"


def _cfg(tmp_path, **control) -> JobConfig:
    return from_dict(JobConfig, {"train": {"steps": 1000}, "logging": {"output_dir": str(tmp_path / "run")},
                                 "control": {"pause_poll_s": 0.02, **control}})


@pytest.fixture
def plane(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASCALE_CONTROL_TOKEN", TOKEN)
    p = ControlPlane(_cfg(tmp_path, tcp_port=0), {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "vpp": None})
    assert p.state.status()["state"] == "starting"
    p.step_boundary(0, None)
    yield p
    p.close()


def _addr(plane) -> str:
    return plane._server.addresses["unix"]


def _tcp(plane) -> tuple[str, int]:
    host, port = plane._server.addresses["tcp"].rsplit(":", 1)
    return host, int(port)


class Raw:
    """A bare socket speaking bytes, to send what no client library would."""

    def __init__(self, address):
        family = socket.AF_INET if isinstance(address, tuple) else socket.AF_UNIX
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(address)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> dict | None:
        """Next reply, or None if the server closed the connection."""
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def _snapshot(plane) -> tuple:
    """Everything a command could change."""
    status = plane.state.status()
    return (plane.paused, plane.draining, json.dumps(plane.cfg.__dict__, default=str, sort_keys=True),
            status["state"], status["pending_commands"])


def _request(cmd="status", **extra) -> bytes:
    return json.dumps({"version": 1, "id": "x", "cmd": cmd, **extra}).encode() + b"\n"


def _assert_unchanged(plane, before) -> None:
    assert plane.step_boundary(1, None) is True
    assert _snapshot(plane) == before
    with ControlClient(_addr(plane)) as c:
        assert c.call("status")["state"] == "running"


# ------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "payload, code",
    [
        (b"{oops\n", ErrorCode.PARSE_ERROR),
        (b"\xff\xff\n", ErrorCode.PARSE_ERROR),
        (b"[" * 40000 + b"\n", ErrorCode.PARSE_ERROR),
        (b"[1,2]\n", ErrorCode.BAD_REQUEST),
        (_request("shutdown"), ErrorCode.UNKNOWN_COMMAND),
        (_request("metrics", args={"last": "all"}), ErrorCode.INVALID_ARGS),
        (_request("pause", args={"now": True}), ErrorCode.INVALID_ARGS),
        (_request("config", args={"action": "set", "field": "train.eval_interval", "value": "ten"}),
         ErrorCode.INVALID_VALUE),
        (_request("config", args={"action": "set", "field": "model.num_layers", "value": 2}),
         ErrorCode.INVALID_VALUE),
        (_request("config", args={"action": "get", "field": "nope.x"}), ErrorCode.INVALID_ARGS),
        (json.dumps({"version": 99, "cmd": "drain"}).encode() + b"\n", ErrorCode.UNSUPPORTED_VERSION),
        (_request("checkpoint"), ErrorCode.NOT_CONFIGURED),
    ],
)
def test_bad_input_on_unix_gets_error_and_changes_nothing(plane, payload, code):
    before = _snapshot(plane)
    raw = Raw(_addr(plane))
    raw.send(payload)
    reply = raw.reply()
    assert reply["ok"] is False and reply["error"]["code"] == code, reply
    # The connection stays usable after a recoverable error.
    raw.send(_request("status"))
    assert raw.reply()["ok"] is True
    raw.close()
    _assert_unchanged(plane, before)


def test_wrong_type_reply_names_field_value_and_fix(plane):
    with ControlClient(_addr(plane)) as c, pytest.raises(ControlError) as e:
        c.call("config", action="set", field="logging.log_interval", value=0)
    assert e.value.code == ErrorCode.INVALID_VALUE
    assert e.value.details["field"] == "logging.log_interval" and e.value.details["value"] == 0
    assert e.value.details["hint"] == "must be > 0"


def _expect_error_then_close(plane, address, data: bytes, code: str) -> None:
    before = _snapshot(plane)
    raw = Raw(address)
    try:
        raw.send(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may close before we finish sending
    assert raw.reply()["error"]["code"] == code
    assert raw.closed()
    raw.close()
    _assert_unchanged(plane, before)


@pytest.mark.parametrize("with_newline", [True, False])
def test_oversized_message_gets_error_then_close(plane, with_newline):
    body = b'{"version": 1, "cmd": "drain", "args": {"pad": "' + b"x" * MAX_MESSAGE_BYTES + b'"}}'
    _expect_error_then_close(plane, _addr(plane), body + (b"\n" if with_newline else b""),
                             ErrorCode.MESSAGE_TOO_LARGE)


def test_exactly_max_size_is_accepted(plane):
    raw = Raw(_addr(plane))
    head = b'{"version":1,"id":"big","cmd":"status","args":{},"token":"'
    line = head + b"t" * (MAX_MESSAGE_BYTES - len(head) - 2) + b'"}'
    assert len(line) == MAX_MESSAGE_BYTES
    raw.send(line + b"\n")
    assert raw.reply()["ok"] is True  # tokens are ignored on the Unix socket
    raw.close()


@pytest.mark.parametrize("token", [None, "", "wrong-token-wrong-token", TOKEN[:-1], TOKEN + "x"])
def test_tcp_needs_the_token(plane, token):
    extra = {} if token is None else {"token": token}
    _expect_error_then_close(plane, _tcp(plane), _request("drain", **extra), ErrorCode.UNAUTHORIZED)


def test_tcp_garbage_is_answered_once_then_closed(plane):
    _expect_error_then_close(plane, _tcp(plane), b"GET / HTTP/1.1\r\n\r\n", ErrorCode.PARSE_ERROR)


def test_tcp_with_token_works(plane):
    with ControlClient(_tcp(plane), token=TOKEN) as c:
        assert c.call("status")["world_size"] == 1
        assert c.call("status")["layout"]["dp"] == 1


def test_abrupt_disconnects_change_nothing(plane):
    before = _snapshot(plane)
    for data in (b"", b'{"version": 1, "cmd": "dr', b"\x00" * 1000, _request("drain")[:-1]):
        raw = Raw(_addr(plane))
        if data:
            raw.send(data)
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        raw.close()  # RST where the kernel allows it
    time.sleep(0.2)
    _assert_unchanged(plane, before)


def test_too_many_connections_get_busy(plane):
    n = plane.cfg.control.max_connections
    held = [Raw(_addr(plane)) for _ in range(n)]
    for r in held:  # make sure the server has accepted every one of them
        r.send(_request("status"))
        assert r.reply()["ok"]
    extra = Raw(_addr(plane))
    assert extra.reply()["error"]["code"] == ErrorCode.BUSY
    assert extra.closed()
    for r in held + [extra]:
        r.close()
    time.sleep(0.2)
    with ControlClient(_addr(plane)) as c:
        assert c.call("status")["state"] == "running"


# ------------------------------------------------------------- valid commands
class Loop:
    """A stand-in training loop: step boundaries every few ms with step records."""

    def __init__(self, plane):
        self.plane = plane
        self.step = 0
        self.stopped_at = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        record = None
        while self.plane.step_boundary(self.step, record) and self.step < self.plane.cfg.train.steps:
            time.sleep(0.005)
            self.step += 1
            record = {"step": self.step, "loss": 10.0 / self.step, "lr": 1e-3, "grad_norm": 1.0,
                      "tokens_per_s": 100.0, "step_s": 0.005}
        self.stopped_at = self.step


def test_pause_resume_config_drain_via_client(plane):
    loop = Loop(plane)
    with ControlClient(_addr(plane)) as c:
        paused = c.call("pause")
        assert paused["state"] == "paused" and paused["changed"]
        time.sleep(0.2)
        status = c.call("status")  # the server answers while training is held
        assert status["state"] == "paused" and status["step"] == paused["step"] == loop.step
        assert c.call("pause")["changed"] is False
        assert c.call("metrics", last=2)["records"][-1]["step"] == paused["step"]
        changed = c.call("config", action="set", field="train.eval_interval", value=25)
        assert changed == {"field": "train.eval_interval", "old": 0, "new": 25, "step": paused["step"]}
        assert plane.cfg.train.eval_interval == 25
        assert c.call("config", action="get", field="train.eval_interval")["value"] == 25
        assert "model" in c.call("config", action="get")["config"]
        resumed = c.call("resume")
        assert resumed["state"] == "running" and resumed["step"] == paused["step"]
        while c.call("status")["step"] < paused["step"] + 3:
            time.sleep(0.01)
        drained = c.call("drain")
        assert drained["state"] == "draining"
        loop.thread.join(10)
        assert loop.stopped_at == drained["step"]
        with pytest.raises(ControlError) as e:
            c.call("pause")
        assert e.value.code == ErrorCode.UNAVAILABLE


def _standing_by(plane, client) -> tuple[threading.Thread, list]:
    """Run ``plane.stand_by(0)`` in a thread until the server says ``standby``;
    returns the thread and the list its result lands in."""
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(plane.stand_by(0)), daemon=True)
    waiter.start()
    while client.call("status")["state"] != "standby":
        time.sleep(0.01)
    return waiter, result


def test_standby_waits_for_join_then_trains(tmp_path):
    """A standby replica group answers status as ``standby`` and holds every
    rank until ``join``; join is refused once it runs (nothing to join)."""
    plane = ControlPlane(_cfg(tmp_path), {},
                         replica_info=lambda: {"replica_id": "r1", "standby": True})
    try:
        with ControlClient(_addr(plane)) as c:
            waiter, joined = _standing_by(plane, c)
            status = c.call("status")
            assert status["replica"] == {"replica_id": "r1", "standby": True} and status["step"] == 0
            with pytest.raises(ControlError) as e:
                c.call("pause")
            assert e.value.code == ErrorCode.UNAVAILABLE and "standing by" in e.value.message
            time.sleep(0.1)
            assert waiter.is_alive() and not joined  # held: nothing but join or drain releases it
            assert c.call("join") == {"state": "joining", "step": 0}
            waiter.join(10)
            assert joined == [True]
            loop = Loop(plane)
            with pytest.raises(ControlError) as e:
                c.call("join")
            assert e.value.code == ErrorCode.UNAVAILABLE and "not standing by" in e.value.message
            assert "elastic.standby=true" in e.value.details["hint"]
            c.call("drain")
            loop.thread.join(10)
    finally:
        plane.close()


def test_drain_releases_a_standby_without_joining(tmp_path):
    plane = ControlPlane(_cfg(tmp_path), {})
    try:
        with ControlClient(_addr(plane)) as c:
            waiter, joined = _standing_by(plane, c)
            assert c.call("drain")["state"] == "draining"
        waiter.join(10)
        assert joined == [False]
    finally:
        plane.close()


def test_metrics_and_status_come_from_step_records(plane):
    for step in range(1, 6):
        plane.step_boundary(step, {"step": step, "loss": float(step), "lr": 0.1})
    with ControlClient(_addr(plane)) as c:
        status = c.call("status")
        assert status["step"] == 5 and status["last_loss"] == 5.0 and status["replica"] is None
        assert [r["step"] for r in c.call("metrics", last=3)["records"]] == [3, 4, 5]


def test_steps_can_be_extended_and_the_loop_honours_it(plane):
    plane.cfg.train.steps = 20
    loop = Loop(plane)
    with ControlClient(_addr(plane)) as c:
        c.call("config", action="set", field="train.steps", value=40)
    loop.thread.join(10)
    assert loop.stopped_at == 40


def test_checkpoint_calls_the_service_at_a_boundary(tmp_path):
    saved = []
    plane = ControlPlane(_cfg(tmp_path), {},
                         checkpoint=lambda step: saved.append(step) or f"/ckpt/step{step}")
    try:
        loop = Loop(plane)
        with ControlClient(_addr(plane)) as c:
            result = c.call("checkpoint")
            assert saved == [result["step"]] and result["checkpoint"] == f"/ckpt/step{result['step']}"
            assert c.call("status")["checkpointing"] is True
            c.call("drain")
        loop.thread.join(10)
    finally:
        plane.close()


def test_unapplied_commands_are_answered_at_close(tmp_path):
    plane = ControlPlane(_cfg(tmp_path), {})
    replies = []
    t = threading.Thread(target=lambda: replies.append(ControlClient(_addr(plane)).request("pause")))
    t.start()
    while plane.state.status()["pending_commands"] == 0:
        time.sleep(0.01)
    plane.close()  # training ended before any further boundary
    t.join(10)
    assert replies[0]["error"]["code"] == ErrorCode.UNAVAILABLE
    assert not os.path.exists(tmp_path / "run" / "control.sock")
    assert not os.path.exists(tmp_path / "run" / "control.json")


def test_endpoint_file_and_socket_mode(plane, tmp_path):
    endpoint = json.loads((tmp_path / "run" / "control.json").read_text())
    assert endpoint["unix"] == _addr(plane) and endpoint["tcp"] == plane._server.addresses["tcp"]
    assert TOKEN not in (tmp_path / "run" / "control.json").read_text()
    assert os.stat(_addr(plane)).st_mode & 0o777 == 0o600


def test_stale_socket_is_replaced_live_one_and_files_are_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run / "control.sock"))
    stale.close()  # file left behind, nobody listening
    first = ControlPlane(_cfg(tmp_path), {})
    try:
        with pytest.raises(ConfigError) as e:
            ControlPlane(_cfg(tmp_path), {})
        assert "another job is serving" in e.value.hint
    finally:
        first.close()
    (run / "control.sock").write_text("precious")
    with pytest.raises(ConfigError) as e:
        ControlPlane(_cfg(tmp_path), {})
    assert "not a socket" in e.value.hint and (run / "control.sock").read_text() == "precious"


def test_disabled_plane_is_inert(tmp_path):
    plane = ControlPlane(_cfg(tmp_path, enabled=False), {})
    assert plane.step_boundary(0, None) is True and not plane.draining
    plane.close()
    assert not (tmp_path / "run").exists()


def test_failing_checkpoint_service_answers_then_raises_in_training(tmp_path):
    def broken(step):
        raise RuntimeError("disk full")

    plane = ControlPlane(_cfg(tmp_path), {}, checkpoint=broken)
    replies = []
    t = threading.Thread(target=lambda: replies.append(ControlClient(_addr(plane)).request("checkpoint")))
    t.start()
    while plane.state.status()["pending_commands"] == 0:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="disk full"):
        plane.step_boundary(3, None)
    t.join(10)
    plane.close()
    assert replies[0]["error"]["code"] == ErrorCode.INTERNAL and "disk full" in replies[0]["error"]["message"]


def test_socket_elsewhere_is_published_in_the_run_dir(tmp_path):
    sock = tmp_path / "elsewhere" / "job.sock"
    plane = ControlPlane(_cfg(tmp_path, socket_path=str(sock)), {})
    try:
        assert endpoint_of_run(str(tmp_path / "run")) == str(sock)
        with ControlClient(endpoint_of_run(str(tmp_path / "run"))) as c:
            assert c.call("status")["state"] == "starting"
    finally:
        plane.close()
    assert not sock.exists() and not (tmp_path / "run" / "control.json").exists()
