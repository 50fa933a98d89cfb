"""Helpers for tests that drive a running job through its control socket."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from megascale_omni.control import ControlClient
from tests.launcher import output_of

#: The installed console script (setup.py entry point), next to this interpreter.
OMNI_CTL = str(Path(sys.executable).parent / "omni-ctl")


def wait_for_server(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Block until the job's control server answers ``status``; fail with the
    job's log if it exits or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"job exited with {proc.returncode} before serving:\n{output_of(proc)[-4000:]}")
        if (run_dir / "control.json").exists():
            try:
                with ControlClient(str(run_dir / "control.sock"), timeout_s=5) as c:
                    c.call("status")
                return
            except OSError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"no control server after {timeout_s}s:\n{output_of(proc)[-4000:]}")


def omni_ctl(run_dir: Path, *args: str, timeout_s: float = 60) -> dict:
    """Run ``omni-ctl --run-dir RUN --json ARGS`` and return the reply object."""
    res = subprocess.run([OMNI_CTL, "--run-dir", str(run_dir), "--json", *args], capture_output=True, text=True,
                         timeout=timeout_s)
    assert res.returncode in (0, 1), f"omni-ctl {args} exited {res.returncode}: {res.stderr}"
    reply = json.loads(res.stdout)
    assert (res.returncode == 0) == reply["ok"]
    return reply


def wait_for_step(run_dir: Path, step: int, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with ControlClient(str(run_dir / "control.sock")) as c:
            now = c.call("status")["step"]
        if now >= step:
            return now
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout_s}s")
