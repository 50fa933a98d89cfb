"""The DiT family's model part: the adaLN DiT with its rectified-flow loss
and EMA weights (every rank). The data module gives the caption vocabulary."""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch

from megascale_omni.models.dit.context import image_token_index
from megascale_omni.models.dit.ema import EMA
from megascale_omni.models.dit.model import build_dit_chunks
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.models.model_spec import ModelSpec


class DitModelSpec(ModelSpec):
    """:class:`~megascale_omni.models.model_spec.ModelSpec` of ``model.family: dit``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema: Optional[EMA] = None
        self.chunks: list = []

    def build_model(self):
        self.chunks = build_dit_chunks(self.cfg, self.dtype, self.data.text_vocab)
        return self.chunks

    def ensure_ema(self) -> Optional[EMA]:
        """The EMA (None when ``dit.ema_decay`` is 0), created from the current
        weights on first use: from the initialised weights when the trainer
        builds a checkpoint template before the first step (resume)."""
        if self.ema is None and self.cfg.dit.ema_decay > 0:
            self.ema = EMA(self.chunks, self.cfg.dit.ema_decay)
        return self.ema

    @property
    def reads_weights_after_step(self) -> bool:
        """The EMA update reads the weights."""
        return self.cfg.dit.ema_decay > 0

    def after_step(self, step: int) -> None:
        """EMA update after each optimizer step (every rank, own shards)."""
        if self.ensure_ema() is not None:
            self.ema.update()

    def state_dict(self, sharded: bool) -> dict:
        """EMA weights: for a checkpoint ShardedTensors ``ema.<model key>``,
        resharded with the model. Every rank."""
        if self.ensure_ema() is None:
            return {}
        return {"ema": self.ema.sharded_state_dict() if sharded else self.ema.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.ensure_ema() is not None:
            self.ema.load_state_dict(state["ema"])

    def forward_step(self, data_iterator: Any, model):
        b = next(data_iterator)
        out = model(b["x_t"].to(self.dtype), b["t"], b["text"], b["text_mask"], target=b["target"].to(self.dtype))
        return out, partial(masked_token_loss, loss_mask=self._local_tokens(b["loss_mask"]))

    def _local_tokens(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` -> this CP rank's ``[B, N / cp]`` (the tokens the model
        computes on this rank, :func:`image_token_index`); itself without CP.
        Loss sums and token counts are then summed over DP x CP by megatron,
        so the objective is the CP1 one."""
        if self.dims.cp == 1:
            return per_token
        from megatron.core import parallel_state as mpu

        index = image_token_index(per_token.shape[1], self.dims.cp, mpu.get_context_parallel_rank())
        return per_token[:, index.to(per_token.device)]
