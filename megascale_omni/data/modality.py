"""The modality mix of a global batch: how many of its samples are
text-only, single-image, multi-image and video, and its vision-tower load.

Every step record carries these (``samples_text`` ... ``vision_tokens``,
:mod:`megascale_omni.metrics.schema`), so whoever sizes the job (the elastic
scheduler's demand estimate, docs/scheduler.md) sees the data's mix as it
drifts, not a trace file's. Pure functions of the plan: every rank computes
the same numbers without communication.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megascale_omni.data.packing import Pack

#: Modality codes, in the order of :data:`MIX_FIELDS`.
TEXT, IMAGE, MULTI_IMAGE, VIDEO = range(4)
#: Step-record field of each modality code's sample count.
MIX_FIELDS = ("samples_text", "samples_image", "samples_multi_image", "samples_video")


def modality_codes(images: Sequence[int] | np.ndarray, frames: Sequence[int] | np.ndarray) -> np.ndarray:
    """int8 ``[n]`` modality code per sample from its images kept and video
    frames read: a sample with any video frame is ``VIDEO`` (whatever images
    it also has), else 0 images ``TEXT``, 1 ``IMAGE``, more ``MULTI_IMAGE``."""
    images, frames = np.asarray(images, dtype=np.int64), np.asarray(frames, dtype=np.int64)
    if images.shape != frames.shape:
        raise ValueError(f"images {images.shape} and frames {frames.shape} must align")
    codes = np.minimum(images, 2).astype(np.int8)  # 0 text, 1 image, 2 multi-image
    codes[frames > 0] = VIDEO
    return codes


def batch_mix(packs: Sequence[Pack], codes: np.ndarray) -> dict[str, int]:
    """The step-record fields of the global batch ``packs`` (plan sample ids
    index ``codes``): samples per modality, ``vision_tokens`` (tower tokens,
    :attr:`Pack.vision`) and ``vision_deferred`` (samples the vision-token
    budget moved to another row, :attr:`Pack.deferred`)."""
    ids = np.asarray([sid for p in packs for sid in p.sample_ids], dtype=np.int64)
    counts = np.bincount(codes[ids], minlength=len(MIX_FIELDS)) if ids.size else np.zeros(len(MIX_FIELDS), int)
    out = {name: int(c) for name, c in zip(MIX_FIELDS, counts)}
    out["vision_tokens"] = sum(p.vision for p in packs)
    out["vision_deferred"] = sum(p.deferred for p in packs)
    return out
