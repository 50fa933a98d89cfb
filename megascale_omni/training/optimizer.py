"""megatron DDP wrapping, optimizer and LR schedule."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, ParamKey, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from megascale_omni.config import ParallelConfig, TrainConfig
from megascale_omni.metrics.breakdown import timed

logger = logging.getLogger(__name__)


def overlaps_grad_reduce(parallel: ParallelConfig, cuda: bool, dp: int) -> bool:
    """``parallel.overlap_grad_reduce`` resolved: as set, else on with CUDA and
    DP > 1, or when ``parallel.overlap_param_gather`` is set true (megatron
    buckets parameters only when it reduces gradients during backward)."""
    if parallel.overlap_grad_reduce is not None:
        return parallel.overlap_grad_reduce
    return (cuda and dp > 1) or bool(parallel.overlap_param_gather)


def overlaps_param_gather(parallel: ParallelConfig, cuda: bool, dp: int) -> bool:
    """``parallel.overlap_param_gather`` resolved: as set, else on with CUDA,
    the distributed optimizer and DP > 1 (unless ``overlap_grad_reduce`` is
    set false)."""
    if parallel.overlap_param_gather is not None:
        return parallel.overlap_param_gather
    return cuda and parallel.use_distributed_optimizer and dp > 1 and parallel.overlap_grad_reduce is not False


def wrap_ddp(
    chunks: Sequence[MegatronModule], config: TransformerConfig, parallel: ParallelConfig, overlap: bool = False,
    overlap_gather: bool = False,
) -> list[DistributedDataParallel]:
    """Wrap each model chunk in megatron DDP (every rank).

    Gradients accumulate in fp32 buffers. Without ``overlap`` the reduce
    runs once per step in ``finalize_model_grads`` (on gloo the overlap buys
    little and the synchronous path is easiest to reason about). With it,
    each bucket (``parallel.ddp_bucket_size`` elements, first chunk only) is
    reduced as soon as backward fills it, and megatron's schedules hold the
    reduction back for all but the last micro-batch
    (``config.no_sync_func`` / ``grad_sync_func``, set here);
    ``finalize_model_grads`` then only waits for the buckets in flight.

    ``overlap_gather`` (distributed optimizer only): ``optimizer.step()``
    leaves the all-gather of the updated parameters to megatron's forward
    pre-hooks, which start it bucket by bucket in the next forward;
    :class:`~megascale_omni.training.param_gather.ParamGather` completes it
    for every other reader of the weights.
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap_gather,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        check_for_nan_in_grad=True,
        bucket_size=parallel.ddp_bucket_size,
    )
    if not overlap and (parallel.ddp_bucket_size is not None or overlap_gather):
        logger.info("without overlap_grad_reduce megatron keeps one bucket per gradient buffer: %s",
                    "parallel.ddp_bucket_size has no effect" if not overlap_gather
                    else "each chunk's whole parameter gather is awaited by its first forward module")
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=chunk,
                # Later chunks' buckets are reduced first when overlapping;
                # kept for parity with megatron's training loop.
                disable_bucketing=i > 0,
            )
        )
    logger.info("DDP buckets per model chunk: %s", [bucket_count(chunk) for chunk in wrapped])
    config.finalize_model_grads_func = timed("grad_sync", finalize_model_grads)
    if overlap:
        no_sync = [chunk.no_sync for chunk in wrapped]
        start = [chunk.start_grad_sync for chunk in wrapped]
        config.no_sync_func = no_sync[0] if len(wrapped) == 1 else no_sync
        config.grad_sync_func = start[0] if len(wrapped) == 1 else start
    return wrapped


def bucket_count(chunk: DistributedDataParallel) -> int:
    """Buckets (units of gradient reduction and parameter gather) of one DDP chunk."""
    return sum(len(group.buckets) for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups)


def optimizer_state_bytes(optimizer: MegatronOptimizer, chunks: Sequence[torch.nn.Module]) -> int:
    """Bytes of optimizer state this rank holds (any rank, no collectives):
    every tensor of the inner torch optimizer's state (Adam moments, step
    counters) plus the main parameters that are not views of the model's own
    parameter storage (fp32 copies of bf16 weights). With the distributed
    optimizer that is this rank's shard only. 0 before the first step (torch
    creates Adam state lazily)."""
    weights = {p.untyped_storage().data_ptr() for chunk in chunks for p in chunk.parameters()}
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in weights:
                    total += p.numel() * p.element_size()
                for value in inner.state.get(p, {}).values():
                    if torch.is_tensor(value):
                        total += value.numel() * value.element_size()
    return total


def build_optimizer(
    chunks: Sequence[DistributedDataParallel], train: TrainConfig, parallel: ParallelConfig, dtype: torch.dtype,
    lr_mult: Optional[dict[str, float]] = None,
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """megatron Adam(W) plus warm-up + decay schedule, stepped once per optimizer step.

    ``lr_mult`` maps a parameter-name pattern (fnmatch, e.g. ``*vision_model.*``)
    to a factor on ``train.lr`` and ``train.min_lr`` for the matching
    parameters; warm-up and decay keep the same shape. Factors of 1 are ignored."""
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        # Read by megatron for MXFP8 parameter buffers only; kept equal to the
        # DDP setting, which decides whether step() gathers (as Megatron-LM does).
        overlap_param_gather=chunks[0].ddp_config.overlap_param_gather,
    )
    overrides = {ParamKey(name=pattern): {"max_lr": train.lr * mult, "min_lr": train.min_lr * mult}
                 for pattern, mult in (lr_mult or {}).items() if mult != 1.0}
    optimizer = get_megatron_optimizer(opt_config, list(chunks), config_overrides=overrides or None)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if train.lr_warmup_steps else train.lr,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=train.lr_warmup_steps,
        lr_decay_steps=max(train.steps, train.lr_warmup_steps + 1),
        lr_decay_style=train.lr_decay_style,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=max(train.steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler
