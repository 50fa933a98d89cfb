"""Exponential moving average of the weights, for sampling.

Each rank averages its *own* parameter shards (TP/PP slices), so EMA needs
no communication and its state has exactly the model's layout.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch


class EMA:
    """``shadow <- d * shadow + (1 - d) * param`` after every optimizer step,
    with the usual warm-up ``d = min(decay, (1 + n) / (10 + n))`` so early
    averages are not dominated by the random initialisation (every rank)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], decay: float):
        self.decay = decay
        self.named = [(f"{i}.{name}", p) for i, c in enumerate(chunks) for name, p in c.named_parameters()]
        self.shadow = {name: p.detach().clone() for name, p in self.named}
        self.num_updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.num_updates += 1
        d = min(self.decay, (1.0 + self.num_updates) / (10.0 + self.num_updates))
        for name, p in self.named:
            self.shadow[name].lerp_(p.detach(), 1.0 - d)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Temporarily load the averaged weights into the model."""
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

    def state_dict(self) -> dict:
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.shadow) - set(state["shadow"])
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...; was it saved with another layout?")
        self.num_updates = int(state["num_updates"])
        for name, t in state["shadow"].items():
            self.shadow[name].copy_(t)
