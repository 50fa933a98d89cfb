"""How a joining replica group receives a live peer's state (``elastic.heal_transport``).

torchft's ``Manager`` hands its checkpoint transport the whole peer state
(``{"user": ..., "torchft": ...}``) in its quorum thread: the sending rank
calls ``send_checkpoint`` for every healing replica rank, the healing rank
calls ``recv_checkpoint`` from the replica rank the lighthouse assigned,
both between the quorum's process-group reconfiguration and the step's first
cross-replica collective (``Manager.allreduce`` waits for the quorum
thread). Rank ``r`` of a group always pairs with rank ``r`` of the peer.

- ``http``: torchft's ``HTTPTransport``. Every rank runs an HTTP server; the
  sender stages its state in host memory (device tensors are copied to the
  host) and the joiner streams it with ``torch.load`` over one connection.
- ``pg``: torchft's ``PGTransport`` over the cross-replica process group
  the Manager already reconfigures per quorum (its replica ranks are the
  ranks the transport addresses): gloo on CPU, NCCL device to device on
  GPU. One pickled metadata message, then one send per tensor. The joiner
  receives into fresh buffers (moved to the host as they arrive) rather
  than in place, so its own weights stay untouched until the state passed
  ``check_peer_state`` and the step commits. PGTransport sends each
  tensor's whole storage, and many of a rank's tensors are views of one
  storage (with the distributed optimizer every parameter is a view of its
  buffer's ``param_data``, and so is its fp32 main parameter): the state is
  therefore sent as its distinct storages, once each, plus the view of
  each tensor (:func:`pack_storages`), as ``torch.save`` does for ``http``.

Sender and joiner must use the same transport. :class:`HealTransport`
prefixes torchft's transport metadata (which the joiner reads from its peer
before fetching) with the transport's name, so a joiner started with the
other value fails its fetch at once and keeps the :class:`ConfigError` for
the training thread to raise, instead of waiting for a transfer that never
comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from megascale_omni.config import ConfigError
from megascale_omni.elastic import adapter

#: ``elastic.heal_transport`` values.
HEAL_TRANSPORTS = ("http", "pg")


@dataclass(frozen=True)
class _View:
    """A tensor of a packed state: a view of ``storages[index]``."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def pack_storages(state: Any) -> dict:
    """``{"storages": [uint8 tensor per distinct storage], "state": state
    with every tensor replaced by its view}`` (any thread; no copies)."""
    storages: list[torch.Tensor] = []
    index: dict[tuple, int] = {}

    def view(leaf: Any) -> Any:
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter):  # DTensors and non-tensors as they are
            return leaf
        storage = leaf.untyped_storage()
        key = (leaf.device, storage.data_ptr(), storage.nbytes())
        if key not in index:
            index[key] = len(storages)
            storages.append(torch.empty(0, dtype=torch.uint8, device=leaf.device).set_(storage))
        return _View(index[key], leaf.dtype, tuple(leaf.shape), leaf.stride(), leaf.storage_offset())

    return {"state": tree_map(view, state), "storages": storages}


def unpack_storages(packed: dict) -> Any:
    """Inverse of :func:`pack_storages`: tensors sharing a storage share it again."""
    storages = packed["storages"]

    def tensor(leaf: Any) -> Any:
        if not isinstance(leaf, _View):
            return leaf
        return torch.as_strided(storages[leaf.index].view(leaf.dtype), leaf.shape, leaf.stride, leaf.offset)

    return tree_map(tensor, packed["state"])


class HealTransport:
    """torchft ``CheckpointTransport`` of one ``elastic.heal_transport``
    value (``kind``), delegating to torchft's ``inner`` transport; called by
    the Manager's quorum thread. :attr:`mismatch` is set (and raised) when
    a peer's metadata names another transport."""

    def __init__(self, kind: str, inner: Any, packs: bool = False):
        self.kind = kind
        self.inner = inner
        #: Send distinct storages once each (:func:`pack_storages`).
        self.packs = packs
        #: Set by :meth:`recv_checkpoint` when the peer uses another transport.
        self.mismatch: Optional[ConfigError] = None

    def metadata(self) -> str:
        return f"{self.kind}|{self.inner.metadata()}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        self.inner.send_checkpoint(dst_ranks, step, pack_storages(state_dict) if self.packs else state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        self.inner.disallow_checkpoint()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        peer, sep, inner = metadata.partition("|")
        if not sep or peer != self.kind:
            self.mismatch = ConfigError(
                "elastic.heal_transport", self.kind,
                f"differs from the running job's ({peer if sep else 'unknown'}): a joiner fetches its peer's "
                f"state through the peer's transport; start this group with the running job's "
                f"elastic.heal_transport",
            )
            raise self.mismatch
        state = self.inner.recv_checkpoint(src_rank, inner, step, timeout)
        return unpack_storages(state) if self.packs else state

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)

    @property
    def name(self) -> str:
        """torchft's class doing the transfer (``HTTPTransport``, ``PGTransport``)."""
        return type(self.inner).__name__


def checkpoint_transport(kind: str, pg, device: torch.device, timeout: timedelta) -> HealTransport:
    """The checkpoint transport for ``elastic.heal_transport=kind`` (every
    rank, before its ``Manager`` is built). ``pg``: the cross-replica
    process group passed to the Manager; ``device``: where the state's
    tensors live (``pg``'s backend works on it)."""
    if kind == "http":
        return HealTransport(kind, adapter.http_transport(timeout))
    if kind == "pg":
        return HealTransport(kind, adapter.pg_transport(pg, timeout, device), packs=True)
    raise ValueError(f"elastic.heal_transport={kind!r}: must be one of {', '.join(HEAL_TRANSPORTS)}")
