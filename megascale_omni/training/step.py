"""One optimizer step over a list of micro-batches, through megatron's schedules (every rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megascale_omni.metrics.breakdown import PHASES
from megascale_omni.parallel.schedules import CrossReplica, reduce_reported_loss, run_forward_backward


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
    #: Seconds in forward+backward (including pipeline p2p and DP grad sync),
    #: read from the step's clock (:data:`~megascale_omni.metrics.breakdown.PHASES`).
    fwd_bwd_s: float
    #: Seconds in the optimizer step (including grad-norm collectives), same clock.
    optimizer_s: float
    num_microbatches: int
    #: Parts of ``fwd_bwd_s``: blocked in pipeline p2p, MoE token dispatch, DP gradient sync,
    #: cross-replica reductions and commit (see metrics/breakdown.py).
    pipeline_wait_s: float = 0.0
    moe_dispatch_s: float = 0.0
    grad_sync_s: float = 0.0
    cross_replica_s: float = 0.0


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

    Times come from :data:`~megascale_omni.metrics.breakdown.PHASES` (CUDA
    events on CUDA), resolved with one synchronisation when the step ends.
    """
    PHASES.start()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    if microbatches:
        reports = run_forward_backward(chunks, forward_step_func, microbatches, seq_length, micro_batch_size)
    else:
        assert cross_replica is not None, "a step needs micro-batches"
        cross_replica.finalize_without_backward(list(chunks))
        reports = []
    loss, count = (None, None)
    committed = True
    if cross_replica is not None:
        # Before the commit decision: a failure here must abandon the step.
        with PHASES.phase("cross_replica"):
            loss, count = reduce_reported_loss(reports, cross_replica)
            committed = cross_replica.should_commit()
    PHASES.mark("fwd_bwd")
    # The rate this step applies to train.lr's parameters (not a vision.lr_mult group).
    lr = next((g["lr"] for g in optimizer.param_groups if g.get("default_config", True)),
              optimizer.param_groups[0]["lr"])
    update_successful, grad_norm = False, None
    if committed:
        if progress is not None:
            progress.optimizer_started = True
        update_successful, grad_norm, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=1)
    PHASES.mark("optimizer")
    # The step's one synchronisation. Every phase (pipeline p2p, grad sync,
    # cross-replica) happens before the fwd_bwd mark: they are its parts.
    times = PHASES.read()
    phases = times.phases
    if cross_replica is None:
        loss, count = reduce_reported_loss(reports)
    return StepStats(
        loss=loss,
        num_loss_tokens=count,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        lr=float(lr),
        update_successful=bool(update_successful),
        committed=committed,
        fwd_bwd_s=times.spans["fwd_bwd"],
        optimizer_s=times.spans["optimizer"],
        num_microbatches=len(microbatches),
        pipeline_wait_s=phases["pipeline_wait"],
        moe_dispatch_s=phases["moe_dispatch"],
        grad_sync_s=phases["grad_sync"],
        cross_replica_s=phases["cross_replica"],
    )
