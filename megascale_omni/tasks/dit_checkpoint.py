"""A trained DiT out of a training checkpoint, for sampling.

A checkpoint (megascale_omni/checkpoint) holds the job config, the model
weights, the EMA weights (``ema.<model key>``, see models/dit/ema.py) and,
for a learned text encoder, the tokenizer. megatron's dist_checkpointing
reshards on load, so the model can be rebuilt in any TP/PP layout, e.g. one
process, whatever layout saved it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import torch
from megatron.core import dist_checkpointing

from megascale_omni.checkpoint.pretrained import ModelCheckpoint, open_model_checkpoint
from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.data.tokenizer import TextTokenizer
from megascale_omni.models.dit.ema import EMA_PREFIX, chunk_param_names, mirror_sharded
from megascale_omni.models.standalone import single_process_config


@dataclasses.dataclass
class DitCheckpoint(ModelCheckpoint):
    """A verified DiT checkpoint: where it is and what it says about itself."""

    @property
    def has_ema(self) -> bool:
        return "ema" in self.common.get("task", {})

    def single_process_config(self) -> JobConfig:
        """The job config with a one-process layout (tp1/pp1, no DP)."""
        return single_process_config(self.cfg)

    def tokenizer(self) -> Optional[TextTokenizer]:
        """The training tokenizer (learned text encoder), or None (precomputed text)."""
        if self.cfg.dit.text_encoder != "learned":
            return None
        serialized = self.common.get("task", {}).get("tokenizer")
        if serialized is None:
            raise ConfigError("checkpoint", str(self.path), "has no tokenizer in its task state; it was not saved "
                              "by pretrain_dit.py with checkpointing of this version")
        return TextTokenizer.from_str(serialized)


def open_dit_checkpoint(path: str | Path, field: str = "checkpoint", checksums: bool = True) -> DitCheckpoint:
    """Resolve ``path`` (a ``step_NNNNNNNN`` directory, or a checkpoint root:
    its newest intact checkpoint), verify it and read its config.

    Raises ConfigError (``field``) when ``path`` does not exist or the
    checkpoint is not a DiT's, CheckpointError when it is broken or
    incomplete. Needs no process group.
    """
    ckpt = open_model_checkpoint(path, field, family="dit", checksums=checksums)
    return DitCheckpoint(ckpt.info, ckpt.cfg, ckpt.common)


@torch.no_grad()
def load_dit_weights(chunks: Sequence[torch.nn.Module], ckpt: DitCheckpoint, ema: bool = True) -> None:
    """Load the EMA (``ema=True``) or the trained weights of ``ckpt`` into
    ``chunks``, resharded to this process's TP/PP layout (every rank).

    Raises ConfigError when ``ema`` is asked for and the run had no EMA.
    """
    if ema and not ckpt.has_ema:
        raise ConfigError("checkpoint", str(ckpt.path), "has no EMA weights (trained with dit.ema_decay=0); "
                          "sample the trained weights instead (tools/sample_dit.py --raw)")
    params = dict(chunk_param_names(chunks))
    template = mirror_sharded(chunks, {name: p.detach() for name, p in params.items()},
                              prefix=EMA_PREFIX if ema else "")
    loaded = dist_checkpointing.load(template, str(ckpt.path))
    for name in template:
        params[name].copy_(loaded[name])
