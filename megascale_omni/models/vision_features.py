"""Projected tower features -> the LM's image and video token sequences.

LLaVA-OneVision's layout (``transformers``' ``LlavaOnevisionModel``, whose
multi-image and video paths this reproduces; anyres tiles with per-row
newlines are not built):

* an image: its ``grid**2`` features, then one ``image_newline`` when the
  model has one;
* a video of ``f`` frames: each frame's ``grid x grid`` features resized
  bilinearly to ``frame_grid x frame_grid`` (``vision.video_pool_stride``),
  the frames one after another, then one ``image_newline`` for the whole video.

The token counts are :meth:`VisionConfig.image_tokens` and
:meth:`VisionConfig.video_tokens`, which the data plan uses as well.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def pool_frames(feats: torch.Tensor, grid: int, frame_grid: int) -> torch.Tensor:
    """``[f, grid * grid, h]`` -> ``[f, frame_grid * frame_grid, h]``: each
    frame resized bilinearly (``align_corners=False``, as OneVision's
    ``apply_pooling``), row-major; unchanged when the sides are equal."""
    if frame_grid == grid:
        return feats
    f, _, h = feats.shape
    x = feats.reshape(f, grid, grid, h).permute(0, 3, 1, 2)
    x = F.interpolate(x, size=(frame_grid, frame_grid), mode="bilinear")
    return x.permute(0, 2, 3, 1).reshape(f, frame_grid * frame_grid, h)


def _with_newline(seq: torch.Tensor, newline: Optional[torch.Tensor]) -> torch.Tensor:
    return seq if newline is None else torch.cat([seq, newline[None].to(seq.dtype)])


def image_sequence(feats: torch.Tensor, newline: Optional[torch.Tensor]) -> torch.Tensor:
    """``[n, p, h]`` image features -> ``[n * (p + newline), h]``, image-major."""
    if newline is None or not feats.shape[0]:
        return feats.reshape(-1, feats.shape[-1])
    return torch.cat([_with_newline(f, newline) for f in feats])


def video_sequence(feats: torch.Tensor, frames: Sequence[int], grid: int, frame_grid: int,
                   newline: Optional[torch.Tensor]) -> torch.Tensor:
    """``[sum(frames), grid * grid, h]`` frame features (every video's frames,
    in order) -> ``[sum_v video_tokens(frames[v]), h]``, video-major."""
    if not frames:
        return feats.new_zeros(0, feats.shape[-1])
    pooled = pool_frames(feats, grid, frame_grid)
    videos = torch.split(pooled, list(frames))
    return torch.cat([_with_newline(v.reshape(-1, v.shape[-1]), newline) for v in videos])
