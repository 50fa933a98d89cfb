"""No process outlives a killed rank (issue 35, the chaos run's leftovers):
a rank of an ``omni-run`` job is SIGSTOPped and then SIGKILLed (what a
peer's hang watchdog does to it) while its asynchronous checkpoint save is
in flight, and once the job has exited no process it started is alive: not
its checkpoint writer (``PR_SET_PDEATHSIG``, even while itself stopped),
not a megatron results-queue manager (none is started:
``write_workers.use_in_process_results_queue``), not multiprocessing's
resource tracker, and nothing else (``omni-run`` adopts and ends what dead
workers leave, ``launch.end_leftovers``)."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid

import psutil
import pytest

from megascale_omni.chaos.supervisor import RUN_MARKER, processes_of_run
from megascale_omni.checkpoint.write_workers import PROCESS_NAME
from tests.dist.test_hang_detection import _omni_run, _worker
from tests.launcher import _read, finish, spawn

SPAWNED = "--multiprocessing-fork"


def _spawned_children(rank: psutil.Process) -> list[psutil.Process]:
    return [c for c in rank.children() if SPAWNED in c.cmdline()]


def _try_worker(launcher: psutil.Process, rank: int):
    try:
        return _worker(launcher, rank)
    except AssertionError:
        return None


def _serving_writers(rank: psutil.Process) -> list[psutil.Process]:
    """The rank's checkpoint writers once they wait for a job on their
    connection (past their start-up, so past their ``prctl``)."""
    out = []
    for c in _spawned_children(rank):
        try:
            if c.name() == PROCESS_NAME.decode() and open(f"/proc/{c.pid}/wchan").read() == "unix_stream_read_generic":
                out.append(c)
        except (OSError, psutil.Error):
            continue
    return out


def _committed(tier) -> list[int]:
    from megascale_omni.checkpoint import layout

    return [c.step for c in layout.scan_tier(tier, str(tier)) if c.complete] if tier.is_dir() else []


def _wait(what: str, proc, predicate, timeout_s: float = 150.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"job exited {proc.returncode} while waiting for {what}:\n{_read(proc)[1][-3000:]}")
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s:g} s:\n{_read(proc)[1][-3000:]}")


def _saves_in_background(proc, rank: int) -> list[int]:
    text = "".join(_read(proc))
    return [int(s) for s in re.findall(rf"\[rank {rank}\] INFO \S+: checkpoint step (\d+) \S+: training blocked .*"
                                       r"writing in background", text)]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_rank_killed_with_a_save_in_flight_leaves_no_process(tmp_path):
    token = uuid.uuid4().hex
    cmd = _omni_run(tmp_path / "run", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=4",
                    "checkpoint.async_save=true", "checkpoint.save_at_end=false")
    proc = spawn(cmd, timeout=230, env={RUN_MARKER: token, "MEGASCALE_DIST_TIMEOUT_S": "20"})
    try:
        launcher = psutil.Process(proc.pid)
        rank = _wait("rank 0", proc, lambda: _try_worker(launcher, 0))
        writers = _wait("checkpoint writer of rank 0 serving", proc, lambda: _serving_writers(rank))
        assert len(writers) == 1, [w.cmdline() for w in writers]
        # Its only other spawned child would be megatron's results-queue manager (not started any more).
        others = [c for c in _spawned_children(rank) if c not in writers]
        tracker = [c for c in rank.children() if "resource_tracker" in " ".join(c.cmdline())]
        assert tracker, "expected multiprocessing's resource tracker under the rank"
        # A stopped writer cannot finish: the newest save submitted is in flight
        # (committed: no; the next is only submitted after it, see Checkpointer.save).
        os.kill(writers[0].pid, signal.SIGSTOP)
        ckpt = tmp_path / "ckpt"
        _wait("a save in flight to the stopped writer", proc,
              lambda: max(_saves_in_background(proc, 0), default=0) > max(_committed(ckpt), default=0))
        os.kill(rank.pid, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(rank.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        # The job is over; give the kernel's parent-death signals and pipe EOFs a moment.
        deadline = time.monotonic() + 10
        while processes_of_run(token) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_of_run(token)
        described = []
        for pid in left:
            try:
                p = psutil.Process(pid)
                described.append(f"pid {pid} ppid {p.ppid()} {p.status()} {' '.join(p.cmdline())[:160]}")
            except psutil.Error:
                continue
        assert not described, "processes left after the job exited:\n" + "\n".join(described)
        assert not others, [c.pid for c in others]
        for p in [*writers, *tracker]:
            assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, p
    finally:
        result = finish(proc, timeout=30)
        for pid in processes_of_run(token):  # never leave a stray behind, even when the test failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert result.returncode != 0, "the job cannot succeed with a killed rank"
