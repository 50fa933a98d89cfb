"""Model chunks in ``params_dtype``: the cast megatron's ``Float16Module`` does,
without its wrapper.

megatron builds most weights in ``TransformerConfig.params_dtype``, but not
all: ``LanguageModelEmbedding.position_embeddings`` (learned positions),
``CLIPViTModel.conv1`` and ``WrappedTorchNorm`` (a plain ``torch.nn``
LayerNorm/RMSNorm) are created in torch's default dtype, fp32. A bf16 run
then multiplies bf16 activations with fp32 weights ("expected m1 and m2 to
have the same dtype"). Megatron-LM fixes this by wrapping every chunk in
``Float16Module``, which calls ``module.bfloat16()``. We cast in place
instead of wrapping: the wrapper would add a ``module.`` level to every
parameter name (checkpoint keys, ``vision.lr_mult`` patterns, EMA names),
and its input cast is not needed because every task hands the model its
floating inputs (images, noised latents, targets) in the task's dtype
already. fp32 master weights and fp32 gradient buffers are megatron's
DDP + mixed-precision optimizer's job (training/optimizer.py).
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


def cast_chunks(chunks: Sequence[torch.nn.Module], device: torch.device, dtype: torch.dtype) -> None:
    """Move every chunk to ``device`` and cast its floating-point parameters
    and buffers to ``dtype`` in place (every rank, after the layout-invariant
    init and pretrained load, before the DDP wrap, which sizes its gradient
    buffers from the parameters as they are then). Integer and bool tensors
    keep their dtype (``nn.Module.to`` semantics)."""
    cast = 0
    for chunk in chunks:
        cast += sum(1 for p in chunk.parameters() if p.is_floating_point() and p.dtype != dtype)
        chunk.to(device=device, dtype=dtype)
    if cast:
        logger.info("cast %d parameter tensors built outside params_dtype to %s", cast, dtype)
