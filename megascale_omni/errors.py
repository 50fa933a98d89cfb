"""The one exception type for invalid configuration (stdlib only: the
scheduler, a client deployed apart, raises it too)."""

from __future__ import annotations

from typing import Any

#: Exit code of a rank whose replica group the progress watchdog tore down
#: (a rank of it was stuck; docs/hang-detection.md). ``omni-run`` passes it
#: on; a requeue (or ``torchrun --max-restarts``) and the elastic scheduler restart the group.
EXIT_HUNG = 43


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
