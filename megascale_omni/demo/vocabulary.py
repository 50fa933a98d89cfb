"""The word vocabularies of the LLaVA shapes demo: the image samples' words
(:mod:`megascale_omni.demo.shapes`) and, for a build with clips, the
clips' words and ``<video>`` (:mod:`megascale_omni.demo.video_shapes`).
Known without building a dataset (no torch import: the registry's
``default_vocab`` is read while a config is validated)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megascale_omni.demo.shapes import dataset_vocabulary
from megascale_omni.demo.video_shapes import clip_vocabulary

if TYPE_CHECKING:
    from megascale_omni.config.schema import JobConfig


def vocabulary(clips: bool = True) -> list[str]:
    """Every word of the image samples and, with ``clips``, of the clips,
    sorted (excludes ``<image>``). An image-only build keeps the image words
    alone: its token ids (and so every tiny-LLaVA trajectory the layout and
    resume tests compare at 1e-6) do not depend on words it never holds."""
    words = set(dataset_vocabulary())
    if clips:
        words |= set(clip_vocabulary())
    return sorted(words)


def word_tokenizer_size(cfg: JobConfig) -> int:
    """Ids of the word tokenizer the embedded shapes dataset of ``cfg`` is
    built with (the special tokens and :func:`vocabulary`, with clips when
    ``data.default_video_fraction`` > 0): the LLaVA family's
    ``default_vocab``, checked before the dataset exists."""
    from megascale_omni.data.tokenizer import SpecialTokens

    clips = bool(cfg.data.default_video_fraction)
    return len(SpecialTokens().in_id_order()) + len(vocabulary(clips=clips))
