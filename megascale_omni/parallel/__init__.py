"""Megatron parallel-state setup (tp/pp/cp/dp/vpp) and the pipeline planner.

The parallel-state names below load :mod:`.state` (and megatron) on first
use (PEP 562), so the planner's pure modules (``pipeline_cost``,
``pipeline_plan``, ``pipeline_solver``) import without megatron: the
family's ``validate`` reads a ``parallel.pipeline_profile`` before omni-run
starts any worker.
"""

import importlib

__all__ = ["ParallelDims", "data_parallel_rank", "destroy_parallel", "initialize_parallel", "is_loss_rank"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("megascale_omni.parallel.state"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
