"""The pipeline planner's nominal LLaVA micro-batch follows the data's
tower inputs (megascale_omni/parallel/tower_mix.py, docs/video.md): image
views and video frames, from the config's expected mix or from the
dataset's index.json; the mean sets stage 0's time, a high quantile (or the
vision budget) its activation memory."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from megascale_omni.config import load_job_config, validate_job
from megascale_omni.parallel.pipeline_cost import EMBEDDING, PROJECTOR, VISION, llava_cost_model
from megascale_omni.parallel.pipeline_plan import plan_for
from megascale_omni.parallel.tower_mix import Z95, tower_mix
from megascale_omni.tasks.registry import family_of
from tests.launcher import REPO

pytestmark = pytest.mark.timeout(300)

EXAMPLE = "examples/llava/pp4_vit_heavy.yaml"


def config(*overrides: str):
    cfg = load_job_config(["--config", EXAMPLE, *overrides])
    validate_job(cfg, cfg.parallel.model_parallel_size)
    return cfg


def test_image_only_config_plans_as_before():
    """No video: ``micro_batch_size * vision.images_per_sequence`` images, peak = mean."""
    cfg = config()
    mix = tower_mix(cfg)
    assert mix.mean == pytest.approx(cfg.train.micro_batch_size * cfg.vision.images_per_sequence, rel=1e-12)
    assert mix.peak == mix.mean and mix.video_share == 0
    assert "vision.images_per_sequence=9.8" in mix.source


def test_a_20_percent_video_mix_raises_the_stage_0_head_and_moves_layers_off_it():
    """pp4_vit_heavy: 16 tower tokens per image, 4-frame clips pooled 2x2 to
    4 LM tokens a frame, so a clip takes the LM tokens of the image it
    replaces (16) and brings 4 tower inputs instead of 1: by hand, tower
    inputs per micro-batch x (0.8 * 1 + 0.2 * 4) = 1.6."""
    image, video = config(), config("data.default_video_fraction=0.2")
    v = video.vision
    assert v.video_tokens(4) == v.image_tokens  # same LM tokens: the same samples per row
    factor = 0.8 * 1 + 0.2 * 4
    assert tower_mix(video).mean == pytest.approx(factor * tower_mix(image).mean, rel=1e-12)
    a, b = llava_cost_model(image), llava_cost_model(video)
    for name in (VISION, PROJECTOR):  # linear in tower inputs (attention is within each input)
        assert b.components[name].flops == pytest.approx(factor * a.components[name].flops, rel=1e-12)
    assert b.components[EMBEDDING] == a.components[EMBEDDING]
    tower = a.components[VISION].flops + a.components[PROJECTOR].flops
    expected_head = factor * tower + a.components[EMBEDDING].flops
    assert b.head_time == pytest.approx(expected_head, rel=1e-12)
    assert b.head_time / a.head_time == pytest.approx(expected_head / (tower + a.components[EMBEDDING].flops))
    assert b.head_time / a.head_time > 1.5  # the tower dominates this head
    # The auto split moves LM layers off stage 0 and stays balanced; the uniform one does not move.
    fn = family_of(image).cost_model_fn(image)
    before, after = plan_for(image, "auto", fn), plan_for(video, "auto", fn)
    assert after.counts[0] < before.counts[0], (before.counts, after.counts)
    assert (before.counts, after.counts) == ((2, 5, 5, 4), (1, 5, 5, 5))
    assert plan_for(video, "uniform", fn).imbalance > after.imbalance


def test_activations_follow_the_peak_and_the_vision_budget_bounds_it():
    """Peak = k * mean + 1.645 * sqrt(k) * std over k samples a micro-batch,
    by hand: k = 2 rows * 256 / (256 / 9.8) = 19.6 samples, tower inputs 1
    or 4 with p = 0.2, std = 3 * sqrt(0.2 * 0.8)."""
    cfg = config("data.default_video_fraction=0.2")
    k = 2 * 9.8
    mean, std = k * (0.8 + 0.2 * 4), 3 * math.sqrt(0.2 * 0.8)
    mix = tower_mix(cfg)
    assert mix.mean == pytest.approx(mean, rel=1e-12)
    assert mix.peak == pytest.approx(mean + Z95 * math.sqrt(k) * std, rel=1e-12)
    assert mix.video_share == pytest.approx(0.2) and mix.frames_per_video == 4
    at_peak = llava_cost_model(config("vision.images_per_sequence=" + repr(mix.peak / 2)))
    at_mean = llava_cost_model(config(f"vision.images_per_sequence={mean / 2!r}"))
    got = llava_cost_model(cfg)
    for name in (VISION, PROJECTOR):
        assert got.components[name].activation_bytes == pytest.approx(at_peak.components[name].activation_bytes)
        assert got.components[name].flops == pytest.approx(at_mean.components[name].flops)
    # A vision budget is a hard bound the plan keeps: 40 tower inputs (x 16 tokens) per micro-batch.
    budget = tower_mix(config("data.default_video_fraction=0.2", "data.max_vision_tokens_per_microbatch=640"))
    assert (budget.mean, budget.peak) == (pytest.approx(mean), 40)
    capped = tower_mix(config("data.default_video_fraction=0.2", "data.max_vision_tokens_per_microbatch=256"))
    assert capped.mean == capped.peak == 16  # the plan defers what does not fit: no more on average either


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Small embedded-shapes builds (costs in index.json): 20% clips, and images only."""
    from megascale_omni.demo.llava_shapes import ensure_shapes_dataset

    root = tmp_path_factory.mktemp("mix")
    for name, fraction in (("video", 0.2), ("image", 0.0)):
        ensure_shapes_dataset(root / name, num_train=60, num_val=4, image_size=32, video_fraction=fraction)
    return root


def by_hand(split, frames_cap: int = 8) -> tuple[float, float, float]:
    """(tower inputs, LM tokens, tower^2) per sample, from the index JSON (16 tokens an image, 4 a frame)."""
    samples = json.loads((split / "index.json").read_text())["samples"]
    tower = lm = sq = 0.0
    for s in samples:
        c = s["cost"]
        frames = sum(min(f, frames_cap) for f, _, _ in c.get("videos", []))
        t = len(c["images"]) + frames
        padded = -(-(c["tokens"] + 16 * len(c["images"]) + 4 * frames) // 8) * 8  # data.pad_to_multiple_of: 8
        tower, sq, lm = tower + t, sq + t * t, lm + padded
    n = len(samples)
    return tower / n, lm / n, sq / n


def test_the_index_decides_when_the_data_is_here(shapes):
    video = shapes / "video"
    cfg = config(f"data.path={video}")
    t, lm, sq = by_hand(video / "train")
    k = 2 * 256 / lm
    mix = tower_mix(cfg)
    assert mix.mean == pytest.approx(k * t, rel=1e-12)
    assert mix.peak == pytest.approx(k * t + Z95 * math.sqrt(k) * math.sqrt(sq - t * t), rel=1e-12)
    assert str(video / "train" / "index.json") in mix.source and mix.video_share > 0
    # data.video_frames reads fewer frames: fewer tower inputs (and LM tokens).
    fewer = tower_mix(config(f"data.path={video}", "data.video_frames=2"))
    t2, lm2, _ = by_hand(video / "train", frames_cap=2)
    assert fewer.mean == pytest.approx(2 * 256 / lm2 * t2, rel=1e-12) and fewer.mean < mix.mean
    # The video set's stage-0 tower costs its tower inputs' ratio more than the image set's.
    image_cfg = config(f"data.path={shapes / 'image'}")
    image = tower_mix(image_cfg)
    assert image.video_share == 0 and image.mean < mix.mean
    a, b = llava_cost_model(image_cfg), llava_cost_model(cfg)
    assert b.components[VISION].flops / a.components[VISION].flops == pytest.approx(mix.mean / image.mean, rel=1e-12)
    # anyres: every image's views (overview + tiles) from its size in the index, as the plan counts them.
    from megascale_omni.data.image_preprocess import ImagePreprocessor

    views = ImagePreprocessor.from_config("anyres", 32, None).num_views
    samples = json.loads((shapes / "image" / "train" / "index.json").read_text())["samples"]
    t_any = sum(views(tuple(hw)) for s in samples for hw in s["cost"]["images"]) / len(samples)
    lm_any = sum(-(-(s["cost"]["tokens"] + 16 * sum(views(tuple(hw)) for hw in s["cost"]["images"])) // 8) * 8
                 for s in samples) / len(samples)
    tiled = tower_mix(config(f"data.path={shapes / 'image'}", "data.image_mode=anyres"))
    assert tiled.mean == pytest.approx(2 * 256 / lm_any * t_any, rel=1e-12) and tiled.mean > image.mean
    # A dataset not on this host: the config's images_per_sequence, and the source says so.
    away = tower_mix(config(f"data.path={shapes / 'missing'}"))
    assert away.mean == pytest.approx(2 * 9.8) and "the config" in away.source


def test_a_blend_schedule_is_planned_at_its_heaviest_stage(shapes):
    blend = [f"data.blend=[{{path: {shapes / 'image'}, weight: 1.0}}, {{path: {shapes / 'video'}, weight: 0.0001}}]"]
    light = tower_mix(config(f"data.path={shapes / 'image'}", *blend))
    scheduled = tower_mix(config(f"data.path={shapes / 'image'}", *blend,
                                 "data.blend_schedule=[{step: 100, weights: [0.0, 1.0]}]"))
    video = tower_mix(config(f"data.path={shapes / 'video'}"))
    assert light.mean < scheduled.mean == pytest.approx(video.mean, rel=1e-12)
    assert "blend stage 1" in scheduled.source


def test_plan_pipeline_prints_the_mix_it_planned_for():
    out = subprocess.run([sys.executable, "tools/plan_pipeline.py", "--config", EXAMPLE,
                          "data.default_video_fraction=0.2", "--device", "cpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=240, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("planned for: "))
    assert line == ("planned for: tower inputs per micro-batch: mean 31.36 (stage-0 time), peak 40.10 (stage-0 "
                    "activations), 20.0% of the samples video (4.0 frames read each); from the config "
                    "(vision.images_per_sequence=9.8, data.default_video_fraction=0.2)")
    assert "auto: layers per chunk [1, 5, 5, 5]" in out
