"""The shapes demo's LLaVA evaluation (``train.evaluator: shapes``): accuracy
on the image-dependent answer words only, broken down by word category
(colour, shape, position, yes/no; for the clips: motion, colour, shape), with
the control (images shuffled across samples, clip frames shuffled in time)."""

from __future__ import annotations

from typing import Any

import torch

from megascale_omni.config import JobConfig
from megascale_omni.demo.shapes import COLORS, POSITIONS, SHAPES
from megascale_omni.demo.video_shapes import OPPOSITE
from megascale_omni.evaluation.chat import ChatEvaluator

#: Answer words of each category the breakdown of image samples reports.
CATEGORIES = {"color": COLORS, "shape": SHAPES, "position": POSITIONS, "yes/no": ("yes", "no")}
#: Answer words of each category of the clips (demo/video_shapes.py): which
#: way a shape moves, which colour it turns / shows last, which shape comes first.
VIDEO_CATEGORIES = {"motion": tuple(OPPOSITE), "color": COLORS, "shape": SHAPES}


class ShapesEvaluator(ChatEvaluator):
    """:class:`~megascale_omni.evaluation.chat.ChatEvaluator` scored on the
    ``eval_mask`` of the word-level shapes format (``image_word_accuracy``),
    plus ``<pass>/accuracy/<category>``."""

    metric = "image_word_accuracy"
    mask_key = "eval_mask"

    @classmethod
    def applies(cls, cfg: JobConfig, data: Any) -> bool:
        """The shapes set: word-level format with every shapes answer word in the vocabulary."""
        return cfg.data.format == "words" and all(
            data.tokenizer.token_to_id(w) is not None for words in CATEGORIES.values() for w in words
        )

    def categories(self) -> dict[str, torch.Tensor]:
        """Token ids of each answer-word category (categories absent from the vocab are dropped)."""
        return self._ids("_categories", CATEGORIES)

    def video_categories(self) -> dict[str, torch.Tensor]:
        """Token ids of each answer-word category of the clips (absent ones dropped)."""
        return self._ids("_video_categories", VIDEO_CATEGORIES)

    def _ids(self, attr: str, table: dict) -> dict[str, torch.Tensor]:
        if not hasattr(self, attr):
            found = {}
            for name, words in table.items():
                ids = [i for i in (self.data.tokenizer.token_to_id(w) for w in words) if i is not None]
                if ids:
                    found[name] = torch.tensor(ids)
            setattr(self, attr, found)
        return getattr(self, attr)
