"""Megatron parallel-state setup (tp/pp/cp/dp/vpp)."""

from megascale_omni.parallel.state import (
    ParallelDims,
    data_parallel_rank,
    destroy_parallel,
    initialize_parallel,
    is_loss_rank,
)

__all__ = ["ParallelDims", "data_parallel_rank", "destroy_parallel", "initialize_parallel", "is_loss_rank"]
