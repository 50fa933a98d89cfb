"""The word vocabulary of the LLaVA shapes demo: the image samples' words
(:mod:`megascale_omni.demo.shapes`), the clips' and ``<video>``
(:mod:`megascale_omni.demo.video_shapes`). One tokenizer whatever the mix,
and known without building a dataset (no torch import: the registry's
``default_vocab`` is read while a config is validated)."""

from __future__ import annotations

from megascale_omni.demo.shapes import dataset_vocabulary
from megascale_omni.demo.video_shapes import clip_vocabulary


def vocabulary() -> list[str]:
    """Every word of the image samples and of the clips, sorted (excludes ``<image>``)."""
    return sorted(set(dataset_vocabulary()) | set(clip_vocabulary()))


def word_tokenizer_size() -> int:
    """Ids of the word tokenizer a shapes dataset is built with (the special
    tokens and :func:`vocabulary`): the LLaVA family's ``default_vocab``,
    checked before the dataset exists."""
    from megascale_omni.data.tokenizer import SpecialTokens

    return len(SpecialTokens().in_id_order()) + len(vocabulary())
