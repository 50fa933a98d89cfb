"""Load-aware live demand (issue 34 item 6) from recorded step records.

tests/data/scheduler/gpt_pp2_steps.jsonl holds the step records of a real
run (examples/elastic/gpt_pp2.yaml, pp=2, 6 micro-batches, one replica
group, 8 steps, CPU), reduced to the fields the scheduler reads. The
quorum size (``participants``), the modality mix (``images``), a slow
input pipeline (``data_s_max``) and the allocator high-water
(``mem_peak_gib_max``, CUDA only) are set on copies of those records where a
case needs them, as an elastic, LLaVA or GPU run reports them.

tests/data/scheduler/llava_video_blend_steps.jsonl holds the step records of
a real LLaVA run (examples/llava/tiny_cpu.yaml, one process, 16 steps) on a
blend of an image-only shapes set and a clips-only one whose
``data.blend_schedule`` turns from 5% to 70% video at step 8, reduced to
the fields the scheduler reads: its modality mix and vision load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megascale_omni.scheduler.live import METRIC_FIELDS, Observation
from megascale_omni.scheduler.live_demand import (DATA_WAIT_HIGH, MIX_SHIFT, SMOOTHING, VISION_TOKEN_COST,
                                                  DemandModel, job_load)
from tests.unit.test_scheduler_actuator import FakeLauncher, _lines, _scheduler, _until

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).parents[1] / "data" / "scheduler"
RECORDS = [json.loads(line) for line in (DATA / "gpt_pp2_steps.jsonl").read_text().splitlines()]
VIDEO_BLEND = [json.loads(line) for line in (DATA / "llava_video_blend_steps.jsonl").read_text().splitlines()]


def seen(record: dict, **changes) -> Observation:
    """What observe() returns for a group whose last step record is ``record`` (with ``changes``)."""
    r = {**record, **changes}
    return Observation("A", True, 1, state="running", step=r["step"], metrics={k: r[k] for k in METRIC_FIELDS if k in r})


def test_the_recorded_pipeline_bubble_shapes_the_curve_at_sizes_not_run_yet():
    model = DemandModel()
    for r in RECORDS:
        model.update(job_load([seen(r, participants=1)]))
    load = job_load([seen(RECORDS[-1], participants=1)])
    assert load.bubble_analytic == pytest.approx(1 / 7) and load.microbatches == 6  # pp=2, m=6
    assert load.bubble == pytest.approx(RECORDS[-1]["pipeline_wait_s_max"] / RECORDS[-1]["step_s"])
    measured = model.rates[1]
    curve = model.curve(3)
    assert curve(1) == measured
    # Two groups run 3 micro-batches each: bubble 1/4 instead of 1/7; three run 2: bubble 1/3.
    assert curve(2) == pytest.approx(2 * measured * (3 / 4) / (6 / 7), rel=1e-12)
    assert curve(3) == pytest.approx(3 * measured * (2 / 3) / (6 / 7), rel=1e-12)
    # A job without a pipeline scales linearly, as before.
    flat = DemandModel()
    flat.update(job_load([seen(RECORDS[-1], participants=1, bubble_analytic=0.0)]))
    assert flat.curve(2)(2) == pytest.approx(2 * flat.rates[1])


def test_rates_are_smoothed_per_quorum_size_and_kept_while_the_mix_holds():
    model = DemandModel()
    a, b = RECORDS[-2], RECORDS[-1]
    model.update(job_load([seen(a, participants=2, images=12)]))
    model.update(job_load([seen(b, participants=2, images=12)]))
    assert model.rates == {2: pytest.approx(0.5 * a["samples_per_s"] + 0.5 * b["samples_per_s"])}
    model.update(job_load([seen(b, participants=1, images=11)]))  # 0.92 images per sample: same mix
    assert sorted(model.rates) == [1, 2] and model.events == []


def test_a_modality_mix_shift_drops_the_rates_measured_under_the_old_mix():
    model = DemandModel()
    for r in RECORDS[:4]:
        model.update(job_load([seen(r, participants=2, images=12)]))  # one image per sample
    assert sorted(model.rates) == [2] and model.mix == 1.0
    model.update(job_load([seen(RECORDS[4], participants=2, images=3)]))  # text-heavy now: 0.25
    assert model.events == ["modality mix moved from 1.00 to 0.25 images per sample: throughput re-measured"]
    assert model.rates == {2: RECORDS[4]["samples_per_s"]} and model.mix == 0.25


def test_a_data_wait_above_the_threshold_caps_demand_at_what_the_groups_keep_busy():
    r = RECORDS[-1]
    quick = job_load([seen(r, participants=2), seen(r, participants=2)])
    assert quick.data_wait == pytest.approx(r["data_s_max"] / r["step_s"]) and quick.data_wait < DATA_WAIT_HIGH
    assert DemandModel().demand(16.0, 2, 4, quick) == 16.0
    starved = job_load([seen(r, participants=2), seen(r, participants=2, data_s_max=0.5 * r["step_s"])])
    assert starved.data_wait == pytest.approx(0.5)  # the slowest rank of any group
    assert DemandModel().demand(16.0, 2, 4, starved) == pytest.approx(2 * 4 * 0.5)


def test_the_allocator_high_water_is_reported_and_moves_no_decision():
    r = RECORDS[-1]
    load = job_load([seen(r, participants=2, mem_peak_gib_max=61.5, mem_peak_gib=60.0),
                     seen(r, participants=2, mem_peak_gib=70.25)])
    assert load.mem_high_water_gib == 70.25  # the group without a group-wide maximum gives its own peak
    assert DemandModel().demand(16.0, 2, 4, load) == 16.0
    assert job_load([seen(r)]).mem_high_water_gib is None  # a CPU run: no allocator, nothing invented


def test_demand_follows_the_per_step_work_of_the_recorded_modality_mix():
    """The blend turns to video at step 8: the video share and the vision
    load the records carry move, and demand scales with the smoothed per-step
    work ``tokens + VISION_TOKEN_COST x vision_tokens`` against the first
    record's; a job whose records carry no vision load keeps its demand."""
    from megascale_omni.data.balance import DEFAULT_VIT_COST_PER_PATCH

    assert VISION_TOKEN_COST == DEFAULT_VIT_COST_PER_PATCH  # the balancer's tower cost, kept apart by the layering
    model, expected, scales = DemandModel(), None, {}
    for r in VIDEO_BLEND:
        load = job_load([seen(r, participants=1)])
        work = r["tokens"] + VISION_TOKEN_COST * r["vision_tokens"]
        assert load.work == pytest.approx(work) and load.video_share == pytest.approx(r["samples_video"] / r["samples"])
        model.update(load)
        expected = work if expected is None else (1 - SMOOTHING) * expected + SMOOTHING * work
        scales[r["step"]] = model.work_scale()
        assert scales[r["step"]] == pytest.approx(expected / (VIDEO_BLEND[0]["tokens"] + VISION_TOKEN_COST
                                                              * VIDEO_BLEND[0]["vision_tokens"]), rel=1e-12)
        assert model.demand(16.0, 1, 4, load) == pytest.approx(16.0 * scales[r["step"]], rel=1e-12)
    images, videos = [r for r in VIDEO_BLEND if r["step"] <= 8], [r for r in VIDEO_BLEND if r["step"] > 8]
    assert max(r["samples_video"] / r["samples"] for r in images) < 0.1  # the schedule really moved the mix
    assert min(r["samples_video"] / r["samples"] for r in videos) > 0.6
    assert min(r["vision_tokens"] for r in videos) > 2 * max(r["vision_tokens"] for r in images)
    assert scales[16] > max(scales[s] for s in range(1, 9))  # more work per step: more GPUs kept busy
    # The same move at a tower 20x heavier per token (e.g. 576-token frames) crosses MIX_SHIFT and is logged.
    heavy = DemandModel()
    for r in VIDEO_BLEND:
        heavy.update(job_load([seen(r, participants=1, vision_tokens=20 * r["vision_tokens"])]))
    assert heavy.work_scale() > 1 + MIX_SHIFT
    assert any(e.startswith("per-step work moved to ") and e.endswith(" of the samples video): demand scaled")
               for e in heavy.events), heavy.events
    # GPT records: no vision load, no work, the configured demand.
    gpt = DemandModel()
    for r in RECORDS:
        gpt.update(job_load([seen(r, participants=1)]))
    assert job_load([seen(RECORDS[-1])]).work is None and gpt.demand(16.0, 1, 4, job_load([seen(RECORDS[-1])])) == 16.0


def test_the_loop_feeds_the_policy_from_what_the_groups_report(tmp_path):
    launcher = FakeLauncher(tmp_path)
    try:
        sched, _ = _scheduler(tmp_path, launcher)
        _until("A runs", lambda: any(g.state == "running" for g in sched.actuator.groups.values()), sched.tick)
        sched.tick()
        state = json.loads((tmp_path / "out" / "state.json").read_text())
        assert state["load"]["A"]["samples_per_s"] == 50.0  # the fake groups' records
        assert state["load"]["A"]["data_wait"] == 0.0 and state["load"]["A"]["participants"] == 1
        assert sched.demand["A"].rates == {1: 50.0}
        assert any(line.startswith("A grow 1 on vm: load ") for line in _lines(tmp_path))
    finally:
        launcher.close()


def test_the_tower_cost_comes_from_the_live_config_else_the_jobs_model():
    """``jobs[i].vision_token_cost``: a number overrides; ``auto`` (the
    default) takes the ``vision_token_cost`` the job's step records carry
    (its model's tower-over-LM FLOPs per token), else VISION_TOKEN_COST."""
    from megascale_omni.config import load_job_config
    from megascale_omni.metrics.flops import StepFlops, vision_token_cost
    from megascale_omni.metrics.record import StepRecorder
    from megascale_omni.parallel.batch_shape import BatchShape
    from megascale_omni.tasks.registry import family_of

    cfg = load_job_config(["--config", "examples/llava/tiny_cpu.yaml"])
    fn = family_of(cfg).cost_model_fn(cfg)
    derived = vision_token_cost(cfg, fn)
    # By hand from the counting convention: one tower input over its tokens, one row over its tokens.
    count = StepFlops(cfg, fn)
    assert derived == pytest.approx((count(BatchShape(tower_inputs=2.0)) / (2 * cfg.vision.tokens_per_image))
                                    / (count(BatchShape(segments=(cfg.model.seq_length,))) / cfg.model.seq_length),
                                    rel=1e-12)
    assert round(derived, 3) == 0.145  # tiny_cpu's tower is wide against its LM: heavier than the 7B default
    for recipe, ratio in (("llava15_7b_stage2", 0.017), ("qwen2_7b_siglip_anyres", 0.061)):  # docs/scheduler.md
        big = load_job_config(["--config", f"examples/recipes/{recipe}.yaml"])
        assert round(vision_token_cost(big, family_of(big).cost_model_fn(big)), 3) == ratio, recipe
    # The trainer's recorder writes it into every record of a LLaVA run (a field the scheduler reads).
    assert "vision_token_cost" in METRIC_FIELDS
    from types import SimpleNamespace

    import torch

    from megascale_omni.metrics.record import StepTiming

    stats = SimpleNamespace(pipeline_wait_s=0.0, moe_dispatch_s=0.0, grad_sync_s=0.0, cross_replica_s=0.0,
                            fwd_bwd_s=1.0, optimizer_s=0.1, loss=1.0, lr=1e-3, grad_norm=1.0,
                            update_successful=True, num_loss_tokens=10, num_microbatches=1)
    timing = StepTiming(step_s=2.0, data_s=0.1, membership_s=0.0, metrics_s=0.0, checkpoint_s=0.0, control_s=0.0)
    record = StepRecorder(torch.device("cpu"), 1, None, None, 1, 1, vision_token_cost=derived).build(
        1, stats, timing, samples=4, tokens=100, images=4, extra={})
    assert record["vision_token_cost"] == derived
    assert "vision_token_cost" not in StepRecorder(torch.device("cpu"), 1, None, None, 1, 1).build(
        1, stats, timing, samples=4, tokens=100, images=None, extra={})  # GPT, DiT: not recorded
    r = VIDEO_BLEND[-1]
    reported = job_load([seen(r, participants=1, vision_token_cost=derived)])
    assert reported.work == pytest.approx(r["tokens"] + derived * r["vision_tokens"], rel=1e-12)
    configured = job_load([seen(r, participants=1, vision_token_cost=derived)], vision_token_cost=0.5)
    assert configured.work == pytest.approx(r["tokens"] + 0.5 * r["vision_tokens"], rel=1e-12)
    for bad in (None, "x", -1.0, float("nan")):  # nothing usable reported: the default
        load = job_load([seen(r, participants=1, vision_token_cost=bad)])
        assert load.work == pytest.approx(r["tokens"] + VISION_TOKEN_COST * r["vision_tokens"], rel=1e-12)


@pytest.mark.parametrize("value,expected", [
    (0.2, 0.2), (0, 0.0), ("auto", None),
])
def test_live_config_reads_vision_token_cost(value, expected):
    from megascale_omni.scheduler.live_config import parse_live_config
    from tests.unit.test_scheduler_actuator import LIVE

    doc = {**LIVE, "jobs": [{**LIVE["jobs"][0], "vision_token_cost": value}]}
    assert parse_live_config(doc).jobs[0].vision_token_cost == expected
    assert parse_live_config(LIVE).jobs[0].vision_token_cost is None  # default: auto


@pytest.mark.parametrize("value", [-0.1, 101, "heavy", True, float("inf")])
def test_a_bad_vision_token_cost_exits_2_with_one_line(tmp_path, capsys, value):
    import yaml

    from megascale_omni.scheduler.cli import cli
    from tests.unit.test_scheduler_actuator import LIVE

    doc = {**LIVE, "out": str(tmp_path / "out"), "jobs": [{**LIVE["jobs"][0], "vision_token_cost": value}]}
    path = tmp_path / "live.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        cli(["run", "--config", str(path)])
    _, err = capsys.readouterr()
    assert e.value.code == 2 and "Traceback" not in err
    assert err == (f"omni-sched: config error: jobs[0].vision_token_cost={value!r}: must be auto (the job's own, "
                   "from its model's FLOPs) or a number in [0, 100]: a tower token's cost against an LM token's\n")
