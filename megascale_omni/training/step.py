"""One optimizer step over a list of micro-batches, through megatron's schedules."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

#: Key under which loss functions report ``[loss_sum, num_tokens]``.
LOSS_KEY = "lm loss"


@dataclass
class StepStats:
    """What one step produced. ``loss`` is the token-mean over the global
    batch and is only set on last-pipeline-stage ranks (None elsewhere)."""

    loss: Optional[float]
    num_loss_tokens: Optional[int]
    grad_norm: Optional[float]
    lr: float
    update_successful: bool
    #: False when the elastic quorum did not commit the step (nothing changed; retry it).
    committed: bool
    #: Seconds in forward+backward (including pipeline p2p and DP grad sync).
    fwd_bwd_s: float
    #: Seconds in the optimizer step (including grad-norm collectives).
    optimizer_s: float
    num_microbatches: int


def masked_token_loss(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss-function body shared by every model family (last stage only).

    ``per_token_loss`` and ``loss_mask`` are ``[batch, seq]``. Returns the
    triple megatron's schedules expect with ``calculate_per_token_loss``:
    the *sum* of masked token losses, the token count, and a reporting dict.
    """
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(per_token_loss.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {LOSS_KEY: report}


def reduce_reports(reports: Sequence[dict]) -> Optional[dict[str, torch.Tensor]]:
    """Sum every reported tensor over micro-batches and the DP×CP group
    (last-stage ranks; a collective among them). None on other stages.

    Keys must be identical on every DP rank; values are ``[numerator,
    denominator]`` pairs by convention.
    """
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    keys = sorted(reports[0]) if reports else [LOSS_KEY]
    total = torch.zeros(len(keys), 2, dtype=torch.float64)
    for r in reports:
        for i, k in enumerate(keys):
            total[i] += r[k].to(torch.float64).cpu()
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return {k: total[i] for i, k in enumerate(keys)}


def reduce_reported_loss(
    reports: Sequence[dict], cross_replica: Optional["CrossReplica"] = None
) -> tuple[Optional[float], Optional[int]]:
    """Token-mean loss over the whole global batch (last-stage ranks; collective
    over the DP×CP group, and over the participants when ``cross_replica``).
    Returns (None, None) on other stages."""
    totals = reduce_reports(reports)
    if totals is None:
        return None, None
    if cross_replica is not None:
        cross_replica.reduce_sum(totals[LOSS_KEY])
    loss_sum, count = totals[LOSS_KEY].tolist()
    return loss_sum / max(count, 1.0), int(count)


def run_forward_backward(
    chunks: Sequence[DistributedDataParallel],
    forward_step_func: Callable,
    microbatches: Sequence[dict],
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list[dict]:
    """Run megatron's schedule (1F1B, interleaved or no-pipelining) over
    ``microbatches`` (every rank of the replica; each rank passes its own DP
    share). Returns the last stage's loss reports."""
    if len(chunks) > 1:
        # Interleaved schedule: one iterator per model chunk, each yielding
        # every micro-batch (megatron consumes them per chunk).
        data_iterator: object = [iter(microbatches) for _ in chunks]
        model: object = list(chunks)
    else:
        data_iterator = iter(microbatches)
        model = chunks[0]
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


class CrossReplica(Protocol):
    """The elastic replica dimension as train_step sees it
    (:class:`megascale_omni.parallel.elastic.ElasticReplica`)."""

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def should_commit(self) -> bool: ...

    def finalize_model_grads(self, model: Sequence, num_tokens: Optional[torch.Tensor] = None) -> None: ...


@dataclass
class StepProgress:
    """How far the current step got (read by failure handling)."""

    optimizer_started: bool = False


def train_step(
    chunks: Sequence[DistributedDataParallel],
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    forward_step_func: Callable,
    microbatches: Sequence[dict],
    seq_length: int,
    micro_batch_size: int,
    progress: Optional["StepProgress"] = None,
    cross_replica: Optional[CrossReplica] = None,
) -> StepStats:
    """Zero grads, forward/backward, DP grad reduce, clip and optimizer step (every rank).

    With ``cross_replica`` (elastic jobs) gradients and the loss are summed
    over the participants (in ``finalize_model_grads``), and the optimizer
    and LR scheduler step only if the quorum commits. ``microbatches`` may
    then be empty (a healing replica, or more replicas than micro-batches):
    the rank still joins every collective, contributing zeros.

    ``progress.optimizer_started`` turns True just before parameters start
    changing: a failure before that leaves the pre-step state intact.
    """
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    t0 = time.perf_counter()
    if microbatches:
        reports = run_forward_backward(chunks, forward_step_func, microbatches, seq_length, micro_batch_size)
    else:
        assert cross_replica is not None, "a step needs micro-batches"
        cross_replica.finalize_model_grads(list(chunks), num_tokens=torch.zeros([], dtype=torch.int))
        reports = []
    loss, count = (None, None)
    committed = True
    if cross_replica is not None:
        # Before the commit decision: a failure here must abandon the step.
        loss, count = reduce_reported_loss(reports, cross_replica)
        committed = cross_replica.should_commit()
    t1 = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]  # the rate this step applies
    update_successful, grad_norm = False, None
    if committed:
        if progress is not None:
            progress.optimizer_started = True
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=1)
    t2 = time.perf_counter()
    if cross_replica is None:
        loss, count = reduce_reported_loss(reports)
    return StepStats(
        loss=loss,
        num_loss_tokens=count,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        lr=float(lr),
        update_successful=bool(update_successful),
        committed=committed,
        fwd_bwd_s=t1 - t0,
        optimizer_s=t2 - t1,
        num_microbatches=len(microbatches),
    )
