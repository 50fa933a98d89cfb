"""Ring-attention block kernels (megascale_omni.models.ring_attention).

The fused CPU kernel and the matmul/softmax fallback compute the same block
output, log-sum-exp and gradients (given a merged output and log-sum-exp),
fp32 within 1e-5, causal and not, with grouped-query heads; and every device
picks a fused kernel except ones torch has none for."""

from __future__ import annotations

import pytest
import torch

from megascale_omni.models import ring_attention
from megascale_omni.models.ring_attention import block_backward, block_forward

TOL = 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_fused_cpu_block_matches_dense_block(causal, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 24, 8, generator=g)
    k, v = (torch.randn(1, 2, 24, 8, generator=g) for _ in range(2))
    dout = torch.randn(1, 4, 24, 8, generator=g)
    fused = block_forward(q, k, v, causal, 0.3)
    # Gradients given a merged (out, lse): here the block's own.
    fused_grads = block_backward(dout, q, k, v, fused[0], fused[1], causal, 0.3)
    monkeypatch.setattr(ring_attention, "_kernel", lambda q: "dense")
    dense = block_forward(q, k, v, causal, 0.3)
    dense_grads = block_backward(dout, q, k, v, dense[0], dense[1], causal, 0.3)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*fused, *fused_grads), (*dense, *dense_grads)):
        assert a.shape == b.shape, label
        assert float((a - b).abs().max()) <= TOL, (label, float((a - b).abs().max()))


def test_kernel_choice():
    cpu = torch.zeros(1, 1, 4, 8)
    assert ring_attention._kernel(cpu) == "cpu"
    assert ring_attention._kernel(torch.zeros(1, 1, 4, 8, device="meta")) == "dense"
