"""Sampling from a (possibly pipelined) DiT.

:func:`sample_images` is the one sampling core: in-process evaluation at the
end of training (:mod:`megascale_omni.demo.dit_eval`) and ``tools/sample_dit.py``
both call it with model chunks.
Each Euler step is one forward-only pass of megatron's schedule over the
pipeline (conditional and empty-caption rows in one micro-batch for CFG);
the last stage then broadcasts the velocity to the other stages of its
pipeline, so every rank holds the same image tensor after every step. Under
context parallelism each CP rank computes its share of the image tokens and
the last stage gathers the whole velocity over the CP group
(:class:`~megascale_omni.models.dit.model.DiTChunk`); every image size must
then have a multiple of ``2 * cp`` tokens.
All ranks of a replica must call it with the same arguments.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from PIL import Image

from megascale_omni.data.dit.batches import CaptionEncoder
from megascale_omni.models.dit.flow import euler_sample, guided
from megascale_omni.parallel.schedules import model_device, run_forward_backward

logger = logging.getLogger(__name__)


def _forward_velocity(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["x_t"], batch["t"], batch["text"], batch["text_mask"]), None


def _pipeline_velocity(chunks, x: torch.Tensor, t: torch.Tensor, text, mask) -> torch.Tensor:
    """Velocity for ``x [B, C, H, W]`` at times ``t [B]`` on every PP stage,
    on ``x``'s device (the model runs, and the stages broadcast, on its own).
    The model sees ``x`` in its parameters' dtype; the returned velocity, like
    the Euler integration, is fp32."""
    dtype = next(iter(chunks[0].parameters())).dtype
    batch = {"x_t": x.to(dtype), "t": t, "text": text, "text_mask": mask}
    outputs = run_forward_backward(chunks, _forward_velocity, [batch], seq_length=x.shape[-2] * x.shape[-1],
                                   micro_batch_size=x.shape[0], forward_only=True)
    v = outputs[0].float() if outputs else torch.empty(x.shape, device=model_device(chunks))
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(v, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
    return v.to(x.device)


@torch.no_grad()
def sample_images(
    chunks: Sequence[torch.nn.Module],
    captions: CaptionEncoder,
    prompts: Sequence[str],
    height: int,
    width: int,
    channels: int,
    steps: int,
    guidance_scale: float,
    seed: int,
    text_states: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Generate one image per prompt: ``[len(prompts), channels, height, width]``
    (pixels in about [-1, 1], or latents). Every rank of the replica calls this."""
    n = len(prompts)
    cond = [captions.encode(p, None if text_states is None else text_states[i], drop=False)
            for i, p in enumerate(prompts)]
    empty = captions.empty()
    text = torch.stack([c[0] for c in cond] + [empty[0]] * n)
    mask = torch.stack([c[1] for c in cond] + [empty[1]] * n)
    noise = torch.randn(n, channels, height, width, generator=torch.Generator().manual_seed(seed))

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        v = _pipeline_velocity(chunks, torch.cat([x, x]), torch.cat([t, t]), text, mask)
        return guided(v[:n], v[n:], guidance_scale)

    for chunk in chunks:
        chunk.eval()
    try:
        return euler_sample(velocity, noise, steps)
    finally:
        for chunk in chunks:
            chunk.train()


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """``[B, 3, H, W]`` in [-1, 1] -> uint8 ``[B, H, W, 3]``."""
    arr = ((images.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return arr.permute(0, 2, 3, 1).numpy()


def save_grid(rows: Sequence[np.ndarray], path: Path, scale: int = 4, gap: int = 2) -> None:
    """Write a PNG grid: ``rows`` of uint8 ``[n, H, W, 3]`` arrays (sizes may differ per row)."""
    tiles = [[Image.fromarray(im).resize((im.shape[1] * scale, im.shape[0] * scale), Image.Resampling.NEAREST)
              for im in row] for row in rows]
    width = max(sum(t.width + gap for t in row) for row in tiles) + gap
    height = sum(max(t.height for t in row) + gap for row in tiles) + gap
    grid = Image.new("RGB", (width, height), (40, 40, 40))
    y = gap
    for row in tiles:
        x = gap
        for tile in row:
            grid.paste(tile, (x, y))
            x += tile.width + gap
        y += max(t.height for t in row) + gap
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
