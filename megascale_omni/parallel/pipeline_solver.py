"""Exact min-max split of identical decoder layers over pipeline stages.

The problem. ``num_layers`` identical language-model layers (time ``c``
each) are cut into ``pp * vpp`` contiguous model chunks in megatron's layout
order: chunk ``k = v * pp + r`` is virtual stage ``v`` of pp rank ``r``.
Chunk 0 also carries a fixed ``head`` time (ViT, projector, embedding), the
last chunk a fixed ``tail`` time (output layer + loss). Every chunk holds at
least one layer. A rank's time per micro-batch is the sum of its chunks; its
memory is ``mem_fixed[r] + n_r * mem_per_layer[r]`` bytes, which must not
exceed ``capacity``.

The objective, lexicographic: first minimise the slowest *rank* (steady-state
pipeline throughput); among those splits minimise the slowest *chunk* (with
interleaving a fat chunk still stalls the ranks waiting for it).

Because layers are identical a split is only a vector of counts, and each
level is a bottleneck allocation solved exactly by binary search over the
finite set of achievable bottleneck values (:func:`min_max_allocation`).
Exactness is checked against brute-force enumeration in the unit tests.
Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

Load = Callable[[int, int], float]


def min_max_allocation(
    total: int, lower: Sequence[int], upper: Sequence[int], load: Load
) -> Optional[tuple[float, list[int]]]:
    """Split ``total`` identical items over bins ``k`` with ``lower[k] <= n[k]
    <= upper[k]`` minimising ``max_k load(k, n[k])``; ``load`` must be
    nondecreasing in ``n``. Returns (optimal bottleneck, counts) or None if no
    split satisfies the bounds.

    Binary search over the sorted candidate values ``load(k, n)``: a value
    ``U`` is achievable iff every bin fits its lower bound under ``U`` and the
    largest counts that fit under ``U`` add up to at least ``total``.
    """
    bins = range(len(lower))
    if any(lo > hi for lo, hi in zip(lower, upper)) or sum(lower) > total or sum(upper) < total:
        return None

    def most_under(k: int, bound: float) -> int:
        """Largest n in [lower, upper] with load <= bound, or lower - 1."""
        lo, hi = lower[k] - 1, upper[k]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if load(k, mid) <= bound:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def feasible(bound: float) -> bool:
        fits = [most_under(k, bound) for k in bins]
        return all(f >= lower[k] for k, f in enumerate(fits)) and sum(fits) >= total

    candidates = sorted({load(k, n) for k in bins for n in range(lower[k], upper[k] + 1)})
    lo, hi = 0, len(candidates) - 1  # candidates[hi] is feasible: every bin at its upper bound
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    best = candidates[lo]
    counts = [most_under(k, best) for k in bins]
    # Any counts under the bound are optimal; hand back the surplus from the
    # most loaded bins so the rest stays as even as possible (deterministic).
    for _ in range(sum(counts) - total):
        k = max((k for k in bins if counts[k] > lower[k]), key=lambda k: (load(k, counts[k]), k))
        counts[k] -= 1
    return best, counts


@dataclass(frozen=True)
class StageProblem:
    """Inputs of one pipeline partition problem (times in any one unit, memory in bytes)."""

    num_layers: int
    pp: int
    vpp: int
    layer_time: float
    head_time: float
    tail_time: float
    #: Per pp rank: bytes that do not depend on its layer count.
    mem_fixed: Sequence[float]
    #: Per pp rank: bytes added by each layer it holds (static + activations in flight).
    mem_per_layer: Sequence[float]
    #: Bytes per pp rank; None = unlimited.
    capacity: Optional[float] = None

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def chunk_fixed(self, chunk: int) -> float:
        t = 0.0
        if chunk == 0:
            t += self.head_time
        if chunk == self.num_chunks - 1:
            t += self.tail_time
        return t

    def rank_chunks(self, rank: int) -> list[int]:
        """Chunk indices held by ``rank``, by virtual stage."""
        return [v * self.pp + rank for v in range(self.vpp)]

    def rank_fixed(self, rank: int) -> float:
        return sum(self.chunk_fixed(k) for k in self.rank_chunks(rank))

    def rank_time(self, rank: int, layers: int) -> float:
        return self.rank_fixed(rank) + self.layer_time * layers

    def rank_memory(self, rank: int, layers: int) -> float:
        return self.mem_fixed[rank] + self.mem_per_layer[rank] * layers

    def max_layers_in_memory(self, rank: int) -> int:
        """Most layers ``rank`` can hold within ``capacity`` (capped at num_layers)."""
        if self.capacity is None:
            return self.num_layers
        room = self.capacity - self.mem_fixed[rank]
        if room < 0:
            return -1
        per = self.mem_per_layer[rank]
        return self.num_layers if per <= 0 else min(self.num_layers, int(math.floor(room / per + 1e-9)))

    def best_chunk_split(self, rank: int, layers: int) -> tuple[float, list[int]]:
        """Split ``layers`` of ``rank`` over its virtual stages minimising the slowest chunk."""
        chunks = self.rank_chunks(rank)
        result = min_max_allocation(
            layers, [1] * self.vpp, [layers] * self.vpp,
            lambda v, n: self.chunk_fixed(chunks[v]) + self.layer_time * n,
        )
        assert result is not None, "layers >= vpp is guaranteed by the caller"
        return result


def solve(problem: StageProblem) -> Optional[list[int]]:
    """Optimal layer counts per chunk (megatron layout order), or None when no
    split fits the memory capacity. See the module docstring for the objective."""
    p = problem
    lower = [p.vpp] * p.pp
    upper = [p.max_layers_in_memory(r) for r in range(p.pp)]
    first = min_max_allocation(p.num_layers, lower, upper, p.rank_time)
    if first is None:
        return None
    slowest_rank, rank_layers = first
    if p.vpp > 1:
        # Second level: keep every rank under the optimal rank time, minimise the slowest chunk.
        capped = [
            max((n for n in range(lower[r], upper[r] + 1) if p.rank_time(r, n) <= slowest_rank), default=lower[r])
            for r in range(p.pp)
        ]
        slowest_chunk: dict[tuple[int, int], float] = {}

        def chunk_bottleneck(r: int, n: int) -> float:
            if (r, n) not in slowest_chunk:
                slowest_chunk[r, n] = p.best_chunk_split(r, n)[0]
            return slowest_chunk[r, n]

        second = min_max_allocation(p.num_layers, lower, capped, chunk_bottleneck)
        assert second is not None, "the first-level solution satisfies these bounds"
        rank_layers = second[1]
    counts = [0] * p.num_chunks
    for r in range(p.pp):
        for k, n in zip(p.rank_chunks(r), p.best_chunk_split(r, rank_layers[r])[1]):
            counts[k] = n
    return counts


def min_memory(problem: StageProblem) -> Optional[tuple[float, list[int]]]:
    """Smallest achievable per-rank peak memory (bytes) and the per-rank layer
    counts that achieve it, ignoring time and capacity; None if
    ``num_layers < pp * vpp``."""
    p = problem
    return min_max_allocation(p.num_layers, [p.vpp] * p.pp, [p.num_layers] * p.pp, p.rank_memory)
