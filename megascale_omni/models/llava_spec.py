"""The LLaVA family's model part: ViT + projector + GPT over packed THD rows
(every rank). The data module gives the vocabulary and the image token id."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch

from megascale_omni.config import ConfigError
from megascale_omni.models.attention import thd_inputs, thd_pipeline_shape
from megascale_omni.models.llava import build_llava_chunks
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.models.model_spec import ModelSpec


def video_refusal(what: str) -> str:
    """The one line that refuses video samples (``what``: where they are)."""
    return (f"{what} with <video>: the llava model does not consume video yet (issue 32: per-frame "
            "pooling and newline tokens are missing), and dropping the videos would train on text that "
            "refers to them: ingest this set without its video records")


class LlavaModelSpec(ModelSpec):
    """:class:`~megascale_omni.models.model_spec.ModelSpec` of ``model.family: llava``."""

    def pipeline_shape(self) -> tuple[int, int]:
        return thd_pipeline_shape(self.data.seq_length, self.cfg.train.micro_batch_size)

    def build_model(self):
        videos = getattr(self.data, "video_samples", 0)
        if videos:
            raise ConfigError("data.path", self.cfg.data.path, video_refusal(f"has {videos} training samples"))
        return self.watch_routers(
            build_llava_chunks(self.cfg, self.dtype, self.data.vocab_size, self.data.tokenizer.image_token_id))

    def lr_mult(self) -> dict[str, float]:
        """``vision.lr_mult`` on the ViT's parameters (the projector keeps ``train.lr``)."""
        return {"*vision_model.*": self.cfg.vision.lr_mult}

    def _images(self, batch: dict) -> Optional[torch.Tensor]:
        """The tower's input (pipeline stage 0); None without images or on a later stage."""
        images = batch.get("images")
        return images.to(self.dtype) if images is not None and images.shape[0] else None

    @staticmethod
    def _refuse_videos(batch: dict) -> None:
        """A batch with videos (an evaluation split, a caller's own batches)
        stops here rather than training on its text with the videos dropped."""
        if "videos" in batch:
            what = f"got a batch of {len(batch['video_frames'])} videos"
            raise ConfigError("model.family", "llava", video_refusal(what), rank_local=True)

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
        batch = next(data_iterator)
        self._refuse_videos(batch)
        batch = self._local(batch)
        tokens, pos, labels, packed = thd_inputs(batch, self.dims.cp)
        output = model(tokens, pos, packed, images=self._images(batch), labels=labels,
                       image_rows=batch.get("image_rows"))
        return output, partial(masked_token_loss, loss_mask=batch["loss_mask"])

    def logits_step(self, data_iterator: Any, model, score: Callable[[torch.Tensor, dict], tuple]):
        """Evaluation ``forward_step_func``: logits ``[1, t, vocab / tp]`` on the
        last stage, scored by ``score(logits, batch)`` -> (loss sum, tokens,
        report); ``batch`` is this CP rank's share."""
        batch = next(data_iterator)
        self._refuse_videos(batch)
        batch = self._local(batch)
        tokens, pos, _, packed = thd_inputs(batch, self.dims.cp)
        logits = model(tokens, pos, packed, images=self._images(batch), labels=None,
                       image_rows=batch.get("image_rows"))
        return logits, partial(score, batch=batch)
