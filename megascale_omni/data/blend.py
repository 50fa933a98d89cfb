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

A schedule (``data.blend_schedule``) changes the weights during training:
stage ``k`` gives the weights from step ``s_k`` on. A blended epoch takes
the weights in effect at its first step, so the mix changes at the first
epoch boundary at or after ``s_k`` (``data.blend_epoch_size`` sets how
often there is one); the plan hands each epoch the first steps of it and of
the epochs before (:meth:`BlendedOrder.__call__`). Each source's stream
position is the sum of its counts over the epochs before, so a source is
still never repeated before a full pass, whatever the weights did.

Everything is a pure function of (item sources, weights, schedule, seed,
epoch, epoch start steps): the global batch of a step stays a function of
(seed, step) whatever the number of data-parallel participants, and a resumed
run continues the mix where it was.
"""

from __future__ import annotations

import bisect
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
        schedule: ``(step, weights)`` stages, steps strictly increasing: from
            ``step`` on, ``weights`` (one per source, >= 0, not all 0) replace
            ``weights`` (see the module docstring). Empty: fixed weights.
    """

    def __init__(self, source_of_item: Sequence[int] | np.ndarray, weights: Sequence[float], seed: int,
                 epoch_size: Optional[int] = None, schedule: Sequence[tuple[int, Sequence[float]]] = ()):
        sources = np.asarray(source_of_item, dtype=np.int64)
        if len(weights) == 0 or any(not w > 0 for w in weights):
            raise ValueError(f"weights must be positive, got {list(weights)}")
        steps = [int(step) for step, _ in schedule]
        if any(b <= a for a, b in zip(steps, steps[1:])) or any(s < 0 for s in steps):
            raise ValueError(f"schedule steps must be non-negative and strictly increasing, got {steps}")
        rows = [list(weights)] + [list(w) for _, w in schedule]
        for row in rows[1:]:
            if len(row) != len(weights) or any(not w >= 0 for w in row) or not sum(row) > 0:
                raise ValueError(f"schedule weights {row} must be {len(weights)} values >= 0 with a positive sum")
        self.pools = [np.flatnonzero(sources == d) for d in range(len(weights))]
        empty = [d for d, pool in enumerate(self.pools) if pool.size == 0 and any(row[d] > 0 for row in rows)]
        if empty:
            raise ValueError(f"blend source(s) {empty} have no usable samples")
        self.seed = seed
        self.epoch_size = int(sources.size if epoch_size is None else epoch_size)
        self._steps = steps
        #: Items per source per epoch, one list per stage (the first: ``weights``).
        self.stage_counts = [split_counts(self.epoch_size, row) for row in rows]
        #: Items per source per epoch before the first scheduled stage.
        self.counts = self.stage_counts[0]
        self._patterns = [self._pattern_of(counts) for counts in self.stage_counts]

    @staticmethod
    def _pattern_of(counts: Sequence[int]) -> np.ndarray:
        """Source of each position of an epoch with ``counts`` items per source, evenly interleaved."""
        keys, items = [], []
        for d, count in enumerate(counts):
            keys.append((np.arange(count) + 0.5) / max(count, 1))
            items.append(np.full(count, d))
        # Stable merge by (key, source): the interleaving pattern, the same every epoch of a stage.
        key = np.concatenate(keys)
        source = np.concatenate(items)
        return source[np.lexsort((source, key))]

    @property
    def scheduled(self) -> bool:
        """Whether the weights change during training (the order needs the epochs' first steps)."""
        return bool(self._steps)

    def stage_at(self, step: int) -> int:
        """Index into :attr:`stage_counts` of the weights in effect at ``step``."""
        return bisect.bisect_right(self._steps, step)

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

    def __call__(self, epoch: int, epoch_starts: Optional[Sequence[int]] = None) -> np.ndarray:
        """Item ids of ``epoch`` in order (``[epoch_size]``, read-only).
        ``epoch_starts``: the first global step of epochs ``0..epoch`` (what
        :class:`~megascale_omni.data.sample_plan.PackedEpochPlan` passes);
        needed only with a schedule."""
        if self.scheduled and (epoch_starts is None or len(epoch_starts) <= epoch):
            raise ValueError(f"a scheduled blend needs the first steps of epochs 0..{epoch}, got {epoch_starts}")
        if self.scheduled:
            stages = np.asarray([self.stage_at(s) for s in epoch_starts[:epoch + 1]], dtype=np.int64)
            table = np.asarray(self.stage_counts, dtype=np.int64)  # [stages, sources]
            starts = table[stages[:-1]].sum(axis=0) if epoch else np.zeros(len(self.pools), dtype=np.int64)
            counts, pattern = self.stage_counts[stages[-1]], self._patterns[stages[-1]]
        else:
            counts, pattern = self.counts, self._patterns[0]
            starts = [epoch * count for count in counts]
        order = np.empty(self.epoch_size, dtype=np.int64)
        for d, count in enumerate(counts):
            if count:
                order[pattern == d] = self._take(d, int(starts[d]), count)
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
