"""The LLaVA training data as a pure function of the step key: the packed
plan's global batch, its cost-balanced DP share, collated into micro-batches.

:class:`LlavaSteps` is what :class:`~megascale_omni.data.loader.StepLoader`
runs, in the training process or pickled into its workers (the plan, the
readers and the batcher pickle without their open files).
"""

from __future__ import annotations

from typing import Sequence

from megascale_omni.data.balance import microbatch_shares, split_balanced_counts
from megascale_omni.data.health import SkipCounter
from megascale_omni.data.llava.batches import LlavaBatcher
from megascale_omni.data.packing import Pack
from megascale_omni.data.sample_plan import PackedEpochPlan


class LlavaSteps:
    """Micro-batches of DP rank ``dp_rank`` of ``dp_size`` at a step (called on
    TP rank 0 of pipeline stage 0, which broadcasts them to the other TP and
    PP ranks, :mod:`megascale_omni.data.broadcast`; :meth:`share` on any rank).

    Args:
        plan: the step-indexed packed plan (sample ids index ``id_map``).
        id_map: plan sample id -> reader index (the scan's usable samples).
        batcher: reads, encodes and collates; counts skipped samples in its counter.
        micro_batch_size: packed rows per micro-batch (``train.micro_batch_size``).
    """

    def __init__(self, plan: PackedEpochPlan, id_map: Sequence[int], batcher: LlavaBatcher, micro_batch_size: int):
        self.plan = plan
        self.id_map = id_map
        self.batcher = batcher
        self.micro_batch_size = micro_batch_size

    @property
    def counter(self) -> SkipCounter:
        """Where the samples read and skipped by :meth:`__call__` are counted."""
        return self.batcher.counter

    def share(self, step: int, dp_rank: int, dp_size: int) -> list[Pack]:
        """DP rank ``dp_rank``'s packed rows of global batch ``step``: whole
        micro-batches (``microbatch_shares``), cost-balanced."""
        packs = self.plan.global_batch(step)
        counts = microbatch_shares(len(packs), self.micro_batch_size, dp_size)
        parts = split_balanced_counts(list(range(len(packs))), [p.cost for p in packs], counts)
        return [packs[i] for i in parts[dp_rank]]

    def __call__(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """The micro-batches of :meth:`share`, ``micro_batch_size`` rows each
        (the dicts of :meth:`LlavaBatcher.microbatch`)."""
        mine = self.share(step, dp_rank, dp_size)
        mbs = self.micro_batch_size
        return [self.batcher.microbatch(mine[i : i + mbs], self.id_map) for i in range(0, len(mine), mbs)]
