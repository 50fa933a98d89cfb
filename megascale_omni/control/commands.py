"""The command set of protocol version 1: arguments, and what may change at run time.

Two kinds of command:

- *immediate* (``status``, ``metrics``, ``config get``) are answered by the
  server thread from a snapshot the training loop publishes;
- *deferred* (``pause``, ``resume``, ``drain``, ``checkpoint``,
  ``config set``, ``join``) become an :class:`Op` that every rank of the replica group
  applies at the same step boundary; the reply is sent once it is applied.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megascale_omni.config import ConfigError, coerce_field
from megascale_omni.control.protocol import ErrorCode, ProtocolError, Request

#: Integers at least this large are not exact in float64.
MAX_EXACT_INT = 2**53
#: Most step records kept for ``metrics``.
MAX_METRIC_RECORDS = 100

#: Config fields ``config set`` may change while training runs, with why the
#: change takes effect. Everything else is baked into objects built at start
#: (model, optimizer, LR schedule, data plan), so changing it would lie.
#: Order matters: the index is the field's code on the wire (append only).
MUTABLE_FIELDS: dict[str, str] = {
    "logging.log_interval": "read by the loop at every step when deciding to print",
    "train.eval_interval": "read by the loop after every step",
    "train.steps": "the loop condition; the LR schedule keeps the length it was built with "
                   "(steps past it run at train.min_lr)",
    "data.max_bad_sample_fraction": "read whenever bad samples are counted",
}
MUTABLE_FIELD_NAMES: tuple[str, ...] = tuple(MUTABLE_FIELDS)


@dataclass(frozen=True)
class Op:
    """A deferred command, as applied by every rank at a step boundary.

    ``field``/``value`` are set for ``config_set`` only; ``value`` is an int,
    float or bool (it travels as one float64, exact for these types).
    """

    kind: str
    field: Optional[str] = None
    value: Any = None


@dataclass(frozen=True)
class ArgSpec:
    """One argument: JSON type(s), whether required, allowed values."""

    types: tuple[type, ...]
    required: bool = False
    choices: tuple = ()
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    help: str = ""


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    args: dict[str, ArgSpec] = field(default_factory=dict)
    #: Kind of :class:`Op` this command queues; None = answered immediately.
    op: Optional[str] = None


_ANY_JSON = (str, int, float, bool, type(None))

COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("status", "step, state, layout, world size, last loss, uptime, replica info"),
        Command(
            "metrics",
            "the last step records (loss, lr, grad_norm, tokens/s, timings)",
            {"last": ArgSpec((int,), minimum=1, maximum=MAX_METRIC_RECORDS, help="how many records (default 1)")},
        ),
        Command("checkpoint", "save a checkpoint at the next step boundary", op="checkpoint"),
        Command("drain", "finish the current step, stop on every rank, exit 0", op="drain"),
        Command("pause", "hold every rank at the next step boundary", op="pause"),
        Command("resume", "continue after pause", op="resume"),
        Command("join", "a standby replica group joins the elastic quorum (elastic.standby=true)", op="join"),
        Command(
            "config",
            "get the config, or set a run-time mutable field",
            {
                "action": ArgSpec((str,), required=True, choices=("get", "set")),
                "field": ArgSpec((str,), help="dotted name, e.g. train.eval_interval"),
                "value": ArgSpec(_ANY_JSON, help="new value (set only)"),
            },
        ),
    )
}


def check_args(request: Request) -> tuple[Command, dict]:
    """The command and its checked arguments (defaults not filled in).

    Raises ProtocolError ``unknown_command`` or ``invalid_args`` naming the
    argument, the value and the fix.
    """
    command = COMMANDS.get(request.cmd)
    if command is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_COMMAND,
            f"unknown command {request.cmd[:64]!r}; commands: {', '.join(COMMANDS)}",
            request.id,
        )
    for name, value in request.args.items():
        spec = command.args.get(name)
        if spec is None:
            allowed = ", ".join(command.args) or "none"
            raise _invalid(request, name, value, f"unknown argument of {command.name}; arguments: {allowed}")
        if isinstance(value, bool) and bool not in spec.types or not isinstance(value, spec.types):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in spec.types)
            raise _invalid(request, name, value, f"must be {wanted}")
        if spec.choices and value not in spec.choices:
            raise _invalid(request, name, value, f"must be one of {', '.join(map(repr, spec.choices))}")
        if spec.minimum is not None and value < spec.minimum or spec.maximum is not None and value > spec.maximum:
            raise _invalid(request, name, value, f"must be in [{spec.minimum}, {spec.maximum}]")
    for name, spec in command.args.items():
        if spec.required and name not in request.args:
            raise _invalid(request, name, None, "is required")
    return command, dict(request.args)


def check_config_set(request: Request, cfg: Any, args: dict) -> Op:
    """Validate ``config set`` against the whitelist and the field's type and
    range (the same rules as the YAML loader). Returns the Op to queue."""
    name = args.get("field")
    if name is None or "value" not in args:
        raise _invalid(request, "field" if name is None else "value", None, "config set needs field and value")
    if name not in MUTABLE_FIELDS:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE,
            f"{name[:100]!r} cannot change while training runs; mutable: {', '.join(MUTABLE_FIELD_NAMES)}",
            request.id,
            field=name[:100],
            hint="change it in the YAML config and restart from a checkpoint",
        )
    try:
        value = coerce_field(cfg, name, args["value"])
    except ConfigError as e:
        raise ProtocolError(
            ErrorCode.INVALID_VALUE, str(e), request.id, field=e.field, value=_short_value(e.value), hint=e.hint
        ) from None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_EXACT_INT:
        # Ops travel as float64 (see exchange.py); larger ints would round.
        raise ProtocolError(
            ErrorCode.INVALID_VALUE, f"config error: {name}={value}: must be below 2**53", request.id,
            field=name, value=_short_value(value), hint="use a smaller value",
        )
    return Op("config_set", name, value)


def get_field(cfg: Any, dotted: str) -> Any:
    section, _, name = dotted.partition(".")
    return getattr(getattr(cfg, section), name)


def set_field(cfg: Any, dotted: str, wire_value: Any) -> Any:
    """Set an already-checked value received as float64 (every rank, at a
    step boundary), cast back to the field's declared type. Returns it."""
    section_name, _, name = dotted.partition(".")
    section = getattr(cfg, section_name)
    tp = typing.get_type_hints(type(section))[name]
    value = tp(wire_value) if tp in (int, float, bool) else wire_value
    setattr(section, name, value)
    return value


def _invalid(request: Request, name: str, value: Any, hint: str) -> ProtocolError:
    return ProtocolError(
        ErrorCode.INVALID_ARGS,
        f"{request.cmd}: argument {name[:64]!r}={_short_value(value)!r}: {hint}",
        request.id,
        field=name[:64],
        value=_short_value(value),
        hint=hint,
    )


def _short_value(value: Any) -> Any:
    """Echo a rejected value back only if it is small."""
    if isinstance(value, (int, float, bool, type(None))):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 100 else text[:100] + "..."
