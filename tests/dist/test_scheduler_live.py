"""``omni-sched run`` live on this machine (examples/scheduler/live_local.yaml):
two small elastic jobs (tiny GPT, one process per replica group), each with
its core on bare metal and a warm standby on the VM pool. The scheduler
grows each job onto its standby (``join`` through the socket); the
availability file announces that the VM pool is reclaimed, and the
scheduler drains the VM groups through their sockets before the deadline;
the pool comes back, new standbys start and the scheduler joins them. Then
SIGTERM: every group is drained and the scheduler exits 0.

Checked per job, against its sample ledger and a fixed-membership run
(non-elastic, same seed and global batch, constant LR): every committed
step consumed its whole global batch exactly once, and the loss equals the
fixed-membership run's at every step within REL_TOL (see
test_elastic_membership.py for why that tolerance and why the test holds
the cores with ``omni-ctl pause`` while new groups start: it keeps the
number of multi-replica steps, whose float summation-order noise compounds,
small). The decisions log holds every decision with its reason.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from megascale_omni.data.sample_plan import SamplePlan
from megascale_omni.data.tokens_module import NUM_SAMPLES
from megascale_omni.elastic.ledger import consumed_samples, read_ledger
from tests.dist.control_helpers import omni_ctl
from tests.dist.elastic_helpers import step_records, wait_for
from tests.launcher import REPO, finish, kill_group, spawn, torchrun_cmd

CONFIG = REPO / "examples" / "scheduler" / "live_local.yaml"
GLOBAL_BATCH, REL_TOL = 12, 1e-4
TIMEOUT = 1500


class Live:
    """The scheduler process and what it writes."""

    def __init__(self, tmp_path: Path):
        cfg = yaml.safe_load(CONFIG.read_text())
        self.out, self.avail = tmp_path / "sched", tmp_path / "availability.yaml"
        cfg.update(out=str(self.out), availability=str(self.avail))
        self.cfg = cfg
        path = tmp_path / "live.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.proc = spawn([sys.executable, "-m", "megascale_omni.scheduler.cli", "-v", "run", "--config", str(path)],
                          timeout=TIMEOUT, env={"PYTHONPATH": str(REPO)})

    def state(self) -> dict:
        path = self.out / "state.json"
        return json.loads(path.read_text()) if path.exists() else {"tick": -1, "groups": {}}

    def groups(self, job: str, pool: str) -> list[str]:
        """The job's member groups on ``pool`` (plain warm standbys excluded)."""
        return [rid for rid, g in self.state()["groups"].items()
                if g["job"] == job and g["pool"] == pool and (not g["standby"] or g["join_pending"])]

    def core(self, job: str) -> Path:
        return self.out / job / self.groups(job, "bare-metal")[0]

    def participants(self, job: str) -> int:
        groups = self.groups(job, "bare-metal")
        recs = step_records(self.out / job / groups[0]) if groups else []
        return recs[-1]["participants"] if recs else 0

    def decisions(self) -> list[str]:
        path = self.out / "decisions.log"
        return [line.split(" ", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []

    def wait(self, what, predicate, timeout=900):
        wait_for(what, predicate, timeout, [self.proc])

    def steps(self, job: str, n: int) -> None:
        core = self.core(job)
        at = len(step_records(core))
        self.wait(f"{n} more steps of {job}", lambda: len(step_records(core)) >= at + n)

    def reclaim_vm(self, jobs: list[str]) -> None:
        """Announce that the VM pool is reclaimed 60 s from now; wait until the scheduler has drained its groups
        through their sockets and every job trains alone."""
        self.avail.write_text(yaml.safe_dump({"vm": {"nodes": 2, "reclaim": {"nodes": 2,
                                                                             "deadline": time.time() + 60}}}))
        self.wait("the VM groups to leave", lambda: not any(self.groups(j, "vm") for j in jobs))
        for j in jobs:
            self.wait(f"{j} trains alone", lambda j=j: self.participants(j) == 1)

    def next_ticks(self, n: int) -> None:
        at = self.state()["tick"]
        self.wait(f"{n} scheduler ticks", lambda: self.state()["tick"] >= at + n)


def check_job(out: Path, job: str, seed: int, reference: Path) -> dict[int, dict]:
    """Exactly-once ledger, constant global batch and loss equal to the fixed-membership run; returns step ->
    record."""
    merged: dict[int, dict] = {}
    for group in sorted(p for p in (out / job).iterdir() if (p / "metrics.jsonl").exists()):
        for r in step_records(group):
            seen = merged.setdefault(r["step"], r)
            assert r["loss"] == pytest.approx(seen["loss"], rel=1e-12), (group.name, r, seen)
    last = max(merged)
    assert sorted(merged) == list(range(1, last + 1))
    for r in merged.values():
        assert r["samples"] == GLOBAL_BATCH
        assert r["healed"] or r["microbatches"] == 6 // r["participants"], r
    plan = SamplePlan(NUM_SAMPLES, GLOBAL_BATCH, seed=seed)
    consumed = consumed_samples(read_ledger(out / job / "ledger"))
    assert sorted(consumed) == list(range(last))
    for step, ids in consumed.items():
        assert sorted(ids) == sorted(plan.global_batch(step)), f"{job} step {step}: {ids}"
    ref = {r["step"]: r["loss"] for r in step_records(reference)}
    assert sorted(ref) == sorted(merged), f"{job}: the reference run has {len(ref)} steps, the live job {last}"
    worst = max(abs(merged[s]["loss"] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"{job}: {last} steps, participants {sorted({r['participants'] for r in merged.values()})}, max relative "
          f"loss difference to the fixed-membership run {worst:.2e}")
    assert worst < REL_TOL
    return merged


def run_references(live: Live, into: Path, refs: list) -> None:
    """Fixed-membership runs (non-elastic, same config) of every job of ``live``, up to its last live step, into
    ``into/<job>``; their processes are appended to ``refs`` (for the caller's cleanup) and awaited."""
    for job in live.cfg["jobs"]:
        last = max(r["step"] for g in (live.out / job["name"]).iterdir() for r in step_records(g))
        refs.append(spawn(torchrun_cmd(1, "megascale_omni.smoke", [
            "--config", job["config"], *job["overrides"], "elastic.enabled=false", f"train.steps={last}",
            f"logging.output_dir={into / job['name']}"]), timeout=TIMEOUT))
    for ref in refs:
        done = finish(ref, 900)
        assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_live_scheduler_drains_for_a_reclaim_and_joins_standbys_when_the_pool_returns(tmp_path):
    live = Live(tmp_path)
    jobs = [j["name"] for j in live.cfg["jobs"]]
    refs = []
    try:
        live.wait("both jobs train on bare metal and their VM standby",
                  lambda: all(live.participants(j) == 2 for j in jobs))
        for j in jobs:
            live.steps(j, 2)
        live.reclaim_vm(jobs)
        live.avail.write_text("vm: {nodes: 0}\n")
        live.next_ticks(2)
        assert not any(g["pool"] == "vm" for g in live.state()["groups"].values())
        # Given back: hold the cores at a step boundary while new standbys start and are joined.
        cores = {j: live.core(j) for j in jobs}
        for j in jobs:
            assert omni_ctl(cores[j], "--timeout", "300", "pause", timeout_s=330)["ok"]
        joined = len([d for d in live.decisions() if " grow: join standby " in d and "(at step" in d])
        live.avail.write_text("vm: {nodes: 2}\n")
        live.wait("both new standbys to be joined",
                  lambda: len([d for d in live.decisions() if " grow: join standby " in d and "(at step" in d])
                  >= joined + 2)
        for j in jobs:
            assert omni_ctl(cores[j], "--timeout", "300", "resume", timeout_s=330)["ok"]
        live.wait("both jobs train with 2 groups again", lambda: all(live.participants(j) == 2 for j in jobs))
        for j in jobs:
            live.steps(j, 2)
        live.proc.send_signal(signal.SIGTERM)
        res = finish(live.proc, 600)
        assert res.returncode == 0, res.stderr[-4000:]
        run_references(live, tmp_path / "reference", refs)
    finally:
        for p in [live.proc, *refs]:
            kill_group(p)
    decisions = live.decisions()
    for j in jobs:
        seed = 99 if j == "B" else 1234
        merged = check_job(live.out, j, seed, tmp_path / "reference" / j)
        assert {r["participants"] for r in merged.values()} == {1, 2}
        drains = [d for d in decisions if d.startswith(f"{j} drain {j}-r") and ": reclaim: 2 node(s) of vm leave" in d]
        assert len(drains) == 2, decisions  # the decision and the drain sent through the socket
        assert not [d for d in decisions if d.startswith(f"{j} kill")], decisions
        joins = [d for d in decisions if d.startswith(f"{j} grow: join standby {j}-r") and "(at step" in d]
        assert len(joins) == 2, decisions
    # Every decision and every action on a group carries its reason.
    acts = [d for d in decisions if d.split(" ")[1].rstrip(":") in ("grow", "drain", "kill", "move", "start")]
    assert len(acts) >= 16 and all(": " in d and d.split(": ", 1)[1].strip() for d in acts), decisions
    print("\n".join(decisions))
