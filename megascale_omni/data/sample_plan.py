"""Deterministic, step-indexed sample plans.

Under elastic data parallelism the set of ranks changes between steps, so
"which data does step ``t`` consume" must not depend on any iterator, worker
or rank state. The plans here are pure functions of
``(configuration, seed, step)``: a trainer that resumes at committed step
``t`` - with any number of data-parallel participants - asks for
``global_batch(t)`` and gets exactly the items the failed run would have
consumed. The only thing a checkpoint has to store is the committed step.

Composition for LLaVA-style packed training (:class:`PackedEpochPlan`):

1. epoch ``e``'s sample order is ``epoch_permutation(num_samples, seed, e)``;
2. that order is packed with :func:`~megascale_omni.data.packing.pack_samples`
   (windowed, so packs follow the shuffled order);
3. global batch ``k`` of epoch ``e`` is the ``k``-th consecutive slice of
   ``global_batch_size`` packs; a trailing partial slice is dropped when
   ``drop_last`` (those samples are simply not seen this epoch - next epoch's
   permutation places them elsewhere).

Because the number of packs varies slightly from epoch to epoch, step ->
epoch lookup walks per-epoch step counts, which are memoised; the expensive
pack lists themselves live in a small LRU cache.

The split of a global batch among participants is a separate concern - see
:mod:`megascale_omni.data.balance`.
"""

from __future__ import annotations

import bisect
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from megascale_omni.data.packing import DEFAULT_PACKING_WINDOW, OverlongPolicy, Pack, pack_samples

logger = logging.getLogger(__name__)

# Mixed into every plan seed so that the same user seed drives independent
# streams here and elsewhere (e.g. weight init), instead of correlated ones.
_PLAN_STREAM_TAG = 0x5EED_91A4


@functools.lru_cache(maxsize=8)
def epoch_permutation(num_items: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits items ``0..num_items-1``.

    Seeded with ``SeedSequence([tag, seed, epoch])`` into a ``PCG64``
    generator, so the result is bit-identical across processes, hosts and
    Python versions (no ``hash()``, no global RNG). Cached because the same
    epoch is requested once per step; the returned array is read-only so the
    cached copy cannot be corrupted by a caller.

    Returns:
        int64 array ``[num_items]``, a permutation of ``arange(num_items)``.
    """
    if num_items < 0 or seed < 0 or epoch < 0:
        raise ValueError(
            f"num_items, seed and epoch must be non-negative, got {num_items}, {seed}, {epoch}"
        )
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([_PLAN_STREAM_TAG, seed, epoch])))
    perm = rng.permutation(num_items).astype(np.int64, copy=False)
    perm.setflags(write=False)
    return perm


@dataclass(frozen=True)
class SamplePlan:
    """Global-batch schedule over ``num_items`` items, indexed by global step.

    Attributes:
        num_items: size of the item space (samples, or pre-built packs).
        global_batch_size: items per optimizer step, independent of the
            data-parallel size (that is what keeps elastic runs exact).
        seed: non-negative plan seed.
        drop_last: drop the trailing ``num_items % global_batch_size`` items
            of each epoch (default); otherwise the last batch of an epoch is
            short.
    """

    num_items: int
    global_batch_size: int
    seed: int
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {self.global_batch_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{self.num_items} items cannot fill one global batch of {self.global_batch_size}"
                f" (drop_last={self.drop_last})"
            )

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_items // self.global_batch_size
        return -(-self.num_items // self.global_batch_size)

    def locate(self, step: int) -> tuple[int, int]:
        """``(epoch, step_in_epoch)`` for a global committed step counter."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return divmod(step, self.steps_per_epoch)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Read-only int64 permutation of item indices for ``epoch``."""
        return epoch_permutation(self.num_items, self.seed, epoch)

    def global_batch(self, step: int) -> list[int]:
        """Item indices consumed by global step ``step`` (depends only on seed and step)."""
        epoch, k = self.locate(step)
        start = k * self.global_batch_size
        return self.epoch_order(epoch)[start : start + self.global_batch_size].tolist()


class PackedEpochPlan:
    """Step-indexed schedule of packed sequences, repacked every epoch.

    Each epoch permutes the *samples* with :func:`epoch_permutation`, packs
    the permuted stream, and serves consecutive slices of
    ``global_batch_size`` packs. ``global_batch(step)`` is a pure function of
    the constructor arguments and ``step``.

    Cost model: packing one epoch of ~560k samples takes ~1.5 s of Python
    CPU; the most recent ``cache_epochs`` pack lists are kept. The first
    lookup of a step in epoch ``E`` packs epochs ``0..E`` once to learn their
    step counts (only the counts are retained).

    Not thread-safe: build one instance per process / loader worker.

    Args:
        lengths: token length per sample (index = sample id), including
            expanded image placeholder tokens.
        seq_length: row capacity in tokens.
        global_batch_size: packs per optimizer step.
        seed: non-negative plan seed.
        costs: per-sample cost (token-equivalents) carried into ``Pack.cost``
            for cost-balanced DP splitting; defaults to ``lengths``.
        window: packing look-ahead window, see :func:`pack_samples`.
        overlong: overlong-sample policy, see :func:`pack_samples`.
        drop_last: drop a trailing partial global batch in each epoch.
        cache_epochs: how many epochs' pack lists to keep.
        order: ``(epoch, first steps of epochs 0..epoch) -> item ids`` fed
            to the packer (e.g. a :class:`~megascale_omni.data.blend.BlendedOrder`,
            whose weights may change by step); default: a
            permutation of every item per epoch (:func:`epoch_permutation`).
        vision: vision-tower tokens per sample; with ``max_vision`` > 0 no
            packed row holds more (see :func:`pack_samples`).
        max_vision: vision tokens a row may hold; 0: unbounded.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        seq_length: int,
        global_batch_size: int,
        seed: int,
        *,
        costs: Optional[Sequence[float] | np.ndarray] = None,
        window: Optional[int] = DEFAULT_PACKING_WINDOW,
        overlong: OverlongPolicy = "error",
        drop_last: bool = True,
        cache_epochs: int = 2,
        order: Optional[Callable[[int], np.ndarray]] = None,
        vision: Optional[Sequence[int] | np.ndarray] = None,
        max_vision: int = 0,
    ) -> None:
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self._costs = (
            self._lengths.astype(np.float64)
            if costs is None
            else np.asarray(costs, dtype=np.float64)
        )
        if self._costs.shape != self._lengths.shape:
            raise ValueError(f"costs {self._costs.shape} must match lengths {self._lengths.shape}")
        self._vision = np.zeros_like(self._lengths) if vision is None else np.asarray(vision, dtype=np.int64)
        if self._vision.shape != self._lengths.shape:
            raise ValueError(f"vision {self._vision.shape} must match lengths {self._lengths.shape}")
        self.max_vision = max_vision
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.window = window
        self.overlong: OverlongPolicy = overlong
        self.drop_last = drop_last
        self._order = order
        # Per-instance LRU: a module-level cache would key on the (large,
        # unhashable) length array.
        self._packs_lru = functools.lru_cache(maxsize=max(cache_epochs, 1))(self._pack_epoch)
        # _epoch_start[e] = global step at which epoch e starts; grows lazily.
        self._epoch_start: list[int] = [0]
        # Pack epoch 0 eagerly so configuration errors (overlong samples, a
        # dataset too small for one global batch) surface at construction.
        self.steps_in_epoch(0)

    def __getstate__(self) -> dict:
        # The bound LRU wrapper does not pickle (data loader workers get a
        # copy of the plan): send its size, rebuild it empty on arrival.
        state = self.__dict__.copy()
        state["_packs_lru"] = state["_packs_lru"].cache_parameters()["maxsize"]
        return state

    def __setstate__(self, state: dict) -> None:
        maxsize = state.pop("_packs_lru")
        self.__dict__.update(state)
        self._packs_lru = functools.lru_cache(maxsize=maxsize)(self._pack_epoch)

    @property
    def num_samples(self) -> int:
        return int(self._lengths.shape[0])

    def epoch_sample_order(self, epoch: int) -> np.ndarray:
        """Read-only sample ids fed to the packer in ``epoch`` (a permutation of
        all of them unless an ``order`` was given)."""
        if self._order is not None:
            if epoch:
                self.steps_in_epoch(epoch - 1)  # the first steps of epochs 0..epoch, for a scheduled blend
            return self._order(epoch, tuple(self._epoch_start[:epoch + 1]))
        return epoch_permutation(self.num_samples, self.seed, epoch)

    def _pack_epoch(self, epoch: int) -> tuple[Pack, ...]:
        order = self.epoch_sample_order(epoch)
        packs = pack_samples(
            self._lengths[order],
            self.seq_length,
            sample_ids=order,
            costs=self._costs[order],
            overlong=self.overlong,
            window=self.window,
            vision=self._vision[order],
            max_vision=self.max_vision,
        )
        logger.debug("packed epoch %d: %d samples -> %d packs", epoch, order.size, len(packs))
        return tuple(packs)

    def epoch_packs(self, epoch: int) -> tuple[Pack, ...]:
        """All packs of ``epoch`` in serving order (LRU-cached)."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        return self._packs_lru(epoch)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps served from ``epoch``'s packs."""
        while len(self._epoch_start) <= epoch + 1:
            e = len(self._epoch_start) - 1
            num_packs = len(self.epoch_packs(e))
            steps = (
                num_packs // self.global_batch_size
                if self.drop_last
                else -(-num_packs // self.global_batch_size)
            )
            if steps == 0:
                raise ValueError(
                    f"epoch {e} yields {num_packs} packs, fewer than one global batch of "
                    f"{self.global_batch_size} (seq_length={self.seq_length})"
                )
            self._epoch_start.append(self._epoch_start[-1] + steps)
        return self._epoch_start[epoch + 1] - self._epoch_start[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """``(epoch, step_in_epoch)`` for a global committed step counter."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        while self._epoch_start[-1] <= step:
            self.steps_in_epoch(len(self._epoch_start) - 1)
        epoch = bisect.bisect_right(self._epoch_start, step) - 1
        return epoch, step - self._epoch_start[epoch]

    def global_batch(self, step: int) -> list[Pack]:
        """Packs consumed by global step ``step``, in a rank-independent order."""
        epoch, k = self.locate(step)
        start = k * self.global_batch_size
        return list(self.epoch_packs(epoch)[start : start + self.global_batch_size])
