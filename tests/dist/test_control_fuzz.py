"""Fuzz the control socket of a 2-process job with >= 1000 random and
malformed messages while it trains: the server keeps answering, nothing
changes, and the per-step losses equal an unfuzzed run's exactly."""

from __future__ import annotations

import json
import random
import socket

import pytest

from megascale_omni.control import ControlClient
from megascale_omni.control.protocol import MAX_MESSAGE_BYTES
from tests.dist.control_helpers import wait_for_server
from tests.launcher import output_of, read_metrics, spawn_torchrun, train_and_read

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TOKEN = "fuzz-token-0123456789abcdef"
MIN_MESSAGES = 1000
# Constant LR: the drained run (train.steps=100000) and the reference run
# (train.steps=D) then follow the same schedule step for step.
COMMON = ["--config", "examples/gpt/tiny.yaml", "train.lr_decay_style=constant", "train.lr_warmup_steps=0"]
READ_ONLY_OK = {"status", "metrics", "config"}
RECOVERABLE = {"parse_error", "bad_request", "unsupported_version", "unknown_command", "invalid_args",
               "invalid_value", "not_configured"}


class Fuzzer:
    """Seeded generator of hostile traffic; checks every answer it gets."""

    def __init__(self, unix_path: str, tcp: tuple[str, int], seed: int = 0):
        self.unix_path, self.tcp = unix_path, tcp
        self.rng = random.Random(seed)
        self.sent = 0
        self.answers: dict[str, int] = {}
        self.conn: socket.socket | None = None
        self.buf = b""

    # ------------------------------------------------------------ transport
    def _connect(self, address) -> socket.socket:
        family = socket.AF_INET if isinstance(address, tuple) else socket.AF_UNIX
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(address)
        return s

    def _unix(self) -> socket.socket:
        if self.conn is None:
            self.conn, self.buf = self._connect(self.unix_path), b""
        return self.conn

    def _reply(self, sock: socket.socket, buf: bytes) -> tuple[dict | None, bytes]:
        while b"\n" not in buf:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return None, buf
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        return json.loads(line), buf

    def _tally(self, key: str) -> None:
        self.answers[key] = self.answers.get(key, 0) + 1

    # -------------------------------------------------------------- message
    def one(self) -> None:
        kind = self.rng.choice(["bytes", "json", "args", "config", "version", "readonly", "oversized",
                                "token", "disconnect", "checkpoint", "nonobject"])
        self.sent += 1
        if kind == "oversized":
            return self._fatal(self.unix_path, b'{"version":1,"cmd":"drain","args":{"x":"' +
                               b"A" * (MAX_MESSAGE_BYTES + self.rng.randint(1, 5000)) + b'"}}\n',
                               "message_too_large")
        if kind == "token":
            token = self.rng.choice([None, "", TOKEN[:-1], TOKEN.upper(), "x" * 300])
            msg = {"version": 1, "cmd": self.rng.choice(["drain", "pause", "status"])}
            if token is not None:
                msg["token"] = token
            return self._fatal(self.tcp, json.dumps(msg).encode() + b"\n", "unauthorized")
        if kind == "disconnect":
            s = self._connect(self.unix_path)
            full = json.dumps({"version": 1, "cmd": self.rng.choice(["drain", "pause"])}).encode()
            s.sendall(full[: self.rng.randint(0, len(full) - 1)])  # never the newline
            s.close()
            self._tally("disconnect")
            return
        line = self._line(kind)
        sock = self._unix()
        sock.sendall(line + b"\n")
        reply, self.buf = self._reply(sock, self.buf)
        assert reply is not None, f"server closed on recoverable input {line[:80]!r}"
        if reply["ok"]:
            assert kind == "readonly", (kind, line[:200], reply)
            self._tally("ok")
        else:
            assert reply["error"]["code"] in RECOVERABLE, (line[:200], reply)
            self._tally(reply["error"]["code"])

    def _fatal(self, address, data: bytes, code: str) -> None:
        s = self._connect(address)
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply, _ = self._reply(s, b"")
        assert reply is not None and reply["error"]["code"] == code, reply
        s.close()
        self._tally(code)

    def _line(self, kind: str) -> bytes:
        r = self.rng
        if kind == "bytes":
            data = bytes(r.randrange(256) for _ in range(r.randint(1, 300)))
            return data.replace(b"\n", b" ").strip() or b"\x00"
        if kind == "json":
            good = json.dumps({"version": 1, "cmd": r.choice(["pause", "drain", "config"]), "args": {}})
            cut = r.randint(1, len(good) - 1)
            # A prefix never closes the outer object, so each variant is invalid JSON.
            return r.choice([good[:cut], good[:cut] + "]", "{" * r.randint(1, 5000), '{"version":1,"cmd":NaN}',
                             good.replace('"', "'")]).encode()
        if kind == "nonobject":
            return json.dumps(r.choice([[], [1, 2], "drain", 3, None, True])).encode()
        if kind == "version":
            return json.dumps({"version": r.choice([0, 2, "1", 1.5, None, True]), "cmd": "drain"}).encode()
        if kind == "args":
            cmd, args = r.choice([
                ("metrics", {"last": r.choice(["3", 0, -1, 101, 2.5, True, [1], None])}),
                ("status", {"verbose": True}), ("pause", {"seconds": 5}), ("drain", {"force": True}),
                ("resume", {"x": 1}), ("config", {}), ("config", {"action": r.choice(["del", 1, None])}),
                (r.choice(["shutdown", "exec", "", "STATUS", "eval", "__import__"]), {}),
            ])
            if cmd == "":
                return json.dumps({"version": 1, "cmd": cmd, "args": args}).encode()
            return json.dumps({"version": 1, "id": r.randint(0, 10**6), "cmd": cmd, "args": args}).encode()
        if kind == "config":
            field, value = r.choice([
                ("train.eval_interval", r.choice(["5", 2.5, -3, True, None, {"a": 1}])),
                ("logging.log_interval", r.choice([0, -1, "x", 1.0])),
                ("train.steps", r.choice([0, 2**60, "many", 1e3])),
                ("data.max_bad_sample_fraction", r.choice([-0.1, 2, "low"])),
                (r.choice(["model.hidden_size", "train.lr", "parallel.tp", "logging.output_dir", "x", "train"]), 1),
            ])
            args = {"action": "set", "field": field, "value": value}
            return json.dumps({"version": 1, "cmd": "config", "args": args}).encode()
        if kind == "checkpoint":
            return json.dumps({"version": 1, "cmd": "checkpoint"}).encode()
        assert kind == "readonly"
        cmd, args = r.choice([("status", {}), ("metrics", {"last": r.randint(1, 100)}),
                              ("config", {"action": "get"}), ("config", {"action": "get", "field": "train.lr"})])
        return json.dumps({"version": 1, "id": "ro", "cmd": cmd, "args": args}).encode()


def test_fuzzed_run_keeps_answering_and_trains_identically(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    run = tmp_path / "fuzzed"
    args = [*COMMON, "train.steps=100000", f"logging.output_dir={run}", "logging.tensorboard=false",
            "logging.log_interval=1000", "control.tcp_port=0", f"control.token_file={tmp_path / 'token'}"]
    with spawn_torchrun(2, "megascale_omni.smoke", args, timeout=240) as proc:
        wait_for_server(run, proc)
        endpoint = json.loads((run / "control.json").read_text())
        host, port = endpoint["tcp"].rsplit(":", 1)
        status = ControlClient(endpoint["unix"])
        config_before = status.call("config", action="get")["config"]
        first_step = status.call("status")["step"]
        fuzzer = Fuzzer(endpoint["unix"], (host, int(port)))
        # Keep going until both hold: enough messages, and training visibly
        # advanced while they arrived (no timing assumption either way).
        while fuzzer.sent < MIN_MESSAGES or status.call("status")["step"] < first_step + 10:
            fuzzer.one()
            assert proc.poll() is None, output_of(proc)[-4000:]
        after = status.call("status")
        assert after["state"] == "running" and after["pending_commands"] == 0
        assert status.call("config", action="get")["config"] == config_before
        drained = status.call("drain")["step"]
        assert proc.wait(timeout=60) == 0, output_of(proc)[-4000:]
        assert "Traceback" not in output_of(proc)
    assert fuzzer.sent >= MIN_MESSAGES
    for code in ("parse_error", "unknown_command", "invalid_args", "invalid_value", "unauthorized",
                 "message_too_large", "disconnect", "ok"):
        assert fuzzer.answers.get(code, 0) > 0, fuzzer.answers
    print(f"fuzz: {fuzzer.sent} messages over steps {first_step}..{after['step']}, drained at {drained}: "
          f"{sorted(fuzzer.answers.items())}")
    fuzzed = [r["loss"] for r in read_metrics(run)]
    assert len(fuzzed) == drained

    reference = train_and_read("megascale_omni.smoke", 2, [*COMMON, f"train.steps={drained}"],
                               tmp_path / "reference", steps=drained, timeout=200)
    assert [r["loss"] for r in reference] == fuzzed
