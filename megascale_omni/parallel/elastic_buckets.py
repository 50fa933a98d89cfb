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

Order: collectives must line up, the cross-replica sums across replicas
(whose backward may fill groups in another order; a healing one runs no
backward) and the inner reductions across the inner DP ranks of a group
(which may hold different numbers of micro-batches, some none, and so be
in megatron's first batch at different steps). Both therefore start in
one fixed order: the chunks in reverse (the order backward finishes them),
each chunk's bucket groups by index (the order backward fills them); a
group filled early waits for those before it. The numbers do not depend on
when a sum starts: the same views are summed in the same order with or
without the overlap.

Why not megatron's own inter-instance all-reduce
(``num_distributed_optimizer_instances``): see the seam note in
:mod:`megascale_omni.parallel.elastic`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from megatron.core.distributed.param_and_grad_buffer import shard_buffer


class _Waited:
    """A bucket group's inner reduction that :class:`BucketSums` already
    awaited; megatron's ``finish_grad_sync`` waits on it again."""

    def wait(self) -> None:
        pass


_WAITED = _Waited()


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
    """Orders the inner reductions of ``model``'s bucket groups and starts
    and awaits their cross-replica sums (every rank; one instance per model,
    installed once on its DDP chunks).

    Every request to start a group's inner reduction (megatron's backward
    hooks, its schedule's ``grad_sync_func``, ``finish_grad_sync``, or
    :meth:`start_without_backward`) goes through here, and the reductions
    start in one fixed order: a group requested early waits for the groups
    before it. That order is the same on every rank of the replica group
    whatever ran on it this step (a full backward, a first batch, whose
    groups megatron starts only in ``finish_grad_sync``, or no backward at
    all), so the inner collectives line up across the inner DP ranks even
    when they hold different numbers of micro-batches.

    ``allowed()`` is asked once per step, before the first sum: False sends
    nothing this step (the replica is alone in its quorum, or the quorum is
    not the one the step assumed: the step is then recomputed). ``send(view)``
    starts one sum in place and returns its work (``.wait()``).
    """

    def __init__(self, model: Sequence[Any], allowed: Callable[[], bool], send: Callable[[torch.Tensor], Any]):
        self.model = list(model)
        # Chunks in reverse: the order backward finishes them (megatron's
        # interleaved schedule ends with chunk 0); a chunk's groups by index,
        # the order backward fills them.
        self.groups = [group for chunk in reversed(self.model) for group in bucket_groups(chunk)]
        self._allowed_fn, self._send = allowed, send
        #: megatron's own ``start_grad_sync`` of each group (the inner reduction).
        self._inner = [group.start_grad_sync for group in self.groups]
        index = {id(group): i for i, group in enumerate(self.groups)}
        for i, group in enumerate(self.groups):
            group.start_grad_sync = self._request(i)
        for chunk in self.model:
            chunk.finish_grad_sync = self._then_wait(chunk.finish_grad_sync,
                                                     [index[id(group)] for group in bucket_groups(chunk)])
        self._reset()

    def _reset(self) -> None:
        #: Bucket groups whose sums started before megatron's
        #: ``finish_grad_sync`` (during backward) in the current step.
        self.early = 0
        self._finishing = False
        self._requested = [False] * len(self.groups)
        self._next = 0  # the next group to start, in self.groups order
        self._works: list[list[Any]] = [[] for _ in self.groups]
        self._allowed: bool | None = None

    def _request(self, i: int) -> Callable:
        def start(force_all_reduce: bool = False, **kwargs):
            if self._finishing:
                # finish_grad_sync runs after this rank's backward: the
                # groups before this one hold their final gradients too.
                self._requested[:i] = [True] * i
            self._requested[i] = True
            self._launch_ready(force_all_reduce)

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

    def start_without_backward(self) -> None:
        """Start every group's inner reduction and cross-replica sums, in
        order, on a rank that runs no backward this step (no micro-batches),
        before megatron's ``finish_grad_sync``: with ``overlap_grad_reduce``
        megatron starts them only from backward hooks after the first batch,
        and would find none started."""
        self._requested = [True] * len(self.groups)
        self._launch_ready()

    def _launch_ready(self, force_all_reduce: bool = False) -> None:
        """Start the inner reductions of the requested groups not yet
        started, in order, each followed by its cross-replica sums."""
        while self._next < len(self.groups) and self._requested[self._next]:
            group = self.groups[self._next]
            self._inner[self._next](force_all_reduce=force_all_reduce)
            if self._allowed is None:
                self._allowed = bool(self._allowed_fn())
            if self._allowed:
                if group.grad_reduce_handle is not None:
                    # The inner reduction is in flight (overlap_grad_reduce):
                    # the sum reads its result. NCCL: orders the streams
                    # without blocking; gloo: waits for it. Then hand
                    # megatron's finish_grad_sync a finished handle for its
                    # own wait: gloo's coalesced reduce-scatter copies its
                    # result into the shards on *every* wait(), so a second
                    # wait would overwrite the cross-replica sum started below
                    # (in flight or done) with this group's own sum.
                    group.grad_reduce_handle.wait()
                    group.grad_reduce_handle = _WAITED
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
