"""The live actuator and loop against a fake launcher whose replica groups are
in-process control planes on real Unix sockets (a stand-in training loop per
group, as in test_control_server.py): a grow joins a warm standby through
its socket, a reclaim drains through the socket, an overdue one kills, an
unreachable socket is retried with backoff and reported, never raised."""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml

from megascale_omni.config import JobConfig, from_dict
from megascale_omni.control.plane import ControlPlane
from megascale_omni.scheduler.actuator import Backoff, LiveActuator
from megascale_omni.scheduler.launchers import GroupSpec
from megascale_omni.scheduler.live_config import parse_live_config
from megascale_omni.scheduler.live_loop import LiveScheduler
from megascale_omni.scheduler.policy import ElasticPolicy, Knobs

pytestmark = pytest.mark.timeout(60)


class FakeGroup:
    """A replica group in a thread: a ControlPlane (standby first if asked) and a stand-in step loop."""

    def __init__(self, spec: GroupSpec, root, serve: bool = True):
        self.spec, self.root, self.code, self.killed = spec, root, None, False
        self.plane = None
        if serve:
            self.serve()

    def serve(self) -> None:
        cfg = from_dict(JobConfig, {"train": {"steps": 10**6}, "control": {"pause_poll_s": 0.02},
                                    "logging": {"output_dir": str(self.root / self.spec.replica_id)}})
        self.plane = ControlPlane(cfg, {},
                                  replica_info=lambda: {"replica_id": self.spec.replica_id,
                                                        "standby": self.spec.standby})
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        if self.spec.standby and not self.plane.stand_by(0):
            self.code = 0
            return
        step, record = 0, None
        while self.plane.step_boundary(step, record) and not self.killed:
            time.sleep(0.005)
            step += 1
            record = {"step": step, "loss": 1.0, "samples_per_s": 50.0, "participants": 1, "step_s": 0.005,
                      "data_s": 0.0}
        self.code = -9 if self.killed else 0

    def kill(self) -> None:
        self.killed = True
        if self.plane is not None:
            self.plane.draining = True  # releases a standby's hold
            self.plane.close()
        self.code = -9


class FakeLauncher:
    def __init__(self, root, serve: bool = True):
        self.root, self.serve, self.groups, self.killed = root, serve, {}, []

    def start(self, group: GroupSpec) -> None:
        self.groups[group.replica_id] = FakeGroup(group, self.root, self.serve)

    def kill(self, group: GroupSpec) -> None:
        self.killed.append(group.replica_id)
        self.groups[group.replica_id].kill()

    def address(self, group: GroupSpec):
        return str(self.root / group.replica_id / "control.sock")

    def exited(self, group: GroupSpec):
        return self.groups[group.replica_id].code

    def close(self) -> None:
        for g in self.groups.values():
            g.kill()


@pytest.fixture
def launcher(tmp_path):
    fake = FakeLauncher(tmp_path)
    yield fake
    fake.close()


def _actuator(launcher, records, sleeps=None, **kw):
    return LiveActuator(launcher, {("A", "bm"): 1, ("A", "vm"): 1}, kw.pop("standbys", {("A", "vm"): 1}),
                        backoff=Backoff(4, 0.5, 8.0), command_timeout_s=10,
                        sleep=(sleeps.append if sleeps is not None else time.sleep), record=records.append, **kw)


def _until(what, predicate, step=lambda: None):
    deadline = time.monotonic() + 30  # a hang guard only; every wait ends on an event
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        step()
        time.sleep(0.01)


def test_grow_joins_a_warm_standby_and_a_new_standby_takes_its_place(launcher):
    records: list[str] = []
    act = _actuator(launcher, records)
    act.keep_standbys({"bm": 2, "vm": 2})
    assert list(act.groups) == ["A-r0"] and act.groups["A-r0"].standby
    act.refresh(0.0)
    assert act.groups["A-r0"].state == "standby"
    assert act.grow("A", "vm", 1, "load 2.00 > 1.05") == ["A-r0"]
    assert records[-1] == "A grow: join standby A-r0 on vm (at step 0): load 2.00 > 1.05"
    _until("A-r0 trains", lambda: act.groups["A-r0"].state == "running", lambda: act.refresh(0.0))
    seen = act.refresh(0.0)
    assert [o.metrics["samples_per_s"] for o in seen["A"]] == [50.0]
    act.keep_standbys({"vm": 2})  # room for one more standby next to the joined group
    assert sorted(act.groups) == ["A-r0", "A-r1"] and act.groups["A-r1"].standby
    assert records[-1] == "A start A-r1 on vm (warm standby): keep 1 warm standby(s) of A on vm"
    _until("A-r1 stands by", lambda: act.groups["A-r1"].state == "standby", lambda: act.refresh(0.0))
    act.keep_standbys({"vm": 1})  # the pool shrank: the standby yields, through its socket
    assert act.groups["A-r1"].state == "draining" and records[-1].startswith("A drain A-r1 (leaves after step 0)")
    _until("A-r1 leaves", lambda: "A-r1" not in act.groups, lambda: act.refresh(0.0))
    assert records[-1] == "A A-r1 left after its drain (exit code 0)" and launcher.killed == []


def test_grow_without_standby_cold_starts_and_a_starting_standby_is_joined_once_it_serves(tmp_path):
    launcher = FakeLauncher(tmp_path, serve=False)
    records: list[str] = []
    act = _actuator(launcher, records, sleeps=[])
    try:
        assert act.grow("A", "bm", 1, "admit") == ["A-r0"]
        assert records == ["A start A-r0 on bm (cold start): admit"] and not act.groups["A-r0"].standby
        act.keep_standbys({"vm": 1})
        assert act.grow("A", "vm", 1, "load high") == ["A-r1"]
        assert act.groups["A-r1"].join_pending and act.groups["A-r1"].member
        assert records[-1] == "A grow: join standby A-r1 on vm once it stands by: load high"
        act.refresh(0.0)  # not serving yet: one quiet try each, no backoff, nothing reported
        assert act.unreachable == [] and act.groups["A-r1"].state == "starting"
        launcher.groups["A-r1"].serve()
        _until("A-r1 joins", lambda: act.groups["A-r1"].state == "running", lambda: act.refresh(0.0))
        assert "A grow: join standby A-r1 on vm (at step 0): load high (the grow waited for the standby to come " \
            "up)" in records
    finally:
        launcher.close()


def test_drain_through_the_socket_then_forget_the_group(launcher):
    records: list[str] = []
    act = _actuator(launcher, records, standbys={})
    act.grow("A", "bm", 1, "admit")
    _until("A-r0 trains", lambda: act.groups["A-r0"].state == "running", lambda: act.refresh(0.0))
    act.drain("A", ["A-r0"], "reclaim: 1 node(s) of vm leave")
    assert act.groups["A-r0"].state == "draining"
    assert records[-1].startswith("A drain A-r0 (leaves after step ") and records[-1].endswith(
        "): reclaim: 1 node(s) of vm leave")
    act.drain("A", ["A-r0"], "again")  # already draining: nothing sent twice
    _until("A-r0 leaves", lambda: "A-r0" not in act.groups, lambda: act.refresh(0.0))
    assert launcher.killed == [] and launcher.groups["A-r0"].code == 0


def test_unreachable_socket_is_retried_with_backoff_and_reported_never_raised(launcher):
    records: list[str] = []
    sleeps: list[float] = []
    act = _actuator(launcher, records, sleeps=sleeps, standbys={})
    act.grow("A", "bm", 1, "admit")
    _until("A-r0 trains", lambda: act.groups["A-r0"].state == "running", lambda: act.refresh(0.0))
    launcher.groups["A-r0"].plane.close()  # the socket goes away; the process does not exit
    assert act.refresh(0.0) == {}
    assert sleeps == [0.5, 1.0, 2.0]
    assert act.unreachable[-1].startswith("A A-r0: A: unreachable after 4 attempt(s) over 3.5 s: ")
    sleeps.clear()
    act.drain("A", ["A-r0"], "shrink")
    assert sleeps == [0.5, 1.0, 2.0] and act.groups["A-r0"].state == "running"
    assert act.unreachable[-1].startswith("A A-r0: drain failed: FileNotFoundError")
    act.kill("A", ["A-r0"], "reclaim deadline passed")
    assert launcher.killed == ["A-r0"] and records[-1] == "A kill A-r0: reclaim deadline passed"


LIVE = {
    "out": "OUT", "tick_s": 0.05, "control": {"attempts": 2, "backoff_s": 0.01, "timeout_s": 10},
    "pools": [{"name": "bm", "kind": "bare_metal", "gpus_per_node": 1, "nodes": 1},
              {"name": "vm", "kind": "vm", "gpus_per_node": 1, "nodes": 1}],
    "jobs": [{"name": "A", "config": "examples/elastic/gpt_pp2.yaml", "replica_gpus": 1,
              "replicas": {"min": 1, "max": 2}, "standby": {"vm": 1}}],
    "policy": {"confirm_min": 0, "window_min": 0.001, "cooldown_min": 0},
}


class Clock:
    def __init__(self):
        self.t = 1.0e9

    def __call__(self) -> float:
        return self.t


def _scheduler(tmp_path, launcher):
    cfg = parse_live_config({**LIVE, "out": str(tmp_path / "out"), "availability": str(tmp_path / "avail.yaml")})
    clock = Clock()
    return LiveScheduler(cfg, launcher, ElasticPolicy(Knobs.from_dict(cfg.policy)), wall=clock), clock


def _lines(tmp_path) -> list[str]:
    return [line.split(" ", 1)[1] for line in (tmp_path / "out" / "decisions.log").read_text().splitlines()]


def test_loop_reclaim_drains_through_the_socket_and_the_return_joins_a_standby(tmp_path, launcher):
    sched, clock = _scheduler(tmp_path, launcher)
    groups = sched.actuator.groups
    sched.tick()  # admission: the core cold-starts on bm; a standby starts on vm (before the policy's grow)
    assert _lines(tmp_path)[:3] == ["A start A-r0 on vm (warm standby): keep 1 warm standby(s) of A on vm",
                                    "A grow 1 on bm: admit: core of 1 group(s) on bare metal",
                                    "A start A-r1 on bm (cold start): admit: core of 1 group(s) on bare metal"]
    _until("A grows onto the standby", lambda: groups["A-r0"].state == "running", sched.tick)
    assert "A grow 1 on vm: load 2.00 > 1.05 for 0 min: 1 -> 2 groups" in _lines(tmp_path)
    # The VM pool is reclaimed in 30 s: its group is drained through its socket.
    (tmp_path / "avail.yaml").write_text(yaml.safe_dump({"vm": {"nodes": 1, "reclaim": {"nodes": 1,
                                                                                          "deadline": clock.t + 30}}}))
    sched.tick()
    assert groups["A-r0"].state == "draining"
    assert "A drain A-r0: reclaim: 1 node(s) of vm leave at t=0.5 min (0.5 min left); drain before the deadline" \
        in _lines(tmp_path)
    _until("A-r0 leaves", lambda: "A-r0" not in groups, sched.tick)
    assert [g.spec.pool for g in groups.values()] == ["bm"] and launcher.killed == []
    (tmp_path / "avail.yaml").write_text("vm: {nodes: 0}\n")
    clock.t += 60
    sched.tick()
    assert list(groups) == ["A-r1"]
    # Given back: a standby starts first, so the policy's grow is a join.
    (tmp_path / "avail.yaml").write_text("vm: {nodes: 1}\n")
    clock.t += 60
    sched.tick()
    assert groups["A-r2"].standby and groups["A-r2"].join_pending
    _until("A-r2 joins", lambda: groups["A-r2"].state == "running", sched.tick)
    assert "A grow: join standby A-r2 on vm (at step 0): load 2.00 > 1.05 for 2 min: 1 -> 2 groups (the grow " \
        "waited for the standby to come up)" in _lines(tmp_path)
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    assert state["pools"]["vm"] == {"nodes": 1, "used": 1, "reclaiming": 0}
    assert {rid: g["state"] for rid, g in state["groups"].items()} == {"A-r1": "running", "A-r2": "running"}
    sched.run(lambda: True, drain_wait_s=30)  # stop: drain everything
    assert groups == {} and launcher.killed == []


def test_loop_kills_after_an_overdue_reclaim_and_survives_an_unreachable_group_and_a_bad_file(tmp_path, launcher):
    sched, clock = _scheduler(tmp_path, launcher)
    groups = sched.actuator.groups
    _until("A runs on both pools", lambda: len(groups) == 2 and all(g.state == "running" for g in groups.values()),
           sched.tick)
    launcher.groups["A-r0"].plane.close()  # the VM group hangs: its socket is gone, its process is not
    (tmp_path / "avail.yaml").write_text(yaml.safe_dump({"vm": {"nodes": 1, "reclaim": {"nodes": 1,
                                                                                          "deadline": clock.t + 30}}}))
    sched.tick()  # the drain cannot get through: reported, retried next tick
    assert groups["A-r0"].state == "running" and "A-r0" not in launcher.killed
    assert any(line.startswith("A A-r0: drain failed: FileNotFoundError") for line in _lines(tmp_path))
    clock.t += 31
    (tmp_path / "avail.yaml").write_text("vm: [not, a, mapping\n")
    sched.tick()  # a half-written file is reported and the last reading kept; the deadline passed: kill
    assert launcher.killed == ["A-r0"] and "A-r0" not in groups
    lines = _lines(tmp_path)
    assert any(line.startswith(f"availability not read (keeping the last reading): {tmp_path / 'avail.yaml'}: "
                               "cannot read it: ") for line in lines)
    assert "A kill A-r0: reclaim deadline t=0.5 min on vm passed with the group(s) still there: kill" in lines
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    assert any("A-r0" in line and "unreachable" in line for line in state["unreachable"])
