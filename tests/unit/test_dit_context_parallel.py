"""DiT context parallelism without processes: which image tokens a CP rank
holds, and the pipeline cost model of one CP rank. (Training under CP is
compared with one process in tests/dist/test_dit_layouts.py; bucket checks
are in tests/unit/test_family_registry.py.)"""

from __future__ import annotations

import pytest
import torch

from megascale_omni.config import load_job_config
from megascale_omni.models.dit.context import image_token_index
from megascale_omni.parallel.pipeline_cost_dit import (
    CONDITION,
    DIT_BLOCK,
    DIT_OUTPUT,
    PATCH_EMBEDDING,
    TEXT_EMBEDDING,
    dit_cost_model,
    dit_package,
)

DIT = "examples/dit/tiny_cpu.yaml"


def test_image_tokens_are_split_load_balanced_and_cover_the_image_once():
    # 16 tokens, CP 2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert image_token_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert image_token_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([image_token_index(48, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(48))
    with pytest.raises(ValueError, match="not a multiple of 2 \\* cp = 4"):
        image_token_index(18, 2, 0)


def test_cost_model_counts_one_cp_rank():
    """Per image token work (patch embedding, linears, MLP, self-attention
    queries, output) halves at CP 2; the caption, its cross-attention keys and
    values, the condition and the modulation linears do not."""
    one = dit_cost_model(load_job_config(["--config", DIT]))
    two = dit_cost_model(load_job_config(["--config", DIT, "parallel.cp=2"]))
    cfg = load_job_config(["--config", DIT])
    h, text = cfg.model.hidden_size, cfg.dit.max_text_length
    _, _, images = dit_package(cfg)
    c1, c2 = one.components, two.components
    for name in (PATCH_EMBEDDING, DIT_BLOCK, DIT_OUTPUT, TEXT_EMBEDDING, CONDITION):
        assert c2[name].params == c1[name].params
    assert c2[PATCH_EMBEDDING].flops == pytest.approx(c1[PATCH_EMBEDDING].flops / 2, rel=1e-12)
    assert c2[PATCH_EMBEDDING].activation_bytes == pytest.approx(c1[PATCH_EMBEDDING].activation_bytes / 2)
    for name in (TEXT_EMBEDDING, CONDITION):
        assert (c2[name].flops, c2[name].activation_bytes) == (c1[name].flops, c1[name].activation_bytes)
    # Forward + 2 backward passes: the caption's K/V linear (h -> 2h) and the adaLN linear (h -> 9h).
    whole = 3 * 2.0 * (images * text * h * 2 * h + images * h * 9 * h)
    assert c2[DIT_BLOCK].flops == pytest.approx((c1[DIT_BLOCK].flops - whole) / 2 + whole, rel=1e-12)
    ada = 3 * 2.0 * images * h * 2 * h
    assert c2[DIT_OUTPUT].flops == pytest.approx((c1[DIT_OUTPUT].flops - ada) / 2 + ada, rel=1e-12)
    assert c1[DIT_BLOCK].activation_bytes / 2 < c2[DIT_BLOCK].activation_bytes < c1[DIT_BLOCK].activation_bytes
