"""Errors that end a process with one line and a known exit code (stdlib
only: the scheduler, a client deployed apart, raises and reads them too):
invalid configuration (exit 2) and failed pre-flight checks (exit 44)."""

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


#: Exit code of a rank whose replica group the hang watchdog tore down (a rank
#: of it was stuck; docs/hang-detection.md). ``omni-run`` passes it on; the
#: live scheduler replaces the group on its pool (docs/scheduler.md,
#: "Robustness"); a requeue restarts a fixed job.
EXIT_HUNG = 43
#: Exit code of a process group whose pre-flight health checks failed
#: (:mod:`megascale_omni.preflight`): the node named in the one-line message
#: and in the JSON result file should be left out of the next placement.
EXIT_PREFLIGHT_FAILED = 44


class PreflightFailed(RuntimeError):
    """One or more pre-flight checks failed (every rank of the group raises it).

    ``lines`` holds one line per failed check, each naming the node, the
    rank, the check, the measured value and the expected bound with the
    setting that holds it; entry points print them on rank 0 and exit with
    :data:`EXIT_PREFLIGHT_FAILED`.
    """

    def __init__(self, lines: list[str]):
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))
