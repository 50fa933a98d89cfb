"""A stand-in replica group for launcher tests (run by torchrun, as a group's entry is):
records that it started (``started``: host and Slurm job id) in its
``logging.output_dir``, then waits; it exits with the code written to
``<output_dir>/exit_code`` (writing a failed pre-flight result naming this
host first when that code is 44, as omni-preflight does: docs/preflight.md)."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from megascale_omni.errors import EXIT_PREFLIGHT_FAILED
from megascale_omni.preflight.result import CheckResult, PreflightReport, write_report


def main() -> int:
    out = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("logging.output_dir=")))
    out.mkdir(parents=True, exist_ok=True)
    (out / "started").write_text(f"{socket.gethostname()} {os.environ.get('SLURM_JOB_ID', '')}\n")
    while not (out / "exit_code").exists():
        time.sleep(0.1)
    code = int((out / "exit_code").read_text())
    if code == EXIT_PREFLIGHT_FAILED:
        failed = CheckResult("clock_skew", "fail", 5000.0, "ms", 100.0, "<=", "preflight.max_clock_skew_ms",
                             host=socket.gethostname())
        write_report(PreflightReport([failed], world_size=1), out / "preflight.json")
    return code


if __name__ == "__main__":
    sys.exit(main())
