"""Blending several training datasets by weight, inside the step-indexed plan.

``data.blend: [{path: A, weight: 0.7}, {path: B, weight: 0.3}]`` trains on the
``train`` splits of A and B (a text-only dataset is just another source, so
"a text-only share" is its weight). Two pieces:

- :class:`ConcatReader` presents the sources' readers as one item space:
  global index = source offset + local index, so every sample has one id
  (the elastic ledger's exactly-once check keeps working unchanged).
- :class:`BlendedOrder` is the plan's per-epoch sample order
  (:class:`~megascale_omni.data.sample_plan.PackedEpochPlan` ``order=``). A
  blended epoch has ``epoch_size`` samples (default: all usable samples),
  ``count_d`` of them from source ``d`` (largest-remainder rounding of
  ``epoch_size * w_d / sum(w)``, so per epoch the mix is exact to one
  sample). Source ``d`` is consumed as an endless stream of its own
  permutations (pass ``k`` is seeded by ``(seed, d, k)``): epoch ``e`` takes
  stream positions ``[e * count_d, (e + 1) * count_d)``, so a small source is
  repeated (upsampled) and a large one is seen partly per epoch, never with
  a sample twice before every sample of its pass was seen once. The
  sources' items are interleaved evenly (item ``i`` of source ``d`` at key
  ``(i + 0.5) / count_d``), so every window of the order, hence every global
  batch, carries the mix, not only the epoch.

Everything is a pure function of (item sources, weights, seed, epoch): the
global batch of a step stays a function of (seed, step) whatever the number
of data-parallel participants.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from megascale_omni.data.sample import Sample
from megascale_omni.data.shards import ShardedSampleReader

# Mixed into every blend seed (independent of the plan's and init's streams).
_BLEND_STREAM_TAG = 0xB1E_4D5


def split_counts(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder
    (sums to ``total``; ties go to the earlier source)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:short]:
        counts[i] += 1
    return [int(c) for c in counts]


class BlendedOrder:
    """Per-epoch sample order over items of several sources mixed by weight.

    Args:
        source_of_item: ``[num_items]`` int, the source of each plan item.
        weights: one positive weight per source (any scale).
        seed: non-negative seed.
        epoch_size: items per blended epoch (default: ``num_items``).
    """

    def __init__(self, source_of_item: Sequence[int] | np.ndarray, weights: Sequence[float], seed: int,
                 epoch_size: Optional[int] = None):
        sources = np.asarray(source_of_item, dtype=np.int64)
        if len(weights) == 0 or any(not w > 0 for w in weights):
            raise ValueError(f"weights must be positive, got {list(weights)}")
        self.pools = [np.flatnonzero(sources == d) for d in range(len(weights))]
        empty = [d for d, pool in enumerate(self.pools) if pool.size == 0]
        if empty:
            raise ValueError(f"blend source(s) {empty} have no usable samples")
        self.seed = seed
        self.epoch_size = int(sources.size if epoch_size is None else epoch_size)
        self.counts = split_counts(self.epoch_size, weights)
        keys, items = [], []
        for d, count in enumerate(self.counts):
            keys.append((np.arange(count) + 0.5) / max(count, 1))
            items.append(np.full(count, d))
        # Stable merge by (key, source): the interleaving pattern, the same every epoch.
        key = np.concatenate(keys)
        source = np.concatenate(items)
        self._pattern = source[np.lexsort((source, key))]

    def _pass(self, source: int, k: int) -> np.ndarray:
        return _source_pass(self.pools[source].size, self.seed, source, k)

    def _take(self, source: int, start: int, count: int) -> np.ndarray:
        """Stream positions ``[start, start + count)`` of ``source`` as item ids."""
        n = self.pools[source].size
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            k, offset = divmod(start + done, n)
            take = min(count - done, n - offset)
            out[done:done + take] = self.pools[source][self._pass(source, k)[offset:offset + take]]
            done += take
        return out

    def __call__(self, epoch: int) -> np.ndarray:
        """Item ids of ``epoch`` in order (``[epoch_size]``, read-only)."""
        order = np.empty(self.epoch_size, dtype=np.int64)
        for d, count in enumerate(self.counts):
            order[self._pattern == d] = self._take(d, epoch * count, count)
        order.setflags(write=False)
        return order


@functools.lru_cache(maxsize=16)
def _source_pass(n: int, seed: int, source: int, k: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([_BLEND_STREAM_TAG, seed, source, k])))
    perm = rng.permutation(n)
    perm.setflags(write=False)
    return perm


class ConcatReader:
    """Several :class:`ShardedSampleReader` as one: index ``offset[d] + i`` is
    sample ``i`` of source ``d`` (``reader[idx]``, ``read_metadata(idx)``)."""

    def __init__(self, readers: Sequence[ShardedSampleReader]):
        self.readers = list(readers)
        self.offsets = np.cumsum([0] + [len(r) for r in self.readers])
        #: For messages: the sources' directories.
        self.root = Path(" + ".join(str(r.root) for r in self.readers))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, idx: int) -> tuple[int, int]:
        """``(source, local index)`` of global index ``idx``."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        source = int(np.searchsorted(self.offsets, idx, side="right")) - 1
        return source, idx - int(self.offsets[source])

    def source_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Source number of each global index."""
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def resolve(self, idx: int) -> tuple[ShardedSampleReader, int]:
        """The source reader holding global sample ``idx`` and its local index."""
        source, local = self.locate(int(idx))
        return self.readers[source], local

    def __getitem__(self, idx: int) -> Sample:
        source, local = self.locate(int(idx))
        return self.readers[source][local]

    def read_metadata(self, idx: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
        source, local = self.locate(int(idx))
        return self.readers[source].read_metadata(local, *args, **kwargs)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
