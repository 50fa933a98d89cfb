"""A DiT job's input paths checked before any process group (the family's
``validate``, on every rank and in omni-run before any worker starts)."""

from __future__ import annotations

from typing import Callable, Optional

from megascale_omni.config import JobConfig
from megascale_omni.data.dataset_root import check_paths

HOW_TO_MAKE = "tools/make_dit_latents.py"


def check_inputs(cfg: JobConfig, default_vocab: Optional[Callable[[JobConfig], int]] = None) -> None:
    """ConfigError for a ``data.path`` without a ``train/`` split or a
    ``data.tokenizer`` that does not exist (stat calls only). The caption
    vocabulary follows the tokenizer, so ``default_vocab`` is unused."""
    check_paths(cfg, default_available=True, how_to_make=HOW_TO_MAKE)
