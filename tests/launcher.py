"""Launch real multi-process jobs for tests: free ports, hard timeouts, and
cleanup of the whole process group (no stray ranks survive a failed test)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def _env(env: dict | None, timeout: float) -> dict:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    # Collectives must fail fast if a peer dies rather than outlive the test.
    full_env.setdefault("MEGASCALE_DIST_TIMEOUT_S", str(int(max(timeout - 10, 10))))
    return full_env


def run(cmd: Sequence[str], timeout: float, env: dict | None = None, cwd: Path = REPO) -> Result:
    """Run ``cmd`` in its own session; on timeout kill the whole group and fail loudly."""
    full_env = _env(env, timeout)
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n--- stderr tail ---\n{err[-4000:]}")
    finally:
        _kill_group(proc)
    return Result(proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun(nproc: int, target: str, args: Sequence[str], timeout: float, env: dict | None = None) -> Result:
    """``torchrun --nproc-per-node nproc <target> args`` on a free loopback port.

    ``target`` is a script path (``pretrain_llava.py``) or a module name
    (``megascale_omni.smoke``, run with ``-m``).
    """
    return run(_torchrun_cmd(nproc, target, args), timeout=timeout, env=env)


def _torchrun_cmd(nproc: int, target: str, args: Sequence[str]) -> list[str]:
    entry = [target] if target.endswith(".py") else ["-m", target]
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        *entry, *args,
    ]


@contextlib.contextmanager
def spawn_torchrun(
    nproc: int, target: str, args: Sequence[str], log_path: str | Path, timeout: float, env: dict | None = None
) -> Iterator[subprocess.Popen]:
    """Start ``torchrun`` in the background (own session, stdout+stderr to
    ``log_path``) for tests that talk to the job while it runs. The whole
    process group is killed on exit, whatever happened; ``timeout`` sets the
    collective timeout as in :func:`run` (wait on the process yourself)."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            _torchrun_cmd(nproc, target, args), cwd=REPO, env=_env(env, timeout), stdout=log,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        try:
            yield proc
        finally:
            _kill_group(proc)
            proc.wait()


def read_metrics(output_dir: str | Path) -> list[dict]:
    """Per-step training records (records with a ``loss`` key) from metrics.jsonl."""
    path = Path(output_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def train_and_read(
    target: str, nproc: int, args: Sequence[str], output_dir: str | Path, steps: int, timeout: float
) -> list[dict]:
    """Run a training entry point under torchrun and return its per-step
    records, asserting a clean exit and exactly ``steps`` consecutive steps."""
    res = torchrun(nproc, target, [*args, f"logging.output_dir={output_dir}", "logging.tensorboard=false"],
                   timeout=timeout)
    assert res.returncode == 0, f"{target} x{nproc} {' '.join(args)} failed:\n{res.stderr[-5000:]}"
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return records
