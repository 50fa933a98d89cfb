"""Cross-replica sums: gradients, token count and reports summed over the
participants of each step through torchft.

Seam (why here): megatron's DDP reduces inside the replica group, bucket
group by bucket group. Right after it starts a group's inner reduction,
:class:`BucketSums` starts the sum of the gradients this rank's optimizer
reads from that group across replicas (during backward with
``overlap_grad_reduce``), and megatron's ``finalize_model_grads``, run
*without* the per-token scaling, awaits them.
:meth:`CrossReplicaSums.reduce_grads_across_replicas` then sums the token
count across replicas and scales by ``1 / global tokens``. Without the
distributed optimizer the summed views are every bucket's whole
``grad_data`` (megatron all-reduced it inside the group). With it, megatron
reduce-scattered each bucket inside the group, so only this rank's shard of
each bucket holds the group's sum and only that shard is read by this
rank's optimizer: the cross-replica sum covers just those shards
(1/inner-DP of the bytes), and megatron all-gathers the updated parameters
inside the group after the commit-gated step. Reduction is hierarchical:
inside the group, then across groups on each rank's shard. Gradients are
therefore exactly those of one large data-parallel job over the whole
global batch, whatever the participant count and even when replicas hold
different numbers of micro-batches; grad-norm clipping in
``optimizer.step()`` sees these global gradients. The alternative seam,
megatron's ``num_distributed_optimizer_instances`` with a
``ManagedProcessGroup`` as the inter-instance group, fixes the instance
count and the gradient scaling when DDP is built and needs the distributed
optimizer, so it cannot follow a changing participant count.

Bucket groups: with ``overlap_grad_reduce`` each group's reduce-scatter
(distributed optimizer) or all-reduce starts from a backward hook as soon
as backward has filled it; without, all start one after the other in
``finish_grad_sync``. Either way :class:`BucketSums` starts the
cross-replica sum of a group's views right after megatron started the
group's inner reduction and waited for it, so the sums of early buckets run
while backward computes the rest. Each chunk's sums are awaited at the end
of its ``finish_grad_sync``, before megatron's other gradient all-reduces
(tied embeddings, layer norms) read the buffers. Every touch of megatron's
bucket groups goes through :mod:`.adapter`.

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

Every method is called by every rank of the replica group, in the same order
on every replica.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.finalize_model_grads import get_pp_last_rank

from megascale_omni.elastic import adapter
from megascale_omni.elastic.membership import ReplicaQuorum
from megascale_omni.parallel.schedules import model_device


class _Done:
    """A finished collective (the sum over a quorum of one replica group)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


class CrossReplicaSums:
    """The gradient seam of one replica group (every rank): sums over the
    participants of ``quorum``'s current step, on ``device`` (where the
    gradient buffers live). The Trainer's step sees it as
    :class:`~megascale_omni.parallel.schedules.CrossReplica`."""

    def __init__(self, quorum: ReplicaQuorum, device: torch.device = torch.device("cpu")):
        self.quorum = quorum
        self.device = device
        #: Payload bytes this rank handed to cross-replica all-reduces since
        #: the last new_step (gradients, token count, loss report).
        self.bytes_sent = 0
        #: Bucket groups whose gradient sums started during backward
        #: (``overlap_grad_reduce``) in the current step.
        self.early_buckets = 0
        #: Counters (float64 vector, same on every rank of the group) this
        #: replica adds to the job's totals in the current attempt, e.g. bad
        #: samples; summed over the participants with the token count in
        #: :meth:`reduce_grads_across_replicas`, which leaves the job-wide
        #: sums here. None: no counters.
        self.step_counts: Optional[torch.Tensor] = None
        # The per-bucket gradient sums of the model (attach()).
        self._buckets: Optional[BucketSums] = None

    def attach(self, model: Sequence[Any]) -> None:
        """Sum ``model``'s gradients across replicas bucket group by bucket
        group as megatron reduces them inside the group (every rank, once,
        before the first step)."""
        self._buckets = BucketSums(model, self.quorum.sends_allowed, self._allreduce_sum)

    def new_step(self) -> None:
        """Reset the step's counters (every rank, before the step's quorum)."""
        self.bytes_sent = 0
        self.early_buckets = 0

    def finalize_model_grads(
        self,
        model: Sequence[Any],
        num_tokens: Optional[torch.Tensor] = None,
        pg_collection: Any = None,
        force_all_reduce: Optional[bool] = False,
    ) -> None:
        """megatron ``finalize_model_grads_func`` for elastic jobs (every rank).

        Inner-replica sync first (unscaled), then the cross-replica sums of
        every grad buffer and of the token count, then ``1 / global tokens``.
        """
        finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        self.reduce_grads_across_replicas(model, num_tokens, pg_collection)

    def finalize_without_backward(self, model: Sequence[Any]) -> None:
        """:meth:`finalize_model_grads` for a rank without micro-batches this
        step (a healing replica, or more DP ranks than micro-batches; every
        rank of such a pipeline): starts its bucket groups' reductions as
        backward would have, then joins every collective with zero
        gradients and zero tokens."""
        assert self._buckets is not None, "attach() the model before its first step"
        self._buckets.start_without_backward()
        # On the model's device, as megatron's schedules hand it over (NCCL takes device tensors only).
        self.finalize_model_grads(model, num_tokens=torch.zeros([], dtype=torch.int, device=model_device(model)))

    def reduce_grads_across_replicas(self, model: Sequence[Any], num_tokens: Optional[torch.Tensor],
                                     pg_collection: Any = None) -> None:
        """The cross-replica half of :meth:`finalize_model_grads` (every
        rank, after megatron's ``finalize_model_grads``, which awaited the
        gradient sums of :meth:`attach`): sum the token count and
        :attr:`step_counts` over the participants, then scale the gradients
        by ``1 / global tokens``. Alone in the quorum the sums are this
        group's own values and nothing leaves the device."""
        assert num_tokens is not None, "elastic training needs per-token loss (calculate_per_token_loss)"
        assert self._buckets is not None, "attach() the model before its first step"
        self.early_buckets = self._buckets.end_step()
        self.quorum.confirm()
        if pg_collection is not None:
            pp_group, dp_cp_group = pg_collection.pp, pg_collection.dp_cp
        else:
            pp_group = mpu.get_pipeline_model_parallel_group()
            dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
        # As megatron does: the count lives on the last stage; share it with
        # the other stages, then sum over the inner DP ranks.
        dist.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)
        dist.all_reduce(num_tokens, group=dp_cp_group)
        total = num_tokens.to(self.device, torch.float64)
        if not self.quorum.alone:
            # One all-reduce carries the token count and the job's step counters.
            sums = total.reshape(1)
            if self.step_counts is not None:
                sums = torch.cat([sums, self.step_counts.to(self.device, torch.float64)])
            self._allreduce_sum(sums).wait()
            if self.step_counts is not None:
                self.step_counts = sums[1:].cpu()
            total = sums[0]
        # A device scalar (no host sync). No tokens anywhere: the gradients are zero.
        scale = (1.0 / total.clamp(min=1.0)).to(torch.float32)
        for chunk in model:
            chunk.scale_gradients(scale)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the participants in place (same group rank of
        every replica; e.g. last-stage loss reports). Returns it."""
        self.quorum.confirm()
        if tensor.device == self.device:
            self._allreduce_sum(tensor).wait()
        else:  # host-side reports, with NCCL across replicas
            staged = tensor.to(self.device)
            self._allreduce_sum(staged).wait()
            tensor.copy_(staged)
        return tensor

    def should_commit(self) -> bool:
        """Whether the step commits (:meth:`ReplicaQuorum.should_commit`)."""
        return self.quorum.should_commit()

    def _allreduce_sum(self, tensor: torch.Tensor):
        """Start a cross-replica sum of ``tensor`` in place; count its bytes.
        Alone in the quorum the sum is ``tensor`` itself: nothing is sent."""
        if self.quorum.alone:
            return _DONE
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return self.quorum.allreduce(tensor)


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
        self.groups = [group for chunk in reversed(self.model) for group in adapter.bucket_groups(chunk)]
        self._allowed_fn, self._send = allowed, send
        #: megatron's own ``start_grad_sync`` of each group (the inner reduction).
        self._inner = [adapter.replace_start_grad_sync(group, self._request(i))
                       for i, group in enumerate(self.groups)]
        index = {id(group): i for i, group in enumerate(self.groups)}
        for chunk in self.model:
            indices = [index[id(group)] for group in adapter.bucket_groups(chunk)]
            adapter.wrap_finish_grad_sync(chunk, lambda finish, indices=indices: self._then_wait(finish, indices))
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
                # The sum reads the inner reduction's result; megatron's own
                # second wait must not overwrite the sum (adapter docstring).
                adapter.await_inner_reduction(group)
                self._works[self._next] = [self._send(view) for view in adapter.group_views(group)]
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
