"""The chaos harness's fault plan and its end-of-run proofs, each shown to
catch a planted failure: a lost sample, a repeated sample, a step committed
twice, a loss mismatch, a broken checkpoint, a leftover process, an
unplanned action; the kill_scheduler fault's firing, detection and
recovery (a duplicate start caught); the reference's anchored segments
(tools/chaos.py; docs/operations.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from megascale_omni.chaos import checks, report
from megascale_omni.chaos.plan import FAULT_CLASSES, make_plan
from megascale_omni.chaos.supervisor import RUN_MARKER, processes_of_run

KINDS = ["kill_rank", "kill_group", "straggler", "control_flood"]


def test_plan_is_seeded_covers_every_class_and_spreads_the_faults():
    plan = make_plan(seed=7, duration_s=100, kinds=KINDS, slots=2, count=10, first_s=5)
    assert plan == make_plan(seed=7, duration_s=100, kinds=KINDS, slots=2, count=10, first_s=5)
    assert plan != make_plan(seed=8, duration_s=100, kinds=KINDS, slots=2, count=10, first_s=5)
    counts = Counter(f.kind for f in plan)
    assert set(counts) == set(KINDS) and min(counts.values()) >= 10 // len(KINDS)
    assert [f.at_s for f in plan] == [5 + 9.5 * i for i in range(10)]
    assert {f.slot for f in plan} <= {0, 1} and [f.index for f in plan] == list(range(10))
    assert [f.kind for f in make_plan(1, 50, KINDS, 3)] and len(make_plan(1, 50, KINDS, 3)) == len(KINDS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kinds=["nosuch"]), "unknown fault class"),
    (dict(kinds=[]), "no fault class"),
    (dict(count=2), "below the 4 classes"),
    (dict(slots=0), "at least one replica group"),
    (dict(duration_s=3.0), "first_s < duration_s"),
])
def test_plan_refuses_bad_arguments(kwargs, message):
    args = {**dict(seed=0, duration_s=60.0, kinds=KINDS, slots=2, first_s=5.0), **kwargs}
    with pytest.raises(ValueError, match=message):
        make_plan(**args)


def test_every_fault_class_has_an_injector():
    from megascale_omni.chaos.faults import INJECTORS

    assert set(FAULT_CLASSES) == set(INJECTORS)


def _ledger(steps: dict[int, list[list[int]]], uncommitted: tuple = ()) -> list[dict]:
    """Ledger lines: step -> one sample list per participant, all committed under quorum 1."""
    lines = []
    for step, shares in steps.items():
        for p, samples in enumerate(shares):
            lines.append({"event": "attempt", "step": step, "quorum": 1, "replica": f"r{p}", "participant": p,
                          "participants": len(shares), "dp_rank": p, "dp_size": len(shares), "samples": samples})
        lines.append({"event": "commit", "step": step, "quorum": 1, "replica": "r0", "committed": True})
    for step, samples in uncommitted:  # an earlier attempt (quorum 0) that never committed
        lines.append({"event": "attempt", "step": step, "quorum": 0, "replica": "r1", "participant": 1,
                      "participants": 2, "dp_rank": 1, "dp_size": 2, "samples": samples})
    return lines


REFERENCE = _ledger({0: [[1, 2, 3, 4]], 1: [[5, 6, 7, 8]]})


def test_ledger_exactly_once_passes_a_re_split_and_ignores_uncommitted_attempts():
    chaos = _ledger({0: [[1, 2], [3, 4]], 1: [[7, 5, 6, 8]]}, uncommitted=[(1, [5, 6])])
    assert checks.ledger_problems(chaos, REFERENCE, last_step=2) == []
    assert report.uncommitted_attempts(chaos) == {1: 1}


def test_ledger_exactly_once_counts_attempts_whose_outcome_died_with_their_group():
    """Step 0: r1 killed right after the cross-replica sum (no outcome line
    of its own), r0 committed. Step 1: both killed before any outcome, step
    2 on record proves step 1 committed under its quorum: nothing lost,
    and no attempt of a committed step counts as thrown away."""
    chaos = [r for r in _ledger({0: [[1, 2], [3, 4]], 1: [[5, 6], [7, 8]], 2: [[9]]})
             if (r["event"], r["step"]) != ("commit", 1)]
    reference = REFERENCE + _ledger({2: [[9]]})
    assert checks.ledger_problems(chaos, reference, last_step=3) == []
    assert report.uncommitted_attempts(chaos) == {}
    planted = [r for r in chaos if (r["event"], r["step"], r.get("replica")) != ("attempt", 1, "r1")]
    assert checks.ledger_problems(planted, reference, last_step=3) == ["ledger step 1: samples lost [7, 8]"]


def test_ledger_catches_a_planted_lost_sample():
    chaos = _ledger({0: [[1, 2], [3]], 1: [[5, 6, 7, 8]]})
    assert checks.ledger_problems(chaos, REFERENCE, 2) == ["ledger step 0: samples lost [4]"]


def test_ledger_catches_a_planted_repeated_sample():
    chaos = _ledger({0: [[1, 2, 3, 4]], 1: [[5, 6], [6, 7, 8]]})
    assert checks.ledger_problems(chaos, REFERENCE, 2) == ["ledger step 1: samples repeated or foreign [6]"]


def test_ledger_catches_a_lost_step_and_a_step_committed_twice():
    assert checks.ledger_problems(_ledger({0: [[1, 2, 3, 4]]}), REFERENCE, 2) == [
        "ledger step 1: no committed consumption in the chaos ledger (its samples lost)"]
    twice = _ledger({0: [[1, 2, 3, 4]], 1: [[5, 6, 7, 8]]}) + [
        {"event": "commit", "step": 1, "quorum": 5, "replica": "r1", "committed": True}]
    [problem] = checks.ledger_problems(twice, REFERENCE, 2)
    assert "step 1 committed under quorums (0, 1) and (0, 5)" in problem


def test_losses_equal_within_tolerance_and_a_planted_mismatch_is_caught():
    merged, problems = checks.merge_step_records([[{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0}],
                                                  [{"step": 2, "loss": 3.0}]])
    assert problems == []
    assert checks.loss_mismatches(merged, {1: 4.0, 2: 3.0 * (1 + 5e-5)}, rtol=1e-4) == []
    [line] = checks.loss_mismatches(merged, {1: 4.0, 2: 3.03}, rtol=1e-4)
    assert line.startswith("step 2: loss 3.0 vs reference 3.03")
    assert checks.worst_loss_difference(merged, {1: 4.0, 2: 3.03}) == pytest.approx(0.03 / 3.03)
    assert checks.loss_difference_profile(merged, {1: 4.0, 2: 3.03}, span=1) == [
        (1, 1, 0.0), (2, 2, pytest.approx(0.03 / 3.03))]


def test_records_that_disagree_or_skip_a_step_are_caught():
    _, problems = checks.merge_step_records([[{"step": 1, "loss": 4.0}, {"step": 3, "loss": 2.0}],
                                             [{"step": 1, "loss": 4.1}]])
    assert problems == ["step 1: groups report losses 4.0 and 4.1", "committed steps have gaps: missing [2]"]


def test_a_planted_broken_checkpoint_is_caught(tmp_path):
    from megascale_omni.checkpoint import layout

    step = tmp_path / layout.step_dir_name(10)
    step.mkdir()
    (step / "model.bin").write_bytes(b"x" * 100)
    layout.write_commit(step, 10, {"reason": "interval"})
    (tmp_path / layout.step_dir_name(20)).mkdir()  # an unfinished save: not a checkpoint
    assert checks.checkpoint_problems(tmp_path) == (1, [])
    (step / "model.bin").write_bytes(b"y" * 100)  # same size, other bytes
    n, problems = checks.checkpoint_problems(tmp_path)
    assert n == 1 and len(problems) == 1 and "BROKEN" in problems[0], problems
    (step / "commit.json").write_text("{not json")
    n, problems = checks.checkpoint_problems(tmp_path)
    assert n == 0 and len(problems) == 1 and str(step) in problems[0], problems


def test_a_planted_leftover_process_is_found_by_the_run_marker():
    token = f"test-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, RUN_MARKER: token})
    try:
        assert processes_of_run(token) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert processes_of_run(token) == []


def test_an_unplanned_action_is_caught():
    actions = [{"action": "start group"}, {"action": "fault"}, {"action": "group exited"}]
    assert checks.intervention_problems(actions) == []
    assert checks.intervention_problems([*actions, {"action": "drain", "replica_id": "g0-1"}]) == [
        "unplanned action: {'action': 'drain', 'replica_id': 'g0-1'}"]


def test_steps_lost_and_ettr():
    lost = {4: 1, 5: 2, 30: 1}
    assert report.steps_lost({"step_fired": 5, "step_recovered": 8}, lost) == 3
    ratio, typical = report.ettr([0.1] * 9 + [5.0], span_s=1.9)
    assert typical == 0.1 and ratio == pytest.approx(1.0 / 2.0)
    assert json.dumps(report.class_table([], {"kill_scheduler": "why"}))


def test_stalls_are_split_among_the_faults_active_during_them():
    # Commits every 0.1 s, then gaps of 10 s (faults 0 and 1 both active), 1 s (not a stall) and 4 s (none active).
    times = [0.1 * i for i in range(11)] + [11.0, 11.1, 12.1, 16.1]
    windows = [(0, 0.5, 12.0), (1, 5.0, 6.0), (2, 20.0, 30.0)]
    stalled, unclaimed = report.stalls(times, typical=0.1, windows=windows)
    assert stalled == pytest.approx({0: 9.9 / 2, 1: 9.9 / 2})
    assert unclaimed == pytest.approx(3.9)
    rows = report.class_table([{"kind": "kill_rank", "detected_s": 1.0, "recovered_s": 2.0, "steps_lost": 1,
                                "stalled_s": 4.3}], {})
    assert rows[0]["stalled_s"] == 4.3 and report.format_table(rows).endswith("| 1 | 4.3 |")


def test_a_fall_back_to_a_checkpoint_counts_only_the_latest_epoch():
    """Epoch 0 committed ledger steps 0-1; every group was lost and epoch 1
    redid step 1 from the checkpoint (quorum ids start over): exactly-once
    holds over the latest epoch, and step 2 is counted as rolled back."""
    old = [{**r, "epoch": 0} for r in _ledger({0: [[1, 2, 3, 4]], 1: [[5, 6, 7, 8]]})]
    new = [{**r, "epoch": 1} for r in _ledger({1: [[5, 6], [7, 8]]})]
    assert checks.ledger_problems(old + new, REFERENCE, 2) == []
    wrong = [{**r, "epoch": 1} for r in _ledger({1: [[5, 6], [7]]})]
    assert checks.ledger_problems(old + wrong, REFERENCE, 2) == ["ledger step 1: samples lost [8]"]
    records = [{"step": 1, "loss": 4.0, "epoch": 0}, {"step": 2, "loss": 3.0, "epoch": 0},
               {"step": 2, "loss": 3.1, "epoch": 1}, {"step": 3, "loss": 2.0, "epoch": 1}]
    merged, problems = checks.merge_step_records([records])
    assert problems == [] and merged[2]["loss"] == 3.1
    assert checks.rolled_back_steps(records) == 1


def _timeline(steps: dict[int, tuple[int, list[list[int]]]], committed: bool = True) -> list[dict]:
    """Ledger lines: step -> (quorum, one sample list per participant); r0 writes the outcome."""
    lines = []
    for step, (quorum, shares) in steps.items():
        for p, samples in enumerate(shares):
            lines.append({"event": "attempt", "step": step, "quorum": quorum, "replica": f"r{p}", "participant": p,
                          "participants": len(shares), "dp_rank": p, "dp_size": len(shares), "samples": samples})
        if committed:
            lines.append({"event": "commit", "step": step, "quorum": quorum, "replica": "r0", "committed": True})
    return lines


def test_a_fall_back_under_the_same_lighthouse_supersedes_the_lost_timeline():
    """Ledger steps 0-3 committed under quorums 1-4 by two groups; then every
    group died (the lighthouse lived on) and the job resumed from the
    checkpoint of step 2: steps 2, 3, 4 ran again under quorums 6-8 with one
    group, another split. The replayed steps are not committed twice, no
    sample is lost or repeated, and the lost timeline's attempts count as
    thrown away. A replay that loses a sample is still caught."""
    reference = _ledger({0: [[1, 2, 3, 4]], 1: [[5, 6, 7, 8]], 2: [[9, 10, 11, 12]], 3: [[13, 14, 15, 16]],
                         4: [[17, 18, 19, 20]]})
    lost = _timeline({0: (1, [[1, 2], [3, 4]]), 1: (2, [[5, 6], [7, 8]]), 2: (3, [[9, 10], [11, 12]]),
                      3: (4, [[13, 14], [15, 16]])})
    lost += _timeline({4: (5, [[17, 18], [19, 20]])}, committed=False)  # in flight when every group died
    replay = _timeline({2: (6, [[9, 10, 11, 12]]), 3: (7, [[13, 14, 15, 16]]), 4: (8, [[17, 18, 19, 20]])})
    assert checks.ledger_problems(lost + replay, reference, last_step=5) == []
    assert report.uncommitted_attempts(lost + replay) == {2: 1, 3: 1, 4: 1}
    short = _timeline({2: (6, [[9, 10, 11]]), 3: (7, [[13, 14, 15, 16]]), 4: (8, [[17, 18, 19, 20]])})
    assert checks.ledger_problems(lost + short, reference, last_step=5) == ["ledger step 2: samples lost [12]"]
    # Without the replay (no attempt of step 2 under a later quorum) two commits of one step are still an error.
    twice = lost + [{"event": "commit", "step": 3, "quorum": 7, "replica": "r0", "committed": True}]
    [problem] = checks.ledger_problems(twice, reference, last_step=4)
    assert "step 3 committed under quorums (0, 4) and (0, 7)" in problem


def test_step_records_of_a_rolled_back_timeline_give_way_to_the_replay():
    """Step records carry their quorum: records 3 and 4 (ledger steps 2, 3)
    of the lost timeline are superseded by the replay's, which ran with
    another membership (its losses differ in the last bits)."""
    lost = [{"step": s, "loss": 5.0 - s, "quorum": s, "participants": 2} for s in (1, 2, 3, 4)]
    replay = [{"step": s, "loss": 5.0 - s + 1e-7, "quorum": s + 3, "participants": 1} for s in (3, 4, 5)]
    merged, problems = checks.merge_step_records([lost, replay])
    assert problems == [] and sorted(merged) == [1, 2, 3, 4, 5]
    assert [merged[s]["quorum"] for s in (1, 2, 3, 4, 5)] == [1, 2, 6, 7, 8]
    assert checks.rolled_back_steps(lost + replay) == 2
    # A healing group's record proves nothing about the job's step; two records of one timeline must agree.
    _, problems = checks.merge_step_records([lost, [{**lost[2], "loss": 1.5}]])
    assert problems == ["step 3: groups report losses 2.0 and 1.5"]


#: Wall times (time.time()) at which the supervisor started lighthouse epochs 0, 1 and 2.
LIGHTHOUSE_STARTS = [100.0, 200.0, 300.0]


def _at(lines: list[dict], quorum_t: float, epoch: int = 0) -> list[dict]:
    """``lines`` answered by the lighthouse at wall time ``quorum_t``, labelled ``epoch`` as a per-group reader would."""
    return [{**r, "quorum_t": quorum_t, "epoch": epoch} for r in lines]


def test_epoch_at_counts_the_lighthouse_starts_before_a_wall_time():
    assert [checks.epoch_at(t, LIGHTHOUSE_STARTS) for t in (50.0, 100.0, 199.9, 200.0, 1e9)] == [0, 0, 0, 1, 2]
    # A line without quorum_t (a fixed group's, an old ledger's) keeps the epoch its reader gave it.
    old = {"event": "commit", "step": 0, "quorum": 3, "epoch": 1}
    assert checks.with_epochs([old], LIGHTHOUSE_STARTS) == [old]
    assert checks.with_epochs([{**old, "quorum_t": 250.0}], LIGHTHOUSE_STARTS)[0]["epoch"] == 1


def test_the_soak_s_replay_after_a_lighthouse_restart_is_no_second_commit_with_per_line_epochs():
    """The soak of 2026-12-02 ("step 1093 committed under quorums (3, 8) and
    (3, 1)"): the job committed ledger steps 0-3 under the first lighthouse's
    quorum 8, a replacement group started before the lighthouse's restart
    resumed from the checkpoint of step 2 and replayed steps 2-4 under the
    restarted lighthouse's quorum 1. Labelled per group, its lines carry the
    old epoch and the proof fails; per line (quorum_t) the replay supersedes
    the lost timeline, and a lost sample in the replay is still caught."""
    reference = _ledger({s: [[4 * s + k for k in range(1, 5)]] for s in range(5)})
    lost = _at(_timeline({s: (8, [[4 * s + 1, 4 * s + 2], [4 * s + 3, 4 * s + 4]]) for s in range(4)}), 150.0)
    replay = _at(_timeline({s: (1, [[4 * s + k for k in range(1, 5)]]) for s in (2, 3, 4)}), 210.0)
    assert checks.ledger_problems(lost + replay, reference, last_step=5) != []  # the per-group label: epoch 0
    fixed = checks.with_epochs(lost + replay, LIGHTHOUSE_STARTS)
    assert checks.ledger_problems(fixed, reference, last_step=5) == []
    short = _at(_timeline({2: (1, [[9, 10, 11]]), 3: (1, [[13, 14, 15, 16]]), 4: (1, [[17, 18, 19, 20]])}), 210.0)
    assert checks.ledger_problems(checks.with_epochs(lost + short, LIGHTHOUSE_STARTS), reference, 5) == [
        "ledger step 2: samples lost [12]"]


def test_a_group_that_rides_out_a_lighthouse_restart_needs_per_line_epochs():
    """One group process trains on across a lighthouse restart (no fall-back):
    ledger steps 0-1 under the first lighthouse's quorum 5, steps 2-3 under
    the restarted one's quorum 1, and its step records likewise. Per line
    nothing is superseded and nothing rolled back; labelled by the group's
    first step (epoch 0 throughout), quorum 1 < 5 reads as a replay of an
    older timeline and the proof fails."""
    reference = _ledger({s: [[2 * s + 1, 2 * s + 2]] for s in range(4)})
    before = _at(_timeline({0: (5, [[1, 2]]), 1: (5, [[3, 4]])}), 150.0)
    after = _at(_timeline({2: (1, [[5, 6]]), 3: (1, [[7, 8]])}), 250.0)
    assert checks.ledger_problems(before + after, reference, last_step=4) != []
    assert checks.ledger_problems(checks.with_epochs(before + after, LIGHTHOUSE_STARTS), reference, 4) == []
    records = [{"step": s + 1, "loss": 4.0 - s, "quorum": q, "quorum_t": t, "participants": 1, "epoch": 0}
               for s, q, t in ((0, 5, 150.0), (1, 5, 150.0), (2, 1, 250.0), (3, 1, 250.0))]
    merged, problems = checks.merge_step_records([checks.with_epochs(records, LIGHTHOUSE_STARTS)])
    assert problems == [] and sorted(merged) == [1, 2, 3, 4]
    assert checks.rolled_back_steps(checks.with_epochs(records, LIGHTHOUSE_STARTS)) == 0
    assert checks.rolled_back_steps(records) == 2


# ----------------------------------------------------------------- kill_scheduler
def test_scheduler_recovery_needs_every_group_adopted_no_duplicate_and_a_tick():
    from megascale_omni.chaos.scheduled import recovery

    before = {"chaos-r0"}
    adopt = ["t=0.010 chaos adopt chaos-r0 on bare-metal (running): started by an earlier scheduler process"]
    ticked = {"tick": 1, "stopped": False, "groups": {"chaos-r0": {"state": "running"}}}
    assert recovery(before, [], None) == (False, "not adopted yet: ['chaos-r0']")
    assert recovery(before, adopt, None)[0] is False  # adopted, no tick of the successor yet
    assert recovery(before, adopt, {**ticked, "tick": 0})[0] is False
    assert recovery(before, adopt, ticked) == (True, "adopted ['chaos-r0'], started none again")
    duplicate = [*adopt, "t=0.020 chaos start chaos-r1 on bare-metal (cold start): admit: core of 1 group(s)"]
    ok, note = recovery(before, duplicate, {**ticked, "groups": {"chaos-r0": {}, "chaos-r1": {}}})
    assert not ok and "duplicate" in note and "chaos-r1" in note
    # A group that died while the scheduler was down is not adopted, and its replacement is no duplicate.
    assert recovery({"chaos-r0"}, duplicate[1:], ticked)[0] is False


def test_the_live_config_of_a_chaos_run_is_valid_and_keeps_a_fixed_core():
    from megascale_omni.chaos.scheduled import live_config
    from megascale_omni.scheduler.live_config import parse_live_config

    cfg = parse_live_config(json.loads(json.dumps(live_config(
        "/tmp/out", "examples/llava/tiny_cpu.yaml", ["train.lr=1e-5", "elastic.ledger_dir=/tmp/l"],
        "http://localhost:29510", groups=1, nproc=2))))
    job = cfg.jobs[0]
    assert (job.min_replicas, job.max_replicas, job.standby, job.ledger) == (1, 1, {}, False)
    assert job.lighthouse == "http://localhost:29510" and job.entry == "pretrain_llava.py"
    assert job.overrides == ("train.lr=1e-5", "elastic.ledger_dir=/tmp/l") and cfg.launcher == "local"
    assert [(p.kind, p.nodes) for p in cfg.pools] == [("bare_metal", 1)]


def test_kill_scheduler_fires_detects_the_restart_and_recovers_on_adoption(tmp_path):
    """A stand-in process for omni-sched (sleep): SIGKILLed by the fault, restarted by the harness's poll
    (detection), recovered once the successor's decisions.log and state.json show the adoption and a step
    commits with every group after it."""
    import random
    import signal

    from megascale_omni.chaos.faults import Context, KillScheduler
    from megascale_omni.chaos.observe import Commit, Progress
    from megascale_omni.chaos.plan import Fault
    from megascale_omni.chaos.scheduled import SchedulerProcess, live_config

    procs = []

    def spawn(argv, log):
        assert argv[1:4] == ["-m", "megascale_omni.scheduler.cli", "-v"]
        procs.append(subprocess.Popen(["sleep", "60"]))
        return procs[-1]

    out = tmp_path / "scheduler"
    sched = SchedulerProcess(out, live_config(out, "x.yaml", [], "http://localhost:1", 1, 2), spawn, [], sys.executable)
    try:
        sched.start()
        (out / "state.json").write_text(json.dumps({"tick": 40, "groups": {"chaos-r0": {"state": "running"}}}))
        sched.decisions.write_text("t=0.000 chaos start chaos-r0 on bare-metal (cold start): admit\n")
        progress = Progress()
        ctx = Context(None, progress, tmp_path, tmp_path, 2, random.Random(0), scheduler=sched)
        inj = KillScheduler(Fault(0, 1.0, "kill_scheduler", 0))
        inj.fire(ctx)
        assert inj.before == {"chaos-r0"} and f"pid {procs[0].pid}" in inj.target
        assert procs[0].wait(10) == -signal.SIGKILL
        assert inj.detected(ctx) is None
        sched.poll()  # the harness, as supervisor, restarts it
        assert len(procs) == 2 and inj.detected(ctx) == sched.starts[1]
        assert [a["action"] for a in sched.actions] == ["start scheduler", "scheduler exited", "start scheduler"]
        inj.tick(ctx)
        assert not inj.recovered(ctx) and "not adopted" in inj.note  # the old state.json does not count
        time.sleep(0.05)
        with open(sched.decisions, "a") as f:
            f.write("t=0.001 chaos adopt chaos-r0 on bare-metal (running): started by an earlier scheduler process\n")
        (out / "state.json").write_text(json.dumps({"tick": 1, "stopped": False, "groups": {"chaos-r0": {}}}))
        inj.tick(ctx)
        assert inj.ticked is not None and not inj.recovered(ctx)  # no full step since
        progress.seen.append(Commit(time.monotonic() + 1, 9, 2, "chaos-r0"))
        assert inj.recovered(ctx)
        progress.seen.clear()
        progress.seen.append(Commit(time.monotonic() + 1, 9, 1, "chaos-r0"))  # one group short: not recovered
        assert not inj.recovered(ctx)
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ------------------------------------------------------------- anchored reference
def test_reference_segments_chain_the_anchors_and_cover_each_step_once():
    from megascale_omni.chaos.reference import Segment, anchor_due, segments

    assert segments([], 300) == [Segment(0, 300)]
    chain = segments([1000, 500, 500, 0, 1600, 2000], 1600)
    assert chain == [Segment(0, 500), Segment(500, 1000), Segment(1000, 1600)]
    for step in range(1, 1601):
        assert sum(s.covers(step) for s in chain) == 1
    assert not any(s.covers(0) or s.covers(1601) for s in chain)
    assert segments([500], 0) == []
    assert [anchor_due(s, [], 500) for s in (475, 500)] == [False, True]
    assert [anchor_due(s, [500], 500) for s in (975, 1000, 1025)] == [False, True, True]
    assert not anchor_due(10_000, [500], 0)


def test_reference_losses_and_ledger_come_from_the_covering_segment_only(tmp_path):
    """Segments run past their end (stopped, not told where to stop); only the covered steps count, so a
    step the next segment re-runs from its anchor is compared with that one."""
    from megascale_omni.chaos.reference import ReferenceRuns, Segment

    runs = ReferenceRuns(tmp_path, lambda seg, out, anchor: [], lambda argv, log: None)
    for seg, losses in ((Segment(0, 3), [1.0, 2.0, 3.0, 4.0, 5.0]), (Segment(3, 5), [0, 0, 30.0, 40.0, 50.0, 60.0])):
        out = tmp_path / f"seg-{seg.start}"
        (out / "ledger").mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i + 1, "loss": x}) + "\n" for i, x in enumerate(losses) if i >= seg.start))
        runs.done[seg] = out
    runs.anchors = [3]
    losses, ledger = runs.finish(5, deadline_s=1)
    assert losses == {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0} and ledger == [] and runs.problems == []
    runs.done.pop(Segment(3, 5))
    runs.finish(5, deadline_s=0)
    assert runs.problems == ["reference segment 3-5 did not run"]


def test_the_reference_reads_a_copy_of_the_data_taken_before_any_fault(tmp_path):
    """A reference segment started while ``shard_corrupt`` holds a shard bad would refuse it (two segments of the
    2026-12-03 soak did): the fault-free reference reads a copy made when the run is set up."""
    from megascale_omni.chaos.reference import Segment
    from megascale_omni.chaos.run import ChaosConfig, ChaosRun

    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    shard = data / "train" / "shard-000000.tar"
    shard.write_bytes(b"good shard")
    run = ChaosRun(ChaosConfig(run_dir=tmp_path / "run", data_dir=data, kinds=["kill_group"]))
    try:
        bad = shard.with_suffix(".bad")
        bad.write_bytes(b"corrupt")
        os.replace(bad, shard)  # what shard_corrupt does to the job's data: a new file at the shard's path
        argv = run._reference_argv(Segment(0, 500), tmp_path / "seg", None)
    finally:
        run.close()
        run.unmount()
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("data.path=")]
    assert paths == [str(tmp_path / "run" / "reference-data")]
    assert (tmp_path / "run" / "reference-data" / "train" / "shard-000000.tar").read_bytes() == b"good shard"
