"""The LLaVA family's model part: ViT + projector + GPT over packed THD rows
(every rank). The data module gives the vocabulary and the image token id."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch

from megascale_omni.models.attention import thd_inputs, thd_pipeline_shape
from megascale_omni.models.llava import build_llava_chunks
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.models.model_spec import ModelSpec


class LlavaModelSpec(ModelSpec):
    """:class:`~megascale_omni.models.model_spec.ModelSpec` of ``model.family: llava``."""

    def pipeline_shape(self) -> tuple[int, int]:
        return thd_pipeline_shape(self.data.seq_length, self.cfg.train.micro_batch_size)

    def build_model(self):
        return self.watch_routers(
            build_llava_chunks(self.cfg, self.dtype, self.data.vocab_size, self.data.tokenizer.image_token_id))

    def lr_mult(self) -> dict[str, float]:
        """``vision.lr_mult`` on the ViT's parameters (the projector keeps ``train.lr``)."""
        return {"*vision_model.*": self.cfg.vision.lr_mult}

    def _images(self, batch: dict) -> Optional[torch.Tensor]:
        """The tower's input (pipeline stage 0); None without images or on a later stage."""
        images = batch.get("images")
        return images.to(self.dtype) if images is not None and images.shape[0] else None

    def _local(self, batch: dict) -> dict:
        """This CP rank's tokens (:meth:`ModelSpec.cp_local`), plus ``image_rows``:
        which rows of the micro-batch's image features (all images, every CP
        rank runs the ViT on all of them) its image placeholders take."""
        local = self.cp_local(batch)
        if self.dims.cp > 1:
            is_image = batch["tokens"].reshape(-1) == self.data.tokenizer.image_token_id
            feature_row = torch.cumsum(is_image, 0) - 1
            mine = local["cp_index"]
            local["image_rows"] = feature_row[mine][is_image[mine]]
        return local

    def forward_step(self, data_iterator: Any, model):
        batch = self._local(next(data_iterator))
        tokens, pos, labels, packed = thd_inputs(batch, self.dims.cp)
        output = model(tokens, pos, packed, images=self._images(batch), labels=labels,
                       image_rows=batch.get("image_rows"))
        return output, partial(masked_token_loss, loss_mask=batch["loss_mask"])

    def logits_step(self, data_iterator: Any, model, score: Callable[[torch.Tensor, dict], tuple]):
        """Evaluation ``forward_step_func``: logits ``[1, t, vocab / tp]`` on the
        last stage, scored by ``score(logits, batch)`` -> (loss sum, tokens,
        report); ``batch`` is this CP rank's share."""
        batch = self._local(next(data_iterator))
        tokens, pos, _, packed = thd_inputs(batch, self.dims.cp)
        logits = model(tokens, pos, packed, images=self._images(batch), labels=None,
                       image_rows=batch.get("image_rows"))
        return logits, partial(score, batch=batch)
