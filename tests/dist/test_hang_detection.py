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

import psutil
import pytest

from megascale_omni.errors import EXIT_HUNG
from tests.dist.test_elastic_membership import Job, ctl
from tests.launcher import finish, free_port, kill_group, spawn, wait_for_record

POLL_S = 0.25


def watchdog_args(collective_s: int) -> list[str]:
    return [f"watchdog.poll_s={POLL_S}", f"watchdog.collective_timeout_s={collective_s}",
            "watchdog.step_timeout_s=120", "watchdog.data_wait_timeout_s=120"]


def deadline_s(collective_s: int) -> float:
    """The feature's promise, the limit plus two polls, and generous slack for
    the processes' teardown on a loaded 2-core host."""
    return collective_s + 2 * POLL_S + 30.0


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


def _check_named(stderr: str, group: str, collective_s: int) -> None:
    match = re.search(rf"watchdog: rank 1 \(replica group {group}, host \S+\) stuck in phase \S+ at step \d+ "
                      rf"for ([\d.]+) s \(limit {collective_s} s; watchdog\.collective_timeout_s\)", stderr)
    assert match, f"no watchdog verdict naming rank 1 of {group}:\n{stderr[-4000:]}"
    # Counted from its last heartbeat or the peer's wait: over the limit, by at most about two polls.
    assert collective_s <= float(match.group(1)) <= collective_s + 2 * POLL_S + 5.0, match.group(0)
    assert "killed rank 1" in stderr and f"exits with code {EXIT_HUNG}" in stderr


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_sigstopped_rank_is_named_and_the_job_exits_hung(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megascale_omni.launch", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "megascale_omni.smoke", "--config", "examples/gpt/tiny.yaml",
           "parallel.pp=2", "train.steps=100000", f"logging.output_dir={out}", "logging.tensorboard=false",
           "logging.progress_bar=false", *watchdog_args(2)]
    started = time.monotonic()
    proc = spawn(cmd, timeout=230)
    try:
        wait_for_record(out, 1, proc, timeout=180)
        worker, stopped_at = _stop(proc.pid, 1)
        res = finish(proc, deadline_s(2) + 30)
        ended_s = time.monotonic() - stopped_at
    finally:
        kill_group(proc)
    print(f"\nstart to step 1: {stopped_at - started:.1f} s; SIGSTOP to exit {res.returncode}: {ended_s:.1f} s")
    assert res.returncode == EXIT_HUNG, res.stderr[-4000:]
    _check_named(res.stderr, "job", 2)
    assert "no checkpoint saved" in res.stderr
    assert ended_s <= deadline_s(2), ended_s
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


@pytest.mark.dist
@pytest.mark.slow  # make test-all: two replica groups, a join and a reference run, ~3 min on 2 cores
@pytest.mark.timeout(900)
def test_elastic_group_with_a_stopped_rank_exits_hung_and_the_survivor_carries_on(tmp_path):
    job = Job(tmp_path, timeout=880)
    # Survivors abandon a step whose peer group is lost after elastic.timeout_s (below the
    # watchdog's collective limit) and wait in the next quorum until the lighthouse drops it.
    job.args += ["elastic.timeout_s=3", *watchdog_args(4)]
    try:
        job.start("r0")
        job.wait("r0's first steps", lambda: len(job.records("r0")) >= 2)
        # Join r1 (under omni-run, which passes a worker's 43 on) while r0 is held.
        assert ctl(job.run / "r0", "pause")["ok"]
        job.start("r1", omni_run=True)
        job.wait("r1's control server", lambda: (job.run / "r1" / "control.json").exists())
        assert ctl(job.run / "r0", "resume")["ok"]
        job.wait("r1 to join", lambda: job.participants("r0") == 2 and len(job.records("r1")) >= 1)
        worker, stopped_at = _stop(job.procs["r1"].pid, 1)
        res1 = job.results["r1"] = job.wait_exit("r1")
        assert time.monotonic() - stopped_at <= deadline_s(4)
        assert res1.returncode == EXIT_HUNG, res1.stderr[-4000:]
        _check_named(res1.stderr, "r1", 4)
        assert "no checkpoint saved" not in res1.stderr  # elastic: the other groups keep checkpointing
        job.wait("r0 to carry on alone", lambda: job.participants("r0") == 1)
        job.wait_steps("r0", 3)
        last = job.finish()
        assert "watchdog: rank" not in job.results["r0"].stderr
        # Every committed step's samples exactly once, losses equal to the fixed-membership run.
        merged = job.check(last)
        assert {r["participants"] for r in merged.values()} == {1, 2}
    finally:
        job.close()
