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
  ``check_peer_state`` and the step commits.
"""

from __future__ import annotations

from datetime import timedelta

import torch

#: ``elastic.heal_transport`` values.
HEAL_TRANSPORTS = ("http", "pg")


def checkpoint_transport(kind: str, pg, device: torch.device, timeout: timedelta):
    """torchft checkpoint transport for ``elastic.heal_transport=kind``
    (every rank, before its ``Manager`` is built). ``pg``: the cross-replica
    process group passed to the Manager; ``device``: where the state's
    tensors live (``pg``'s backend works on it)."""
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    if kind == "http":
        # Whole state in one stream (num_chunks=0), as torchft's default.
        return HTTPTransport(timeout=timeout, num_chunks=0)
    if kind == "pg":
        return PGTransport(pg, timeout=timeout, device=device)
    raise ValueError(f"elastic.heal_transport={kind!r}: must be one of {', '.join(HEAL_TRANSPORTS)}")
