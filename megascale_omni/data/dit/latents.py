"""Frozen encoders for real-data DiT training: a diffusers VAE and a
transformers text encoder, both loaded from local directories.

Used offline by ``tools/make_dit_latents.py`` (images -> latents, captions ->
text states) and by ``tools/sample_dit.py`` (prompts -> text states,
latents -> images). Imports are lazy: training never needs diffusers or
transformers (``pip install -e '.[latents]'`` adds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch


def _require(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError as exc:
        raise SystemExit(
            f"error: {module} is not installed; run `pip install -e '.[latents]'` for the latent tools"
        ) from exc


@dataclass
class VaeCodec:
    """A diffusers ``AutoencoderKL`` with its latent scaling.

    ``downsample``: image pixels per latent pixel; latents are
    ``(mean - shift_factor) * scaling_factor`` of the encoder posterior.
    """

    vae: Any
    downsample: int
    scaling_factor: float
    shift_factor: float

    @classmethod
    def load(cls, path: str | Path) -> "VaeCodec":
        diffusers = _require("diffusers")
        vae = diffusers.AutoencoderKL.from_pretrained(str(path), local_files_only=True).eval()
        cfg = vae.config
        return cls(vae, 2 ** (len(cfg.block_out_channels) - 1), float(cfg.scaling_factor),
                   float(getattr(cfg, "shift_factor", None) or 0.0))

    @property
    def channels(self) -> int:
        return int(self.vae.config.latent_channels)

    @torch.no_grad()
    def encode(self, images: np.ndarray) -> np.ndarray:
        """uint8 ``[B, H, W, 3]`` -> float32 latents ``[B, C, H/f, W/f]``."""
        x = torch.from_numpy(images).float().permute(0, 3, 1, 2) / 127.5 - 1.0
        mean = self.vae.encode(x).latent_dist.mean
        return ((mean - self.shift_factor) * self.scaling_factor).numpy()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, h, w]`` -> images ``[B, 3, h*f, w*f]`` in about [-1, 1]."""
        return self.vae.decode(latents / self.scaling_factor + self.shift_factor).sample


@dataclass
class TextStates:
    """A transformers tokenizer + encoder; captions -> last hidden states."""

    tokenizer: Any
    encoder: Any
    max_length: int

    @classmethod
    def load(cls, path: str | Path, max_length: int) -> "TextStates":
        transformers = _require("transformers")
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        enc = transformers.AutoModel.from_pretrained(str(path), local_files_only=True).eval()
        # Encoder-decoder checkpoints (T5) carry a decoder we do not need.
        enc = enc.get_encoder() if hasattr(enc, "get_encoder") and enc.config.is_encoder_decoder else enc
        return cls(tok, enc, max_length)

    @property
    def dim(self) -> int:
        return int(self.encoder.config.hidden_size)

    @torch.no_grad()
    def encode(self, captions: Sequence[str]) -> list[np.ndarray]:
        """One float32 ``[L_i, D]`` array per caption (padding removed)."""
        batch = self.tokenizer(list(captions), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt")
        out = self.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        states = out.last_hidden_state.float().numpy()
        lengths = batch["attention_mask"].sum(1).tolist()
        return [states[i, : max(1, int(n))] for i, n in enumerate(lengths)]
