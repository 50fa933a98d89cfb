"""The one exception type for invalid configuration."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """An invalid setting: names the field, the offending value and the fix.

    Entry points turn it into exit code 2 and a single line on stderr
    (see :func:`megascale_omni.config.cli.run_cli`).
    """

    def __init__(self, field: str, value: Any, hint: str, *, rank_local: bool = False):
        self.field = field
        self.value = value
        self.hint = hint
        #: Detected on the raising rank only (e.g. a port that rank failed to
        #: bind), so entry points print it there instead of on rank 0 only.
        self.rank_local = rank_local
        super().__init__(f"config error: {field}={value!r}: {hint}")


def require_positive(section: str, name: str, value: int | float, allow_zero: bool = False) -> None:
    """Raise ConfigError for ``section.name`` unless ``value`` > 0 (>= 0 with ``allow_zero``)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{section}.{name}", value, f"must be {bound}")
