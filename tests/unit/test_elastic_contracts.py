"""The megatron-core and torchft internals the elastic adapter
(megascale_omni/elastic/adapter.py) relies on, pinned against the installed
libraries: each test fails when the behaviour the adapter assumes changes,
so an upgrade fails here instead of in a job. Real megatron DDP on a tiny
GPT (distributed optimizer, overlap_grad_reduce) and a real torchft
lighthouse and manager, one rank, in process."""

from __future__ import annotations

import importlib.metadata
import inspect

import megatron.core
import pytest
import torch
from megatron.core.distributed import finalize_model_grads, param_and_grad_buffer

from megascale_omni.config import ConfigError, ElasticConfig, load_job_config
from megascale_omni.elastic import adapter
from tests.launcher import REPO

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ versions
def test_the_installed_releases_are_the_supported_ones():
    assert megatron.core.__version__ == adapter.MEGATRON_CORE == "0.16.1"
    assert importlib.metadata.version("torchft") == adapter.TORCHFT == "0.2.0"


@pytest.mark.parametrize("megatron_version, torchft_version, package, installed, supported", [
    ("0.17.0", "0.2.0", "megatron-core", "0.17.0", "0.16.1"),
    ("0.16.1", "0.3.0", "torchft", "0.3.0", "0.2.0"),
])
def test_another_release_is_refused_with_one_line(megatron_version, torchft_version, package, installed, supported):
    with pytest.raises(ConfigError) as err:
        adapter.check_versions(megatron_version, torchft_version)
    assert str(err.value) == (
        f"platform error: {package} {installed} is installed, megascale_omni.elastic.adapter supports {supported}: "
        f"install {package}=={supported} (setup.py's pin), or port the adapter and re-run "
        "tests/unit/test_elastic_contracts.py"
    )
    assert (err.value.field, err.value.value) == (package, installed)


def test_a_refused_release_exits_2_from_an_entry_point(capsys):
    from megascale_omni.entry import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: adapter.check_versions("0.16.1", "0.3.0"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("platform error: torchft 0.3.0 is installed")


# ------------------------------------------------------- megatron-core DDP
class Handle:
    """A stand-in in-flight reduction that counts its waits."""

    def __init__(self):
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


class Starts:
    """A replacement ``start_grad_sync`` that records its calls and leaves
    ``handle`` in flight on the group, as megatron's async start does."""

    def __init__(self, group, handle=None):
        self.group, self.handle, self.calls = group, handle, 0

    def __call__(self, force_all_reduce: bool = False, **kwargs) -> None:
        self.calls += 1
        self.group.grad_reduce_handle = self.handle


@pytest.fixture
def ddp():
    """(DDP chunks, optimizer) of a tiny GPT: distributed optimizer,
    overlap_grad_reduce, small buckets (several bucket groups); fresh for
    each test (its process group must be gone before the torchft tests')."""
    from megascale_omni.models.standalone import one_process
    from megascale_omni.parallel import ParallelDims
    from megascale_omni.platform import init_platform
    from megascale_omni.tasks.registry import get_family
    from megascale_omni.training.optimizer import build_optimizer, wrap_ddp

    cfg = load_job_config(["--config", str(REPO / "examples/gpt/tiny.yaml"), "parallel.use_distributed_optimizer=true",
                           "parallel.overlap_grad_reduce=true", "parallel.ddp_bucket_size=20000"])
    with one_process(seed=cfg.train.seed):
        task = get_family("gpt").build_task(cfg, init_platform(), ParallelDims.from_config(cfg.parallel, 1))
        model = task.build_model()
        chunks = wrap_ddp(model, model[0].config, cfg.parallel, overlap=True)
        optimizer, _ = build_optimizer(chunks, cfg.train, cfg.parallel, torch.float32)
        yield chunks, optimizer


@pytest.fixture
def group(ddp):
    """The first bucket group of the fresh model's chunk."""
    return adapter.bucket_groups(ddp[0][0])[0]


def test_the_chunk_finish_grad_sync_finishes_the_adapters_bucket_groups_in_order(ddp, monkeypatch):
    chunk = ddp[0][0]
    groups = adapter.bucket_groups(chunk)
    assert len(groups) > 1 and groups == list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)
    finished = []
    for i, g in enumerate(groups):
        monkeypatch.setattr(g, "finish_grad_sync", lambda force_all_reduce=False, i=i: finished.append(i))
    chunk.finish_grad_sync()
    assert finished == list(range(len(groups)))


def test_finish_grad_sync_waits_on_grad_reduce_handle_once_and_clears_it(group):
    """What BucketSums hands back after awaiting the inner reduction itself
    (adapter.await_inner_reduction): megatron's finish waits on exactly this
    attribute, once, and starts nothing when it is set after the first batch."""
    starts, handle = Starts(group), Handle()
    adapter.replace_start_grad_sync(group, starts)
    group.is_first_batch = False
    group.grad_reduce_handle = handle
    group.finish_grad_sync()
    assert (handle.waits, starts.calls, group.grad_reduce_handle) == (1, 0, None)


def test_await_inner_reduction_leaves_megatron_a_handle_whose_wait_does_nothing(group):
    handle = Handle()
    group.grad_reduce_handle = handle
    adapter.await_inner_reduction(group)
    assert handle.waits == 1 and group.grad_reduce_handle is not handle
    group.is_first_batch = False
    group.finish_grad_sync()
    assert handle.waits == 1 and group.grad_reduce_handle is None


def test_finish_grad_sync_of_a_first_batch_starts_through_the_instance_start_grad_sync(group):
    handle = Handle()
    starts = Starts(group, handle)
    inner = adapter.replace_start_grad_sync(group, starts)
    assert inner.__func__ is param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync
    group.is_first_batch = True
    group.grad_reduce_handle = None
    group.finish_grad_sync()
    assert (starts.calls, handle.waits, group.grad_reduce_handle) == (1, 1, None)


def test_finish_grad_sync_without_overlap_starts_through_the_instance_start_grad_sync(group, monkeypatch):
    monkeypatch.setattr(group.ddp_config, "overlap_grad_reduce", False)
    starts = Starts(group)
    adapter.replace_start_grad_sync(group, starts)
    group.finish_grad_sync()
    assert starts.calls == 1


def test_backward_hooks_start_through_the_instance_start_grad_sync(group, monkeypatch):
    """After the first batch megatron's hook starts a group once every one
    of its parameters has its gradient (register_grad_ready)."""
    starts = Starts(group, Handle())
    adapter.replace_start_grad_sync(group, starts)
    group.is_first_batch = False
    monkeypatch.setattr(group, "is_last_microbatch", True)
    monkeypatch.setattr(group, "golden_per_param_grad_ready_counts", {p: 1 for p in group.params})
    monkeypatch.setattr(group, "per_param_grad_ready_counts", {})
    params = list(group.params)
    for k, param in enumerate(params, 1):
        group.register_grad_ready(param)
        assert starts.calls == (k == len(params)), k


def test_ddp_start_grad_sync_starts_every_group_through_its_instance_start_grad_sync(ddp, monkeypatch):
    """The schedules' ``grad_sync_func`` (DDP's start_grad_sync)."""
    chunk = ddp[0][0]
    groups = adapter.bucket_groups(chunk)
    starts = []
    for g in groups:
        monkeypatch.setattr(g, "start_grad_sync", g.start_grad_sync)
        starts.append(Starts(g))
        adapter.replace_start_grad_sync(g, starts[-1])
    monkeypatch.setattr(chunk.config, "grad_sync_func", chunk.config.grad_sync_func)
    chunk.config.grad_sync_func()
    assert [s.calls for s in starts] == [1] * len(groups)
    for g in groups:
        g.grad_reduce_handle = None


def test_finalize_model_grads_calls_the_chunks_finish_grad_sync_attribute(ddp, monkeypatch):
    chunk = ddp[0][0]
    monkeypatch.setattr(chunk, "finish_grad_sync", chunk.finish_grad_sync)
    calls = []
    adapter.wrap_finish_grad_sync(chunk, lambda finish: lambda *a, **k: calls.append(finish))
    finalize_model_grads([chunk], None)
    assert len(calls) == 1 and calls[0].__func__.__name__ == "finish_grad_sync"


def test_the_inner_reduce_scatter_fills_the_views_the_adapter_sums(group, monkeypatch):
    """With the distributed optimizer, megatron reduce-scatters each bucket
    into the shards ``adapter.group_views`` returns, and leaves the
    reduction in flight in ``grad_reduce_handle`` (overlap_grad_reduce)."""
    outputs = []
    real = param_and_grad_buffer.dist_reduce_scatter_func

    def recording(output, input, **kwargs):
        outputs.append((output, input))
        return real(output, input, **kwargs)

    monkeypatch.setattr(param_and_grad_buffer, "dist_reduce_scatter_func", recording)
    group.is_first_batch = False
    group.grad_reduce_handle = None
    group.start_grad_sync()
    try:
        assert group.grad_reduce_handle is not None
    finally:
        group.grad_reduce_handle.wait()
        group.grad_reduce_handle = None
    views = adapter.group_views(group)
    assert len(outputs) == len(views) == len(group.buckets) > 0
    for (output, input), view, bucket in zip(outputs, views, group.buckets):
        assert input is bucket.grad_data
        assert (output.data_ptr(), output.shape, output.dtype) == (view.data_ptr(), view.shape, view.dtype)
        assert view.untyped_storage().data_ptr() == bucket.grad_data.untyped_storage().data_ptr()


def test_bucket_numel_counts_every_trainable_element_as_the_optimizer_buckets_do(ddp):
    chunks, optimizer = ddp
    numel = [adapter.bucket_numel(chunk) for chunk in chunks]
    trainable = sum(p.numel() for chunk in chunks for p in chunk.parameters() if p.requires_grad)
    assert sum(map(sum, numel)) == trainable
    from megatron.core.optimizer import DistributedOptimizer

    subs = [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(opt, DistributedOptimizer)]
    assert subs
    per_buffer = [adapter.optimizer_bucket_numel(opt) for opt in subs]
    flat = [n for layout in per_buffer for per_chunk in layout for buckets in per_chunk.values() for n in buckets]
    assert flat == [n for per_chunk in numel for n in per_chunk]


# ------------------------------------------------------------ torchft Manager
@pytest.fixture(scope="module")
def manager():
    """A torchft manager of a one-rank replica group alone at a fresh lighthouse."""
    from megascale_omni.elastic.membership import ReplicaQuorum
    from tests.unit.replica_group import one_rank_group

    with one_rank_group():
        lighthouse = adapter.lighthouse_server(min_replicas=1)
        cfg = ElasticConfig(enabled=True, lighthouse=lighthouse.address().replace("[::]", "localhost"),
                            replica_id="r0", timeout_s=20, quorum_timeout_s=20)
        quorum = ReplicaQuorum(cfg, state_dict=lambda: {"w": 7}, load_state_dict=lambda state: None)
        try:
            yield quorum.manager
        finally:
            quorum.leave()
            lighthouse.shutdown()


def test_the_quorum_id_is_set_by_the_first_quorum_and_kept_while_it_is_unchanged(manager):
    assert adapter.quorum_id(manager) == -1
    ids = []
    for _ in range(2):
        manager.start_quorum()
        manager.wait_quorum()
        ids.append(adapter.quorum_id(manager))
        assert manager.should_commit()
    assert ids[0] >= 0 and ids[1] == ids[0]


def test_a_committed_vote_advances_exactly_what_the_lone_commit_advances(manager):
    manager.start_quorum()
    manager.wait_quorum()
    before = manager.state_dict()
    assert set(before) == {"step", "batches_committed"} and manager.num_participants() == 1
    assert manager.should_commit()
    voted = manager.state_dict()
    assert voted == {"step": before["step"] + 1, "batches_committed": before["batches_committed"] + 1}
    assert adapter.commit_failures(manager) == 0 and manager.current_step() == voted["step"]
    manager.start_quorum()
    manager.wait_quorum()
    adapter.commit_without_vote(manager, manager.num_participants())
    assert manager.state_dict() == {"step": voted["step"] + 1, "batches_committed": voted["batches_committed"] + 1}
    # The step count the next quorum request carries (torchft's data position).
    assert manager.current_step() == voted["step"] + 1


def test_a_fetched_peer_state_waits_in_pending_state_dict_under_user_default(manager):
    # The quorum thread stores the transport's result there; should_commit applies and clears it.
    source = inspect.getsource(type(manager))
    assert "self._pending_state_dict = self._checkpoint_transport.recv_checkpoint(" in source
    sent = manager._manager_state_dict()  # what a live peer's send_checkpoint is given
    assert sent == {"user": {"default": {"w": 7}}, "torchft": manager.state_dict()}
    assert adapter.pending_peer_state(manager) is None
    manager._pending_state_dict = sent
    try:
        assert adapter.pending_peer_state(manager) == {"w": 7}
    finally:
        manager._pending_state_dict = None


def test_quorum_answers_are_asked_through_the_client_and_configure_the_group_under_a_quorum_prefix(manager):
    # adapter.watch_quorum_answers wraps exactly these two calls of the quorum thread.
    source = inspect.getsource(type(manager)._async_quorum)
    assert "quorum = self._client._quorum(" in source and "max_step = quorum.max_step" in source
    assert 'f"{store_address}/torchft/{quorum_id}/{self._group_rank}"' in source
    assert "self._pg.configure(\n                        store_prefixed_addr," in source
    assert isinstance(manager._client, adapter.QuorumAnswers)
    manager.start_quorum()
    manager.wait_quorum()
    assert manager._client.max_step == manager.current_step() and manager._client.wall_time is not None

