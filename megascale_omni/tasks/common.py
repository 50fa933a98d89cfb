"""Data-health helpers shared by the task families (bad-sample policy)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megascale_omni.data.errors import DataQualityError
from megascale_omni.data.llava_data import SkipCounter
from megascale_omni.parallel import ParallelDims


def check_bad_fraction(bad: int, seen: int, limit: float, where: str) -> None:
    """Raise DataQualityError when ``bad / seen`` exceeds ``limit`` (data.max_bad_sample_fraction)."""
    if seen and bad / seen > limit:
        raise DataQualityError(
            f"{bad} of {seen} samples were bad while {where} ({bad / seen:.1%} > "
            f"data.max_bad_sample_fraction={limit:.1%}); fix or rebuild the shards "
            f"(see the warnings above for which samples) or raise the limit"
        )


def reduce_skip_counts(counter: SkipCounter, dims: ParallelDims) -> tuple[int, int]:
    """``(skipped, seen)`` samples over the whole job (every rank; a collective).

    Every TP/PP/CP rank of a replica reads the same samples, so each sample
    is counted once per replica member and divided back out here.
    """
    counts = torch.tensor([counter.skipped, counter.seen + counter.skipped], dtype=torch.float64)
    dist.all_reduce(counts)
    per_sample = dims.tp * dims.pp * dims.cp
    return int(counts[0]) // per_sample, int(counts[1]) // per_sample
