"""Hang detection on real processes: a rank SIGSTOPped mid-run is named by
its peer within the configured limit, killed, and its replica group exits
43 (``EXIT_HUNG``) through ``omni-run``; in an elastic job the other replica
group carries on alone (docs/hang-detection.md)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from megascale_omni.errors import EXIT_HUNG
from tests.dist.elastic_helpers import merged_steps, start_lighthouse, start_replica, step_records, wait_for
from tests.launcher import finish, free_port, kill_group, spawn, wait_for_record

POLL_S = 0.5
COLLECTIVE_S = 4.0
#: The feature's promise: named within the limit plus two polls; the rest is
#: generous slack for process start-up and teardown on a loaded 2-core host.
DEADLINE_S = COLLECTIVE_S + 2 * POLL_S + 30.0
WATCHDOG = [f"watchdog.poll_s={POLL_S}", f"watchdog.collective_timeout_s={COLLECTIVE_S}",
            "watchdog.step_timeout_s=120", "watchdog.data_wait_timeout_s=120"]
VERDICT = re.compile(r"watchdog: rank 1 \(replica group (\S+), host \S+\) stuck in phase (\S+) at step (\d+) "
                     r"for ([\d.]+) s \(limit 4 s; watchdog\.collective_timeout_s\)")


def _worker(launcher: psutil.Process, rank: int) -> psutil.Process:
    """The training process of ``rank``: a child of the torchrun agent that
    ``launcher`` (omni-run) runs (a worker's own forked helpers share its command line)."""
    for child in launcher.children():
        try:
            if child.environ().get("RANK") == str(rank) and "megascale_omni.smoke" in child.cmdline():
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of rank {rank} under {launcher.pid}")


def _stop(launcher_pid: int, rank: int) -> tuple[psutil.Process, float]:
    worker = _worker(psutil.Process(launcher_pid), rank)
    os.kill(worker.pid, signal.SIGSTOP)
    return worker, time.monotonic()


def _check_named(stderr: str, group: str) -> None:
    match = VERDICT.search(stderr)
    assert match, f"no watchdog verdict naming rank 1:\n{stderr[-4000:]}"
    assert match.group(1) == group
    # Counted from its last heartbeat or the peer's wait: over the limit, by at most about two polls.
    assert COLLECTIVE_S <= float(match.group(4)) <= COLLECTIVE_S + 2 * POLL_S + 5.0, match.group(0)
    assert "killed rank 1" in stderr and f"exits with code {EXIT_HUNG}" in stderr


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_sigstopped_rank_is_named_and_the_job_exits_hung(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megascale_omni.launch", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
           "parallel.pp=2", "train.steps=100000", f"logging.output_dir={out}", "logging.tensorboard=false",
           "logging.progress_bar=false", *WATCHDOG]
    proc = spawn(cmd, timeout=230)
    try:
        wait_for_record(out, 2, proc, timeout=180)
        worker, stopped_at = _stop(proc.pid, 1)
        res = finish(proc, DEADLINE_S + 30)
        ended_s = time.monotonic() - stopped_at
    finally:
        kill_group(proc)
    assert res.returncode == EXIT_HUNG, res.stderr[-4000:]
    _check_named(res.stderr, "job")
    assert "no checkpoint saved" in res.stderr
    assert ended_s <= DEADLINE_S, ended_s
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


@pytest.mark.dist
@pytest.mark.slow  # make test-all: two replica groups and the lighthouse's heartbeat timeout, ~2 min on 2 cores
@pytest.mark.timeout(600)
def test_elastic_group_with_a_stopped_rank_is_replaced_survivor_carries_on(tmp_path):
    run = tmp_path / "run"
    steps = 40
    # Survivors abandon a step whose peer group is lost after elastic.timeout_s and
    # wait for the next quorum (the lighthouse drops the lost group after its heartbeat timeout).
    args = [f"train.steps={steps}", "elastic.timeout_s=3", "elastic.quorum_timeout_s=120", *WATCHDOG]
    lighthouse, addr = start_lighthouse(timeout=580)
    procs = {}
    try:
        procs["r0"] = start_replica("r0", addr, run, args, timeout=580, omni_run=True)
        wait_for("r0's first step", lambda: len(step_records(run / "r0")) >= 1, 240, [procs["r0"]])
        procs["r1"] = start_replica("r1", addr, run, args, timeout=580, omni_run=True)
        wait_for("r1 to train with r0", lambda: any(r["participants"] == 2 for r in step_records(run / "r1")),
                 240, list(procs.values()))
        worker, stopped_at = _stop(procs["r1"].pid, 1)
        res1 = finish(procs["r1"], DEADLINE_S + 30)
        assert time.monotonic() - stopped_at <= DEADLINE_S
        assert res1.returncode == EXIT_HUNG, res1.stderr[-4000:]
        _check_named(res1.stderr, "r1")
        assert "no checkpoint saved" not in res1.stderr  # elastic: the other group keeps checkpointing
        res0 = finish(procs["r0"], 400)
        assert res0.returncode == 0, res0.stderr[-4000:]
        assert "watchdog: rank" not in res0.stderr
        records0 = step_records(run / "r0")
        assert records0[-1]["step"] == steps and records0[-1]["participants"] == 1
        merged_steps([records0, step_records(run / "r1")])
    finally:
        for p in [*procs.values(), lighthouse]:
            kill_group(p)
            p.wait()
