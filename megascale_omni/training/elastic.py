"""Elastic training glue: the Trainer's one seam to the replica dimension.

:class:`ElasticTrainer` decides, per step, which share of the global batch
this rank computes (from the quorum), writes the sample ledger, and owns the
state a joining replica copies from a live peer. The math of the
cross-replica reduction lives in :mod:`megascale_omni.parallel.elastic`.

Data position: the global batch of committed step ``s`` is a pure function
of (seed, s). Participant ``p`` of ``P`` with inner DP rank ``i`` of ``I``
computes DP rank ``p * I + i`` of ``P * I`` of it (whole micro-batches,
:func:`megascale_omni.data.balance.microbatch_shares`), so a retried step
uses the same samples and a membership change re-splits the same batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from megatron.core import parallel_state as mpu

from megascale_omni.parallel.elastic import ElasticReplica, Participation
from megascale_omni.training.ledger import SampleLedger

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShare:
    """What this rank computes in the step about to run."""

    #: Step index (committed steps so far, on every participant).
    step: int
    participation: Participation
    #: This rank's DP coordinates over all participants (None while healing).
    dp_rank: Optional[int]
    dp_size: int


class ElasticTrainer:
    """Replica membership, data share, ledger and status for one Trainer (every rank)."""

    def __init__(self, trainer):
        self.trainer = trainer
        cfg = trainer.cfg.elastic
        self.replica = ElasticReplica(cfg, self._peer_state, self._load_peer_state)
        for chunk in trainer.chunks:
            chunk.config.finalize_model_grads_func = self.replica.finalize_model_grads
        self.inner_dp = trainer.dims.dp
        writes_ledger = (
            bool(cfg.ledger_dir)
            and mpu.is_pipeline_first_stage(ignore_virtual=True)
            and mpu.get_tensor_model_parallel_rank() == 0
        )
        self.ledger = SampleLedger(cfg.ledger_dir, cfg.replica_id, trainer.dp_rank) if writes_ledger else None
        if trainer.step:
            # Resumed from a checkpoint: torchft counts committed steps from
            # there, so replica groups that loaded the same step need no heal.
            self.replica.resume_at(trainer.step)
        self.left = False
        #: Whether the last finished attempt committed (None before the first).
        self.last_committed: Optional[bool] = None
        self.retries = 0

    # ------------------------------------------------------------- per step
    def begin_step(self) -> StepShare:
        """Join the quorum; return this rank's share of the step (every rank)."""
        part = self.replica.begin_step()
        step = self.replica.current_step()
        if not part.participating:
            logger.info("elastic: healing from a live peer at step %d (quorum %d)", step, part.quorum_id)
            return StepShare(step, part, None, part.size * self.inner_dp)
        if step != self.trainer.step:
            raise RuntimeError(f"elastic: torchft is at step {step} but the trainer at {self.trainer.step}")
        dp_size = part.size * self.inner_dp
        return StepShare(step, part, part.rank * self.inner_dp + self.trainer.dp_rank, dp_size)

    def microbatches(self, share: StepShare) -> list[dict]:
        """This rank's micro-batches (empty while healing); logs the attempt to the ledger."""
        if share.dp_rank is None:
            samples, mbs = [], []
        else:
            task = self.trainer.task
            mbs = task.microbatches(share.step, share.dp_rank, share.dp_size)
            samples = task.sample_ids(share.step, share.dp_rank, share.dp_size) if self.ledger else []
        if self.ledger is not None:
            p = share.participation
            self.ledger.attempt(share.step, p.quorum_id, p.rank, p.size, share.dp_rank, share.dp_size, samples)
        return mbs

    def end_step(self, share: StepShare, committed: bool) -> None:
        self.last_committed = committed
        self.retries += 0 if committed else 1
        if self.ledger is not None:
            self.ledger.commit(share.step, share.participation.quorum_id, committed)
        if not committed:
            logger.warning(
                "elastic: step %d not committed (quorum %d, %d participants); retrying it with the same samples",
                share.step + 1, share.participation.quorum_id, share.participation.size,
            )

    def is_writer(self) -> bool:
        """Whether this replica group writes the shared checkpoints: it was
        participant rank 0 in the last quorum (same answer on all its ranks)."""
        p = self.replica.participation
        return p is not None and p.rank == 0

    # ---------------------------------------------------- leave and status
    # Drain is the control plane's: `omni-ctl drain` reaches every rank of the
    # replica at the same step boundary (ControlPlane.step_boundary returns
    # False), the loop stops and the Trainer calls leave() on every rank.
    def leave(self) -> None:
        if not self.left:
            self.left = True
            self.replica.leave()
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    def describe(self) -> dict:
        """Replica view for ``omni-ctl status`` (training thread): replica id,
        participants and this replica's participant rank in the last quorum,
        quorum id, committed steps, whether the last attempt committed, retries."""
        return {
            **self.replica.describe(),
            "committed_steps": self.trainer.step,
            "last_step_committed": self.last_committed,
            "uncommitted_attempts": self.retries,
            "healing": self.replica.healing,
        }

    # ------------------------------------------------ state for joining peers
    def _peer_state(self) -> dict:
        """What a joining replica's same group rank needs (torchft's quorum
        thread calls this while the training thread waits for the quorum)."""
        t = self.trainer
        task_state = t.task.checkpoint_state() if hasattr(t.task, "checkpoint_state") else {}
        return {
            "model": [c.module.state_dict() for c in t.chunks],
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "step": t.step,
            "task": task_state,
        }

    def _load_peer_state(self, state: dict) -> None:
        """Apply a peer's state (training thread, inside should_commit, before the update)."""
        t = self.trainer
        for chunk, model_state in zip(t.chunks, state["model"]):
            chunk.module.load_state_dict(model_state)
        t.optimizer.load_state_dict(state["optimizer"])
        t.scheduler.load_state_dict(state["scheduler"])
        if state["task"] and hasattr(t.task, "load_checkpoint_state"):
            t.task.load_checkpoint_state(state["task"])
        t.step = int(state["step"])
        logger.info("elastic: healed from a live peer: model, optimizer, LR scheduler at step %d", t.step)
