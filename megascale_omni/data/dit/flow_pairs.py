"""Rectified-flow (flow-matching) training pairs, made at collation.

Convention: time ``t`` runs from 0 (data) to 1 (noise) on the straight path

    x_t = (1 - t) * x_0 + t * eps,        eps ~ N(0, I)

and the model is trained to predict the constant velocity along it,
``v = dx_t/dt = eps - x_0``, with a mean-squared error. The pair
``(x_t, v)`` is a function of the sample and its seeded noise and time, so
it is built with the batch (:mod:`megascale_omni.data.dit.batches`) and is
the same under every layout; the sampler that integrates the learned
velocity back to data is :mod:`megascale_omni.models.dit.flow`.

Timestep sampler (``dit.timestep_sampling``):

* ``logit_normal`` (default): ``t = sigmoid(n)``, ``n ~ N(logit_mean,
  logit_std^2)``. Puts most samples at intermediate noise levels, where the
  velocity is hardest to predict; the ends (pure data, pure noise) are
  nearly trivial. This is the sampler Esser et al. (2024) found best for
  rectified-flow image models.
* ``uniform``: ``t ~ U(0, 1)``.
"""

from __future__ import annotations

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
