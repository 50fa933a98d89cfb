"""DiT building blocks that need no process group: patchify, positions,
flow objective, Euler/CFG sampler, EMA, the colour measure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megascale_omni.data.dit.flow_pairs import flow_pair, sample_timesteps
from megascale_omni.demo.dit_shapes import dominant_color, generate
from megascale_omni.demo.shapes import COLORS
from megascale_omni.models.dit.ema import EMA
from megascale_omni.models.dit.embed import patchify, sincos_2d, unpatchify
from megascale_omni.models.dit.flow import euler_sample, guided


@pytest.mark.parametrize("hw", [(16, 16), (12, 20), (32, 16)])
def test_patchify_roundtrip_and_row_major_order(hw):
    x = torch.randn(3, 4, *hw)
    tokens = patchify(x, 4)
    assert tokens.shape == (hw[0] // 4 * hw[1] // 4, 3, 4 * 16)
    assert torch.equal(unpatchify(tokens, 4, *hw, 4), x)
    # token 1 is the patch at row 0, column 1
    assert torch.equal(tokens[1, 0].view(4, 4, 4), x[0, :, 0:4, 4:8])


def test_positions_are_shared_across_aspect_ratios():
    wide, square = sincos_2d(4, 8, 64), sincos_2d(4, 4, 64)
    assert wide.shape == (32, 64)
    # the left 4x4 block of the wide grid has exactly the square grid's codes
    assert torch.equal(wide.view(4, 8, 64)[:, :4].reshape(16, 64), square)
    assert torch.unique(wide, dim=0).shape[0] == 32  # every patch distinct


def test_flow_pair_and_exact_euler_on_a_straight_path():
    x0, noise = torch.randn(5, 3, 4, 4), torch.randn(5, 3, 4, 4)
    t = torch.rand(5)
    x_t, v = flow_pair(x0, noise, t)
    assert torch.allclose(x_t, x0 + t.view(-1, 1, 1, 1) * v, atol=1e-6)
    # with the true (constant) velocity, Euler recovers the data from the noise exactly
    assert torch.allclose(euler_sample(lambda x, tt: v, noise, steps=7), x0, atol=1e-5)
    assert torch.equal(guided(torch.ones(2), torch.zeros(2), 3.0), torch.full((2,), 3.0))


def test_logit_normal_timesteps_concentrate_mid_range():
    g = torch.Generator().manual_seed(0)
    t = sample_timesteps(20000, g, "logit_normal")
    assert 0 < t.min() and t.max() < 1 and abs(t.mean() - 0.5) < 0.01
    u = sample_timesteps(20000, torch.Generator().manual_seed(0), "uniform")
    assert ((t > 0.25) & (t < 0.75)).float().mean() > ((u > 0.25) & (u < 0.75)).float().mean() + 0.1


def test_ema_tracks_and_applies_temporarily():
    m = torch.nn.Linear(2, 2)
    ema = EMA([m], decay=0.5)
    start = m.weight.detach().clone()
    assert torch.equal(ema.shadow["0.weight"], start)
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update()  # the first update copies
    assert torch.equal(ema.shadow["0.weight"], start + 1)
    with torch.no_grad():
        m.weight.add_(1.0)
    ema.update()  # warm-up decay min(0.5, 3/12)
    d = 3 / 12
    assert torch.allclose(ema.shadow["0.weight"], d * (start + 1) + (1 - d) * (start + 2))
    with ema.applied():
        assert torch.allclose(m.weight, ema.shadow["0.weight"])
    assert torch.allclose(m.weight, start + 2)


def test_ema_of_bf16_weights_averages_in_fp32():
    """A bf16 shadow would round away every step (0.5% of 0.01 is under half a
    bf16 ulp at 0.05) and stay at 0.05005; the fp32 shadow follows the exact
    average within fp32 rounding."""
    m = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.fill_(0.05)
    ema = EMA([m], decay=0.995)
    # Long after the warm-up (d = decay), the weights move from 0.05 to 0.06.
    ema.load_state_dict({"num_updates": 10_000, "shadow": {"0.weight": torch.full((1, 4), 0.05)}})
    with torch.no_grad():
        m.weight.fill_(0.06)
    for _ in range(200):
        ema.update()
    target = m.weight[0, 0].item()  # 0.06 in bf16
    exact = target + (0.05 - target) * 0.995**200  # from 0.05: fp32 holds it within 1.4e-9
    shadow = ema.shadow["0.weight"]
    assert (shadow.double() - exact).abs().max().item() < 1e-6, (shadow, exact)
    assert shadow.dtype == torch.float32
    assert abs(exact - 0.05637) < 1e-5
    # Applied, the average reaches the bf16 weights rounded; the weights come back after.
    with ema.applied():
        assert m.weight.dtype == torch.bfloat16 and torch.equal(m.weight, shadow.to(torch.bfloat16))
    assert torch.equal(m.weight, torch.full_like(m.weight, 0.06))


def test_dominant_color_reads_the_generated_colour():
    for i in range(50):
        image, caption, color = generate(i, 0, 0)
        assert dominant_color(image) == color, caption
    assert dominant_color(np.zeros((8, 8, 3), np.uint8)) is None
    assert set(COLORS) >= {"red", "white"}
