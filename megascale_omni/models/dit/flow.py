"""The Euler ODE sampler of a rectified-flow DiT, with classifier-free guidance.

The model predicts the velocity ``v = dx_t/dt`` on the straight path from
data (``t = 0``) to noise (``t = 1``); the training pairs and the timestep
sampler are :mod:`megascale_omni.data.dit.flow_pairs`. Sampling integrates
``dx/dt = v(x, t)`` from ``t = 1`` (noise) to ``t = 0`` with ``steps``
uniform Euler steps. Classifier-free guidance mixes the conditional and
unconditional (empty-caption) velocities:
``v = v_uncond + w * (v_cond - v_uncond)``.
"""

from __future__ import annotations

from typing import Callable

import torch


def guided(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance."""
    return v_uncond + scale * (v_cond - v_uncond)


def euler_sample(
    velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor, steps: int
) -> torch.Tensor:
    """Integrate from ``t=1`` to ``t=0``: ``velocity(x [B, ...], t [B]) -> v``; returns ``x_0``."""
    times = torch.linspace(1.0, 0.0, steps + 1)
    x = noise
    for i in range(steps):
        t = torch.full((x.shape[0],), float(times[i]))
        x = x + (times[i + 1] - times[i]) * velocity(x, t)
    return x
