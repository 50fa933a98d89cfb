"""Cross-replica gradient sums per DDP bucket group, started as soon as
megatron has started the group's reduction inside the replica group.

megatron's DDP reduces gradients in bucket groups: with
``overlap_grad_reduce`` each group's reduce-scatter (distributed optimizer)
or all-reduce starts from a backward hook as soon as backward has filled it;
without, all start one after the other in ``finish_grad_sync``. Either way
:class:`BucketSums` starts the cross-replica sum of a group's views (this
rank's shard of each bucket, or each whole bucket without the distributed
optimizer) right after megatron started the group's inner reduction and
waited for it, so the sums of early buckets run while backward computes the
rest. Each chunk's sums are awaited at the end of its ``finish_grad_sync``,
before megatron's other gradient all-reduces (tied embeddings, layer norms)
read the buffers.

Order: cross-replica collectives must line up across replicas, whose
backward may fill groups in another order and a healing one has no
backward at all. Sums therefore start in one fixed order, the chunks' order
and each chunk's bucket groups in index order; a group filled early waits
for those before it. The numbers do not depend on when a sum starts: the
same views are summed in the same order with or without the overlap.

Why not megatron's own inter-instance all-reduce
(``num_distributed_optimizer_instances``): see the seam note in
:mod:`megascale_omni.parallel.elastic`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from megatron.core.distributed.param_and_grad_buffer import shard_buffer


def group_views(group: Any) -> list[torch.Tensor]:
    """The views of one bucket group that this rank sums across replica
    groups after the inner reduction (fp32 views into megatron's buffers):
    with the distributed optimizer, the shard ``intra-instance rank`` of each
    bucket (the one its reduce-scatter filled and this rank's optimizer
    reads, ``1 / inner DP`` of the elements); without, each whole bucket."""
    if not group.ddp_config.use_distributed_optimizer:
        return [bucket.grad_data for bucket in group.buckets]
    size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
    return [shard_buffer(bucket.grad_data, size)[rank] for bucket in group.buckets]


def bucket_groups(chunk: Any) -> list[Any]:
    """A DDP chunk's bucket groups, in the order megatron finishes them."""
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


class BucketSums:
    """Starts and awaits the cross-replica sums of ``model``'s bucket groups
    (every rank; one instance per model, installed once on its DDP chunks).

    ``allowed()`` is asked once per step, before the first sum: False sends
    nothing this step (the replica is alone in its quorum, or the quorum is
    not the one the step assumed: the step is then recomputed). ``send(view)``
    starts one sum in place and returns its work (``.wait()``).
    """

    def __init__(self, model: Sequence[Any], allowed: Callable[[], bool], send: Callable[[torch.Tensor], Any]):
        self.model = list(model)
        self.groups = [group for chunk in self.model for group in bucket_groups(chunk)]
        self._allowed_fn, self._send = allowed, send
        index = {id(group): i for i, group in enumerate(self.groups)}
        for group in self.groups:
            group.start_grad_sync = self._after(group.start_grad_sync, index[id(group)])
        for chunk in self.model:
            chunk.finish_grad_sync = self._then_wait(chunk.finish_grad_sync,
                                                     [index[id(group)] for group in bucket_groups(chunk)])
        self._reset()

    def _reset(self) -> None:
        #: Bucket groups whose sums started before megatron's
        #: ``finish_grad_sync`` (during backward) in the current step.
        self.early = 0
        self._finishing = False
        self._started = [False] * len(self.groups)
        self._next = 0  # the next group whose sums start, in self.groups order
        self._works: list[list[Any]] = [[] for _ in self.groups]
        self._allowed: bool | None = None

    def _after(self, start_grad_sync: Callable, i: int) -> Callable:
        def start(*args, **kwargs):
            start_grad_sync(*args, **kwargs)
            self._started[i] = True
            self._launch_ready()

        return start

    def _then_wait(self, finish_grad_sync: Callable, indices: list[int]) -> Callable:
        def finish(*args, **kwargs):
            self._finishing = True
            try:
                finish_grad_sync(*args, **kwargs)
            finally:
                self._finishing = False
            for i in indices:
                assert i < self._next, "a bucket group's cross-replica sum did not start"
                for work in self._works[i]:
                    work.wait()
                self._works[i] = []

        return finish

    def _launch_ready(self) -> None:
        """Start the sums of every started group not yet sent, in order."""
        while self._next < len(self.groups) and self._started[self._next]:
            group = self.groups[self._next]
            if self._allowed is None:
                self._allowed = bool(self._allowed_fn())
            if self._allowed:
                if group.grad_reduce_handle is not None:
                    # The inner reduction is in flight (overlap_grad_reduce):
                    # the sum reads its result. NCCL: orders the streams
                    # without blocking; gloo: waits for it.
                    group.grad_reduce_handle.wait()
                self._works[self._next] = [self._send(view) for view in group_views(group)]
                self.early += not self._finishing
            self._next += 1

    def end_step(self) -> int:
        """Every group's sums started and were awaited (after megatron's
        ``finish_grad_sync`` on every chunk); clear the step. Returns
        :attr:`early` of the step."""
        assert self._next == len(self.groups), "finish_grad_sync did not run on every bucket group"
        early = self.early
        self._reset()
        return early
