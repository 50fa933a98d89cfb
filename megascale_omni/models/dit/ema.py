"""Exponential moving average of the weights, for sampling.

Each rank averages its *own* parameter shards (TP/PP slices), so EMA needs
no communication and its state has exactly the model's layout. In a
checkpoint the shadow is a set of megatron ShardedTensors that mirror the
model's own (same global shape, offsets and replica ids, keys prefixed with
``ema.``), so it reshards across TP/PP/DP exactly like the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Mapping, Sequence

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

#: Key prefix of the EMA weights in a checkpoint (``ema.<model key>``).
EMA_PREFIX = "ema."


def chunk_param_names(chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """``("<chunk index>.<parameter name>", parameter)`` of every parameter of ``chunks``."""
    return [(f"{i}.{name}", p) for i, c in enumerate(chunks) for name, p in c.named_parameters()]


def mirror_sharded(
    chunks: Sequence[torch.nn.Module], tensors: Mapping[str, torch.Tensor], prefix: str = EMA_PREFIX
) -> dict[str, ShardedTensor]:
    """ShardedTensors holding ``tensors`` (named as by :func:`chunk_param_names`,
    each shaped like its parameter) with the metadata of the parameter's entry
    in its chunk's ``sharded_state_dict()`` and the key ``prefix + key``.

    Used to save/load the EMA shadow and, with ``tensors`` the parameters
    themselves, to load EMA weights straight into a model (every rank). Each
    entry takes its dtype from its tensor (the shadow is fp32 whatever the
    parameters' dtype).
    Raises KeyError when a parameter has no ShardedTensor entry.
    """
    out = {}
    for i, chunk in enumerate(chunks):
        entries = chunk.sharded_state_dict()
        for name, _ in chunk.named_parameters():
            full = f"{i}.{name}"
            if full not in tensors:
                continue
            sh = entries.get(name)
            if not isinstance(sh, ShardedTensor):
                raise KeyError(f"parameter {name} has no ShardedTensor in the model's sharded_state_dict")
            data = tensors[full]
            out[full] = dataclasses.replace(sh, key=prefix + sh.key, data=data, dtype=data.dtype)
    return out


class EMA:
    """``shadow <- d * shadow + (1 - d) * param`` after every optimizer step
    (every rank, own shards).

    The shadow starts as a copy of the parameters. The first update copies
    the parameters (``d = 0``), later ones use the warm-up
    ``d = min(decay, (1 + n) / (10 + n))`` (``n`` = updates so far, this one
    included), so early averages are not dominated by the random
    initialisation.

    The shadow is fp32 whatever the parameters' dtype: with ``decay`` 0.995
    each update moves it by 0.5% of its distance to the weights. Half a bf16
    ulp is 2^-9..2^-8 of the value, so unless the weights are ~40-80% away
    the step rounds to nothing and a bf16 shadow stays at the early weights
    (200 updates from 0.05 toward 0.06: 0.05005 in bf16, 0.05637 in fp32).
    """

    def __init__(self, chunks: Sequence[torch.nn.Module], decay: float):
        self.decay = decay
        self.chunks = list(chunks)
        self.named = chunk_param_names(chunks)
        self.shadow = {name: p.detach().to(torch.float32, copy=True) for name, p in self.named}
        self.num_updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.num_updates += 1
        n = self.num_updates
        d = 0.0 if n == 1 else min(self.decay, (1.0 + n) / (10.0 + n))
        for name, p in self.named:
            self.shadow[name].lerp_(p.detach().float(), 1.0 - d)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Temporarily load the averaged weights into the model (rounded to
        the parameters' dtype)."""
        backup = [p.detach().clone() for _, p in self.named]
        with torch.no_grad():
            for name, p in self.named:
                p.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for (_, p), b in zip(self.named, backup):
                    p.copy_(b)

    def sharded_state_dict(self) -> dict:
        """Checkpoint state: the shadow as ShardedTensors (see :func:`mirror_sharded`)
        plus ``decay`` and ``num_updates`` (plain values)."""
        return {"decay": self.decay, "num_updates": self.num_updates,
                "shadow": mirror_sharded(self.chunks, self.shadow)}

    def state_dict(self) -> dict:
        """In-memory state of this rank's shadow (plain tensors, this rank's
        shards), e.g. for a joining replica's same rank."""
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": dict(self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict`, or of :meth:`sharded_state_dict` after
        loading (shadow tensors in this rank's layout). ``decay`` stays the configured one."""
        missing = set(self.shadow) - set(state["shadow"])
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...")
        self.num_updates = int(state["num_updates"])
        for name, t in state["shadow"].items():
            self.shadow[name].copy_(t)
