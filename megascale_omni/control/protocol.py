"""Wire format of the control socket, version 1.

One message is one line: a UTF-8 JSON object followed by ``\\n``, at most
:data:`MAX_MESSAGE_BYTES` bytes before the newline. A request is::

    {"version": 1, "id": "7", "cmd": "status", "args": {}, "token": "..."}

and its reply is either ``{"version": 1, "id": "7", "ok": true, "result": {...}}``
or ``{"version": 1, "id": "7", "ok": false, "error": {"code": "...", "message": "..."}}``.

Only ``json`` is used in either direction: nothing on the socket is ever
unpickled or evaluated. Non-finite floats (a diverged loss) are sent as the
strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` so every message is
strict JSON. The full contract is in ``docs/control-protocol.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

PROTOCOL_VERSION = 1
#: Largest message, bytes, excluding the terminating newline.
MAX_MESSAGE_BYTES = 64 * 1024
#: Longest accepted request id (characters).
MAX_ID_CHARS = 128

RequestId = Union[str, int, None]


class ErrorCode:
    """Values of ``error.code`` in a reply (stable across protocol version 1)."""

    PARSE_ERROR = "parse_error"  # not UTF-8 JSON
    BAD_REQUEST = "bad_request"  # JSON, but not a valid request object
    UNSUPPORTED_VERSION = "unsupported_version"
    UNAUTHORIZED = "unauthorized"  # missing or wrong token (connection is closed)
    UNKNOWN_COMMAND = "unknown_command"
    INVALID_ARGS = "invalid_args"  # unknown/missing argument or wrong type
    INVALID_VALUE = "invalid_value"  # config value of the right shape but not allowed
    MESSAGE_TOO_LARGE = "message_too_large"  # connection is closed
    NOT_CONFIGURED = "not_configured"  # e.g. checkpoint without a checkpoint service
    UNAVAILABLE = "unavailable"  # draining or shutting down
    BUSY = "busy"  # too many connections or pending commands (connection is closed)
    REQUEST_TIMEOUT = "request_timeout"  # no complete request in time (connection is closed)
    INTERNAL = "internal_error"


class ProtocolError(Exception):
    """A request that cannot be served; becomes an error reply.

    ``details`` are extra keys of the ``error`` object (e.g. ``field``,
    ``value``, ``hint`` for invalid arguments).
    """

    def __init__(self, code: str, message: str, request_id: RequestId = None, **details: Any):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.details = details

    def reply(self) -> dict:
        return error_reply(self.request_id, self.code, self.message, **self.details)


@dataclass(frozen=True)
class Request:
    """A parsed, well-formed request (arguments not yet checked against the command)."""

    cmd: str
    args: dict = field(default_factory=dict)
    id: RequestId = None
    token: Optional[str] = None


_REQUEST_KEYS = {"version", "id", "cmd", "args", "token"}


def parse_request(line: bytes) -> Request:
    """Decode one request line (without its newline). Raises ProtocolError.

    Structural checks only: which command and which arguments are valid is
    decided by :mod:`megascale_omni.control.commands`.
    """
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE, f"message exceeds {MAX_MESSAGE_BYTES} bytes")
    try:
        obj = json.loads(line.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # RecursionError: deeply nested arrays ("[[[[...") inside the size limit.
        raise ProtocolError(ErrorCode.PARSE_ERROR, f"not a UTF-8 JSON line: {_short(e)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a request is a JSON object, got {type(obj).__name__}")
    request_id = obj.get("id")
    if not (request_id is None or isinstance(request_id, str) or _is_int(request_id)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'id' must be a string, an integer or absent")
    if isinstance(request_id, str) and len(request_id) > MAX_ID_CHARS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"'id' is longer than {MAX_ID_CHARS} characters")
    unknown = sorted(set(obj) - _REQUEST_KEYS)
    if unknown:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"unknown request keys {unknown}; allowed: {sorted(_REQUEST_KEYS)}", request_id
        )
    version = obj.get("version")
    if version != PROTOCOL_VERSION or not _is_int(version):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported; send \"version\": {PROTOCOL_VERSION}",
            request_id,
            supported=[PROTOCOL_VERSION],
        )
    cmd = obj.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'cmd' must be a non-empty string", request_id)
    args = obj.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'args' must be a JSON object", request_id)
    token = obj.get("token")
    if token is not None and not isinstance(token, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "'token' must be a string", request_id)
    return Request(cmd=cmd, args=args, id=request_id, token=token)


def request_message(cmd: str, args: Optional[dict] = None, request_id: RequestId = None,
                    token: Optional[str] = None) -> dict:
    """Build a request object (client side)."""
    msg: dict = {"version": PROTOCOL_VERSION, "id": request_id, "cmd": cmd, "args": args or {}}
    if token is not None:
        msg["token"] = token
    return msg


def ok_reply(request_id: RequestId, result: Any) -> dict:
    return {"version": PROTOCOL_VERSION, "id": request_id, "ok": True, "result": result}


def error_reply(request_id: RequestId, code: str, message: str, **details: Any) -> dict:
    return {
        "version": PROTOCOL_VERSION,
        "id": request_id,
        "ok": False,
        "error": {"code": code, "message": message, **details},
    }


def encode(message: Any) -> bytes:
    """One strict-JSON line (non-finite floats become strings, see module doc)."""
    return json.dumps(_finite(message), allow_nan=False, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def decode_reply(line: bytes) -> dict:
    """Decode a reply line (client side). Raises ProtocolError on a malformed reply."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(ErrorCode.PARSE_ERROR, f"server sent a non-JSON line: {_short(e)}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "server reply is not a reply object")
    if obj.get("version") != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"server speaks protocol {obj.get('version')!r}")
    return obj


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text[:200]
