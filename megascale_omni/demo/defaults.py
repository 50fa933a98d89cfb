"""The embedded default datasets of the registry's ``default_dataset`` hook:
built on first use when ``data.path`` is null (every rank; one directory per
size, so changing the size never clobbers a build)."""

from __future__ import annotations

from pathlib import Path

from megascale_omni.config import JobConfig
from megascale_omni.demo.dit_shapes import ensure_dit_shapes_dataset
from megascale_omni.demo.llava_shapes import ensure_shapes_dataset

LLAVA_DATASET_DIR = "data/shapes-{num_train}-{num_val}-{image_size}px"
#: Appended to the directory of a build with clips (``data.default_video_fraction``).
LLAVA_VIDEO_SUFFIX = "-video{percent:g}pct"
DIT_DATASET_DIR = "data/dit-shapes-{num_train}-{num_val}"


def llava_shapes(cfg: JobConfig) -> Path:
    """The shapes conversations for ``cfg`` (``data.default_num_*``,
    ``data.default_video_fraction``, ``vision.image_size``)."""
    d = cfg.data
    root = llava_shapes_dir(cfg)
    ensure_shapes_dataset(root, num_train=d.default_num_train, num_val=d.default_num_val,
                          image_size=cfg.vision.image_size, video_fraction=d.default_video_fraction)
    return root


def llava_shapes_dir(cfg: JobConfig) -> Path:
    """Where :func:`llava_shapes` builds (or finds) the set for ``cfg``; builds nothing."""
    d = cfg.data
    root = LLAVA_DATASET_DIR.format(num_train=d.default_num_train, num_val=d.default_num_val,
                                    image_size=cfg.vision.image_size)
    if d.default_video_fraction:
        root += LLAVA_VIDEO_SUFFIX.format(percent=round(100 * d.default_video_fraction, 2))
    return Path(root)


def dit_shapes(cfg: JobConfig) -> Path:
    """The captioned multi-aspect shapes images for ``cfg`` (``data.default_num_*``)."""
    d = cfg.data
    return ensure_dit_shapes_dataset(DIT_DATASET_DIR.format(num_train=d.default_num_train, num_val=d.default_num_val),
                                     d.default_num_train, d.default_num_val)
