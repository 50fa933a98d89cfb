"""The hang watchdog's logic with a fake clock and an in-memory store: the
phases a step reports, each phase's deadline, a silent peer and a peer that
holds the others up named, a paused or disabled rank left alone, what a
verdict does (log line, stack, kill, exit), and the settings refused."""

from __future__ import annotations

import logging
import math
import time

import pytest

from megascale_omni.config import ConfigError, JobConfig, WatchdogConfig, load_job_config, validate_job
from megascale_omni.metrics.clock import PhaseClock
from megascale_omni.watchdog import Beat, Heartbeat, Watchdog, judge
from megascale_omni.watchdog.service import watched_ranks

CFG = WatchdogConfig(step_timeout_s=100.0, collective_timeout_s=10.0, data_wait_timeout_s=20.0, poll_s=1.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """The c10d store calls the watchdog makes, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: str, desired: bytes) -> bytes:
        if key not in self.data and expected == "":
            self.data[key] = desired
        return self.data[key]


def beat(rank: int = 0, phase: str = "forward-backward", in_phase_s: float = 0.0, since_step_s: float = 0.0,
         step: int = 17, seq: int = 1) -> Beat:
    return Beat(rank, "r1", "h", 100 + rank, 0.0, step, phase, in_phase_s, since_step_s, seq)


# ------------------------------------------------------------------ heartbeat
def test_the_step_reports_its_phases_through_the_phase_clock():
    clock = FakeClock()
    hb = Heartbeat(clock)
    phases = PhaseClock()
    phases.listen(hb)
    seen = []
    hb.enter("data-wait", step=3)
    seen.append(hb.read()[1])
    phases.start()
    seen.append(hb.read()[1])
    with phases.phase("grad_sync"):
        with phases.phase("cross_replica"):  # nested: the outermost phase counts
            seen.append(hb.read()[1])
    seen.append(hb.read()[1])
    with phases.phase("pipeline_wait"):
        seen.append(hb.read()[1])
    phases.mark("fwd_bwd")
    seen.append(hb.read()[1])
    with phases.phase("cross_replica"):
        seen.append(hb.read()[1])
    phases.mark("optimizer")
    seen.append(hb.read()[1])
    assert seen == ["data-wait", "forward-backward", "grad-sync", "forward-backward", "pipeline-wait",
                    "optimizer", "cross-replica-allreduce", "step-boundary"]
    clock.now += 7.0
    step, phase, in_phase, since_step = hb.read()
    assert (step, phase, in_phase, since_step) == (3, "step-boundary", 7.0, 7.0)
    hb.step_ended(4)
    clock.now += 2.0
    assert hb.read() == (4, "step-boundary", 2.0, 2.0)
    phases.listen(None)
    phases.start()
    assert hb.read()[1] == "step-boundary"  # no longer listening


# ---------------------------------------------------------------- deadlines
@pytest.mark.parametrize("phase, limit, setting", [
    ("data-wait", 20.0, "watchdog.data_wait_timeout_s"),
    ("data-start", 100.0, "watchdog.step_timeout_s"),  # the first batch waits for the data workers to start
    ("pipeline-wait", 10.0, "watchdog.collective_timeout_s"),
    ("grad-sync", 10.0, "watchdog.collective_timeout_s"),
    ("cross-replica-allreduce", 10.0, "watchdog.collective_timeout_s"),
    ("forward-backward", 100.0, "watchdog.step_timeout_s"),
    ("optimizer", 100.0, "watchdog.step_timeout_s"),
    ("checkpoint", 100.0, "watchdog.step_timeout_s"),
    ("quorum", 100.0, "watchdog.step_timeout_s"),
])
def test_each_phase_has_its_deadline(phase, limit, setting):
    assert judge(beat(phase=phase, in_phase_s=limit, since_step_s=limit), [], CFG) is None
    verdict = judge(beat(phase=phase, in_phase_s=limit + 0.5, since_step_s=limit + 0.5), [], CFG)
    assert verdict is not None and verdict.culprit.rank == 0 and not verdict.silent
    assert (verdict.limit_s, verdict.setting, verdict.stuck_s) == (limit, setting, limit + 0.5)
    assert verdict.line().startswith(f"watchdog: rank 0 (replica group r1, host h) stuck in phase {phase} at step 17 "
                                     f"for {limit + 0.5:.1f} s (limit {limit:g} s; {setting})")


def test_no_step_for_step_timeout_is_a_stall_in_any_phase():
    # Phases change (a busy boundary) but no step ends.
    verdict = judge(beat(phase="data-wait", in_phase_s=1.0, since_step_s=100.5), [], CFG)
    assert (verdict.setting, verdict.stuck_s) == ("watchdog.step_timeout_s", 100.5)


def test_paused_and_exited_ranks_have_no_deadline():
    for phase in ("paused", "exited"):
        assert judge(beat(phase=phase, in_phase_s=1e6, since_step_s=1e6), [], CFG) is None


# -------------------------------------------------------------------- peers
def test_a_silent_peer_is_named_by_a_healthy_one():
    me = beat(0, "pipeline-wait", in_phase_s=3.0)
    peer = beat(3, "forward-backward", in_phase_s=0.2)
    assert judge(me, [(peer, 9.9)], CFG) is None
    verdict = judge(me, [(peer, 10.5)], CFG)
    assert verdict.culprit.rank == 3 and verdict.silent and verdict.reporter == 0
    # A silent peer is judged by min(its phase's limit, collective_timeout_s).
    assert (verdict.limit_s, verdict.setting) == (10.0, "watchdog.collective_timeout_s")
    assert "rank 3 (replica group r1, host h) stuck in phase forward-backward at step 17 for 10.5 s" in verdict.line()
    assert "heartbeat stopped" in verdict.line()
    # An exited peer is not silent: it left the loop.
    assert judge(me, [(beat(3, "exited"), 1e6)], CFG) is None


def test_a_silent_peer_is_named_at_the_heartbeat_limit_without_waiting_out_the_collective_limit():
    cfg = WatchdogConfig(step_timeout_s=100.0, collective_timeout_s=10.0, data_wait_timeout_s=20.0, poll_s=1.0,
                         heartbeat_timeout_s=3.0)
    me = beat(0, "grad-sync", in_phase_s=3.5)  # far below its own collective limit
    peer = beat(1, "forward-backward", in_phase_s=0.2)
    assert judge(me, [(peer, 2.9)], cfg) is None
    verdict = judge(me, [(peer, 3.1)], cfg)
    assert verdict.culprit.rank == 1 and verdict.silent and verdict.reporter == 0
    assert (verdict.limit_s, verdict.setting) == (3.0, "watchdog.heartbeat_timeout_s")
    # A live peer long in a phase is judged by that phase's limit, not by the heartbeat limit.
    assert judge(beat(0, "forward-backward", in_phase_s=1.0), [(beat(1, "forward-backward", in_phase_s=50.0), 0.5)],
                 cfg) is None


def test_a_waiting_rank_names_the_peer_that_holds_it_up():
    me = beat(0, "grad-sync", in_phase_s=10.5)
    computing = beat(1, "forward-backward", in_phase_s=11.0, step=17)
    waiting = beat(2, "pipeline-wait", in_phase_s=10.2)
    verdict = judge(me, [(waiting, 0.5), (computing, 0.5)], CFG)
    assert verdict.culprit.rank == 1 and not verdict.silent
    assert verdict.setting == "watchdog.collective_timeout_s" and verdict.stuck_s == 10.5
    assert verdict.detail == "rank 0 waits on it in grad-sync"
    # A peer silent for over two polls holds it up, before its own silence passes the limit.
    verdict = judge(me, [(waiting, 0.5), (beat(2, "optimizer"), 2.5)], CFG)
    assert verdict.culprit.rank == 2 and verdict.silent
    # Everybody waits: the collective itself is stuck, this rank says so ...
    verdict = judge(me, [(waiting, 0.5)], CFG)
    assert verdict.culprit.rank == 0 and "every watched rank waits" in verdict.detail
    # ... except in an elastic job: the group waits on another replica group, torchft's to settle;
    # only the step limit applies then.
    assert judge(me, [(waiting, 0.5)], CFG, elastic=True) is None
    late = beat(0, "grad-sync", in_phase_s=10.5, since_step_s=100.5)
    assert judge(late, [(waiting, 0.5)], CFG, elastic=True).setting == "watchdog.step_timeout_s"
    # A peer of its own group that holds it up is still named.
    assert judge(me, [(computing, 0.5)], CFG, elastic=True).culprit.rank == 1


def test_watched_ranks_are_the_node_and_the_next_nodes_first():
    assert watched_ranks(0, 2, 0, 2) == [1]
    assert watched_ranks(5, 16, 1, 4) == [4, 6, 7, 8]
    assert watched_ranks(13, 16, 1, 4) == [0, 12, 14, 15]
    assert watched_ranks(0, 1, 0, 1) == []


# ------------------------------------------------------------ the service
def _pair(clock, store, **kw):
    exits, kills = [], []
    dogs = [Watchdog(CFG, rank, 2, "r1", elastic=False, local_rank=rank, local_world_size=2, store=lambda: store,
                     clock=clock, exit=lambda r=rank: exits.append(r), kill=lambda b: kills.append(b.rank) or True,
                     **kw) for rank in (0, 1)]
    return dogs, exits, kills


def test_a_stopped_rank_is_named_killed_and_the_group_exits(caplog, tmp_path):
    clock, store = FakeClock(), FakeStore()
    (d0, d1), exits, kills = _pair(clock, store)
    for d in (d0, d1):
        d.heartbeat.step_ended(16)
    for _ in range(3):  # both healthy
        clock.now += 1.0
        assert d0.check() is None and d1.check() is None
    d1.heartbeat.enter("forward-backward")
    d1.check()
    d0.heartbeat.enter("pipeline-wait")
    # Rank 1 stops (SIGSTOP): its watchdog publishes no more.
    verdict = None
    for _ in range(12):
        clock.now += 1.0
        verdict = d0.check()
        if verdict is not None:
            break
    assert verdict is not None and verdict.culprit.rank == 1 and verdict.silent
    # Named within the limit plus the poll slack.
    assert clock.now - 1000.0 - 4.0 <= CFG.collective_timeout_s + 2 * CFG.poll_s
    with caplog.at_level(logging.ERROR):
        d0.act(verdict)
    assert kills == [1] and exits == [0]
    assert any(r.getMessage().startswith("watchdog: rank 1 (replica group r1, host ") and
               "stuck in phase forward-backward at step 16" in r.getMessage() for r in caplog.records)
    assert "no checkpoint saved" in caplog.text and "exits with code 43" in caplog.text


def test_a_live_culprit_dumps_its_stack_and_exits(caplog, tmp_path):
    clock, store = FakeClock(), FakeStore()
    (d0, d1), exits, kills = _pair(clock, store)
    d0.heartbeat.enter("grad-sync")
    d1.heartbeat.enter("data-wait")
    d1.heartbeat.step_ended(5)
    d1.heartbeat.enter("data-wait")
    clock.now += 0.5
    d1.check()
    clock.now += 10.0
    d1.check()
    verdict = d0.check()  # rank 0 waited 10.5 s in grad-sync on rank 1, which reads data
    assert verdict.culprit.rank == 1 and verdict.culprit.phase == "data-wait" and not verdict.silent
    seen = d1.check()  # rank 1 reads the published verdict naming it
    assert seen == verdict
    d1.stack_file = (tmp_path / "stack.txt").open("w+")
    with caplog.at_level(logging.ERROR):
        d1.act(seen)
    d1.stack_file.seek(0)
    assert "test_a_live_culprit_dumps_its_stack_and_exits" in d1.stack_file.read()
    assert "stack of rank 1 (stuck in phase data-wait at step 5)" in caplog.text
    assert exits == [1] and store.check(["verdict-ack"])
    d0.act(verdict)  # the reporter waits for that acknowledgement (here already given), then exits
    assert exits == [1, 0] and kills == []


def test_a_paused_job_is_not_a_hang():
    clock, store = FakeClock(), FakeStore()
    paused = [True]
    (d0, d1), _, _ = _pair(clock, store, held=lambda: paused[0])
    for d in (d0, d1):
        d.heartbeat.enter("step-boundary")
    for _ in range(300):
        clock.now += 1.0
        assert d0.check() is None and d1.check() is None
    assert store.data["beat/0"] and b'"paused"' in store.data["beat/0"]
    paused[0] = False
    clock.now += 99.0
    assert d0.check() is None
    clock.now += 2.0
    assert d0.check().setting == "watchdog.step_timeout_s"


def test_disabled_or_alone():
    dog = Watchdog(WatchdogConfig(enabled=False), 0, 2, "job", elastic=False, store=FakeStore)
    dog.start()
    assert dog._thread is None
    dog.close()
    # A store that does not answer: the rank is still judged alone.
    clock = FakeClock()

    def broken():
        raise RuntimeError("connection refused")

    alone = Watchdog(CFG, 0, 2, "job", elastic=False, store=broken, clock=clock)
    alone.heartbeat.enter("data-wait")
    clock.now += 25.0
    assert alone.check().setting == "watchdog.data_wait_timeout_s"


# ----------------------------------------------------------------- settings
@pytest.mark.parametrize("field", ["step_timeout_s", "collective_timeout_s", "data_wait_timeout_s",
                                   "heartbeat_timeout_s", "poll_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_bad_settings_are_refused_with_one_line(field, value):
    with pytest.raises(ConfigError) as err:
        WatchdogConfig(**{field: value})
    assert err.value.field == f"watchdog.{field}"
    assert "\n" not in str(err.value)


def test_poll_must_be_below_every_limit_and_overrides_parse():
    with pytest.raises(ConfigError, match=r"watchdog.poll_s=5.0: must be below every watchdog limit"):
        WatchdogConfig(data_wait_timeout_s=5.0)
    with pytest.raises(ConfigError, match=r"watchdog.heartbeat_timeout_s=2.0: must be at least 3 x "
                                          r"watchdog.poll_s = 3 s"):
        WatchdogConfig(poll_s=1.0, heartbeat_timeout_s=2.0)
    cfg = load_job_config(["watchdog.poll_s=0.5", "watchdog.collective_timeout_s=4"])
    assert (cfg.watchdog.poll_s, cfg.watchdog.collective_timeout_s) == (0.5, 4.0)
    with pytest.raises(ConfigError, match="watchdog.step_timeout_s"):
        load_job_config(["watchdog.step_timeout_s=nan"])


def test_elastic_survivors_are_not_torn_down_before_torchft_abandons_the_step():
    cfg = JobConfig()
    cfg.elastic.enabled, cfg.elastic.lighthouse, cfg.elastic.replica_id = True, "http://h:1", "r0"
    cfg.elastic.timeout_s = 60.0
    cfg.watchdog = WatchdogConfig(collective_timeout_s=60.0)
    with pytest.raises(ConfigError, match=r"watchdog.collective_timeout_s=60.0: must exceed elastic.timeout_s=60"):
        validate_job(cfg, 1)
    cfg.watchdog = WatchdogConfig(collective_timeout_s=61.0, step_timeout_s=121.0)
    # A survivor in the cross-replica sums (judged by the step deadline) outwaits the stuck group's own
    # watchdog and torchft's abandon (found by the chaos run: survivors torn down while the peer hung).
    with pytest.raises(ConfigError, match=r"watchdog.step_timeout_s=121.0: must exceed watchdog.collective_timeout_s "
                                          r"\+ elastic.timeout_s = 121 in an elastic job"):
        validate_job(cfg, 1)
    cfg.watchdog = WatchdogConfig(collective_timeout_s=61.0)
    validate_job(cfg, 1)


def test_the_thread_publishes_at_once_and_says_exited_on_close():
    store = FakeStore()
    cfg = WatchdogConfig(step_timeout_s=100.0, collective_timeout_s=10.0, data_wait_timeout_s=20.0, poll_s=0.05)
    dog = Watchdog(cfg, 1, 2, "job", elastic=False, local_rank=1, local_world_size=2, store=lambda: store)
    dog.heartbeat.step_ended(7)
    dog.start()
    try:
        deadline = time.monotonic() + 30  # a hang guard only
        while "beat/1" not in store.data:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert Beat.decode(store.data["beat/1"]).step == 7
    finally:
        dog.close()
    last = Beat.decode(store.data["beat/1"])
    assert last.phase == "exited" and dog._thread is None
    dog.close()  # idempotent
