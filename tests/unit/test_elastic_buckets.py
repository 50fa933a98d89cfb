"""BucketSums on stand-ins of megatron's DDP chunks and bucket groups: the
order inner reductions and sums start in, when they are awaited, and what is summed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megascale_omni.elastic.adapter import group_views
from megascale_omni.elastic.cross_replica import BucketSums


class Handle:
    """An inner reduction in flight; records when it is awaited."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(("inner done", self.name))


class Group:
    """A bucket group: ``start_grad_sync`` starts its inner reduction (async
    when ``overlap``, as megatron's with overlap_grad_reduce)."""

    def __init__(self, log: list, name: str, numel: int = 4, distopt: bool = False, overlap: bool = True):
        self.log, self.name, self.overlap = log, name, overlap
        self.ddp_config = SimpleNamespace(use_distributed_optimizer=distopt)
        self.buckets = [SimpleNamespace(grad_data=torch.arange(float(numel)))]
        self.intra_distributed_optimizer_instance_size, self.intra_distributed_optimizer_instance_rank = 2, 1
        self.grad_reduce_handle = None

    def start_grad_sync(self, force_all_reduce=False) -> None:
        self.log.append(("inner start", self.name))
        self.grad_reduce_handle = Handle(self.log, self.name) if self.overlap else None


class Chunk:
    """A DDP chunk: ``finish_grad_sync`` starts the groups backward did not start, in index order."""

    def __init__(self, groups: list[Group]):
        self.bucket_groups, self.expert_parallel_bucket_groups = groups, []

    def finish_grad_sync(self, force_all_reduce=False) -> None:
        for group in self.bucket_groups:
            if group.grad_reduce_handle is None:
                group.start_grad_sync()
            group.grad_reduce_handle = None


class Work:
    def __init__(self, log: list, view: torch.Tensor):
        self.log, self.view = log, view

    def wait(self) -> None:
        self.log.append(("sum done", self.view.numel()))


def _model(log: list, overlap: bool = True) -> list[Chunk]:
    # Bucket sizes tell the groups apart in the send log: a0=1, a1=2, b0=3.
    return [Chunk([Group(log, "a0", 1, overlap=overlap), Group(log, "a1", 2, overlap=overlap)]),
            Chunk([Group(log, "b0", 3, overlap=overlap)])]


def _sums(model: list[Chunk], log: list, allowed: bool = True) -> BucketSums:
    def send(view):
        log.append(("sum start", view.numel()))
        return Work(log, view)

    def ask():
        log.append(("allowed?",))
        return allowed

    return BucketSums(model, ask, send)


def test_reductions_and_sums_start_in_fixed_order_and_are_awaited_in_finish():
    log: list = []
    model = _model(log)
    sums = _sums(model, log)
    # The order is b0, a0, a1 (chunks in reverse, groups by index). Backward
    # fills a0 first: it waits for b0; b0 then starts both.
    model[0].bucket_groups[0].start_grad_sync()
    assert log == []
    model[1].bucket_groups[0].start_grad_sync()
    assert log == [("inner start", "b0"), ("allowed?",), ("inner done", "b0"), ("sum start", 3),
                   ("inner start", "a0"), ("inner done", "a0"), ("sum start", 1)]
    del log[:]
    model[0].bucket_groups[1].start_grad_sync()
    assert log == [("inner start", "a1"), ("inner done", "a1"), ("sum start", 2)]
    del log[:]
    for chunk in model:
        chunk.finish_grad_sync()
    assert log == [("sum done", 1), ("sum done", 2), ("sum done", 3)]
    assert sums.end_step() == 3  # all three started during backward
    # The next step starts afresh; finish_grad_sync of the first chunk starts
    # the groups before its own too (backward is over).
    del log[:]
    for chunk in model:
        chunk.finish_grad_sync()
    assert [e for e in log if e[0].endswith("start")] == [
        ("inner start", "b0"), ("sum start", 3), ("inner start", "a0"), ("sum start", 1),
        ("inner start", "a1"), ("sum start", 2)]
    assert sums.end_step() == 0  # started by finish_grad_sync, not during backward


def test_without_overlap_each_sum_starts_after_its_synchronous_inner_reduction():
    log: list = []
    model = _model(log, overlap=False)
    sums = _sums(model, log)
    for chunk in model:
        chunk.finish_grad_sync()
    assert log == [("inner start", "b0"), ("allowed?",), ("sum start", 3), ("inner start", "a0"), ("sum start", 1),
                   ("inner start", "a1"), ("sum start", 2), ("sum done", 1), ("sum done", 2), ("sum done", 3)]
    assert sums.end_step() == 0


def _inner_starts(run) -> list[str]:
    log: list = []
    model = _model(log)
    sums = _sums(model, log, allowed=False)
    run(model, sums)
    for chunk in model:
        chunk.finish_grad_sync()
    sums.end_step()
    return [e[1] for e in log if e[0] == "inner start"]


def test_inner_reductions_start_in_the_same_order_with_or_without_backward():
    """Inner DP ranks of one group may hold different numbers of micro-batches
    (some none): their inner collectives must still line up."""

    def backward(model, sums):  # hooks in another order than the fixed one
        for chunk, i in ((0, 1), (1, 0), (0, 0)):
            model[chunk].bucket_groups[i].start_grad_sync()

    def first_batch(model, sums):  # megatron starts every group in finish_grad_sync
        pass

    def no_backward(model, sums):  # no micro-batches this step
        sums.start_without_backward()

    orders = [_inner_starts(run) for run in (backward, first_batch, no_backward)]
    assert orders == [["b0", "a0", "a1"]] * 3


def test_nothing_is_sent_when_not_allowed():
    log: list = []
    model = _model(log)
    sums = _sums(model, log, allowed=False)
    model[0].bucket_groups[0].start_grad_sync()
    for chunk in model:
        chunk.finish_grad_sync()
    assert not [e for e in log if e[0].startswith("sum")]
    assert log.count(("allowed?",)) == 1
    assert sums.end_step() == 0


def test_end_step_fails_if_a_group_never_started():
    log: list = []
    model = _model(log)
    sums = _sums(model, log)
    model[1].finish_grad_sync()  # b0 only: first in the order
    with pytest.raises(AssertionError, match="did not run on every bucket group"):
        sums.end_step()


def test_views_are_whole_buckets_or_this_ranks_shard():
    whole, shard = Group([], "w", 6), Group([], "s", 6, distopt=True)
    assert [v.tolist() for v in group_views(whole)] == [[0, 1, 2, 3, 4, 5]]
    # Rank 1 of 2 holds the second half of each bucket after the reduce-scatter.
    assert [v.tolist() for v in group_views(shard)] == [[3, 4, 5]]


class CopyingHandle:
    """gloo's coalesced reduce-scatter in flight: every ``wait()`` copies the
    group's own sum into this rank's shard (measured on torch 2.13 gloo)."""

    def __init__(self, shard: torch.Tensor, result: torch.Tensor):
        self.shard, self.result = shard, result

    def wait(self) -> None:
        self.shard.copy_(self.result)


class MegatronGroup(Group):
    """A distributed-optimizer bucket group whose ``finish_grad_sync`` waits
    on the reduce-scatter handle like megatron's (overlap_grad_reduce)."""

    def start_grad_sync(self, force_all_reduce=False) -> None:
        shard = group_views(self)[0]
        self.grad_reduce_handle = CopyingHandle(shard, torch.full_like(shard, 10.0))

    def finish_grad_sync(self, force_all_reduce=False) -> None:
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None


def test_megatron_waiting_the_reduce_scatter_again_keeps_the_cross_replica_sum():
    """The sum started in place on the shard during backward must survive
    megatron's own wait on the reduce-scatter in ``finish_grad_sync``."""
    group = MegatronGroup([], "g", 6, distopt=True)
    chunk = Chunk([group])
    chunk.finish_grad_sync = lambda force_all_reduce=False: group.finish_grad_sync()

    def send(view):  # the peer replica's shard holds 1.0: the sum lands in place
        view.add_(1.0)
        return Work([], view)

    sums = BucketSums([chunk], lambda: True, send)
    group.start_grad_sync()  # megatron's grad-ready hook during backward
    chunk.finish_grad_sync()
    assert sums.end_step() == 1
    assert group_views(group)[0].tolist() == [11.0, 11.0, 11.0]
