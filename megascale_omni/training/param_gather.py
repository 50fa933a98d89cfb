"""When the distributed optimizer's updated parameters reach every DP rank
(``parallel.overlap_param_gather``).

With megatron's distributed optimizer each DP rank updates only its shard of
every bucket; an all-gather inside the DP group then gives every rank the
whole updated weights. Without the overlap ``optimizer.step()`` runs that
all-gather before it returns. With it (megatron DDP ``overlap_param_gather``)
``step()`` returns at once and megatron's forward pre-hooks start and await
each bucket's gather during the next forward, so the gather hides behind
compute; until then the weights outside this rank's shards are the previous
step's. :class:`ParamGather` keeps every other reader of the weights
correct:

- :meth:`ParamGather.sync` completes a pending gather before a checkpoint
  save, an evaluation or DiT's EMA update, and turns the pre-hooks off until
  the next update (as Megatron-LM does around evaluation), so neither an
  evaluation on some ranks only nor the next forward gathers the same weights
  again;
- elastic jobs (``serves_peers``) never use the pre-hooks: the gather starts
  asynchronously right after the step and :meth:`ParamGather.sync` completes
  it before the next quorum request, on the training thread. A joining
  replica group's peer state is read on torchft's quorum thread at any time
  during the next step, so the weights must be whole and unchanging by then;
  and a rank without micro-batches (healing, or more DP ranks than
  micro-batches) runs no forward, so pre-hook gathers on its DP peers would
  have no partner. The gather then overlaps the step boundary's own work
  (step record, metrics, control) instead of the next forward.

Every method is called by every rank of the DP group at the same point: the
gathers are collectives over it.
"""

from __future__ import annotations

from typing import Sequence

from megatron.core.distributed import DistributedDataParallel


class ParamGather:
    """The pending parameter all-gather of one rank's DDP chunks.

    ``overlap``: the chunks were wrapped with megatron's
    ``overlap_param_gather`` (otherwise every method does nothing: the
    optimizer gathered inside ``step()``). ``serves_peers``: an elastic job
    (see the module docstring).
    """

    def __init__(self, chunks: Sequence[DistributedDataParallel], overlap: bool, serves_peers: bool):
        self.chunks = list(chunks)
        self.enabled = overlap
        self.serves_peers = overlap and serves_peers
        #: The optimizer changed this rank's shards since the last completed gather.
        self.pending = False
        # megatron registers the pre-hooks when it wraps a chunk with the overlap.
        self._hooks_on = overlap
        if self.serves_peers:
            self._set_hooks(False, sync=False)

    def step_done(self, updated: bool) -> None:
        """After each optimizer step attempt; ``updated``: the optimizer
        changed the weights (every rank). Elastic jobs start the gather here."""
        if not self.enabled:
            return
        if self.serves_peers:
            if updated:
                for chunk in self.chunks:
                    chunk.start_param_sync()  # asynchronous: the DDP config overlaps it
                self.pending = True
            return
        if updated and not self._hooks_on:
            self._set_hooks(True)
        # The step's forward gathered any earlier update (through the pre-hooks).
        self.pending = updated

    def sync(self) -> None:
        """Make the weights whole on this rank: wait for, or run, the pending
        gather (every rank of the DP group at the same point)."""
        if not self.enabled:
            return
        if self.serves_peers:
            if self.pending:
                for chunk in self.chunks:
                    chunk.start_param_sync(force_sync=True)  # waits for the gathers in flight
        elif self._hooks_on:
            self._set_hooks(False, sync=self.pending)
        self.pending = False

    def _set_hooks(self, on: bool, sync: bool = False) -> None:
        for chunk in self.chunks:
            if on:
                chunk.enable_forward_pre_hook()
            else:
                # With ``sync`` megatron gathers every bucket synchronously (waiting for those in flight).
                chunk.disable_forward_pre_hook(param_sync=sync)
        self._hooks_on = on
