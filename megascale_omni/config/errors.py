"""The one exception type for invalid configuration, and range checks that raise it.

:class:`ConfigError` is defined in :mod:`megascale_omni.errors` (stdlib
only, so the scheduler can raise it without importing the config package).
"""

from __future__ import annotations

from megascale_omni.errors import ConfigError

__all__ = ["ConfigError", "require_positive"]


def require_positive(section: str, name: str, value: int | float, allow_zero: bool = False) -> None:
    """Raise ConfigError for ``section.name`` unless ``value`` > 0 (>= 0 with ``allow_zero``)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{section}.{name}", value, f"must be {bound}")
