"""Checkpoints of an elastic job on real processes.

Replica groups share ``checkpoint.dir``; only the participant of rank 0
writes. After every group died (SIGKILL), a new replica group resumes from
the newest committed checkpoint, torchft counts steps from there, and the
loss curve continues the fixed-membership reference run's at every step.
"""

from __future__ import annotations

import json

import pytest

from megascale_omni.checkpoint import layout
from tests.dist.control_helpers import omni_ctl
from tests.dist.elastic_helpers import start_lighthouse, start_replica, step_records, wait_for
from tests.dist.test_elastic_membership import REL_TOL, Job, drain
from tests.launcher import kill_group, finish

INTERVAL = 3


def _saved_steps(run_dir) -> list[int]:
    path = run_dir / "checkpoints.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(1200)
# slow (make test-all): ~2 min on 2 cores
@pytest.mark.slow
def test_one_writer_then_resume_after_every_group_died(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, timeout=1200)
    job.args += [f"checkpoint.dir={ckpt}", f"checkpoint.interval={INTERVAL}", "checkpoint.keep_last=10"]
    lighthouse2 = resumed = None
    try:
        # Phase 1: r0 and r1 train together; r0 (participant rank 0) writes.
        job.start("r0")
        job.wait("r0's first committed steps", lambda: len(job.records("r0")) >= 2)
        job.stand_by("r1", hold="r0")
        job.join_standby("r1", hold="r0")
        job.wait("a save with 2 participants", lambda: any(
            r["participants"] == 2 and r["step"] % INTERVAL == 0 for r in job.records("r0")[:-2]))
        # The control command reaches the writer and a non-writer alike.
        assert omni_ctl(job.run / "r1", "checkpoint", timeout_s=120)["result"]["checkpoint"]["writer"] is False
        job.kill("r0")
        job.kill("r1")
        killed_at = max(r["step"] for rid in ("r0", "r1") for r in job.records(rid))
        newest = layout.newest_complete([("persistent", str(ckpt))])[0]
        assert INTERVAL <= newest.step <= killed_at and newest.step % INTERVAL == 0
        assert _saved_steps(job.run / "r0") and not _saved_steps(job.run / "r1")

        # Phase 2: every group is gone; a new job of one group resumes. The
        # fixed-membership reference starts now (it need not compete with phase 1).
        job.start_reference()
        lighthouse2, addr2 = start_lighthouse(timeout=1200)
        run2 = tmp_path / "run2"
        resumed = start_replica("r1", addr2, run2, job.args, timeout=1200)
        wait_for("the resumed group to save", lambda: len(_saved_steps(run2 / "r1")) >= 1, 600,
                 [resumed, job.reference])
        drain(run2 / "r1")
        res = finish(resumed, 1200)
        assert res.returncode == 0, res.stderr[-4000:]
        assert f"at step {newest.step} in" in res.stderr  # "resumed from ... at step N in X s"
        records = step_records(run2 / "r1")
        last = records[-1]["step"]
        job.wait("the reference run to pass the resumed run", lambda: len(step_records(tmp_path / "reference")) >= last)
        drain(tmp_path / "reference")
        assert finish(job.reference, 1200).returncode == 0
    finally:
        job.close()
        for proc in (lighthouse2, resumed):
            if proc is not None:
                kill_group(proc)
    # Resumed exactly after the checkpoint, every step once, on the reference curve.
    assert [r["step"] for r in records] == list(range(newest.step + 1, last + 1))
    reference = {r["step"]: r["loss"] for r in step_records(tmp_path / "reference")}
    worst = max(abs(r["loss"] - reference[r["step"]]) / abs(reference[r["step"]]) for r in records)
    print(f"resumed at step {newest.step} (killed at {killed_at}); max relative loss difference {worst:.2e}")
    assert worst < REL_TOL
