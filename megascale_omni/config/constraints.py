"""Per-field constraints, declared where the field is declared.

A section field states its range in its own declaration::

    lr: float = checked(1.0e-3, gt=0)
    adam_beta1: float = checked(0.9, ge=0, lt=1)

and the section's ``__post_init__`` starts with :func:`check_fields`, which
raises the one-line :class:`~megascale_omni.config.errors.ConfigError`
(field, value, the allowed range) for the first violated bound. Types and
finiteness are enforced for every field by the loader (``_coerce``);
relations between fields stay in ``__post_init__`` (one section) or in
:mod:`megascale_omni.config.validate` (across sections, with the world size).

Why not pydantic: our sections are plain dataclasses that megatron-free code,
checkpoints and the CLI override syntax already share; the bounds are all
this needs, and the error format is ours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from typing import Any, Optional

#: Key of a field's :class:`Bound` in ``dataclasses.Field.metadata``.
BOUND = "megascale_omni.bound"


@dataclasses.dataclass(frozen=True)
class Bound:
    """Allowed numeric range of one field; ``None`` values are not checked
    (optional fields). ``note`` follows the range in the error."""

    gt: Optional[float] = None
    ge: Optional[float] = None
    lt: Optional[float] = None
    le: Optional[float] = None
    note: str = ""

    def allows(self, value: float) -> bool:
        return not (
            (self.gt is not None and value <= self.gt)
            or (self.ge is not None and value < self.ge)
            or (self.lt is not None and value >= self.lt)
            or (self.le is not None and value > self.le)
        )

    def describe(self) -> str:
        """``> 0``, ``>= 0``, ``<= 4``, ``in [0, 1)``, ``in [0, 65535]``..."""
        low = f"({_num(self.gt)}" if self.gt is not None else (f"[{_num(self.ge)}" if self.ge is not None else None)
        high = f"{_num(self.lt)})" if self.lt is not None else (f"{_num(self.le)}]" if self.le is not None else None)
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f"> {_num(self.gt)}" if self.gt is not None else f">= {_num(self.ge)}"
        else:
            text = f"< {_num(self.lt)}" if self.lt is not None else f"<= {_num(self.le)}"
        return f"{text} {self.note}" if self.note else text


def _num(x: float) -> str:
    """``1048576`` rather than ``1.04858e+06``; ``0.5`` as is."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def checked(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    gt: Optional[float] = None,
    ge: Optional[float] = None,
    lt: Optional[float] = None,
    le: Optional[float] = None,
    note: str = "",
) -> Any:
    """A dataclass field with a declared range (see the module docstring)."""
    bound = Bound(gt, ge, lt, le, note)
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={BOUND: bound})
    return dataclasses.field(default=default, metadata={BOUND: bound})


def check_fields(section_obj: Any, section: str) -> None:
    """Raise ConfigError for the first field of ``section_obj`` (a config
    section named ``section``) outside its declared :class:`Bound`."""
    from megascale_omni.config.errors import ConfigError

    for f in dataclasses.fields(section_obj):
        bound = f.metadata.get(BOUND)
        value = getattr(section_obj, f.name)
        if bound is None or value is None or isinstance(value, bool):
            continue
        if not bound.allows(value):
            raise ConfigError(f"{section}.{f.name}", value, f"must be {bound.describe()}")


def declared_bounds(section_cls: type) -> dict[str, Bound]:
    """``{field: Bound}`` of a section class (documentation and tests)."""
    return {f.name: f.metadata[BOUND] for f in dataclasses.fields(section_cls) if BOUND in f.metadata}
