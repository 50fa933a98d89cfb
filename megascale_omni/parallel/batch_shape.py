"""What a batch holds, as the cost models count it: packed samples, tower inputs, DiT packages.

The pipeline planner sizes a nominal micro-batch from the config; the step
record counts the model FLOPs of the global batch a step really trained.
Both go through the same cost model (:data:`~megascale_omni.parallel.pipeline_cost.CostModelFn`),
which takes a :class:`BatchShape` for the second. Tasks build it from their
step-indexed data plans (``Task.batch_shape``). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class BatchShape:
    """The samples of one batch (typically a whole global batch, all DP ranks).

    ``segments``: non-padding tokens of every language-model sample; each is
    one causal segment of its packed row (image placeholder tokens included).
    ``tower_inputs``: images and video frames through the vision tower (anyres: its views).
    ``dit_packages``: ``(image tokens per image, images)`` of every DiT
    package (padding slots excluded). Padding is computed but is not model work.
    """

    segments: tuple[int, ...] = ()
    tower_inputs: float = 0.0
    dit_packages: tuple[tuple[int, int], ...] = ()

    @property
    def tokens(self) -> int:
        """Language-model tokens of the batch."""
        return sum(self.segments)


def causal_pairs(lengths: Iterable[float]) -> float:
    """Query-key pairs a causal mask keeps in segments of ``lengths`` tokens:
    ``s * (s + 1) / 2`` each (a token attends to itself and those before it)."""
    return sum(s * (s + 1) / 2 for s in lengths)
