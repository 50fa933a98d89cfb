"""Held-out token loss of a language model (the GPT family's evaluation)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megascale_omni.evaluation.base import Evaluator
from megascale_omni.parallel import data_parallel_rank
from megascale_omni.parallel.schedules import reduce_reported_loss


class HeldOutLoss(Evaluator):
    """Mean token loss over the data module's ``eval_microbatches``, each DP
    rank its equal slice, through the training forward step (every rank)."""

    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """``{"loss": mean token loss}`` on the loss rank; None elsewhere."""
        mbs = self.data.eval_microbatches(data_parallel_rank(), self.dims.dp)
        loss, _ = reduce_reported_loss(self.forward_only(chunks, self.model.forward_step, mbs))
        return None if loss is None else {"loss": loss}
