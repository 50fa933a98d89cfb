"""The one exception type for invalid configuration (stdlib only: the
scheduler, a client deployed apart, raises it too)."""

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


#: A replica group's exit code when its hang watchdog ended it (the live scheduler replaces the group).
EXIT_HUNG = 43
#: A replica group's exit code when its pre-flight checks failed; it writes ``preflight.json`` naming the node in
#: its output directory (the live scheduler excludes that node and replaces the group).
EXIT_PREFLIGHT_FAILED = 44
