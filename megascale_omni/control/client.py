"""Client library for the control socket (used by ``omni-ctl`` and tests).

Example::

    with ControlClient("runs/demo/control.sock") as c:
        print(c.call("status")["step"])
        c.call("config", action="set", field="train.eval_interval", value=50)
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from typing import Any, Optional, Union

from megascale_omni.control.protocol import (
    MAX_MESSAGE_BYTES,
    ProtocolError,
    decode_reply,
    encode,
    request_message,
)

Address = Union[str, tuple[str, int]]


class ControlError(Exception):
    """The server answered ``ok: false``. ``code`` is an ``ErrorCode`` value."""

    def __init__(self, code: str, message: str, details: Optional[dict] = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}


def parse_target(target: str) -> Address:
    """``/path/x.sock``, ``unix:PATH``, ``HOST:PORT`` or ``tcp:HOST:PORT`` -> address."""
    if target.startswith("unix:"):
        return target[len("unix:"):]
    if target.startswith("tcp:"):
        target = target[len("tcp:"):]
    elif os.path.exists(target) or "/" in target:
        return target
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{target!r} is neither a socket path nor HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def endpoint_of_run(run_dir: str, prefer: str = "unix") -> Address:
    """The address a job publishes in ``<run_dir>/control.json`` (rank 0 writes
    it once the server listens); falls back to ``<run_dir>/control.sock``."""
    path = os.path.join(run_dir, "control.json")
    try:
        with open(path, encoding="utf-8") as f:
            endpoint = json.load(f)
    except FileNotFoundError:
        return os.path.join(run_dir, "control.sock")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}); the job rewrites it when it starts, "
                         f"or pass --socket") from None
    if not isinstance(endpoint, dict):
        raise ValueError(f"{path} must hold a JSON object with 'unix' and/or 'tcp'; pass --socket instead")
    other = "tcp" if prefer == "unix" else "unix"
    chosen = endpoint.get(prefer) or endpoint.get(other)
    if not chosen or not isinstance(chosen, str):
        raise ValueError(f"{path} names no endpoint")
    return parse_target(chosen) if chosen == endpoint.get("tcp") else chosen


class ControlClient:
    """One connection; requests are sent one at a time and matched by id.

    ``timeout_s`` bounds connecting and each reply. Deferred commands
    (``pause``, ``drain``, ...) reply once applied at a step boundary, so
    give them at least one step time.
    """

    def __init__(self, address: Address, token: Optional[str] = None, timeout_s: float = 30.0):
        self.address = parse_target(address) if isinstance(address, str) else address
        self.token = token
        self.timeout_s = timeout_s
        self._sock: Optional[socket.socket] = None
        self._buf = bytearray()
        self._ids = itertools.count(1)

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def connect(self) -> None:
        if self._sock is not None:
            return
        if isinstance(self.address, tuple):
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.address)
            except OSError:
                sock.close()
                raise
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._buf.clear()

    def request(self, cmd: str, args: Optional[dict] = None) -> dict:
        """Send one request, return the raw reply object (``ok`` true or false)."""
        self.connect()
        assert self._sock is not None
        request_id = str(next(self._ids))
        self._sock.sendall(encode(request_message(cmd, args, request_id, self.token)))
        while True:
            reply = decode_reply(self._read_line())
            if reply.get("id") in (request_id, None):
                return reply

    def call(self, cmd: str, **args: Any) -> Any:
        """Send one request and return its ``result``; raises ControlError."""
        reply = self.request(cmd, args)
        if not reply["ok"]:
            error = reply.get("error") or {}
            details = {k: v for k, v in error.items() if k not in ("code", "message")}
            raise ControlError(str(error.get("code")), str(error.get("message")), details)
        return reply["result"]

    def _read_line(self) -> bytes:
        assert self._sock is not None
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                return line
            if len(self._buf) > 16 * MAX_MESSAGE_BYTES:
                raise ProtocolError("message_too_large", "server reply too large")
            chunk = self._sock.recv(65536)
            if not chunk:
                self.close()
                raise ConnectionError("the server closed the connection")
            self._buf += chunk
