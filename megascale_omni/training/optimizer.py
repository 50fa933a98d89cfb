"""megatron DDP wrapping, optimizer and LR schedule."""

from __future__ import annotations

from typing import Sequence

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from megascale_omni.config import ParallelConfig, TrainConfig
from megascale_omni.metrics.breakdown import timed


def wrap_ddp(
    chunks: Sequence[MegatronModule], config: TransformerConfig, parallel: ParallelConfig
) -> list[DistributedDataParallel]:
    """Wrap each model chunk in megatron DDP (every rank).

    Gradients accumulate in fp32 buffers; the reduce runs once per step in
    ``finalize_model_grads`` (no overlap: on gloo it buys nothing and the
    synchronous path is easiest to reason about).
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        check_for_nan_in_grad=True,
    )
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
    config.finalize_model_grads_func = timed("grad_sync", finalize_model_grads)
    return wrapped


def build_optimizer(
    chunks: Sequence[DistributedDataParallel], train: TrainConfig, parallel: ParallelConfig, dtype: torch.dtype
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """megatron Adam(W) plus warm-up + decay schedule, stepped once per optimizer step."""
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
    )
    optimizer = get_megatron_optimizer(opt_config, list(chunks))
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
