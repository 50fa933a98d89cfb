#!/usr/bin/env python
"""Sample images from a trained DiT (Euler ODE, classifier-free guidance) into a PNG grid.

    python tools/sample_dit.py --run runs/dit-tiny --prompt "a red circle" --prompt "a blue square" \\
        --size 16x16 --size 16x32 --out grid.png [--per-prompt 4] [--steps 20] [--guidance 4] [--score-colors]

``--run`` is a pretrain_dit.py output directory: its ``config.yaml`` gives
the model and its ``sampling-weights/`` the EMA weights written after the
last step. Run it with the training run's TP/PP layout (plain python for
TP1/PP1; ``torchrun --nproc-per-node tp*pp`` otherwise). One grid row per
prompt and size. ``--score-colors`` prints, for prompts that name a colour,
the fraction of images whose dominant colour is the prompted one.
Latent runs need ``--vae`` (to decode) and ``--text-encoder`` (to embed the
prompts), the local directories used by tools/make_dit_latents.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

try:
    import megascale_omni  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale_omni.config import ConfigError, JobConfig, apply_overrides, from_dict, load_yaml, run_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, type=Path, help="pretrain_dit.py output directory")
    p.add_argument("--prompt", action="append", required=True, help="caption to sample (repeatable)")
    p.add_argument("--size", action="append", default=None, help="HxW in latent pixels (repeatable; default 16x16)")
    p.add_argument("--out", type=Path, default=None, help="PNG grid path (default RUN/samples.png)")
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
        out.append((h, w))
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    config_path = args.run / "config.yaml"
    cfg = from_dict(JobConfig, apply_overrides(load_yaml(config_path), []))
    if cfg.model.family != "dit":
        raise ConfigError("--run", str(args.run), f"{config_path} is a {cfg.model.family!r} run, not dit")
    sizes = _sizes(args.size)
    for h, w in sizes:
        if h % cfg.dit.patch_size or w % cfg.dit.patch_size:
            raise ConfigError("--size", f"{h}x{w}", f"sides must be multiples of dit.patch_size={cfg.dit.patch_size}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.parallel.tp * cfg.parallel.pp:
        raise ConfigError("WORLD_SIZE", world, f"launch tp*pp={cfg.parallel.tp * cfg.parallel.pp} processes "
                          f"(the run's layout; one per model-parallel rank)")
    cfg.parallel.use_distributed_optimizer = False

    from megascale_omni.data.dit_shapes import dominant_color
    from megascale_omni.data.tokenizer import TextTokenizer
    from megascale_omni.models.dit.model import build_dit_chunks
    from megascale_omni.parallel import ParallelDims
    from megascale_omni.parallel.state import destroy_parallel, initialize_parallel
    from megascale_omni.platform import init_platform
    from megascale_omni.platform.device import init_distributed
    from megascale_omni.tasks.dit import resolve_dit_dataset
    from megascale_omni.tasks.dit_batches import CaptionEncoder
    from megascale_omni.tasks.dit_sampling import load_sampling_weights, sample_images, save_grid, to_uint8

    platform = init_platform()
    init_distributed(platform)
    initialize_parallel(ParallelDims.from_config(cfg.parallel, world), cfg.train.seed)
    try:
        tokenizer, states = None, None
        if cfg.dit.text_encoder == "learned":
            root, _ = resolve_dit_dataset(cfg)
            tokenizer = TextTokenizer.from_path(Path(cfg.data.tokenizer) if cfg.data.tokenizer
                                                else root / "tokenizer.json")
        elif args.text_encoder is None:
            raise ConfigError("--text-encoder", None, "this run trained on precomputed text states; pass the encoder")
        else:
            from megascale_omni.data.latents import TextStates

            encoder = TextStates.load(args.text_encoder, cfg.dit.max_text_length)
            states = [torch.from_numpy(s) for s in encoder.encode(args.prompt)]
        multiple = cfg.model.make_vocab_size_divisible_by
        vocab = -(-tokenizer.vocab_size // multiple) * multiple if tokenizer else 0
        chunks = build_dit_chunks(cfg, platform.default_dtype(cfg.train.precision), vocab)
        load_sampling_weights(chunks, args.run)
        captions = CaptionEncoder(cfg.dit, tokenizer)
        prompts = [p for p in args.prompt for _ in range(args.per_prompt)]
        prompt_states = None if states is None else [s for s in states for _ in range(args.per_prompt)]
        vae = None
        if cfg.dit.in_channels != 3 or args.vae is not None:
            if args.vae is None:
                raise ConfigError("--vae", None, "this run trained on latents; pass the VAE directory to decode them")
            from megascale_omni.data.latents import VaeCodec

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
        if int(os.environ.get("RANK", "0")) == 0:
            out = args.out or args.run / "samples.png"
            save_grid(rows, out)
            print(f"wrote {len(rows) * args.per_prompt} samples to {out}")
            if args.score_colors:
                total = float(np.mean(list(scores.values()))) if scores else float("nan")
                print(json.dumps({"color_accuracy": total, "per_prompt": scores}, indent=1))
    finally:
        destroy_parallel()


def dominant_color_name(word: str) -> bool:
    from megascale_omni.data.shapes import COLORS

    return word in COLORS


if __name__ == "__main__":
    run_cli(main)
