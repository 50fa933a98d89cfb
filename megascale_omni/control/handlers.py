"""Turn a request into a reply (server thread).

Immediate commands are answered from :class:`ControlState`; deferred ones
are validated here, completely, and queued for the training loop, so a bad
request is refused before it can reach a rank and no state changes.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from megascale_omni.control.commands import (
    MUTABLE_FIELDS,
    Op,
    check_args,
    check_config_set,
)
from megascale_omni.control.protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError, Request, ok_reply
from megascale_omni.control.state import ControlState, Enqueued, Post


class RequestHandler:
    """Serves requests against one :class:`ControlState` (server thread only).

    ``cfg`` is the live job config, read only here (to type-check ``config
    set`` the same way the YAML loader does). ``checkpointing`` says whether
    a checkpoint service is wired in.
    """

    def __init__(self, state: ControlState, cfg: Any, checkpointing: bool, started_at: float):
        self.state = state
        self.cfg = cfg
        self.checkpointing = checkpointing
        self.started_at = started_at

    def __call__(self, request: Request, post: Post) -> Optional[dict]:
        """The reply to send now, or None when ``post`` will be called later
        (after the training loop applied the command). Raises ProtocolError."""
        command, args = check_args(request)
        if command.name == "status":
            return ok_reply(request.id, self._status())
        if command.name == "metrics":
            return ok_reply(request.id, {"records": self.state.records(args.get("last", 1))})
        if command.name == "config":
            if args["action"] == "get":
                return ok_reply(request.id, self._config_get(request, args))
            op = check_config_set(request, self.cfg, args)
        else:
            assert command.op is not None
            op = Op(command.op)
        return self._queue(request, op, post)

    def _queue(self, request: Request, op: Op, post: Post) -> None:
        status = self.state.status()
        if op.kind == "checkpoint" and not self.checkpointing:
            raise ProtocolError(
                ErrorCode.NOT_CONFIGURED,
                "checkpointing is not configured for this job; nothing was saved",
                request.id,
                hint="set checkpoint.dir (see docs/checkpoints.md) when launching the job",
            )
        if op.kind == "join" and status["state"] != "standby":
            raise ProtocolError(
                ErrorCode.UNAVAILABLE,
                f"the replica group is {status['state']}, not standing by; nothing to join",
                request.id,
                hint="join applies to replica groups started with elastic.standby=true",
            )
        if status["state"] in ("draining", "finished"):
            raise ProtocolError(
                ErrorCode.UNAVAILABLE, f"the replica is {status['state']}; no further commands apply", request.id
            )
        queued = self.state.enqueue(op, request.id, post)
        if queued is Enqueued.CLOSED:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "the control plane is shutting down", request.id)
        if queued is Enqueued.FULL:
            raise ProtocolError(
                ErrorCode.BUSY,
                f"{self.state.max_pending} commands (or {self.state.max_pending} requests for this one) are "
                f"waiting for a step boundary; nothing was queued",
                request.id,
                hint="retry after the next step boundary (see pending_commands in status)",
            )
        return None

    def _status(self) -> dict:
        status = self.state.status()
        status["uptime_s"] = round(time.time() - self.started_at, 3)
        status["protocol_version"] = PROTOCOL_VERSION
        status["checkpointing"] = self.checkpointing
        return status

    def _config_get(self, request: Request, args: dict) -> dict:
        if "value" in args:
            raise ProtocolError(
                ErrorCode.INVALID_ARGS, "config get takes no 'value'; use action 'set'", request.id, field="value"
            )
        view = self.state.config()
        name = args.get("field")
        if name is None:
            return {"config": view, "mutable": dict(MUTABLE_FIELDS)}
        section, _, key = name.partition(".")
        if not isinstance(view.get(section), dict) or key not in view[section]:
            raise ProtocolError(
                ErrorCode.INVALID_ARGS,
                f"config get: no field {name[:100]!r}; sections: {', '.join(view)}",
                request.id,
                field=name[:100],
            )
        return {"field": name, "value": view[section][key], "mutable": name in MUTABLE_FIELDS}
