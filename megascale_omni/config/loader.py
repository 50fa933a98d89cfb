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
import math
import os
import types
import typing
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union

import yaml

from megascale_omni.config.errors import ConfigError

T = TypeVar("T")


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML
    keeps the last one silently, so a typo'd duplicate would win unnoticed)."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, typing.Hashable) and key in seen:
            raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
        if isinstance(key, typing.Hashable):
            seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int):
        self.key, self.first, self.again = key, first, again


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def load_yaml(path: str | os.PathLike) -> dict:
    """Read a YAML mapping of sections. A missing, unreadable, non-UTF-8,
    empty or malformed file, a key given twice in one mapping, or a top level
    that is not a mapping is a ConfigError naming the file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError("--config", path, "file not found; pass an existing YAML file (see examples/)")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("--config", path, f"is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError("--config", path, f"cannot be read: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as e:
        raise ConfigError("--config", path, f"key {e.key!r} appears twice in one section (lines {e.first} and "
                                            f"{e.again}); keep one") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("--config", path, f"is not valid YAML{where}: fix the syntax") from None
    if data is None:
        raise ConfigError("--config", path, "is empty; give at least one section (model:, train:, ...)")
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
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, value, "must be a number")
        if not math.isfinite(value):
            raise ConfigError(name, value, "must be a finite number (not nan or inf)")
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
