#!/usr/bin/env python
"""Ingest LLaVA-format JSON, caption JSONL and text-only JSONL into training shards.

    python tools/ingest_llava.py --out data/my_set/train --image-root /data/images \\
        --llava-json llava_v1_5_mix665k.json [--captions blip_laion.jsonl] [--text sharegpt.jsonl] \\
        [--workers 8] [--samples-per-shard 1000] [--val-fraction 0.01 [--val-seed 0]] [--val-json val.json] \\
        [--tokenizer ckpt/llava/tokenizer [--data-format chat|words] [--seq-length 4096 --tokens-per-image 576 \\
        [--tokens-per-frame 196 [--video-newline]]]] [--video-frames 8 [--video-fps 1.0]]

Writes WebDataset shards + ``index.json`` into ``--out`` (a split
directory: point ``data.path`` at its parent, which holds ``train/`` and
optionally ``val/``), ``rejected.jsonl`` (every rejected record with its
position, source line and reason) and ``ingest_report.json`` (counts).
Images are stored as their source bytes (JPEG, PNG, WebP), checked by a
full decode here. Records with ``"video"``/``"videos"`` (a clip or a frame
folder per ``<video>`` marker) keep ``--video-frames`` frames of each
(docs/video.md). ``--val-fraction`` (records chosen by a hash of their id
and ``--val-seed``) and ``--val-json`` (every record) make the val split in
``--val-out`` (default: ``val`` beside ``--out``).
Rerunning the same command resumes: finished shards are kept. With
``--tokenizer`` (the training run's: an HF tokenizer directory with a chat
template, or with ``--data-format words`` a word-level ``tokenizer.json``)
the index records each sample's token count, so training plans from the
index alone; with ``--seq-length`` too, samples the chat template renders
longer are rejected, each image as ``--tokens-per-image`` placeholders and
each video as ``--tokens-per-frame`` per kept frame (plus one with
``--video-newline``: the run's ``vision.video_tokens``). See
``megascale_omni/data/llava/ingest.py`` and docs/data.md. Exit 2 with one
line for unusable arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megascale_omni.config import ConfigError  # noqa: E402
from megascale_omni.data.llava.ingest import (  # noqa: E402
    IngestInputs,
    LengthCheck,
    ValSplit,
    chat_coster,
    ingest,
    words_coster,
)
from megascale_omni.data.video import VideoSampling  # noqa: E402
from megascale_omni.entry import run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output split directory (e.g. data/my_set/train)")
    p.add_argument("--image-root", default=".", help="directory image paths are relative to")
    p.add_argument("--llava-json", action="append", default=[], help="LLaVA-format JSON array (repeatable)")
    p.add_argument("--captions", action="append", default=[], help="image-caption JSONL (repeatable)")
    p.add_argument("--caption-prompt", default="", help="user text after the <image> of caption samples")
    p.add_argument("--text", action="append", default=[], help="text-only conversation JSONL (repeatable)")
    p.add_argument("--samples-per-shard", type=int, default=1000, help="input records per shard")
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="worker processes")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="share of the records moved to the val split, chosen by a hash of (seed, record id)")
    p.add_argument("--val-seed", type=int, default=0, help="seed of the --val-fraction choice")
    p.add_argument("--val-json", action="append", default=[], help="LLaVA-format JSON of val records (repeatable)")
    p.add_argument("--val-out", help="the val split directory (default: val beside --out)")
    p.add_argument("--tokenizer", help="the training run's tokenizer: token counts in the index (and the length check)")
    p.add_argument("--data-format", choices=("chat", "words"), default="chat",
                   help="with --tokenizer: the training run's data.format the counts are for")
    p.add_argument("--seq-length", type=int, help="with --tokenizer: reject samples longer than this")
    p.add_argument("--tokens-per-image", type=int, default=0, help="with --tokenizer: placeholder tokens per image")
    p.add_argument("--image-token", default="<image>", help="with --tokenizer: the image placeholder token")
    p.add_argument("--tokens-per-frame", type=int, default=0,
                   help="with --seq-length: placeholder tokens per kept video frame after pooling, "
                        "ceil(grid / vision.video_pool_stride)**2 (0: records with a video are rejected)")
    p.add_argument("--video-newline", action="store_true",
                   help="with --tokens-per-frame: one more placeholder after each video (vision.image_newline)")
    p.add_argument("--video-token", default="<video>", help="with --tokens-per-frame: the video placeholder token")
    p.add_argument("--video-frames", type=int, default=8,
                   help="frames kept per video: uniformly spread as transformers' LLaVA-OneVision does, "
                        "or with --video-fps their maximum")
    p.add_argument("--video-fps", type=float, default=None,
                   help="keep this many frames per second of each clip (at most --video-frames)")
    return p.parse_args(argv)


def _coster(args: argparse.Namespace):
    """The index coster of ``--tokenizer`` (ConfigError naming it when unusable)."""
    want = "directory" if args.data_format == "chat" else "tokenizer.json or directory"
    if not os.path.exists(args.tokenizer) or (args.data_format == "chat" and not os.path.isdir(args.tokenizer)):
        raise ConfigError("--tokenizer", args.tokenizer, f"no such {want}")
    try:
        if args.data_format == "chat":
            return chat_coster(args.tokenizer, args.image_token)
        return words_coster(args.tokenizer)
    except (OSError, ValueError) as err:
        raise ConfigError("--tokenizer", args.tokenizer, f"is not a usable {args.data_format} tokenizer: {err}") from None


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not (args.llava_json or args.captions or args.text):
        raise ConfigError("--llava-json/--captions/--text", None, "give at least one input file")
    for path in (*args.llava_json, *args.captions, *args.text, *args.val_json):
        if not os.path.isfile(path):
            raise ConfigError("input", path, "no such file")
    val = None
    if args.val_fraction or args.val_json:
        val_out = args.val_out or os.path.join(os.path.dirname(os.path.abspath(args.out)), "val")
        val = ValSplit(val_out, args.val_fraction, args.val_seed, args.val_json)
    elif args.val_out:
        raise ConfigError("--val-out", args.val_out, "needs --val-fraction or --val-json")
    length = coster = None
    if args.seq_length is not None:
        if not (args.tokenizer and args.seq_length > 0 and args.tokens_per_image > 0 and args.data_format == "chat"):
            raise ConfigError("--tokenizer/--seq-length/--tokens-per-image",
                              f"{args.tokenizer}/{args.seq_length}/{args.tokens_per_image}",
                              "the length check needs all three (a chat tokenizer directory, positive numbers)")
        if args.tokens_per_frame < 0:
            raise ConfigError("--tokens-per-frame", args.tokens_per_frame, "must be >= 0 (0: no videos expected)")
        length = LengthCheck(args.tokenizer, args.seq_length, args.tokens_per_image, args.image_token,
                             args.tokens_per_frame, int(args.video_newline), args.video_token)
    elif args.tokens_per_frame or args.video_newline:
        raise ConfigError("--tokens-per-frame/--video-newline", f"{args.tokens_per_frame}/{args.video_newline}",
                          "only count with --seq-length (the length check)")
    if args.tokenizer:
        coster = _coster(args)
    video = VideoSampling("uniform" if args.video_fps is None else "fps", args.video_frames,
                          1.0 if args.video_fps is None else args.video_fps)
    inputs = IngestInputs(args.llava_json, args.captions, args.text, args.image_root, args.caption_prompt)
    report = ingest(inputs, args.out, args.samples_per_shard, args.workers, length, coster, val, video)
    print(json.dumps(report.to_dict(), indent=2))
    for out, rep in ((args.out, report), (val and val.out, report.val)):
        if rep is not None:
            print(f"ingested {rep.kept} of {rep.inputs} records into {rep.shards} shard(s) under {out}; "
                  f"{rep.rejected} rejected (see {os.path.join(out, 'rejected.jsonl')})")


if __name__ == "__main__":
    run_cli(main)
