"""The evaluation part of a model family: what is measured, on how many
samples, with which optional controls.

An :class:`Evaluator` is built on every rank after the family's data module
and model spec; the Trainer calls :meth:`Evaluator.evaluate` at
``train.eval_interval`` and at the end. A family's registry entry names its
evaluators (``ModelFamily.evaluators``); ``train.evaluator: auto`` takes the
first whose :meth:`Evaluator.applies` to the data, a name picks one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from megascale_omni.config import JobConfig
from megascale_omni.parallel import ParallelDims
from megascale_omni.parallel.schedules import run_forward_backward
from megascale_omni.platform import Platform


class Evaluator:
    """A held-out measurement of the model (every rank). The base measures
    nothing: ``train.evaluator: none``."""

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims, data: Any, model: Any):
        self.cfg = cfg
        self.platform = platform
        self.dims = dims
        #: The family's :class:`~megascale_omni.data.module.DataModule` and
        #: :class:`~megascale_omni.models.model_spec.ModelSpec`.
        self.data = data
        self.model = model

    @classmethod
    def applies(cls, cfg: JobConfig, data: Any) -> bool:
        """Whether ``train.evaluator: auto`` picks this evaluator for ``data``
        (asked in registry order; every rank gets the same answer)."""
        return True

    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Held-out evaluation of ``chunks`` after ``step`` steps (every rank);
        metrics on the loss rank, None elsewhere or when there is nothing to evaluate."""
        return None

    def forward_only(self, chunks: Sequence[torch.nn.Module], forward_step: Callable,
                     microbatches: Sequence[dict]) -> list[dict]:
        """Run ``forward_step`` over ``microbatches`` without gradients through
        the pipeline schedule, in eval mode (every rank of the replica).
        Returns the last stage's loss reports."""
        for chunk in chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                return run_forward_backward(
                    chunks, forward_step, microbatches, *self.model.pipeline_shape(), forward_only=True,
                )
        finally:
            for chunk in chunks:
                chunk.train()
