"""The shapes demo's DiT evaluation: sample every colour prompt with the EMA
weights and score the dominant colour of each image (pixel-space data with
learned captions; latents need a VAE decoder: use tools/sample_dit.py)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from megascale_omni.data.dit.batches import CaptionEncoder
from megascale_omni.demo.dit_shapes import caption_of, dominant_color
from megascale_omni.demo.shapes import COLORS, SHAPES
from megascale_omni.evaluation.base import Evaluator
from megascale_omni.parallel import is_loss_rank
from megascale_omni.tasks.dit_sampling import sample_images, save_grid, to_uint8

logger = logging.getLogger(__name__)


class DitColorEvaluator(Evaluator):
    """``train.evaluator: colors`` of the DiT family (every rank), at the
    ``dit.eval_resolutions`` (none: no evaluation, said once at start so an
    empty override does not skip it unnoticed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.cfg.dit.eval_resolutions:  # INFO: rank 0's log only (platform/logging_setup.py)
            logger.info("evaluation: off (dit.eval_resolutions is empty; list [height, width] sizes to sample)")

    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Sample the colour prompts with the EMA weights; write the PNG grid and
        the colour accuracy into the run directory (loss rank). Runs under the
        training layout, CP included (``dit.eval_resolutions`` are checked like
        the buckets)."""
        d = self.cfg.dit
        if not d.eval_resolutions:
            return None
        if self.data.description.get("kind", "pixels") != "pixels" or self.data.tokenizer is None:
            logger.info("evaluation: skipped (sampling latent data needs the VAE; see tools/sample_dit.py)")
            return None
        out_dir = Path(self.cfg.logging.output_dir) if is_loss_rank() else None
        ema = self.model.ensure_ema()
        with ema.applied() if ema is not None else contextlib.nullcontext():
            result = evaluate_colors(
                chunks, self.data.captions, d.eval_resolutions, d.eval_samples_per_prompt,
                d.sample_steps, d.guidance_scale, seed=self.cfg.train.seed, out_dir=out_dir,
                tag=f"step{step}",
            )
        logger.info(
            "evaluation at step %d: colour accuracy %.3f over %d samples (%s)%s", step,
            result["color_accuracy"], int(result["color_samples"]),
            ", ".join(f"{k.split('/')[1]}: {v:.3f}" for k, v in result.items() if k.startswith("color_accuracy/")),
            f"; grid {out_dir / f'samples-step{step}.png'}" if out_dir else "",
        )
        return result


def color_prompts(per_color: int) -> list[tuple[str, str]]:
    """``(caption, colour)`` pairs: every colour ``per_color`` times, shapes cycling."""
    return [(caption_of(c, SHAPES[i % len(SHAPES)]), c) for c in COLORS for i in range(per_color)]


def evaluate_colors(
    chunks, captions: CaptionEncoder, resolutions: Sequence[Sequence[int]], per_color: int, steps: int,
    guidance_scale: float, seed: int, out_dir: Path | None, tag: str,
) -> dict[str, float]:
    """Sample every colour prompt at every resolution; score the dominant colour.

    Writes ``<out_dir>/samples-<tag>.png`` (one row per colour and
    resolution) and ``<out_dir>/color_accuracy-<tag>.json`` when ``out_dir``
    is given. Returns ``color_accuracy`` and one ``color_accuracy/<H>x<W>``
    per resolution (fractions in [0, 1]). Every rank calls it.
    """
    pairs = color_prompts(per_color)
    prompts, wanted = [p for p, _ in pairs], [c for _, c in pairs]
    result, rows, hits_all = {}, [], []
    for h, w in resolutions:
        images = to_uint8(sample_images(chunks, captions, prompts, h, w, 3, steps, guidance_scale, seed))
        got = [dominant_color(im) for im in images]
        hits = [g == c for g, c in zip(got, wanted)]
        hits_all += hits
        result[f"color_accuracy/{h}x{w}"] = float(np.mean(hits))
        rows += [images[i * per_color : (i + 1) * per_color] for i in range(len(COLORS))]
    result["color_accuracy"] = float(np.mean(hits_all))
    result["color_samples"] = float(len(hits_all))
    if out_dir is not None:
        save_grid(rows, out_dir / f"samples-{tag}.png")
        (out_dir / f"color_accuracy-{tag}.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result
