"""megatron's pipeline schedules over a list of micro-batches, and the
reduction of what the last stage reports.

Used by the training step and by every task's forward-only passes
(evaluation), so it sits below both.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.pipeline_parallel import get_forward_backward_func

#: Key under which loss functions report ``[loss_sum, num_tokens]``
#: (see :func:`megascale_omni.models.loss.masked_token_loss`).
LOSS_KEY = "lm loss"


class CrossReplica(Protocol):
    """The elastic replica dimension as a step sees it
    (:class:`megascale_omni.elastic.cross_replica.CrossReplicaSums`)."""

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def should_commit(self) -> bool: ...

    def finalize_without_backward(self, model: Sequence) -> None: ...


def run_forward_backward(
    chunks: Sequence[torch.nn.Module],
    forward_step_func: Callable,
    microbatches: Sequence[dict],
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list[dict]:
    """Run megatron's schedule (1F1B, interleaved or no-pipelining) over
    ``microbatches`` (every rank of the replica; each rank passes its own DP
    share). Returns the last stage's loss reports.

    Micro-batches are built on the host; each is moved to the device of the
    model's parameters (:func:`batch_to`) when the schedule takes it."""
    device = model_device(chunks)
    if len(chunks) > 1:
        # Interleaved schedule: one iterator per model chunk, each yielding
        # every micro-batch (megatron consumes them per chunk).
        data_iterator: object = [(batch_to(mb, device) for mb in microbatches) for _ in chunks]
        model: object = list(chunks)
    else:
        data_iterator = (batch_to(mb, device) for mb in microbatches)
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


def model_device(chunks: Sequence[torch.nn.Module]) -> torch.device:
    """The device of the first chunk's parameters (CPU for a chunk without any)."""
    param = next(iter(chunks[0].parameters()), None)
    return param.device if param is not None else torch.device("cpu")


def batch_to(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensors in dicts, lists and tuples; other values kept) with
    every tensor on ``device``; the same objects when already there."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: batch_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch_to(v, device) for v in batch)
    return batch


def collective_device(group) -> torch.device:
    """Where tensors handed to a collective of ``group`` must live: the
    current CUDA device under NCCL, the host otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_reports(reports: Sequence[dict]) -> Optional[dict[str, torch.Tensor]]:
    """Sum every reported tensor over micro-batches and the DP×CP group
    (last-stage ranks; a collective among them). None on other stages.

    Keys must be identical on every DP rank; values are ``[numerator,
    denominator]`` pairs by convention.
    """
    if not mpu.is_pipeline_last_stage(ignore_virtual=True):
        return None
    keys = sorted(reports[0]) if reports else [LOSS_KEY]
    if reports:
        # Summed where the reports live: one copy to the host per step, not one per micro-batch.
        total = torch.stack([torch.stack([r[k] for k in keys]) for r in reports]).to(torch.float64).sum(0)
    else:
        total = torch.zeros(len(keys), 2, dtype=torch.float64)
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        # NCCL takes device tensors only.
        total = total.to(collective_device(group))
        dist.all_reduce(total, group=group)
    total = total.cpu()
    return {k: total[i] for i, k in enumerate(keys)}


def reduce_reported_loss(
    reports: Sequence[dict], cross_replica: Optional[CrossReplica] = None
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
