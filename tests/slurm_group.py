"""A stand-in replica group for launcher tests (run by torchrun, as a group's entry is):
records that it started (``started``: host and Slurm job id) in its
``logging.output_dir``, then waits; it exits with the code written to
``<output_dir>/exit_code`` (writing ``preflight.json`` naming this host first
when that code is 44, as a failed pre-flight does)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from megascale_omni.errors import EXIT_PREFLIGHT_FAILED


def main() -> int:
    out = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("logging.output_dir=")))
    out.mkdir(parents=True, exist_ok=True)
    (out / "started").write_text(f"{socket.gethostname()} {os.environ.get('SLURM_JOB_ID', '')}\n")
    while not (out / "exit_code").exists():
        time.sleep(0.1)
    code = int((out / "exit_code").read_text())
    if code == EXIT_PREFLIGHT_FAILED:
        (out / "preflight.json").write_text(json.dumps({"node": socket.gethostname(), "failed": ["stand-in"]}))
    return code


if __name__ == "__main__":
    sys.exit(main())
