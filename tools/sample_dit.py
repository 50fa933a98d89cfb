#!/usr/bin/env python
"""Sample images from a trained DiT checkpoint (Euler ODE, classifier-free guidance) into a PNG grid.

    python tools/sample_dit.py --checkpoint runs/dit-tiny/checkpoints --prompt "a red circle" \\
        --prompt "a blue square" --size 16x16 --size 16x32 --out grid.png \\
        [--per-prompt 4] [--steps 20] [--guidance 4] [--raw] [--score-colors]

``--checkpoint`` is a pretrain_dit.py checkpoint: the run's ``checkpoint.dir``
(its newest intact checkpoint is used) or one ``step_NNNNNNNN`` directory.
It is verified (checksums) and gives the model config, the weights (the EMA
weights, or the trained ones with ``--raw``) and the tokenizer. One process
samples whatever TP/PP/DP layout trained the model: the checkpoint is
resharded on load. One grid row per prompt and size. ``--score-colors``
prints, for prompts that name a colour, the fraction of images whose
dominant colour is the prompted one. Latent runs need ``--vae`` (to decode)
and ``--text-encoder`` (to embed the prompts), the local directories used by
tools/make_dit_latents.py. Exit codes: 2 bad arguments or not a DiT
checkpoint, 4 broken or incomplete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

try:
    import megascale_omni  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale_omni.config import ConfigError
from megascale_omni.entry import run_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="checkpoint root (newest intact checkpoint) or a step_NNNNNNNN directory")
    p.add_argument("--prompt", action="append", required=True, help="caption to sample (repeatable)")
    p.add_argument("--size", action="append", default=None, help="HxW in latent pixels (repeatable; default 16x16)")
    p.add_argument("--out", type=Path, required=True, help="PNG grid path")
    p.add_argument("--raw", action="store_true", help="sample the trained weights instead of their EMA")
    p.add_argument("--per-prompt", type=int, default=4, help="images per prompt and size")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default: the run's dit.sample_steps)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the run's dit.guidance_scale)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--score-colors", action="store_true", help="print dominant-colour accuracy per prompt")
    p.add_argument("--vae", type=Path, default=None, help="diffusers VAE directory (latent runs)")
    p.add_argument("--text-encoder", type=Path, default=None, help="transformers text encoder (precomputed text)")
    return p.parse_args(argv)


def _sizes(items) -> list[tuple[int, int]]:
    out = []
    for item in items or ["16x16"]:
        try:
            h, w = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ConfigError("--size", item, "must look like HxW, e.g. 16x32") from None
        if h <= 0 or w <= 0:
            raise ConfigError("--size", item, "both sides must be positive, e.g. 16x32")
        out.append((h, w))
    return out


def _check_out(out: Path) -> None:
    """``--out`` must be a new or replaceable image file in a directory this
    user can create or write: checked before loading and sampling, so a bad
    path costs nothing."""
    from PIL import Image

    from megascale_omni.config.validate import directory_problem

    if out.is_dir():
        raise ConfigError("--out", str(out), f"is a directory; give a file path such as {out / 'grid.png'}")
    problem = directory_problem(str(out.parent))
    if problem:
        raise ConfigError("--out", str(out), f"cannot be written: {problem}; choose another path")
    Image.init()
    if Image.registered_extensions().get(out.suffix.lower()) not in Image.SAVE:
        raise ConfigError("--out", str(out), "needs an image file extension PIL can write, e.g. .png")


def main(argv=None) -> None:
    args = parse_args(argv)
    for name in ("per_prompt", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", value, "must be >= 1")
    if args.guidance is not None and not math.isfinite(args.guidance):
        raise ConfigError("--guidance", args.guidance, "must be a finite number")
    for name in ("vae", "text_encoder"):
        path = getattr(args, name)
        if path is not None and not path.is_dir():
            # A missing local directory is never taken for a model-hub id (no network access is assumed).
            raise ConfigError(f"--{name.replace('_', '-')}", str(path), "no such directory; pass a local model directory")
    sizes = _sizes(args.size)
    _check_out(args.out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ConfigError("WORLD_SIZE", world, "run with plain python (one process): the checkpoint is resharded "
                          "to one process whatever layout trained it")
    from megascale_omni.tasks.dit_checkpoint import load_dit_weights, open_dit_checkpoint

    ckpt = open_dit_checkpoint(args.checkpoint, field="--checkpoint")
    cfg = ckpt.single_process_config()
    for h, w in sizes:
        if h % cfg.dit.patch_size or w % cfg.dit.patch_size:
            raise ConfigError("--size", f"{h}x{w}", f"sides must be multiples of dit.patch_size={cfg.dit.patch_size}")
    if cfg.dit.text_encoder != "learned" and args.text_encoder is None:
        raise ConfigError("--text-encoder", None, "this run trained on precomputed text states; pass the encoder")
    if cfg.dit.in_channels != 3 and args.vae is None:
        raise ConfigError("--vae", None, "this run trained on latents; pass the VAE directory to decode them")

    from megascale_omni.data.dit.batches import CaptionEncoder
    from megascale_omni.demo.dit_shapes import dominant_color
    from megascale_omni.models.dit.model import build_dit_chunks
    from megascale_omni.parallel import ParallelDims
    from megascale_omni.parallel.state import destroy_parallel, initialize_parallel
    from megascale_omni.platform import init_platform
    from megascale_omni.platform.device import init_distributed
    from megascale_omni.tasks.dit_sampling import sample_images, save_grid, to_uint8

    platform = init_platform()
    init_distributed(platform)
    initialize_parallel(ParallelDims.from_config(cfg.parallel, 1), cfg.train.seed)
    try:
        tokenizer, states = ckpt.tokenizer(), None
        if tokenizer is None:
            from megascale_omni.data.dit.latents import TextStates

            encoder = TextStates.load(args.text_encoder, cfg.dit.max_text_length)
            states = [torch.from_numpy(s) for s in encoder.encode(args.prompt)]
        vocab = cfg.model.padded_vocab_size(tokenizer.vocab_size) if tokenizer else 0
        chunks = build_dit_chunks(cfg, platform.default_dtype(cfg.train.precision), vocab)
        load_dit_weights(chunks, ckpt, ema=not args.raw)
        print(f"loaded the {'trained' if args.raw else 'EMA'} weights of {ckpt.path} "
              f"(step {ckpt.info.step}, saved with {_layout(ckpt.common)})", file=sys.stderr)
        captions = CaptionEncoder(cfg.dit, tokenizer)
        prompts = [p for p in args.prompt for _ in range(args.per_prompt)]
        prompt_states = None if states is None else [s for s in states for _ in range(args.per_prompt)]
        vae = None
        if args.vae is not None:
            from megascale_omni.data.dit.latents import VaeCodec

            vae = VaeCodec.load(args.vae)
        rows, scores = [], {}
        for h, w in sizes:
            x = sample_images(chunks, captions, prompts, h, w, cfg.dit.in_channels,
                              args.steps or cfg.dit.sample_steps, args.guidance or cfg.dit.guidance_scale,
                              args.seed, text_states=prompt_states)
            images = to_uint8(vae.decode(x) if vae is not None else x)
            for i, prompt in enumerate(args.prompt):
                block = images[i * args.per_prompt : (i + 1) * args.per_prompt]
                rows.append(block)
                wanted = next((word for word in prompt.split() if dominant_color_name(word)), None)
                if args.score_colors and wanted:
                    hits = [dominant_color(im) == wanted for im in block]
                    scores[f"{prompt} @ {h}x{w}"] = float(np.mean(hits))
        save_grid(rows, args.out)
        print(f"wrote {len(rows) * args.per_prompt} samples to {args.out}")
        if args.score_colors:
            total = float(np.mean(list(scores.values()))) if scores else float("nan")
            print(json.dumps({"color_accuracy": total, "per_prompt": scores}, indent=1))
    finally:
        destroy_parallel()


def _layout(common: dict) -> str:
    saved = common.get("layout", {})
    return " ".join(f"{k}{saved[k]}" for k in ("tp", "pp", "dp") if k in saved) or "an unknown layout"


def dominant_color_name(word: str) -> bool:
    from megascale_omni.demo.shapes import COLORS

    return word in COLORS


if __name__ == "__main__":
    run_cli(main)
