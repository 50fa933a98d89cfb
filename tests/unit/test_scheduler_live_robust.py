"""Live robustness (issue 34 item 5), each against a defect of the earlier code:
a failing launcher command is retried with backoff and reported, never
raised; the Kubernetes launcher reports a group's exit from its pods; group
ids never repeat across scheduler restarts; a scheduler that dies without
shutting down is replaced by one that adopts its groups and grows or drains
nothing twice; a loop that stops on an error kills what it started; exit
codes 43 (hung) and 44 (pre-flight failed) replace the group / exclude the
node. Fake launchers over in-process control planes (test_scheduler_actuator.py)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from megascale_omni.errors import EXIT_HUNG, EXIT_PREFLIGHT_FAILED
from megascale_omni.preflight.result import CheckResult, PreflightReport, write_report
from megascale_omni.scheduler.cluster_launchers import KubernetesLauncher, SlurmLauncher
from megascale_omni.scheduler.launchers import EXIT_UNKNOWN, GroupSpec, JobTemplate
from megascale_omni.scheduler.live_recovery import candidates, replay
from tests.unit.test_scheduler_actuator import FakeLauncher, _actuator, _lines, _scheduler, _until
from tests.unit.test_scheduler_actuator import launcher  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)


class Flaky(FakeLauncher):
    """``fail[op]`` more calls of ``op`` raise like a failing ``srun`` / ``scancel``."""

    def __init__(self, root, **fail):
        super().__init__(root)
        self.fail = fail
        self.excluded: list[str] = []
        self.jobs = {"A": JobTemplate("A", "x.yaml", str(root))}

    def _maybe_fail(self, op: str, argv: list[str]) -> None:
        if self.fail.get(op, 0):
            self.fail[op] -= 1
            raise subprocess.CalledProcessError(1, argv, stderr="srun: error: Unable to contact slurm controller\n")

    def start(self, group):
        self._maybe_fail("start", ["srun"])
        super().start(group)

    def kill(self, group):
        self._maybe_fail("kill", ["scancel"])
        if group.replica_id in self.groups:  # like scancel --name of a job that never started
            super().kill(group)

    def exclude(self, node):
        self.excluded.append(node)


def test_a_failing_launcher_command_is_retried_with_backoff_reported_and_never_raised(tmp_path):
    records, sleeps = [], []
    launcher = Flaky(tmp_path, start=2, kill=6)
    act = _actuator(launcher, records, sleeps=sleeps, standbys={})
    try:
        assert act.grow("A", "bm", 1, "admit") == ["A-r0"]  # third try goes through
        assert sleeps == [0.5, 1.0] and act.unreachable == []
        launcher.fail["start"] = 4
        assert act.grow("A", "bm", 1, "more") == []  # four failures: reported, forgotten, nothing raised
        assert "A-r1" not in act.groups
        assert act.unreachable[-1] == ("A A-r1: launcher start failed after 4 attempt(s): CalledProcessError: "
                                       "Command '['srun']' "
                                       "returned non-zero exit status 1. (srun: error: Unable to contact slurm "
                                       "controller)")
        act.kill("A", ["A-r0"], "reclaim")  # scancel fails 4 times (the failed start's cleanup took one)
        assert "A-r0" in act.pending_kills and "A-r0" not in launcher.killed
        act.refresh(0.0)  # retried every tick until it goes through
        assert "A-r0" in act.pending_kills
        act.refresh(0.0)
        assert act.pending_kills == {} and launcher.killed == ["A-r0"]
        assert records[-1] == "A kill A-r0: went through on a retry"
    finally:
        launcher.close()


class PodRunner:
    """``kubectl get`` answers from canned JSON."""

    def __init__(self):
        self.pods, self.jobsets, self.calls = [], "", []

    def __call__(self, argv, stdin=None, background=False):
        self.calls.append(argv)

    def output(self, argv):
        return json.dumps({"items": self.pods}) if "pods" in argv else self.jobsets


def _pod(phase, code=None):
    state = {"terminated": {"exitCode": code}} if code is not None else {"running": {}}
    return {"status": {"phase": phase, "containerStatuses": [{"state": state}]}}


def test_kubernetes_launcher_reports_exit_from_the_pods():
    runner = PodRunner()
    k8s = KubernetesLauncher({"A": JobTemplate("A", "x.yaml", "/shared/A")}, "img", {"vm": 8}, runner=runner)
    group = GroupSpec("A", "A-r3", "vm", nodes=2)
    k8s.start(group)
    runner.jobsets = '{"kind": "JobSet"}'
    assert k8s.exited(group) is None  # no pods yet, JobSet still there
    runner.pods = [_pod("Running"), _pod("Pending")]
    assert k8s.exited(group) is None
    runner.pods = [_pod("Succeeded", 0), _pod("Running")]
    assert k8s.exited(group) is None
    runner.pods = [_pod("Succeeded", 0), _pod("Succeeded", 0)]
    assert k8s.exited(group) == 0
    runner.pods = [_pod("Running"), _pod("Failed", EXIT_PREFLIGHT_FAILED)]
    assert k8s.exited(group) == EXIT_PREFLIGHT_FAILED
    runner.pods, runner.jobsets = [], ""
    assert k8s.exited(group) == EXIT_UNKNOWN  # deleted behind our back
    k8s.close()
    assert runner.calls[-1][:4] == ["kubectl", "delete", "jobset", "omni-a-r3"]


def test_slurm_launcher_reads_exit_codes_and_its_groups_from_scontrol():
    class Scontrol(PodRunner):
        def output(self, argv):
            assert argv == ["scontrol", "show", "job", "--oneliner"]
            return self.jobsets

    runner = Scontrol()
    slurm = SlurmLauncher({"A": JobTemplate("A", "x.yaml", "/shared/A")}, {"vm": 1}, runner=runner)
    runner.jobsets = ("JobId=7 JobName=omni-A-r4 JobState=RUNNING Comment=omni,job=A,replica=A-r4,pool=vm,standby=0 "
                      "NumNodes=1 ExitCode=0:0\n"
                      "JobId=5 JobName=omni-A-r2 JobState=FAILED Comment=omni,job=A,replica=A-r2,pool=vm,standby=1 "
                      "NumNodes=1 ExitCode=44:0\n"
                      "JobId=8 JobName=omni-A-r5 JobState=COMPLETING Comment=omni,job=A,replica=A-r5,pool=vm,standby=0 "
                      "NumNodes=1 ExitCode=0:0\n"
                      "JobId=9 JobName=omni-A-r6 JobState=CANCELLED Comment=omni,job=A,replica=A-r6,pool=vm,standby=0 "
                      "NumNodes=1 ExitCode=0:0\n")
    assert slurm.running_groups() == [GroupSpec("A", "A-r4", "vm", 1, False)]
    for rid in ("A-r2", "A-r4", "A-r5", "A-r6", "A-r9"):
        slurm.adopt(GroupSpec("A", rid, "vm"))
    assert slurm.exited(GroupSpec("A", "A-r5", "vm")) is None  # completing: the final state is not known yet
    assert slurm.exited(GroupSpec("A", "A-r6", "vm")) == 137  # Slurm records 0:0 for a cancel: not a clean exit
    assert slurm.exited(GroupSpec("A", "A-r2", "vm")) == EXIT_PREFLIGHT_FAILED
    assert slurm.exited(GroupSpec("A", "A-r4", "vm")) is None
    assert slurm.exited(GroupSpec("A", "A-r9", "vm")) == EXIT_UNKNOWN  # Slurm forgot it
    slurm.exclude("node17")
    assert "--exclude=node17" in slurm.command(GroupSpec("A", "A-r5", "vm"))


def test_group_ids_are_unique_across_scheduler_restarts(tmp_path, launcher):
    first, _ = _scheduler(tmp_path, launcher)
    first.tick()
    assert sorted(first.actuator.groups) == ["A-r0", "A-r1"]
    first.run(lambda: True, drain_wait_s=30)  # a clean stop: every group drained
    second, _ = _scheduler(tmp_path, launcher)
    second.tick()
    assert sorted(second.actuator.groups) == ["A-r2", "A-r3"]


def test_a_restarted_scheduler_adopts_the_groups_and_grows_or_drains_nothing_twice(tmp_path, launcher):
    first, _ = _scheduler(tmp_path, launcher)
    _until("A runs on both pools", lambda: len(first.actuator.groups) == 2 and all(
        g.state == "running" for g in first.actuator.groups.values()), first.tick)
    slow = launcher.groups["A-r0"]
    boundary = slow.plane.step_boundary

    def leaves_slowly(*args, **kwargs):  # after its last step the group takes long to exit (a checkpoint)
        go_on = boundary(*args, **kwargs)
        while not go_on and not slow.killed:
            time.sleep(0.01)
        return go_on

    slow.plane.step_boundary = leaves_slowly
    first.actuator.drain("A", ["A-r0"], "operator")  # a drain sent, the group not gone yet
    del first  # the scheduler dies: no shutdown, its groups keep running
    before = len(_lines(tmp_path))
    second, _ = _scheduler(tmp_path, launcher)
    groups = second.actuator.groups
    assert {rid: g.state for rid, g in groups.items()} == {"A-r0": "draining", "A-r1": "running"}
    for _ in range(5):
        second.tick()
    new = _lines(tmp_path)[before:]
    assert [line for line in new if " adopt " in line] == [
        "A adopt A-r0 on vm (draining): started by an earlier scheduler process",
        "A adopt A-r1 on bm (running): started by an earlier scheduler process"], new
    assert not [line for line in new if " start " in line or " drain A-r" in line or "grow: join" in line], new
    assert sorted(launcher.groups) == ["A-r0", "A-r1"]


def test_a_loop_that_stops_on_an_error_kills_everything_it_started(tmp_path, launcher):
    sched, clock = _scheduler(tmp_path, launcher)
    sched.tick()
    decide = sched.policy.decide

    def broken(snapshot):
        if sched.ticks >= 2:
            raise RuntimeError("policy bug")
        return decide(snapshot)

    sched.policy.decide = broken
    with pytest.raises(RuntimeError, match="policy bug"):
        sched.run(lambda: bool(setattr(clock, "t", clock.t + 1)))  # time passes; never asked to stop
    assert sorted(launcher.killed) == ["A-r0", "A-r1"] and sched.actuator.groups == {}
    assert json.loads((tmp_path / "out" / "state.json").read_text())["stopped"]


def test_exit_43_replaces_the_group_and_exit_44_excludes_its_node(tmp_path):
    records = []
    launcher = Flaky(tmp_path)
    act = _actuator(launcher, records, standbys={})
    try:
        act.grow("A", "bm", 2, "admit")
        _until("both train", lambda: all(g.state == "running" for g in act.groups.values()),
               lambda: act.refresh(0.0))
        launcher.groups["A-r0"].kill()
        launcher.groups["A-r0"].code = EXIT_HUNG
        act.refresh(0.0)
        assert "A A-r0 exited unexpectedly (exit code 43)" in records
        assert records[-1] == "A start A-r2 on bm (cold start): replaces A-r0, ended by its hang watchdog " \
            "(exit code 43)"
        (tmp_path / "A-r1").mkdir(exist_ok=True)
        write_report(PreflightReport([
            CheckResult("device_matmul", "pass", 900.0, "GFLOP/s", 1.0, host="node6", rank=0),
            CheckResult("clock_skew", "fail", 5002.3, "ms", 100.0, "<=", "preflight.max_clock_skew_ms",
                        host="node7", rank=1)], world_size=2), tmp_path / "A-r1" / "preflight.json")
        launcher.groups["A-r1"].kill()
        launcher.groups["A-r1"].code = 1  # torchrun's code for a worker that exited 44: the result file tells
        act.refresh(0.0)
        assert launcher.excluded == ["node7"] and sorted(act.groups) == ["A-r2"]
        assert records[-1] == "A exclude node node7: A-r1 failed its pre-flight checks (exit code 1)"
        # A group-wide failure (the all-reduce) names no node: reported, nothing excluded.
        (tmp_path / "A-r2").mkdir(exist_ok=True)
        write_report(PreflightReport([CheckResult("allreduce_busbw", "fail", 0.1, "GB/s", 1.0, scope="group",
                                                  host="node6")], world_size=2), tmp_path / "A-r2" / "preflight.json")
        launcher.groups["A-r2"].kill()
        launcher.groups["A-r2"].code = EXIT_PREFLIGHT_FAILED
        act.refresh(0.0)
        assert launcher.excluded == ["node7"] and act.groups == {}
        assert act.unreachable[-1].startswith("A A-r2 failed a group-wide pre-flight check")
    finally:
        launcher.close()


def test_replay_of_a_decisions_log():
    log = ["t=0.1 A start A-r0 on vm (warm standby): keep 1",
           "t=0.1 A start A-r1 on bm (cold start): admit",
           "t=0.2 A grow: join standby A-r0 on vm (at step 3): load",
           "t=0.3 A start A-r2 on vm (warm standby): keep 1",
           "t=0.4 A drain A-r2 (leaves after step 9): standby: vm has no room for it",
           "t=0.5 A start A-r3 on vm (cold start): more",
           "t=0.6 A kill A-r3: not serving",
           "t=0.7 A A-r2 left after its drain (exit code 0)"]
    assert replay(log) == {
        "A-r0": {"job": "A", "pool": "vm", "standby": True, "join_pending": True, "state": "starting"},
        "A-r1": {"job": "A", "pool": "bm", "standby": False, "join_pending": False, "state": "starting"}}


def test_a_launcher_that_cannot_list_its_groups_leaves_the_log_as_the_source(tmp_path):
    log = tmp_path / "decisions.log"
    log.write_text("t=0.1 A start A-r0 on vm (warm standby): keep 1\nt=0.2 B start B-r0 on vm (cold start): x\n")

    class Broken:
        def running_groups(self):
            raise subprocess.CalledProcessError(1, ["scontrol", "show", "job"])

    got = candidates(str(log), Broken(), {("A", "vm"): 1, ("B", "vm"): 1}, ["A"])  # B: not configured any more
    assert [(spec, last["standby"]) for spec, last in got] == [(GroupSpec("A", "A-r0", "vm", 1, True), True)]
