"""The GPT family's model part: a megatron GPT over THD micro-batches (every rank)."""

from __future__ import annotations

from functools import partial
from typing import Any

from megascale_omni.models.attention import thd_inputs, thd_pipeline_shape
from megascale_omni.models.gpt import build_gpt_chunks, transformer_config
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.models.model_spec import ModelSpec


class GptModelSpec(ModelSpec):
    """:class:`~megascale_omni.models.model_spec.ModelSpec` of ``model.family: gpt``."""

    def pipeline_shape(self) -> tuple[int, int]:
        return thd_pipeline_shape(self.data.seq_length, self.cfg.train.micro_batch_size)

    def build_model(self):
        config = transformer_config(self.cfg.model, self.cfg.parallel, self.dtype, self.cfg.moe)
        return self.watch_routers(build_gpt_chunks(self.cfg.model, config, vocab_size=self.data.vocab_size,
                                                   max_sequence_length=self.data.seq_length))

    def forward_step(self, data_iterator: Any, model):
        batch = self.cp_local(next(data_iterator))
        tokens, position_ids, labels, packed = thd_inputs(batch, self.dims.cp)
        output = model(tokens, position_ids, None, labels=labels, packed_seq_params=packed)
        return output, partial(masked_token_loss, loss_mask=batch["loss_mask"])
