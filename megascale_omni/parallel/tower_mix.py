"""The vision-tower inputs of the pipeline planner's nominal LLaVA micro-batch, from the data.

The planner sizes one micro-batch of ``train.micro_batch_size`` packed rows
of ``model.seq_length`` LM tokens (padding is computed, so the rows count as
full). How many tower inputs (image views and video frames) such a
micro-batch carries depends on the data: a row of 4-frame clips holds
nearly four times the tower inputs of a row of single-image samples with
the same LM tokens. :func:`tower_mix` estimates them per sample:

- ``tower``: tower inputs (image views, anyres: 1 + tiles; ``min(stored
  frames, data.video_frames)`` frames per video);
- ``lm``: LM tokens (text, ``vision.image_tokens`` per view and
  ``vision.video_tokens(frames)`` per video, padded to the plan's multiple,
  ``data.pad_to_multiple_of``: what the plan packs);

and a micro-batch holds ``k = micro_batch_size * seq_length / mean(lm)``
samples. Two statistics, for two uses:

- **mean** ``k * mean(tower)``: the stage-0 head's *time*. Every micro-batch
  passes stage 0 once per step, so its share of a step is the sum over the
  micro-batches, i.e. the mean per micro-batch (what balances throughput);
- **peak**, the 95th percentile of a micro-batch's tower inputs under a
  normal approximation of the sum of ``k`` independent samples,
  ``k * mean + 1.645 * sqrt(k) * std`` (never above a micro-batch filled with
  the densest samples), or the vision budget
  (``data.max_vision_tokens_per_microbatch // vision.tokens_per_image``, a
  hard bound the plan keeps) when set: the stage-0 head's *activation
  memory*, which must hold the heavy micro-batches in flight, not the average one.

Where the samples come from (:attr:`TowerMix.source` says which):

- ``data.path`` or ``data.blend`` whose train split's ``index.json`` is on this
  host with token counts: every sample's cost (no sample is read); a blend
  weighs its sources by their weights, and with a ``data.blend_schedule``
  the stage with the most tower inputs per micro-batch is planned for (a
  partition is fixed for the run; memory must hold in every stage);
- otherwise the config: single-image samples at ``vision.images_per_sequence``
  per row, of which ``data.default_video_fraction`` (the embedded shapes set,
  ``data.path: null``) are clips of ``DEFAULT_CLIP_FRAMES`` frames in place of the image.

The embedded set is always planned from the config (it is built at start,
so the same config plans the same before and after it exists). Pure Python
besides reading ``index.json``; cached per process.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megascale_omni.config.schema import DEFAULT_CLIP_FRAMES, JobConfig
from megascale_omni.config.validate import sequence_multiple

logger = logging.getLogger(__name__)

#: z of the one-sided 95th percentile of a normal distribution.
Z95 = 1.645


@dataclass(frozen=True)
class SampleMoments:
    """Per-sample means over one dataset (or a two-class config mix), each
    sample weighted equally: tower inputs, their square, LM tokens, samples
    with a video, frames read; and the most tower inputs per LM token of any sample."""

    tower: float
    tower_sq: float
    lm: float
    video: float
    frames: float
    max_density: float


def blend(parts: list[tuple[float, SampleMoments]]) -> SampleMoments:
    """Moments of a mix drawing ``weight / sum(weights)`` of its samples from each part."""
    total = sum(w for w, _ in parts)
    mean = {f: sum(w * getattr(m, f) for w, m in parts) / total for f in ("tower", "tower_sq", "lm", "video", "frames")}
    return SampleMoments(**mean, max_density=max(m.max_density for w, m in parts if w > 0))


@dataclass(frozen=True)
class TowerMix:
    """Tower inputs per nominal micro-batch: ``mean`` (time) and ``peak``
    (activation memory); ``video_share`` of the samples have a video, of
    ``frames_per_video`` frames read on average; ``source``: where from."""

    mean: float
    peak: float
    video_share: float
    frames_per_video: float
    source: str

    def describe(self) -> str:
        """One line for the plan's output."""
        video = (f", {self.video_share:.1%} of the samples video ({self.frames_per_video:.1f} frames read each)"
                 if self.video_share else ", no video")
        return (f"tower inputs per micro-batch: mean {self.mean:.2f} (stage-0 time), peak {self.peak:.2f} "
                f"(stage-0 activations){video}; from {self.source}")


def mix_of(cfg: JobConfig, m: SampleMoments, source: str) -> TowerMix:
    """The micro-batch statistics of samples with moments ``m`` (see the module docstring)."""
    rows = cfg.train.micro_batch_size * cfg.model.seq_length
    if m.lm <= 0:
        return TowerMix(0.0, 0.0, 0.0, 0.0, source)
    k = rows / m.lm
    mean = k * m.tower
    std = math.sqrt(max(m.tower_sq - m.tower**2, 0.0))
    peak = min(mean + Z95 * math.sqrt(k) * std, max(rows * m.max_density, mean))
    budget = cfg.data.max_vision_tokens_per_microbatch
    if budget:
        peak = budget // cfg.vision.tokens_per_image
        mean = min(mean, peak)
    frames = m.frames / m.video if m.video else 0.0
    return TowerMix(mean, peak, m.video, frames, source)


def config_moments(cfg: JobConfig) -> SampleMoments:
    """Single-image samples at ``vision.images_per_sequence`` per row, a
    ``data.default_video_fraction`` of them clips of the embedded set's
    ``DEFAULT_CLIP_FRAMES`` frames (at most ``data.video_frames``) instead."""
    v, d = cfg.vision, cfg.data
    ips = v.images_per_sequence
    if ips <= 0:
        return SampleMoments(0.0, 0.0, float(cfg.model.seq_length), 0.0, 0.0, 0.0)
    image_lm = cfg.model.seq_length / ips
    f = d.default_video_fraction if cfg.data.path is None and not cfg.data.blend else 0.0
    frames = min(DEFAULT_CLIP_FRAMES, d.video_frames) if d.video_frames else DEFAULT_CLIP_FRAMES
    clip_lm = max(image_lm - v.image_tokens + v.video_tokens(frames), 1.0)
    image = SampleMoments(1.0, 1.0, image_lm, 0.0, 0.0, 1.0 / image_lm)
    clip = SampleMoments(float(frames), float(frames**2), clip_lm, 1.0, float(frames), frames / clip_lm)
    return blend([(1.0 - f, image), (f, clip)])


def index_moments(cfg: JobConfig, split: Path) -> Optional[SampleMoments]:
    """Moments of the samples of ``split`` (a train split) from its ``index.json``
    costs; None when the index is missing, unreadable or has no token counts."""
    from megascale_omni.data.costs import frames_read
    from megascale_omni.data.shards import ShardedSampleReader

    v, d = cfg.vision, cfg.data
    try:
        index = ShardedSampleReader(split, verify=False).index
    except Exception as err:  # noqa: BLE001 - any unreadable index: the config's mix instead, with why
        logger.info("pipeline plan: %s not read (%s): planning tower inputs from the config", split, err)
        return None
    views_of = None
    if d.image_mode == "anyres":
        from megascale_omni.data.llava.module import build_image_preprocessor

        # The tokenizer directory (which may hold the tower's preprocessor config) is data.path's, as in training.
        views_of = build_image_preprocessor(cfg, Path(d.path) if d.path else split.parent).num_views
    multiple = sequence_multiple(cfg)
    n = tower = tower_sq = lm = video = frames = max_density = 0.0
    for s in index.samples:
        cost = s.cost
        if cost is None or cost.tokens is None:
            continue
        views = [views_of(hw) for hw in cost.image_hw] if views_of else [1] * len(cost.image_hw)
        read = frames_read(cost, d.video_frames)
        t = sum(views) + sum(read)
        length = cost.tokens + v.image_tokens * sum(views) + sum(v.video_tokens(f) for f in read)
        length = -(-length // multiple) * multiple  # padded as the plan packs it
        n += 1
        tower, tower_sq, lm = tower + t, tower_sq + t * t, lm + length
        video, frames = video + bool(read), frames + sum(read)
        max_density = max(max_density, t / max(length, 1))
    if not n:
        logger.info("pipeline plan: %s has no token counts: planning tower inputs from the config", split)
        return None
    return SampleMoments(tower / n, tower_sq / n, lm / n, video / n, frames / n, max_density)


def _data_mix(cfg: JobConfig) -> Optional[TowerMix]:
    """:func:`tower_mix` from the data's indexes, or None when one is not usable here."""
    d = cfg.data
    if d.blend:
        splits = [Path(s.path) / "train" for s in d.blend]
        stages = [[s.weight for s in d.blend]] + [list(st.weights) for st in d.blend_schedule]
        where = f"the index.json of data.blend's {len(splits)} train splits"
    elif d.path is not None:
        splits, stages, where = [Path(d.path) / "train"], [[1.0]], f"{Path(d.path) / 'train' / 'index.json'}"
    else:
        return None
    moments = [index_moments(cfg, split) for split in splits]
    if any(m is None for m in moments):
        return None
    mixes = [mix_of(cfg, blend(list(zip(w, moments))), where + (f", blend stage {i}" if len(stages) > 1 else ""))
             for i, w in enumerate(stages)]
    return max(mixes, key=lambda x: x.mean)


_CACHE: dict[str, TowerMix] = {}


def tower_mix(cfg: JobConfig) -> TowerMix:
    """Tower inputs of ``cfg``'s nominal micro-batch (module docstring): from
    the data's ``index.json`` when it is here, else from the config."""
    d, v = cfg.data, cfg.vision
    key = repr((d.path, [(s.path, s.weight) for s in d.blend], [s.weights for s in d.blend_schedule],
                d.video_frames, d.image_mode, d.image_processor, d.tokenizer, d.default_video_fraction,
                d.max_vision_tokens_per_microbatch, cfg.train.micro_batch_size, cfg.model.seq_length,
                v.images_per_sequence, v.image_size, v.patch_size, v.video_pool_stride, v.image_newline))
    if key not in _CACHE:
        mix = _data_mix(cfg)
        if mix is None:
            source = (f"the config (vision.images_per_sequence={v.images_per_sequence:g}"
                      + (f", data.default_video_fraction={d.default_video_fraction:g}"
                         if d.path is None and not d.blend else "") + ")")
            mix = mix_of(cfg, config_moments(cfg), source)
        _CACHE[key] = mix
    return _CACHE[key]
