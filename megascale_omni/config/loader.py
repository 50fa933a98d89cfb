"""Build typed configs from YAML files and ``section.field=value`` overrides.

We use our own small dataclass loader instead of OmegaConf/Hydra because the
contract we need is narrow and strict: unknown keys and wrong types must fail
with the exact dotted field name, and ``int`` must never silently become
``str``. Values of overrides are parsed as YAML scalars, so ``parallel.vpp=null``
and ``train.lr=3e-4`` mean what they say.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union

import yaml

from megascale_omni.config.errors import ConfigError

T = TypeVar("T")


def load_yaml(path: str | os.PathLike) -> dict:
    """Read a YAML mapping; a missing file or non-mapping is a ConfigError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError("--config", path, "file not found; pass an existing YAML file (see examples/)")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError("--config", path, f"is not valid YAML{where}: fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("--config", path, "must contain a mapping of sections (model:, train:, ...)")
    return data


def merge_sections(base: dict, update: dict) -> dict:
    """``update`` over ``base``, recursively for mappings (returns a new dict)."""
    out = _deep_copy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_sections(out[key], value)
        else:
            out[key] = _deep_copy(value) if isinstance(value, dict) else value
    return out


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply ``a.b=value`` strings to a nested dict (returns a new dict)."""
    out = _deep_copy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, None, "overrides look like section.field=value, e.g. train.lr=3e-4")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("-")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(key, value, f"{part!r} is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def from_dict(cls: type[T], data: Mapping[str, Any] | None, prefix: str = "") -> T:
    """Construct dataclass ``cls`` from ``data``, checking keys and types.

    Raises ConfigError naming the dotted field for unknown keys (with a
    close-match suggestion), wrong types and anything ``__post_init__`` rejects.
    """
    data = dict(data or {})
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{prefix}{key}", data[key], f"unknown key; {hint}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{prefix}{name}")
    return cls(**kwargs)


def coerce_field(cfg: Any, dotted: str, value: Any) -> Any:
    """Check ``value`` for field ``section.name`` of config ``cfg`` exactly as a
    YAML value would be checked (type, then the section's ``__post_init__``).

    Returns the coerced value; raises ConfigError naming the field. ``cfg`` is
    not modified. Used for run-time changes (control ``config set``).
    """
    section_name, _, name = dotted.partition(".")
    section = getattr(cfg, section_name)
    coerced = _coerce(typing.get_type_hints(type(section))[name], value, dotted)
    dataclasses.replace(section, **{name: coerced})  # runs the section's own range checks
    return coerced


def _coerce(tp: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(name, value, f"must be a section (mapping) of {tp.__name__} fields")
        return from_dict(tp, value, prefix=f"{name}.")
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, name)
            except ConfigError as e:
                errors.append(e.hint)
        raise ConfigError(name, value, " or ".join(errors) + (" (or null)" if type(None) in args else ""))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(name, value, f"must be one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, value, "must be a list")
        return [_coerce(item_tp, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-4" (no dot) as a string.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, value, "must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(name, value, "must be a string")
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {name}")


def to_dict(cfg: Any) -> dict:
    """Plain-dict view of a config (for logging, checkpoints and JSON)."""
    return dataclasses.asdict(cfg)


def _deep_copy(d: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}
