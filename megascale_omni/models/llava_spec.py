"""The LLaVA family's model part: ViT + projector + GPT over packed THD rows
(every rank). The data module gives the vocabulary and the image and video
token ids; videos are laid out as :mod:`~megascale_omni.models.vision_features` says."""

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
        return self.watch_routers(build_llava_chunks(
            self.cfg, self.dtype, self.data.vocab_size, self.data.tokenizer.image_token_id,
            video_token_id=self.data.video_token_id))

    def lr_mult(self) -> dict[str, float]:
        """``vision.lr_mult`` on the ViT's parameters (the projector keeps ``train.lr``)."""
        return {"*vision_model.*": self.cfg.vision.lr_mult}

    def _images(self, batch: dict) -> Optional[torch.Tensor]:
        """The tower's input (pipeline stage 0); None without images or on a later stage."""
        images = batch.get("images")
        return images.to(self.dtype) if images is not None and images.shape[0] else None

    def _local(self, batch: dict) -> dict:
        """This CP rank's tokens (:meth:`ModelSpec.cp_local`), plus
        ``image_rows`` / ``video_rows``: which rows of the micro-batch's image
        (video) sequence (all of them: every CP rank runs the ViT on every
        image and frame) its placeholders take."""
        local = self.cp_local(batch)
        if self.dims.cp > 1:
            tokens, mine = batch["tokens"].reshape(-1), local["cp_index"]
            for key, token_id in (("image_rows", self.data.tokenizer.image_token_id),
                                  ("video_rows", self.data.video_token_id)):
                is_slot = tokens == token_id
                feature_row = torch.cumsum(is_slot, 0) - 1
                local[key] = feature_row[mine][is_slot[mine]]
        return local

    def _vision_inputs(self, batch: dict) -> dict:
        """The model's image/video keyword arguments from a (local) micro-batch."""
        videos = batch.get("videos")
        return dict(images=self._images(batch), image_rows=batch.get("image_rows"),
                    videos=None if videos is None else videos.to(self.dtype),
                    video_frames=batch.get("video_frames"), video_rows=batch.get("video_rows"))

    def forward_step(self, data_iterator: Any, model):
        batch = self._local(next(data_iterator))
        tokens, pos, labels, packed = thd_inputs(batch, self.dims.cp)
        output = model(tokens, pos, packed, labels=labels, **self._vision_inputs(batch))
        return output, partial(masked_token_loss, loss_mask=batch["loss_mask"])

    def logits_step(self, data_iterator: Any, model, score: Callable[[torch.Tensor, dict], tuple]):
        """Evaluation ``forward_step_func``: logits ``[1, t, vocab / tp]`` on the
        last stage, scored by ``score(logits, batch)`` -> (loss sum, tokens,
        report); ``batch`` is this CP rank's share."""
        batch = self._local(next(data_iterator))
        tokens, pos, _, packed = thd_inputs(batch, self.dims.cp)
        logits = model(tokens, pos, packed, labels=None, **self._vision_inputs(batch))
        return logits, partial(score, batch=batch)
