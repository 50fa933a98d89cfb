"""The Slurm launcher against a real single-host Slurm (tests/slurm_fixture.py):
the live actuator starts replica groups with ``srun`` (stand-in groups,
tests/slurm_group.py, under torchrun as real ones), reads their state and
exit codes from Slurm, kills them with ``scancel``; a launcher of a
restarted scheduler finds them through ``scontrol`` (their ``--comment``
tags) and takes them over; a group that fails its pre-flight checks gets
its node excluded from further ``srun`` lines; ``close`` cancels what is
left. The two-job elastic run through Slurm is test_scheduler_slurm_e2e.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megascale_omni.scheduler.actuator import Backoff, LiveActuator
from megascale_omni.scheduler.cluster_launchers import SlurmLauncher
from megascale_omni.scheduler.launchers import GroupSpec, JobTemplate
from tests.launcher import REPO
from tests.slurm_fixture import slurm_cluster  # noqa: F401

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def _until(what, predicate, timeout=120.0, step=lambda: None):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        step()
        time.sleep(0.2)


def _squeue(cluster, name: str) -> str:
    return subprocess.run(["squeue", "--states=all", "-h", "-n", name, "-o", "%T"], capture_output=True, text=True,
                          env={**__import__("os").environ, **cluster.env}).stdout.strip()


def test_slurm_launcher_starts_reads_adopts_excludes_and_cancels_for_real(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{__import__('os').environ['PATH']}")  # torchrun
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    job = JobTemplate("A", "unused.yaml", str(tmp_path / "A"), lighthouse="http://127.0.0.1:1",
                      entry=str(REPO / "tests" / "slurm_group.py"))
    partitions = {"bm": slurm_cluster.partition, "vm": slurm_cluster.partition}
    launcher = SlurmLauncher({"A": job}, {"bm": 1, "vm": 1}, partitions=partitions, request_gpus=False)
    records: list[str] = []
    act = LiveActuator(launcher, {("A", "bm"): 1, ("A", "vm"): 1}, backoff=Backoff(2, 0.1), command_timeout_s=2,
                       drain_timeout_s=120, record=records.append)
    out = Path(job.run_dir)
    try:
        assert act.grow("A", "bm", 1, "admit") == ["A-r0"]
        assert act.grow("A", "vm", 1, "more") == ["A-r1"]
        _until("both groups run under Slurm", lambda: all((out / r / "started").exists() for r in ("A-r0", "A-r1")))
        host, job_id = (out / "A-r0" / "started").read_text().split()
        assert host == slurm_cluster.node and job_id.isdigit() and _squeue(slurm_cluster, "omni-A-r0") == "RUNNING"
        act.refresh(0.0)
        assert sorted(act.groups) == ["A-r0", "A-r1"]
        # A restarted scheduler's launcher finds both in Slurm and reads their state from scontrol.
        again = SlurmLauncher({"A": job}, {"bm": 1, "vm": 1}, partitions=partitions, request_gpus=False)
        found = sorted(again.running_groups(), key=lambda g: g.replica_id)
        assert found == [GroupSpec("A", "A-r0", "bm", 1, False), GroupSpec("A", "A-r1", "vm", 1, False)]
        for g in found:
            again.adopt(g)
        assert again.exited(found[0]) is None
        # A-r1 fails its pre-flight checks: its node is excluded from the next srun lines.
        (out / "A-r1" / "exit_code").write_text("44")
        _until("A-r1 leaves", lambda: "A-r1" not in act.groups, step=lambda: act.refresh(0.0))
        assert f"A exclude node {slurm_cluster.node}: A-r1 failed its pre-flight checks (exit code 1)" in records, \
            records  # torchrun reports a failed worker as 1; preflight.json names the node
        # scontrol's ExitCode, for a group this launcher did not start (1 from torchrun; 137 if the actuator's
        # clean-up scancel reached the job before it had completed)
        _until("Slurm settles A-r1", lambda: again.exited(found[1]) is not None)
        assert again.exited(found[1]) in (1, 137), again.queue()
        assert f"--exclude={slurm_cluster.node}" in launcher.command(GroupSpec("A", "A-r9", "vm"))
        # scancel through the actuator; Slurm reports the job cancelled.
        act.kill("A", ["A-r0"], "reclaim deadline passed")
        _until("A-r0 cancelled", lambda: _squeue(slurm_cluster, "omni-A-r0") == "CANCELLED")
        _until("its srun returns and Slurm settles", lambda: launcher.exited(GroupSpec("A", "A-r0", "bm")) is not None)
        assert launcher.exited(GroupSpec("A", "A-r0", "bm")) == 137  # srun says 0; cancelled is no clean exit
        # A group Slurm refuses (no such partition): srun fails, reported as an exit, never raised.
        bad = SlurmLauncher({"A": job}, {"bm": 1}, partitions={"bm": "no-such-partition"}, request_gpus=False)
        act.launcher = bad
        assert act.grow("A", "bm", 1, "admit") == ["A-r2"]
        _until("srun gives up", lambda: "A-r2" not in act.groups, step=lambda: act.refresh(0.0))
        assert any(line.startswith("A A-r2 exited unexpectedly (exit code 1)") for line in records), records
    finally:
        launcher.close()
    _until("nothing of ours left in Slurm", lambda: not [
        s for s in _squeue(slurm_cluster, "omni-A-r0,omni-A-r1").split() if s in ("RUNNING", "PENDING")])
