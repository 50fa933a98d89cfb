"""``omni-sched run`` through a real single-host Slurm (tests/slurm_fixture.py):
the live config of test_scheduler_live.py (two tiny elastic GPT jobs, each
with its core on bare metal and a warm standby on the VM pool), with
``launcher: slurm``: every replica group is an ``srun`` job, its control
socket on TCP with a token, the lighthouses started here.

1. join: both jobs grow onto their VM standby (``join`` through the socket);
2. kill and replacement: A's VM group is cancelled behind the scheduler's
   back (``scancel``, a lost node); the scheduler sees it exit (srun's exit,
   Slurm's state), a new standby starts and is joined;
3. SIGKILL of the scheduler: a new one on the same ``out`` adopts the four
   groups from its decisions log and Slurm, and starts, joins or drains
   nothing;
4. drain: the VM pool is reclaimed; both VM groups are drained through
   their sockets before the deadline;
5. SIGTERM: every group is drained, nothing of ours is left in Slurm.

Checked per job, as test_scheduler_live.py does: every committed step
consumed its whole global batch exactly once (the sample ledger), and the
loss equals a fixed-membership run's at every step within REL_TOL. The cores
are held at a step boundary (``omni-ctl pause``) while groups start, join or
are adopted, which keeps the multi-replica steps (whose summation-order
noise compounds) few.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.dist.control_helpers import omni_ctl
from tests.dist.test_scheduler_live import CONFIG, Live, check_job, run_references
from tests.launcher import REPO, finish, free_port, kill_group, spawn
from tests.slurm_fixture import slurm_cluster  # noqa: F401

TIMEOUT = 1500
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(TIMEOUT)]
BIN = Path(sys.executable).parent


class SlurmLive(Live):
    """test_scheduler_live.py's view of the scheduler (state, groups, steps), with the Slurm launcher, its own
    lighthouses and a scheduler process that can be restarted."""

    def __init__(self, tmp_path: Path, cluster):
        self.cluster = cluster
        cfg = yaml.safe_load(CONFIG.read_text())
        self.out, self.avail = tmp_path / "sched", tmp_path / "availability.yaml"
        self.lighthouses = []
        for job in cfg["jobs"]:
            port = free_port()
            self.lighthouses.append(spawn([str(BIN / "torchft_lighthouse"), "--min_replicas", "1", "--bind",
                                           f"[::]:{port}", "--join_timeout_ms", "60000", "--heartbeat_timeout_ms",
                                           "2000", "--quorum_tick_ms", "50"], timeout=TIMEOUT))
            job["lighthouse"] = f"http://localhost:{port}"
        cfg.update(out=str(self.out), availability=str(self.avail), launcher="slurm",
                   slurm={"partitions": {"bare-metal": cluster.partition, "vm": cluster.partition},
                          "request_gpus": False})
        self.cfg = cfg
        self.path = tmp_path / "live.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.env = {"PYTHONPATH": str(REPO), "PATH": f"{BIN}:{os.environ['PATH']}", **cluster.env,
                    "MEGASCALE_CONTROL_TOKEN": secrets.token_hex(16)}
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = spawn([sys.executable, "-m", "megascale_omni.scheduler.cli", "-v", "run", "--config",
                           str(self.path)], timeout=TIMEOUT, env=self.env)

    def slurm_jobs(self) -> list[str]:
        """Names of our Slurm jobs still pending or running."""
        res = subprocess.run(["squeue", "-h", "--states=PENDING,RUNNING,CONFIGURING,COMPLETING", "-o", "%j"],
                             capture_output=True, text=True, env={**os.environ, **self.cluster.env})
        return [n for n in res.stdout.split() if n.startswith("omni-")]

    def hold(self, jobs, pause: bool) -> None:
        for j in jobs:
            assert omni_ctl(self.core(j), "--timeout", "300", "pause" if pause else "resume", timeout_s=330)["ok"]


@pytest.mark.timeout(TIMEOUT)
def test_live_scheduler_runs_two_elastic_jobs_through_slurm(slurm_cluster, tmp_path):
    began = time.monotonic()
    live = SlurmLive(tmp_path, slurm_cluster)
    jobs = [j["name"] for j in live.cfg["jobs"]]
    refs = []
    try:
        live.wait("both jobs train on bare metal and their VM standby (Slurm jobs)",
                  lambda: all(live.participants(j) == 2 for j in jobs))
        assert len(live.slurm_jobs()) == 4, live.slurm_jobs()
        for j in jobs:
            live.steps(j, 2)
        # A lost node: A's VM group is cancelled behind the scheduler's back; the scheduler replaces it.
        victim = live.groups("A", "vm")[0]
        joins = len([d for d in live.decisions() if d.startswith("A grow: join standby") and "(at step" in d])
        live.hold(["A"], pause=True)
        subprocess.run(["scancel", "--signal=KILL", "--full", f"--name=omni-{victim}"], check=True,
                       env={**os.environ, **slurm_cluster.env})
        live.wait(f"{victim} seen gone", lambda: any(d.startswith(f"A {victim} exited unexpectedly")
                                                      for d in live.decisions()))
        live.wait("A's replacement joined", lambda: len(
            [d for d in live.decisions() if d.startswith("A grow: join standby") and "(at step" in d]) > joins)
        live.hold(["A"], pause=False)
        live.wait("A trains with 2 groups again", lambda: live.participants("A") == 2)
        live.steps("A", 2)
        # SIGKILL: no shutdown, the groups keep running under Slurm; a new scheduler adopts them.
        live.hold(jobs, pause=True)
        members = {rid for j in jobs for pool in ("bare-metal", "vm") for rid in live.groups(j, pool)}
        assert len(members) == 4, live.state()
        os.killpg(live.proc.pid, signal.SIGKILL)
        live.proc.wait()
        (live.out / "state.json").unlink()
        before = len(live.decisions())
        live.start()
        live.wait("3 ticks of the new scheduler", lambda: live.state()["tick"] >= 3)
        after = live.decisions()[before:]
        assert sorted(d.split(" ")[2] for d in after if " adopt " in d) == sorted(members), after
        assert not [d for d in after if " start " in d or "grow: join" in d or " drain " in d], after
        assert len(live.slurm_jobs()) == 4
        live.hold(jobs, pause=False)
        for j in jobs:
            live.steps(j, 2)
        live.reclaim_vm(jobs)  # both VM groups are drained through their sockets before the deadline
        for j in jobs:
            live.steps(j, 2)
        live.proc.send_signal(signal.SIGTERM)
        res = finish(live.proc, 600)
        assert res.returncode == 0, res.stderr[-4000:]
        deadline = time.monotonic() + 60
        while live.slurm_jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert live.slurm_jobs() == []  # shutdown removed everything it started
        run_references(live, tmp_path / "reference", refs)
    finally:
        for p in [live.proc, *refs, *live.lighthouses]:
            kill_group(p)
    decisions = live.decisions()
    for j in jobs:
        merged = check_job(live.out, j, 99 if j == "B" else 1234, tmp_path / "reference" / j)
        assert {r["participants"] for r in merged.values()} == {1, 2}
        assert len([d for d in decisions if d.startswith(f"{j} drain {j}-r")
                    and ": reclaim: 2 node(s) of vm leave" in d]) == 2, decisions
    print(f"Slurm e2e: {time.monotonic() - began:.0f} s in all")
    print("\n".join(decisions))
