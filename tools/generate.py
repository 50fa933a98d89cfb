#!/usr/bin/env python
"""Generate text from a checkpoint in one process: greedy or sampled, with images and videos for LLaVA.

    python tools/generate.py --checkpoint runs/demo-llava/checkpoints \\
        --image shape.png --prompt "<image> what shape is this ?" --max-new-tokens 8
    python tools/generate.py --checkpoint ckpt/llava-onevision \\
        --video clip.mp4 --frames 8 --prompt "<video> What happens?" --max-new-tokens 32
    python tools/generate.py --checkpoint ckpt/qwen2-0.5b --prompt "The capital of France is" \\
        --max-new-tokens 20 --temperature 0.7 --top-k 50 --seed 1

--checkpoint: a checkpoint root (newest intact checkpoint) or a step_NNNNNNNN directory of a
gpt or llava model, saved under any layout (resharded to one process), or a tools/hf_import.py
output. Each <image> in --prompt takes the next --image (resized to vision.image_size and
normalised as in training, or with the tower's mean/std when the tokenizer directory has a
preprocessor_config.json or a processor_config.json). Each <video> takes the next --video, a
clip (decoded with PyAV) or a folder of JPEG/PNG frames, of which --frames are kept uniformly as
training and transformers' LLaVA-OneVision keep them (docs/video.md), each frame prepared as an
image. The tokenizer: --tokenizer, else the one the checkpoint carries
(step_NNNNNNNN/tokenizer/: every checkpoint of a run from an import), else the import's tokenizer/,
else the training run's (data.tokenizer or <data.path>/tokenizer.json). Prints the generated text;
--ids also prints the token ids. Exit codes: 2 bad arguments, 4 broken checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

try:
    import megascale_omni  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megascale_omni.checkpoint.hf_assets import ASSET_DIR
from megascale_omni.config import ConfigError
from megascale_omni.entry import run_cli

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
_MARKERS = re.compile(f"({IMAGE_MARKER}|{VIDEO_MARKER})")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="checkpoint root or step_NNNNNNNN directory")
    p.add_argument("--prompt", required=True, help=f"prompt text; {IMAGE_MARKER} marks where an image goes")
    p.add_argument("--image", type=Path, action="append", default=[], help="image file, one per marker (repeatable)")
    p.add_argument("--video", type=Path, action="append", default=[],
                   help=f"video clip or frame folder, one per {VIDEO_MARKER} marker (repeatable)")
    p.add_argument("--frames", type=int, default=8, help="frames kept of each --video, uniformly (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json or a directory holding one")
    p.add_argument("--ids", action="store_true", help="also print the generated token ids")
    return p.parse_args(argv)


def find_tokenizer(args_tokenizer, ckpt) -> Path:
    """Where the tokenizer of ``ckpt`` is (see the module docstring)."""
    cfg = ckpt.cfg
    candidates = [args_tokenizer, ckpt.path / ASSET_DIR, ckpt.path.parent / "tokenizer"]
    if cfg.data.tokenizer:
        candidates.append(Path(cfg.data.tokenizer))
    if cfg.data.path:
        candidates.append(Path(cfg.data.path) / "tokenizer.json")
    if cfg.model.family == "llava" and not cfg.data.path:
        from megascale_omni.demo.defaults import llava_shapes_dir

        candidates.append(llava_shapes_dir(cfg) / "tokenizer.json")
    for c in candidates:
        if c is None:
            continue
        if c.is_file() or (c / "tokenizer.json").is_file():
            return c if c.is_file() else c / "tokenizer.json"
        if c is args_tokenizer:
            raise ConfigError("--tokenizer", str(c), "has no tokenizer.json; point it at the file or its directory")
    raise ConfigError("--tokenizer", None, f"no tokenizer found for {ckpt.path}; pass --tokenizer")


def encode_prompt(tok, text: str, image_tokens: int, video_tokens: list[int], image_token: int,
                  video_token: int) -> tuple[list[int], int, int]:
    """Token ids of ``text`` with each image marker expanded to ``image_tokens``
    image tokens and the ``i``-th video marker to ``video_tokens[i]`` video
    tokens (none when fewer are given), after the tokenizer's start tokens
    (its post-processor's, or ``<bos>`` when it has one and no
    post-processor). Returns (ids, image markers, video markers)."""
    start = tok.encode("", add_special_tokens=True).ids
    if not start and tok.token_to_id("<bos>") is not None:
        start = [tok.token_to_id("<bos>")]
    ids = list(start)
    images = videos = 0
    for piece in _MARKERS.split(text):
        if piece == IMAGE_MARKER:
            ids.extend([image_token] * image_tokens)
            images += 1
        elif piece == VIDEO_MARKER:
            ids.extend([video_token] * (video_tokens[videos] if videos < len(video_tokens) else 0))
            videos += 1
        elif piece.strip():
            ids.extend(tok.encode(piece, add_special_tokens=False).ids)
    return ids, images, videos


def _normalizer(tokenizer_dir: Path):
    """uint8 ``[H, W, 3]`` (already ``image_size`` square) -> float32 ``[3, H, W]``:
    the tower's mean/std when the tokenizer directory has its preprocessor
    config, else [-1, 1] as our training data."""
    import numpy as np
    import torch

    from megascale_omni.data.image_preprocess import PreprocessorSpec, find_preprocessor_config

    found = find_preprocessor_config(tokenizer_dir)
    spec = PreprocessorSpec.from_file(found) if found is not None else None

    def normalize(pixels) -> torch.Tensor:
        x = np.asarray(pixels, dtype=np.float32)
        if spec is not None and spec.image_mean and spec.image_std:
            x = (x / 255.0 - np.array(spec.image_mean)) / np.array(spec.image_std)
        else:
            x = x / 127.5 - 1.0
        return torch.from_numpy(x.astype(np.float32)).permute(2, 0, 1)

    return normalize


def load_images(paths, image_size: int, tokenizer_dir: Path):
    import torch
    from PIL import Image, UnidentifiedImageError

    normalize = _normalizer(tokenizer_dir)
    out = []
    for p in paths:
        try:
            im = Image.open(p).convert("RGB").resize((image_size, image_size), Image.BICUBIC)
        except (OSError, UnidentifiedImageError) as e:
            raise ConfigError("--image", str(p), f"cannot be read as an image ({e})") from None
        out.append(normalize(im))
    return torch.stack(out)


def load_videos(paths, frames: int, image_size: int, tokenizer_dir: Path):
    """(``[F, 3, S, S]`` every video's kept frames, frames per video)."""
    import torch
    from PIL import Image

    from megascale_omni.data.video import VideoError, VideoSampling, load_video

    normalize = _normalizer(tokenizer_dir)
    out, counts = [], []
    for p in paths:
        try:
            video = load_video(str(p), VideoSampling(frames=frames))
        except (OSError, VideoError) as e:
            raise ConfigError("--video", str(p), f"cannot be read as a video ({e})") from None
        for frame in video.frames:
            out.append(normalize(Image.fromarray(frame).resize((image_size, image_size), Image.BICUBIC)))
        counts.append(len(video.frames))
    return torch.stack(out), counts


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.max_new_tokens <= 0:
        raise ConfigError("--max-new-tokens", args.max_new_tokens, "must be > 0")
    if args.temperature < 0:
        raise ConfigError("--temperature", args.temperature, "must be >= 0 (0 = greedy)")
    from tokenizers import Tokenizer

    from megascale_omni.checkpoint.pretrained import load_model_weights, open_model_checkpoint
    from megascale_omni.hf.exporter import hf_vocab_size
    from megascale_omni.models.generation import generate
    from megascale_omni.models.standalone import build_model, one_process

    ckpt = open_model_checkpoint(args.checkpoint, "--checkpoint")
    cfg = ckpt.cfg
    if cfg.model.family not in ("gpt", "llava"):
        raise ConfigError("--checkpoint", str(ckpt.path), f"holds a {cfg.model.family!r} model; generation is for "
                          "gpt and llava (DiT: tools/sample_dit.py)")
    tok_path = find_tokenizer(args.tokenizer, ckpt)
    tok = Tokenizer.from_file(str(tok_path))
    is_llava = cfg.model.family == "llava"
    image_token = _token_id(ckpt, tok, "image_token_id", IMAGE_MARKER)
    video_token = _token_id(ckpt, tok, "video_token_id", VIDEO_MARKER)
    if args.frames <= 0:
        raise ConfigError("--frames", args.frames, "must be > 0 (frames kept of each --video)")
    videos, frames = load_videos(args.video, args.frames, cfg.vision.image_size, tok_path.parent) \
        if args.video and is_llava else (None, [])
    v = cfg.vision
    prompt, n_images, n_videos = encode_prompt(tok, args.prompt, v.image_tokens if is_llava else 0,
                                               [v.video_tokens(f) for f in frames], image_token, video_token)
    for flag, n, given, marker in (("--image", n_images, args.image, IMAGE_MARKER),
                                   ("--video", n_videos, args.video, VIDEO_MARKER)):
        if n != len(given) or (n and not is_llava):
            raise ConfigError(flag, [str(p) for p in given], f"the prompt has {n} {marker} markers"
                              + ("" if is_llava else " but this is a text-only model") + f"; give one {flag} per marker")
    if is_llava and v.image_newline and n_images == 1:
        print("note: one image is laid out as an image of a multi-image prompt (its features, then the newline); "
              "transformers' LLaVA-OneVision tiles a lone image (anyres), so its answer may differ (docs/hf.md)",
              file=sys.stderr)
    if n_videos and video_token < 0:
        raise ConfigError("--video", [str(p) for p in args.video], f"neither the checkpoint nor the tokenizer names a "
                          f"{VIDEO_MARKER} token; use a model imported from LLaVA-OneVision or a tokenizer with one")
    if len(prompt) + args.max_new_tokens > cfg.model.seq_length and cfg.model.position_embedding_type != "rope":
        raise ConfigError("--max-new-tokens", args.max_new_tokens,
                          f"prompt ({len(prompt)} tokens) + new tokens exceed model.seq_length={cfg.model.seq_length}")
    images = load_images(args.image, cfg.vision.image_size, tok_path.parent) \
        if args.image else None
    eos = _eos_id(ckpt, tok)
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt.path))
    padded = next(int(v.global_shape[0]) for k, v in meta.items() if k.endswith("embedding.word_embeddings.weight"))
    with one_process(cfg.train.seed):
        model = build_model(cfg, padded, image_token, video_token)
        load_model_weights([model], ckpt, "--checkpoint")
        model.eval()
        new = generate(model, prompt, args.max_new_tokens, hf_vocab_size(ckpt, padded), images=images, eos_id=eos,
                       temperature=args.temperature, top_k=args.top_k, seed=args.seed, videos=videos,
                       video_frames=frames)
    print(tok.decode(new, skip_special_tokens=True))
    if args.ids:
        print(json.dumps({"prompt_ids": prompt, "new_ids": new}))


def _token_id(ckpt, tok, key: str, marker: str) -> int:
    """The imported model's ``key`` token, else the tokenizer's ``marker``, else -1."""
    token = int(ckpt.provenance.get(key, -1))
    if token < 0 and tok.token_to_id(marker) is not None:
        token = tok.token_to_id(marker)
    return token


def _eos_id(ckpt, tok):
    text = ckpt.provenance.get("text_config") or {}
    eos = text.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        eos = tok.token_to_id("<eos>")
    return eos


if __name__ == "__main__":
    run_cli(main)
