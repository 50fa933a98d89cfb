"""Video costs and the vision-token budget (issue 32 item 4) and the step
record's modality mix (item 5): packed rows never exceed a row's share of
``data.max_vision_tokens_per_microbatch`` (deferred, never dropped; what was
deferred is counted), a sample over it alone is excluded and counted as bad,
the DP cost balancer keeps rank imbalance <= 1.05 on a mix with 20% video,
the budget is validated and part of the plan record, and every step's mix
(text / image / multi-image / video samples, vision tokens) comes from the plan."""

from __future__ import annotations

import numpy as np
import pytest

from megascale_omni.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml
from megascale_omni.config.validate import row_vision_budget
from megascale_omni.data.balance import imbalance, sample_cost
from megascale_omni.data.llava.batches import LlavaEncoder
from megascale_omni.data.llava.plan_scan import PlanScanner
from megascale_omni.data.llava.steps import LlavaSteps
from megascale_omni.data.modality import IMAGE, MULTI_IMAGE, TEXT, VIDEO, batch_mix, modality_codes
from megascale_omni.data.packing import pack_samples
from megascale_omni.data.plan_record import plan_settings
from megascale_omni.data.sample_plan import PackedEpochPlan
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset

# A LLaVA-OneVision-like mix: 576 tower tokens per image or frame; a video of
# 8 frames pooled 2x2 takes 8 * 144 + 1 LM tokens.
TOWER = 576
FRAMES = 8


def _mix(n: int, video_share: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(LM lengths, balance costs, vision tokens) of ``n`` samples, ``video_share`` of them videos."""
    rng = np.random.default_rng(seed)
    lengths, costs, vision = [], [], []
    for _ in range(n):
        text = int(rng.integers(20, 200))
        if rng.random() < video_share:
            inputs, lm = FRAMES, text + FRAMES * 144 + 1
        else:
            inputs = int(rng.choice([0, 1, 1, 1, 2]))
            lm = text + inputs * TOWER
        lengths.append(lm)
        vision.append(inputs * TOWER)
        costs.append(sample_cost(lm, inputs, TOWER))
    return np.asarray(lengths), np.asarray(costs), np.asarray(vision)


def test_rows_stay_within_the_budget_and_deferred_samples_are_kept_and_counted():
    lengths, costs, vision = _mix(600, 0.2)
    budget = 10 * TOWER
    free = pack_samples(lengths, 4096, costs=costs, vision=vision)
    capped = pack_samples(lengths, 4096, costs=costs, vision=vision, max_vision=budget)
    assert max(p.vision for p in free) > budget  # the budget binds on this mix
    assert max(p.vision for p in capped) <= budget
    for packs in (free, capped):
        assert sorted(s for p in packs for s in p.sample_ids) == list(range(600))  # none dropped
        assert all(p.vision == vision[list(p.sample_ids)].sum() for p in packs)
    assert sum(p.deferred for p in capped) > 0 and sum(p.deferred for p in free) == 0
    # Without a budget the rows are those of the plain packer.
    assert [p.sample_ids for p in free] == [p.sample_ids for p in pack_samples(lengths, 4096, costs=costs)]
    with pytest.raises(ValueError, match="sample 3 has 1152 vision tokens > max_vision 1000"):
        pack_samples([10] * 4, 64, vision=[0, 0, 0, 1152], max_vision=1000)


@pytest.mark.parametrize("dp", [2, 4])
def test_twenty_percent_video_balances_within_five_percent_and_no_microbatch_over_budget(dp):
    lengths, costs, vision = _mix(3000, 0.2, seed=dp)
    mbs, budget = 2, 32 * TOWER  # per micro-batch; a row holds half: two videos and some images
    plan = PackedEpochPlan(lengths, 4096, 32, seed=7, costs=costs, vision=vision, max_vision=budget // mbs)
    steps = LlavaSteps(plan, np.arange(len(lengths)), batcher=None, micro_batch_size=mbs)
    worst = naive_worst = 0.0
    for step in range(plan.steps_in_epoch(0)):
        packs = plan.global_batch(step)
        naive = [packs[r * len(packs) // dp:(r + 1) * len(packs) // dp] for r in range(dp)]
        naive_worst = max(naive_worst, imbalance([sum(p.cost for p in s) for s in naive]))
        shares = [steps.share(step, r, dp) for r in range(dp)]
        assert sorted(id(p) for s in shares for p in s) == sorted(id(p) for p in packs)
        for share in shares:
            for i in range(0, len(share), mbs):
                assert sum(p.vision for p in share[i:i + mbs]) <= budget
        worst = max(worst, imbalance([sum(p.cost for p in s) for s in shares]))
    assert sum(p.deferred for p in plan.epoch_packs(0)) > 0  # the budget binds
    assert worst <= 1.05 < naive_worst, (worst, naive_worst)  # the contiguous cut is what the balancer fixes


def test_modality_codes_and_the_batch_mix():
    codes = modality_codes([0, 1, 2, 3, 0, 1], [0, 0, 0, 0, 8, 4])
    assert codes.tolist() == [TEXT, IMAGE, MULTI_IMAGE, MULTI_IMAGE, VIDEO, VIDEO]
    lengths, costs, vision = _mix(40, 0.5)
    packs = pack_samples(lengths, 4096, costs=costs, vision=vision, max_vision=8 * TOWER)
    mix = batch_mix(packs[:3], modality_codes(vision // TOWER * (vision < FRAMES * TOWER), vision == FRAMES * TOWER))
    members = [s for p in packs[:3] for s in p.sample_ids]
    assert sum(mix[k] for k in ("samples_text", "samples_image", "samples_multi_image", "samples_video")) == len(
        members)
    assert mix["samples_video"] == int((vision[members] == FRAMES * TOWER).sum())
    assert mix["vision_tokens"] == int(vision[members].sum())
    assert mix["vision_deferred"] == sum(p.deferred for p in packs[:3])


def test_scan_excludes_samples_over_a_rows_budget_and_reports_the_mix(tmp_path, caplog):
    make_shapes_dataset(tmp_path / "ds", num_train=60, num_val=4, samples_per_shard=30)
    reader = ShardedSampleReader(tmp_path / "ds" / "train")
    encoder = LlavaEncoder(load_shapes_tokenizer(tmp_path / "ds"), 4)
    free = PlanScanner(encoder, 4, 512, 1).scan(reader)
    images = np.asarray([len(s.cost.image_hw) for s in reader.index.samples])
    assert set(images.tolist()) == {0, 1, 2}
    assert free.vision.tolist() == (images * 4).tolist() and free.frames.tolist() == [0] * 60
    assert free.tower_inputs.tolist() == images.tolist()
    codes = modality_codes(free.images, free.frames)
    assert np.bincount(codes, minlength=4).tolist() == [int((images == k).sum()) for k in (0, 1, 2)] + [0]
    capped = PlanScanner(encoder, 4, 512, 1, max_vision=4).scan(reader)  # one image per row
    assert capped.over_vision_budget == capped.bad == int((images == 2).sum())
    assert capped.ids.tolist() == np.flatnonzero(images < 2).tolist()
    assert "over the vision-token budget of 4 per packed row" in caplog.text


def _cfg(*overrides: str) -> JobConfig:
    return from_dict(JobConfig, apply_overrides(load_yaml("examples/llava/tiny_cpu.yaml"), list(overrides)))


def test_budget_is_validated_and_decides_the_plan():
    cfg = _cfg("data.max_vision_tokens_per_microbatch=0")
    assert row_vision_budget(cfg) == 0 and "train.micro_batch_size" not in plan_settings(cfg)
    per_input = cfg.vision.tokens_per_image
    cfg = _cfg(f"data.max_vision_tokens_per_microbatch={4 * per_input}", "train.micro_batch_size=2")
    assert row_vision_budget(cfg) == 2 * per_input
    assert plan_settings(cfg)["train.micro_batch_size"] == 2  # a row's share depends on it
    with pytest.raises(ConfigError) as err:
        row_vision_budget(_cfg(f"data.max_vision_tokens_per_microbatch={per_input}", "train.micro_batch_size=2"))
    assert str(err.value) == (
        f"config error: data.max_vision_tokens_per_microbatch={per_input}: leaves {per_input // 2} per packed row "
        f"(train.micro_batch_size=2), less than one image or frame (vision.tokens_per_image={per_input}); use at "
        f"least {2 * per_input}, or 0 for no budget")
    with pytest.raises(ConfigError, match="max_vision_tokens_per_microbatch"):
        _cfg("data.max_vision_tokens_per_microbatch=-1")


def test_video_frames_are_tower_inputs_and_video_samples_in_the_mix(tmp_path):
    """Demo clips (8 frames) among image samples: the scan counts each frame read
    as a tower input of the FLOPs batch shape and as vision tokens, and the mix
    counts the clips as video."""
    from megascale_omni.data.shard_writer import write_shards
    from megascale_omni.data.tokenizer import build_word_tokenizer
    from megascale_omni.demo.shapes import dataset_vocabulary, generate_samples
    from megascale_omni.demo.video_shapes import clip_vocabulary, generate_clip

    tok = build_word_tokenizer(sorted(set(dataset_vocabulary()) | set(clip_vocabulary())), tmp_path / "tok.json")
    per_frame = lambda frames: frames * 4  # noqa: E731  (LM tokens of a video: 4 a frame, no newline)
    encoder = LlavaEncoder(tok, 4, tok.token_to_id("<video>"), per_frame)
    images = list(generate_samples(8, seed=1))
    clips = [generate_clip(8 + i, seed=1) for i in range(2)]
    write_shards(images + clips, tmp_path / "train", samples_per_shard=5, coster=encoder)
    reader = ShardedSampleReader(tmp_path / "train")
    per_image = [s.num_images for s in images]
    for frames in (0, 3):  # every stored frame, or data.video_frames=3
        scan = PlanScanner(encoder, 4, 512, 1, video_frames=frames, video_tokens=per_frame).scan(reader)
        read = frames or 8
        assert scan.frames.tolist() == [0] * 8 + [read, read] and scan.video_samples == 2
        assert scan.tower_inputs.tolist() == per_image + [read, read]
        assert scan.vision.tolist() == [4 * n for n in per_image + [read, read]]
        codes = modality_codes(scan.images, scan.frames)
        packs = pack_samples(scan.lengths, 512, vision=scan.vision)
        mix = batch_mix(packs, codes)
        assert mix["samples_video"] == 2 and mix["vision_tokens"] == int(scan.vision.sum())
        assert mix["samples_text"] + mix["samples_image"] + mix["samples_multi_image"] == 8
