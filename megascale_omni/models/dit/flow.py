"""Rectified-flow (flow-matching) objective and the Euler ODE sampler.

Convention: time ``t`` runs from 0 (data) to 1 (noise) on the straight path

    x_t = (1 - t) * x_0 + t * eps,        eps ~ N(0, I)

and the model predicts the constant velocity along it,
``v = dx_t/dt = eps - x_0``, trained with a mean-squared error.

Timestep sampler (``dit.timestep_sampling``):

* ``logit_normal`` (default): ``t = sigmoid(n)``, ``n ~ N(logit_mean,
  logit_std^2)``. Puts most samples at intermediate noise levels, where the
  velocity is hardest to predict; the ends (pure data, pure noise) are
  nearly trivial. This is the sampler Esser et al. (2024) found best for
  rectified-flow image models.
* ``uniform``: ``t ~ U(0, 1)``.

Sampling integrates ``dx/dt = v(x, t)`` from ``t = 1`` (noise) to ``t = 0``
with ``steps`` uniform Euler steps. Classifier-free guidance mixes the
conditional and unconditional (empty-caption) velocities:
``v = v_uncond + w * (v_cond - v_uncond)``.
"""

from __future__ import annotations

from typing import Callable

import torch


def sample_timesteps(
    n: int, generator: torch.Generator, kind: str = "logit_normal", mean: float = 0.0, std: float = 1.0
) -> torch.Tensor:
    """``n`` training times in (0, 1) from ``generator`` (float32 ``[n]``)."""
    if kind == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(n, generator=generator))
    if kind == "uniform":
        return torch.rand(n, generator=generator)
    raise ValueError(f"unknown timestep sampler {kind!r}; use logit_normal or uniform")


def flow_pair(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, v_target)`` for data ``x0 [B, ...]``, noise like it, times ``t [B]``."""
    tt = t.reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - tt) * x0 + tt * noise, noise - x0


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
