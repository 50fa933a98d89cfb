"""Every touch of megatron-core or torchft internals the elastic code makes.

The elastic package leans on behaviour neither library promises:

- megatron-core's DDP bucket groups (``_ParamAndGradBucketGroup``, a private
  class): their ``start_grad_sync`` is replaced per instance so each inner
  reduction is followed by its cross-replica sum; ``finish_grad_sync`` of a
  DDP chunk is wrapped to await those sums; an in-flight inner reduction is
  the group's ``grad_reduce_handle``, which megatron's ``finish_grad_sync``
  waits on and clears; each bucket's ``grad_data`` is the gradient view and
  ``shard_buffer`` its distributed-optimizer shards; ``numel_unpadded`` and
  the optimizer's ``per_bucket_numel_unpadded`` describe the buckets.
- torchft's ``Manager``: the quorum id lives only in ``_quorum_id``, a
  fetched peer state only in ``_pending_state_dict`` (until
  ``should_commit`` applies it); a committed vote advances exactly
  ``step`` by 1 and ``batches_committed`` by the participant count (the
  lone commit reproduces that through ``load_state_dict``); the quorum is
  asked through ``_client._quorum`` (on the quorum thread; its answer holds
  ``max_step``) and the cross-replica process group is reconfigured through
  ``_pg.configure(store_addr, ...)`` with ``store_addr`` ending in
  ``/torchft/<quorum id>/<group rank>`` (:func:`watch_quorum_answers`).

Nothing else in the package reads those names. This module checks at import
that the installed releases are the ones these assumptions were read from
(:data:`MEGATRON_CORE`, :data:`TORCHFT`) and refuses others with one line
(:class:`UnsupportedVersion`, a ConfigError: entry points exit 2).
``tests/unit/test_elastic_contracts.py`` pins each assumption against the
installed libraries, so an upgrade fails in ``make test``, not in a job.

torchft is imported on demand (seconds of start-up; only elastic jobs need
it): :func:`import_torchft`. Its version is read from the package metadata.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import megatron.core
import torch
from megatron.core.distributed.param_and_grad_buffer import shard_buffer

from megascale_omni.config import ConfigError

#: The megatron-core release whose DDP bucket groups this module was written against.
MEGATRON_CORE = "0.16.1"
#: The torchft release whose Manager this module was written against.
TORCHFT = "0.2.0"


class UnsupportedVersion(ConfigError):
    """An installed megatron-core or torchft other than the one the elastic
    adapter was checked against (one line; entry points exit 2)."""

    def __init__(self, package: str, installed: str, supported: str):
        super().__init__(package, installed, f"the elastic adapter supports {supported} only")
        self.args = (
            f"platform error: {package} {installed} is installed, megascale_omni.elastic.adapter supports "
            f"{supported}: install {package}=={supported} (setup.py's pin), or port the adapter and "
            f"re-run tests/unit/test_elastic_contracts.py",
        )


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def check_versions(megatron_version: str, torchft_version: str) -> None:
    """Raise :class:`UnsupportedVersion` unless both are the supported releases."""
    if megatron_version != MEGATRON_CORE:
        raise UnsupportedVersion("megatron-core", megatron_version, MEGATRON_CORE)
    if torchft_version != TORCHFT:
        raise UnsupportedVersion("torchft", torchft_version, TORCHFT)


check_versions(megatron.core.__version__, _installed("torchft"))


# ======================================================================
# torchft
# ======================================================================
def import_torchft():
    """Import torchft with its logging quieted; returns the module (any
    rank; a standby replica group calls this before it stands by)."""
    # torchft's Rust side logs every quorum and commit at INFO, and reads
    # RUST_LOG when it loads; our step line already says what matters. A
    # RUST_LOG set by the user wins.
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import torchft

    return torchft


def process_group_for(device: torch.device, timeout: timedelta):
    """torchft's reconfigurable process group for cross-replica collectives on
    ``device``: NCCL on CUDA tensors (no host copy), gloo on CPU."""
    torchft = import_torchft()
    if device.type == "cuda":
        return torchft.ProcessGroupNCCL(timeout=timeout)
    return torchft.ProcessGroupGloo(timeout=timeout)


def new_manager(**kwargs: Any):
    """A torchft ``Manager(**kwargs)`` (every rank of the replica group)."""
    return import_torchft().Manager(**kwargs)


def http_transport(timeout: timedelta):
    """torchft's ``HTTPTransport``, the whole state in one stream (num_chunks=0, torchft's default)."""
    import_torchft()
    from torchft.checkpointing.http_transport import HTTPTransport

    return HTTPTransport(timeout=timeout, num_chunks=0)


def pg_transport(pg: Any, timeout: timedelta, device: torch.device):
    """torchft's ``PGTransport`` over the cross-replica process group ``pg``."""
    import_torchft()
    from torchft.checkpointing.pg_transport import PGTransport

    return PGTransport(pg, timeout=timeout, device=device)


def lighthouse_server(min_replicas: int = 1):
    """A torchft lighthouse on a free port (tests and benchmarks; the address
    is ``.address()``)."""
    import_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas)


class QuorumAnswers:
    """The manager's client, seen through: the wall time (``time.time()``)
    and ``max_step`` of the last quorum answer (set on torchft's quorum
    thread before the manager acts on the answer, so they are current once
    the quorum has been awaited)."""

    def __init__(self, client: Any):
        self._client = client
        #: time.time() when the lighthouse's last quorum answer arrived (None before the first).
        self.wall_time: Optional[float] = None
        #: The step the last quorum formed at (the participants' highest step).
        self.max_step: Optional[int] = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        answer = self._client._quorum(*args, **kwargs)
        self.max_step, self.wall_time = int(answer.max_step), time.time()
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def watch_quorum_answers(manager: Any) -> QuorumAnswers:
    """Time-stamp the manager's quorum answers, and make the store prefix of
    every process-group configuration unique across lighthouse restarts
    (every rank, right after the manager is created).

    torchft prefixes the gloo/NCCL rendezvous keys of a quorum with
    ``/torchft/<quorum id>/<group rank>`` on the primary group's store and
    requires that prefix to be new at every ``configure``. A restarted
    lighthouse numbers its quorums from 1 again, so a quorum id can recur
    on the same store with stale keys of the old quorum under it. The
    prefix gets ``/step<max_step>`` appended: every member of a quorum
    sees the same ``max_step``, and a restarted lighthouse's first quorum
    forms at a step at or past every step of the old lighthouse's quorums,
    so (quorum id, step) recurs only if the old lighthouse never saw a step
    committed after its quorum of that id formed."""
    answers = QuorumAnswers(manager._client)
    manager._client = answers
    configure = manager._pg.configure

    def configure_uniquely(store_addr: str, *args: Any, **kwargs: Any) -> None:
        configure(f"{store_addr}/step{answers.max_step}", *args, **kwargs)

    manager._pg.configure = configure_uniquely
    return answers


def quorum_id(manager: Any) -> int:
    """The id of the manager's current quorum (torchft exposes it only as an attribute)."""
    return int(manager._quorum_id)


def pending_peer_state(manager: Any) -> Optional[dict]:
    """The user part of a peer state the manager fetched for this healing rank
    and has not applied yet (``should_commit`` applies it), or None (nothing
    fetched, or the fetch failed)."""
    pending = manager._pending_state_dict
    return None if pending is None else pending["user"]["default"]


def commit_failures(manager: Any) -> int:
    """Consecutive uncommitted votes (a committed vote resets it to 0)."""
    return int(manager._commit_failures)


def commit_without_vote(manager: Any, participants: int) -> None:
    """What ``Manager.should_commit`` changes on a committed vote, without the
    vote: ``step + 1``, ``batches_committed + participants`` (every rank of a
    replica group alone in an unchanged quorum)."""
    state = manager.state_dict()
    manager.load_state_dict({"step": state["step"] + 1,
                             "batches_committed": state["batches_committed"] + participants})


# ======================================================================
# megatron-core DDP bucket groups
# ======================================================================
class _Waited:
    """An inner reduction already awaited; megatron's ``finish_grad_sync`` waits on it again."""

    def wait(self) -> None:
        pass


_WAITED = _Waited()


def bucket_groups(chunk: Any) -> list[Any]:
    """A DDP chunk's bucket groups, in the order its ``finish_grad_sync`` finishes them."""
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


def replace_start_grad_sync(group: Any, start: Callable) -> Callable:
    """Make every call of ``group.start_grad_sync`` (megatron's backward hook,
    DDP's ``start_grad_sync``, its ``finish_grad_sync``) call ``start``
    instead; returns megatron's own, which starts the inner reduction."""
    inner = group.start_grad_sync
    group.start_grad_sync = start
    return inner


def wrap_finish_grad_sync(chunk: Any, wrap: Callable[[Callable], Callable]) -> None:
    """Replace the DDP chunk's ``finish_grad_sync`` by ``wrap(megatron's own)``."""
    chunk.finish_grad_sync = wrap(chunk.finish_grad_sync)


def await_inner_reduction(group: Any) -> None:
    """Wait for the group's in-flight inner reduction (``overlap_grad_reduce``;
    nothing to wait for without it) and hand megatron's ``finish_grad_sync``
    a finished handle for its own wait. NCCL: orders the streams without
    blocking; gloo: waits. gloo's coalesced reduce-scatter copies its result
    into the shards on *every* ``wait()``, so megatron's second wait would
    overwrite a cross-replica sum started after the first."""
    if group.grad_reduce_handle is not None:
        group.grad_reduce_handle.wait()
        group.grad_reduce_handle = _WAITED


def group_views(group: Any) -> list[torch.Tensor]:
    """The views of one bucket group that this rank sums across replica
    groups after the inner reduction (views into megatron's buffers): with
    the distributed optimizer, the shard ``intra-instance rank`` of each
    bucket (the one its reduce-scatter filled and this rank's optimizer
    reads, ``1 / inner DP`` of the elements); without, each whole bucket."""
    if not group.ddp_config.use_distributed_optimizer:
        return [bucket.grad_data for bucket in group.buckets]
    size, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
    return [shard_buffer(bucket.grad_data, size)[rank] for bucket in group.buckets]


def bucket_numel(chunk: Any) -> list[int]:
    """Unpadded elements of each DDP bucket of ``chunk`` (dense bucket groups, in order)."""
    return [bucket.numel_unpadded for group in chunk.bucket_groups for bucket in group.buckets]


def optimizer_bucket_numel(optimizer: Any) -> Any:
    """The distributed optimizer's unpadded element count of every bucket of
    every gradient buffer (``per_bucket_numel_unpadded``)."""
    return optimizer.per_bucket_numel_unpadded
