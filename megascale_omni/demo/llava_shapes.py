"""Build and open the on-disk shapes dataset (train/val shards + tokenizer).

Layout of ``out_dir``::

    dataset.json       description: build args, generator config, splits, vocab size
    tokenizer.json     word-level tokenizer covering every dataset word (with
                       clips: the clips' words and ``<video>`` too)
    train/             shards + index.json, generator stream 0
    val/               shards + index.json, generator stream 1 (disjoint from train)

With ``video_fraction`` > 0 that share of each split is synthetic clips of
:mod:`megascale_omni.demo.video_shapes` (``CLIP_FRAMES`` frames of the
image size), spread evenly among the image samples: the demo's video part.

The build is a pure function of its arguments: rebuilding gives byte-identical
files (for the same PIL/zlib/tokenizers versions). It is written to a
temporary sibling directory and renamed into place, so a crash never leaves a
half-built dataset and concurrent builders (e.g. several ranks on first run)
cannot interleave their files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator

from megascale_omni.config.schema import DEFAULT_CLIP_FRAMES
from megascale_omni.data.llava.batches import LlavaEncoder
from megascale_omni.data.sample import KIND_VIDEO, SAMPLE_KINDS, Sample
from megascale_omni.data.shard_writer import write_shards
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.data.tokenizer import TOKENIZER_FILENAME, TextTokenizer, build_word_tokenizer
from megascale_omni.demo.shapes import ShapesConfig, generate_sample, generate_samples
from megascale_omni.demo.video_shapes import ClipConfig, generate_clip
from megascale_omni.demo.vocabulary import vocabulary

logger = logging.getLogger(__name__)

DATASET_FILENAME = "dataset.json"
DATASET_FORMAT_VERSION = 1
# Generator stream per split; distinct streams give disjoint RNG states.
SPLIT_STREAMS = {"train": 0, "val": 1}


#: Frames of a demo clip (the planner reads the same constant).
CLIP_FRAMES = DEFAULT_CLIP_FRAMES
#: Shape side in a clip against the frame's: 12 px at 32, the size of the image samples' shapes
#: (``ShapesConfig.min_extent``..``max_extent``), so the tower sees one scale of shapes.
CLIP_EXTENT = 0.375


def clip_config(image_size: int) -> ClipConfig:
    """The demo clips' geometry at ``image_size``."""
    return ClipConfig(frames=CLIP_FRAMES, size=image_size, extent=round(CLIP_EXTENT * image_size))


def _build_args(num_train: int, num_val: int, seed: int, image_size: int, samples_per_shard: int,
                video_fraction: float = 0.0) -> dict[str, Any]:
    args: dict[str, Any] = {"num_train": int(num_train), "num_val": int(num_val), "seed": int(seed),
                            "image_size": int(image_size), "samples_per_shard": int(samples_per_shard)}
    if not 0.0 <= video_fraction <= 1.0:
        raise ValueError(f"video_fraction must be in [0, 1], got {video_fraction}")
    if video_fraction:  # absent when 0, so image-only builds keep the arguments they were made with
        args["video_fraction"] = float(video_fraction)
    return args


def is_clip(position: int, video_fraction: float) -> bool:
    """Whether sample ``position`` of a split is a clip: the clips are spread
    evenly, ``floor(n * video_fraction)`` of the first ``n`` samples."""
    return int((position + 1) * video_fraction) > int(position * video_fraction)


def mixed_samples(num: int, seed: int, config: ShapesConfig, stream: int,
                  video_fraction: float = 0.0) -> Iterator[Sample]:
    """``num`` samples of ``stream``: image samples (:func:`generate_sample`,
    indices 0, 1, ...) with clips (:func:`generate_clip`, indices 0, 1, ... of
    the same stream) at the positions :func:`is_clip` picks; each sample's
    ``id`` is its position."""
    clips_at = clip_config(config.image_size)
    images = clips = 0
    for position in range(num):
        if is_clip(position, video_fraction):
            sample, clips = generate_clip(clips, seed, clips_at, stream), clips + 1
        else:
            sample, images = generate_sample(images, seed, config, stream), images + 1
        sample.id = position
        yield sample


def _counting(samples: Iterable[Sample], counts: Counter) -> Iterator[Sample]:
    for sample in samples:
        counts[sample.kind] += 1
        yield sample


def _missing_hint(out_dir: Path) -> str:
    return f"run `python tools/make_shapes_dataset.py --out {out_dir}` to build it"


def make_shapes_dataset(out_dir: str | os.PathLike, num_train: int = 4000, num_val: int = 500,
                        seed: int = 1234, image_size: int = 32, samples_per_shard: int = 500,
                        overwrite: bool = False, video_fraction: float = 0.0) -> dict[str, Any]:
    """Generate the shapes dataset into ``out_dir``; returns the ``dataset.json`` dict.
    ``video_fraction``: share of each split that is clips (:func:`mixed_samples`).

    Raises:
        FileExistsError: ``out_dir`` exists (and is not empty) and ``overwrite`` is False.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty; pass overwrite=True "
                              f"(--overwrite) or choose another directory")
    args = _build_args(num_train, num_val, seed, image_size, samples_per_shard, video_fraction)
    config = ShapesConfig(image_size=image_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = build_word_tokenizer(vocabulary(clips=bool(video_fraction)), tmp / TOKENIZER_FILENAME)
        # Token counts in the index: a run with this tokenizer plans from index.json alone.
        coster = LlavaEncoder(tokenizer, tokens_per_image=1)
        kinds = SAMPLE_KINDS + ((KIND_VIDEO,) if video_fraction else ())
        splits = {}
        for split, num in (("train", num_train), ("val", num_val)):
            counts: Counter = Counter()
            samples = _counting(mixed_samples(num, seed, config, SPLIT_STREAMS[split], video_fraction), counts)
            index = write_shards(samples, tmp / split, samples_per_shard, coster=coster)
            splits[split] = {
                "dir": split,
                "stream": SPLIT_STREAMS[split],
                "num_samples": index.num_samples,
                "num_shards": len(index.shards),
                "kind_counts": {kind: counts[kind] for kind in kinds},
            }
        description = {
            "name": "shapes",
            "format_version": DATASET_FORMAT_VERSION,
            "build_args": args,
            "generator": config.to_dict(),
            **({"clips": asdict(clip_config(image_size))} if video_fraction else {}),
            "splits": splits,
            "tokenizer": TOKENIZER_FILENAME,
            "vocab_size": tokenizer.vocab_size,
        }
        (tmp / DATASET_FILENAME).write_text(json.dumps(description, indent=2, sort_keys=True) + "\n",
                                            encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if overwrite and out.exists():
            shutil.rmtree(out)
        # rename() replaces an empty directory atomically and fails on a
        # non-empty one, which is how a concurrent builder that won is detected.
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("built shapes dataset at %s: %s", out, {s: d["num_samples"] for s, d in splits.items()})
    return description


def load_dataset_description(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Parsed ``out_dir/dataset.json``; FileNotFoundError (with the fix) if absent."""
    path = Path(out_dir) / DATASET_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"dataset description {str(path)!r} does not exist; "
                                f"{_missing_hint(Path(out_dir))}")
    return json.loads(path.read_text(encoding="utf-8"))


def ensure_shapes_dataset(out_dir: str | os.PathLike, num_train: int = 4000, num_val: int = 500,
                          seed: int = 1234, image_size: int = 32,
                          samples_per_shard: int = 500, video_fraction: float = 0.0) -> dict[str, Any]:
    """Return the dataset description, building the dataset first if it is absent.

    Safe to call from several processes at once: each builds privately and the
    first rename wins; the others verify the winner's build args.

    Raises:
        ValueError: ``out_dir`` holds a shapes dataset built with other arguments.
    """
    out = Path(out_dir)
    args = _build_args(num_train, num_val, seed, image_size, samples_per_shard, video_fraction)
    if not (out / DATASET_FILENAME).is_file():
        try:
            return make_shapes_dataset(out, **args)
        except (FileExistsError, OSError):
            if not (out / DATASET_FILENAME).is_file():
                raise  # not a lost race: a genuine error or a foreign non-empty directory
            logger.info("another process built %s concurrently; using its build", out)
    description = load_dataset_description(out)
    if description.get("build_args") != args:
        raise ValueError(f"{out} holds a shapes dataset built with {description.get('build_args')}, "
                         f"requested {args}; delete it or pick another directory")
    return description


def open_shapes_split(out_dir: str | os.PathLike, split: str) -> ShardedSampleReader:
    """Random-access reader of ``out_dir/<split>`` (``"train"`` or ``"val"``)."""
    if split not in SPLIT_STREAMS:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLIT_STREAMS)}")
    return ShardedSampleReader(Path(out_dir) / split, missing_hint=_missing_hint(Path(out_dir)))


def load_shapes_tokenizer(out_dir: str | os.PathLike) -> TextTokenizer:
    """The tokenizer stored with the dataset at ``out_dir``."""
    path = Path(out_dir) / TOKENIZER_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist; {_missing_hint(Path(out_dir))}")
    return TextTokenizer.from_path(path)


def make_shapes_llava_json(out_dir: str | os.PathLike, num_train: int = 4000, num_val: int = 500,
                           seed: int = 1234, image_size: int = 32) -> dict[str, int]:
    """The shapes samples in LLaVA's JSON format instead of shards:
    ``OUT/<split>/llava.json`` + ``OUT/<split>/images/*.png`` and
    ``OUT/tokenizer.json`` (the same samples :func:`make_shapes_dataset`
    shards). Input for ``tools/ingest_llava.py``, so the ingestion path runs
    on the embedded data. Returns the samples written per split."""
    from megascale_omni.data.llava.ingest import write_llava_json

    out = Path(out_dir)
    config = ShapesConfig(image_size=image_size)
    written = {}
    for split, num in (("train", num_train), ("val", num_val)):
        samples = list(generate_samples(num, seed, config, stream=SPLIT_STREAMS[split]))
        write_llava_json(samples, out / split)
        written[split] = len(samples)
    build_word_tokenizer(vocabulary(clips=False), out / TOKENIZER_FILENAME)
    return written
