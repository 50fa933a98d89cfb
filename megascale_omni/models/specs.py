"""Which layer implementation to build: megatron local modules or transformer-engine.

Specs separate *which* implementation from *how* a block is wired. On CPU we
always use megatron's local modules; on CUDA ``auto`` picks transformer-engine
when it imports. transformer-engine is never imported on a CPU run.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megascale_omni.config.errors import ConfigError

logger = logging.getLogger(__name__)


def resolve_layer_impl(requested: str) -> str:
    """Map ``model.layer_impl`` to ``local`` or ``transformer_engine`` for this host."""
    te_available = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if requested == "auto":
        return "transformer_engine" if te_available else "local"
    if requested == "transformer_engine" and not te_available:
        raise ConfigError(
            "model.layer_impl",
            requested,
            "transformer-engine needs CUDA and `pip install megascale-omni[gpu]`; use auto or local",
        )
    return requested


def gpt_layer_spec(impl: str, normalization: str) -> ModuleSpec:
    """Transformer-layer spec for the language model (``impl`` already resolved)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization)
