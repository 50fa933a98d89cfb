"""Where a step's time goes: timed phases inside megatron's schedule, and memory.

The training step marks its own spans (forward/backward, optimizer) on
:data:`PHASES`; what happens *inside* megatron's forward/backward is timed
as phases of the same clock, fed by the seams below:

- ``pipeline_wait``: megatron's ``P2PCommunicator._communicate`` (every
  pipeline send/receive, blocking until the peer is ready: the measured
  bubble plus transfer), wrapped once by :func:`install_pipeline_timer`;
- ``moe_dispatch``: megatron's MoE token dispatchers' ``token_dispatch`` and
  ``token_combine`` (the all-to-all, or all-gather / reduce-scatter, of
  tokens to and from their experts' EP ranks) in forward, and in backward
  from the arrival of the gradient of their output tokens to its arrival at
  their input tokens (the same collectives transposed), wrapped once by
  :func:`install_dispatch_timer`;
- ``grad_sync``: megatron's ``finalize_model_grads`` (DP all-reduce of the
  grad buffers, tied-embedding sync, token-count scaling; elastic: also the
  wait for the per-bucket cross-replica gradient sums), timed by the
  ``finalize_model_grads_func`` we install;
- ``cross_replica``: the elastic quorum wait, token-count and loss sums and
  the commit.

The step subtracts these from its forward/backward time to get pure
compute. :data:`PHASES` takes CUDA events on CUDA and host timestamps
elsewhere (:mod:`megascale_omni.metrics.clock`; the Trainer picks the
source for its device) and is resolved once per step.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from megascale_omni.metrics.clock import PhaseClock

#: The process's clock: megatron's schedules are patched at class level, so
#: their seams need one process-wide clock to feed (training thread only).
PHASES = PhaseClock()


def timed(name: str, fn: Callable) -> Callable:
    """``fn`` with every call timed as phase ``name``."""

    def wrapper(*args, **kwargs):
        with PHASES.phase(name):
            return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def install_pipeline_timer() -> None:
    """Time every pipeline p2p call as ``pipeline_wait`` (idempotent; every
    rank, after the platform patches)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    current = P2PCommunicator._communicate
    if getattr(current, "__wrapped__", None) is not None:
        return
    P2PCommunicator._communicate = timed("pipeline_wait", current)


class _BackwardMark(torch.autograd.Function):
    """Identity in forward; in backward stamps the clock: at a dispatch's
    output (``box`` is empty) the start, at its input the end of one
    ``moe_dispatch`` interval. ``box`` pairs the two marks of one call."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, box: list) -> torch.Tensor:
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.box:
            PHASES.interval("moe_dispatch", ctx.box.pop(), PHASES.stamp())
        else:
            ctx.box.append(PHASES.stamp())
        return grad, None


def _timed_exchange(fn: Callable) -> Callable:
    """A dispatcher's ``token_dispatch``/``token_combine`` timed as
    ``moe_dispatch`` in forward and, through :class:`_BackwardMark` on its
    first input and first output (the tokens), in backward."""

    def wrapper(self, tokens, *args, **kwargs):
        marked = torch.is_grad_enabled() and tokens.requires_grad
        box: list = []
        if marked:
            tokens = _BackwardMark.apply(tokens, box)  # its backward runs last: the end
        with PHASES.phase("moe_dispatch"):
            out = fn(self, tokens, *args, **kwargs)
        if marked:
            first = out[0] if isinstance(out, tuple) else out
            first = _BackwardMark.apply(first, box)  # its backward runs first: the start
            out = (first, *out[1:]) if isinstance(out, tuple) else first
        return out

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def install_dispatch_timer() -> None:
    """Time the MoE token dispatchers' exchanges as ``moe_dispatch``
    (idempotent; every rank; a dense model never calls them)."""
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    for cls in (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher):
        for name in ("token_dispatch", "token_combine"):
            current = getattr(cls, name)
            if getattr(current, "__wrapped__", None) is None:
                setattr(cls, name, _timed_exchange(current))


def analytic_bubble(pp: int, vpp: int, microbatches: int) -> float:
    """Idle share of a 1F1B (interleaved: ``vpp`` chunks) pipeline with
    ``microbatches`` per step: ``(pp - 1) / (vpp * m + pp - 1)``; 0 without PP."""
    if pp <= 1 or microbatches <= 0:
        return 0.0
    return (pp - 1) / (max(vpp, 1) * microbatches + pp - 1)


@functools.lru_cache(maxsize=1)
def _this_process():
    import psutil

    return psutil.Process()


def memory_stats(device: torch.device) -> dict[str, float]:
    """This rank's memory at the end of a step, GiB. On CUDA: allocated,
    reserved, the step's peak (the peak counter is reset for the next step)
    and fragmentation ``1 - allocated / reserved``; always: process RSS."""
    gib = float(1 << 30)
    stats = {"rss_gib": _this_process().memory_info().rss / gib}
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        stats.update(
            mem_allocated_gib=allocated / gib,
            mem_reserved_gib=reserved / gib,
            mem_peak_gib=torch.cuda.max_memory_allocated(device) / gib,
            mem_fragmentation=1.0 - allocated / reserved if reserved else 0.0,
        )
        torch.cuda.reset_peak_memory_stats(device)
    return stats
