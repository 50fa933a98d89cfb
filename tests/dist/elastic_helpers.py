"""Helpers for elastic tests: a torchft lighthouse and replica groups as real
processes on loopback (free ports, hard timeouts, process-group cleanup)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pytest

from megascale_omni.elastic.lighthouse_main import lighthouse_argv
from tests.launcher import finish, free_port, spawn, torchrun_cmd

CONFIG = "examples/elastic/gpt_pp2.yaml"
#: The same lighthouse, started without importing torch (megascale_omni/elastic/lighthouse_main.py).
LIGHTHOUSE_FAST = lighthouse_argv(sys.executable, [])
#: The lighthouse drops a replica this long after its last heartbeat (drain,
#: SIGKILL); long enough for a test to resume a paused replica before a
#: just-killed peer is dropped (see test_elastic_membership.Job.kill_in_flight).
HEARTBEAT_TIMEOUT_MS = 10000


def start_lighthouse(timeout: float, min_replicas: int = 1, port: int = 0) -> tuple[subprocess.Popen, str]:
    """A lighthouse on ``port`` (a free one if 0) that forms quorums of
    ``min_replicas`` groups or more; returns (process, address)."""
    port = port or free_port()
    proc = spawn(
        # join_timeout far above a step time and above any pause in the tests:
        # a quorum forms only once every heartbeating replica asks for it, so
        # joiners never form a quorum of their own while a replica is mid-step
        # or paused.
        [*LIGHTHOUSE_FAST, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}", "--join_timeout_ms", "900000",
         "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS), "--quorum_tick_ms", "50"],
        timeout=timeout,
    )
    return proc, f"http://localhost:{port}"


def start_replica(
    replica_id: str, lighthouse: str, run_dir: Path, args: Sequence[str], timeout: float, nproc: int = 2,
    cpus: str | None = None, omni_run: bool = False, env: dict | None = None,
) -> subprocess.Popen:
    """One replica group (torchrun of ``nproc`` ranks, its own store port);
    ``cpus`` (``taskset -c`` list) confines it to those cores, like a node of its own;
    ``omni_run``: launched by ``omni-run``, which exits with a failed worker's code;
    ``env``: extra environment (e.g. the group's ``CUDA_VISIBLE_DEVICES``)."""
    cmd = torchrun_cmd(nproc, "megascale_omni.smoke", [
        "--config", CONFIG, f"elastic.replica_id={replica_id}", f"elastic.lighthouse={lighthouse}",
        f"logging.output_dir={run_dir / replica_id}", *args,
    ])
    if omni_run:
        assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
        cmd[2] = "megascale_omni.launch"
    return spawn(["taskset", "-c", cpus, *cmd] if cpus else cmd, timeout=timeout, env=env)


def step_records(output_dir: Path) -> list[dict]:
    """Committed step records written so far (a half-written last line is skipped)."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r:
            out.append(r)
    return out


def merged_steps(records: Iterable[list[dict]]) -> dict[int, dict]:
    """Step -> record over the step records of every replica group: groups in
    one quorum report the same global loss, the steps run 1..last without a
    gap and every loss is finite (all asserted)."""
    merged: dict[int, dict] = {}
    for group in records:
        for r in group:
            seen = merged.setdefault(r["step"], r)
            assert r["loss"] == pytest.approx(seen["loss"], rel=1e-12), (r, seen)
    assert sorted(merged) == list(range(1, max(merged) + 1)), sorted(merged)
    assert all(math.isfinite(r["loss"]) for r in merged.values())
    return merged


def wait_for(what: str, predicate: Callable[[], bool], timeout: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    """Poll ``predicate`` (0.2 s); fail if it stays false for ``timeout`` s or a process in ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.poll() is not None:
                res = finish(p, 1)
                raise AssertionError(f"while waiting for {what}: {p.args} exited {p.returncode}\n{res.stderr[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)
