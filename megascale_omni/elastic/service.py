"""Replica membership as the Trainer sees it: which share of each global
batch this rank computes, and how a step is run.

The Trainer holds one membership object and calls it the same way whatever
the job: :class:`StaticMembership` for a fixed replica group (the null
object: the share is this rank's DP slice), :class:`ElasticMembership` for
replica groups that join and leave through torchft. The elastic one decides
per step, from the quorum (:mod:`.membership`), which share of the global
batch this rank computes, recomputes a step whose assumed quorum changed
(:meth:`ElasticMembership.run_step`), writes the sample ledger, and serves
the :class:`~megascale_omni.checkpoint.train_state.TrainState` a joining
replica copies from a live peer. The sums over the participants are
:mod:`.cross_replica`'s. The checkpointer asks :meth:`is_writer` (a
predicate it receives at construction).

Data position: the global batch of committed step ``s`` is a pure function
of (seed, s). Participant ``p`` of ``P`` with inner DP rank ``i`` of ``I``
computes DP rank ``p * I + i`` of ``P * I`` of it (whole micro-batches,
:func:`megascale_omni.data.balance.microbatch_shares`), so a retried step
uses the same samples and a membership change re-splits the same batch.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads

from megascale_omni.checkpoint.train_state import TrainState
from megascale_omni.config import ElasticConfig
from megascale_omni.elastic import adapter
from megascale_omni.elastic.cross_replica import CrossReplicaSums
from megascale_omni.elastic.ledger import SampleLedger
from megascale_omni.elastic.membership import MembershipChanged, Participation, ReplicaQuorum
from megascale_omni.metrics.breakdown import PHASES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepShare:
    """What this rank computes in the step about to run."""

    #: Step index (committed steps so far, on every participant).
    step: int
    #: This rank's DP coordinates over all participants (None while healing).
    dp_rank: Optional[int]
    dp_size: int


def _ledger_writer(directory: str, replica_id: str, dp_rank: int) -> Optional[SampleLedger]:
    """The ledger of DP rank ``dp_rank`` when ``directory`` is set and this rank
    writes it (every rank calls; None elsewhere): one writer per DP rank, its
    first-stage process of TP rank 0 and CP rank 0 (the TP and CP ranks of a
    DP rank compute the same samples)."""
    writes = (
        bool(directory)
        and mpu.is_pipeline_first_stage(ignore_virtual=True)
        and mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_context_parallel_rank() == 0
    )
    return SampleLedger(directory, replica_id, dp_rank) if writes else None


class StaticMembership:
    """A fixed replica group: every step belongs to it alone (every rank).

    With ``elastic.ledger_dir`` it writes the sample ledger too (quorum 0,
    participant 0 of 1, replica ``elastic.replica_id`` or ``job``), after each
    step: what each step of a run consumed, across resumes at any layout."""

    enabled = False
    #: No cross-replica dimension: gradients are reduced by megatron's DDP only.
    cross_replica = None

    def __init__(self, state: TrainState, dp_rank: int, ledger_dir: str = "", replica_id: str = ""):
        self.state = state
        self.dp_rank = dp_rank
        self.account = state.task.bad_samples
        self.ledger = _ledger_writer(ledger_dir, replica_id or "job", dp_rank)

    def enter(self, control: Any) -> bool:
        """Ready to train at once."""
        return True

    def begin_step(self) -> StepShare:
        return StepShare(self.state.step, self.dp_rank, self.state.dims.dp)

    def microbatches(self, share: StepShare) -> list[dict]:
        return self.state.task.microbatches(share.step, share.dp_rank, share.dp_size)

    def run_step(self, share: StepShare, mbs: list[dict],
                 attempt: Callable[[list[dict]], Any]) -> tuple[StepShare, Any]:
        """``(share, attempt(mbs))``: a fixed group's step runs once."""
        return share, attempt(mbs)

    def end_step(self, share: StepShare, committed: bool) -> None:
        """A fixed group always commits: the step's bad-sample counts, reduced
        while it computed, are added to the totals; the ledger records the
        step's samples (every rank)."""
        if self.account is not None:
            self.account.settle()
        if self.ledger is not None:
            samples = self.state.task.sample_ids(share.step, share.dp_rank, share.dp_size)
            self.ledger.attempt(share.step, 0, 0, 1, share.dp_rank, share.dp_size, samples)
            self.ledger.commit(share.step, 0, committed)

    def annotate(self, record: dict, share: StepShare) -> None:
        """No replica fields in the step record."""

    def is_writer(self) -> bool:
        return True

    def describe(self) -> Optional[dict]:
        return None

    def leave(self) -> None:
        """Nothing to leave; the ledger is closed."""
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None


class ElasticMembership:
    """Replica membership, data share, ledger and status of one replica group
    in an elastic job (every rank).

    The torchft manager is created in :meth:`enter` (after the checkpoint
    resume, so torchft counts steps from the resumed one); a standby group
    (``elastic.standby``) creates it only once the control plane tells it
    to join.
    """

    enabled = True

    def __init__(self, state: TrainState, cfg: ElasticConfig, dp_rank: int):
        self.state = state
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.inner_dp = state.dims.dp
        self.quorum: Optional[ReplicaQuorum] = None
        self.sums: Optional[CrossReplicaSums] = None
        self.ledger: Optional[SampleLedger] = None
        self.left = False
        #: Whether the last finished attempt committed (None before the first).
        self.last_committed: Optional[bool] = None
        self.retries = 0
        #: (step, quorum id, participant, participants) of the last attempt line written.
        self._recorded: Optional[tuple] = None
        # Bad-sample counts are summed over the participants and committed
        # with the step, so every replica holds the job's totals.
        self.account = state.task.bad_samples
        if self.account is not None:
            self.account.job_wide = True

    @property
    def cross_replica(self) -> Optional[CrossReplicaSums]:
        return self.sums

    def _finalize_model_grads(self, model, num_tokens=None, pg_collection=None, force_all_reduce=False) -> None:
        """``CrossReplicaSums.finalize_model_grads`` with its two halves timed
        as ``grad_sync`` and ``cross_replica`` (metrics/breakdown.py)."""
        with PHASES.phase("grad_sync"):
            finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        with PHASES.phase("cross_replica"):
            self.sums.reduce_grads_across_replicas(model, num_tokens, pg_collection)

    def _start(self) -> None:
        """Create the torchft manager and hook the cross-replica gradient sum (every rank)."""
        device = next(self.state.chunks[0].parameters()).device
        self.quorum = ReplicaQuorum(self.cfg, self.state.state_dict, self._load_peer_state,
                                    check_peer_state=self.state.check_peer_state, device=device,
                                    on_quorum=self._record_attempt)
        self.sums = CrossReplicaSums(self.quorum, device)
        self.sums.attach(self.state.chunks)
        for chunk in self.state.chunks:
            chunk.config.finalize_model_grads_func = self._finalize_model_grads
        self.ledger = _ledger_writer(self.cfg.ledger_dir, self.cfg.replica_id, self.dp_rank)
        if self.state.step:
            # Resumed from a checkpoint: torchft counts committed steps from
            # there, so replica groups that loaded the same step need no heal.
            self.quorum.resume_at(self.state.step)

    def enter(self, control: Any) -> bool:
        """Enter the quorum (every rank, before the first step); a standby
        group first waits for ``omni-ctl join``. False when drained before
        joining."""
        if self.quorum is not None:
            return True
        if not self.cfg.standby:
            self._start()
            return True
        # Pay torchft's import (seconds) while standing by, not after `join`.
        adapter.import_torchft()
        if not control.stand_by(self.state.step):
            logger.info("elastic: drained while standing by; replica %s never joined", self.cfg.replica_id)
            return False
        t0 = time.perf_counter()
        self._start()
        logger.info("elastic: replica %s left standby; torchft manager up in %.3f s",
                    self.cfg.replica_id, time.perf_counter() - t0)
        return True

    # ------------------------------------------------------------- per step
    def begin_step(self) -> StepShare:
        """Request the quorum; return this rank's share of the step (every rank).

        With ``elastic.overlap_quorum``, after a committed step in which this
        replica participated, the share is computed for the same
        participation without waiting: the quorum is confirmed at the step's
        first cross-replica collective, and the Trainer recomputes the step
        (:meth:`run_step`) if membership changed. The weights are made
        whole first (:meth:`TrainState.sync_params`): a joining replica may
        read them on torchft's quorum thread at any time during the step."""
        # Before the quorum: a joiner's peer state is read on torchft's quorum thread during the step.
        self.state.sync_params()
        last = self.quorum.participation
        expect = last if self.cfg.overlap_quorum and self.last_committed and last and last.participating else None
        self.sums.new_step()
        return self._share(self.quorum.begin_step(expect))

    def run_step(self, share: StepShare, mbs: list[dict],
                 attempt: Callable[[list[dict]], Any]) -> tuple[StepShare, Any]:
        """``(share, attempt(mbs))`` (every rank). If the quorum the step
        assumed (``elastic.overlap_quorum``) gives this replica another
        participation, :class:`MembershipChanged` is raised before anything
        was sent or updated: the step is computed again, once, for the share
        of the quorum it got (the counts of the discarded micro-batches are
        dropped); returns that share and its result."""
        try:
            return share, attempt(mbs)
        except MembershipChanged as changed:
            if self.account is not None:
                self.account.abandon()
            logger.info("elastic: membership changed during step %d (%s); recomputing it",
                        self.state.step + 1, changed)
            share = self._share(changed.participation)
            return share, attempt(self.microbatches(share))

    def _coordinates(self, part: Participation) -> StepShare:
        """This rank's share of the current step in ``part`` (no checks)."""
        dp_rank = part.rank * self.inner_dp + self.dp_rank if part.participating else None
        return StepShare(self.quorum.current_step(), dp_rank, part.size * self.inner_dp)

    def _share(self, part: Participation) -> StepShare:
        share = self._coordinates(part)
        if not part.participating:
            logger.info("elastic: healing from a live peer at step %d (quorum %d)", share.step, part.quorum_id)
        elif share.step != self.state.step:
            raise RuntimeError(f"elastic: torchft is at step {share.step} but the trainer at {self.state.step}")
        return share

    def _record_attempt(self, part: Participation) -> None:
        """Write the ledger's attempt line of this step in quorum ``part``
        (every rank; the ledger's writer writes, once per step and quorum):
        called by :class:`ReplicaQuorum` as soon as the step's quorum is
        known, so the line is on disk (:meth:`SampleLedger.attempt`) before
        this group's gradients enter the cross-replica sum, and a group
        killed after that sum still has its share on record. The samples
        are those :meth:`microbatches` computes for the same share (a pure
        function of step and DP coordinates)."""
        if self.ledger is None:
            return
        share = self._coordinates(part)
        key = (share.step, part.quorum_id, part.rank, part.size)
        if key == self._recorded:
            return
        samples = ([] if share.dp_rank is None
                   else self.state.task.sample_ids(share.step, share.dp_rank, share.dp_size))
        self.ledger.attempt(share.step, part.quorum_id, part.rank, part.size, share.dp_rank, share.dp_size,
                            samples, part.quorum_t)
        self._recorded = key

    def microbatches(self, share: StepShare) -> list[dict]:
        """This rank's micro-batches (empty while healing)."""
        if share.dp_rank is None:
            mbs = []
        else:
            mbs = self.state.task.microbatches(share.step, share.dp_rank, share.dp_size)
        if self.account is not None:
            # This replica's counts of the attempt (zero while healing); they
            # ride in the step's cross-replica all-reduce, so settle them now.
            self.account.settle()
            self.sums.step_counts = self.account.attempt.clone()
        return mbs

    def end_step(self, share: StepShare, committed: bool) -> None:
        """Record the attempt's outcome in the ledger (its attempt line was
        written when the quorum was known, :meth:`_record_attempt`); on
        commit add the job-wide step counts to the task's totals (every rank)."""
        self.last_committed = committed
        self._recorded = None  # a retry in an unchanged quorum writes its own attempt line
        p = self.quorum.participation  # confirmed by the step's collectives
        if self.account is not None:
            if committed:
                self.account.commit(self.sums.step_counts)
            else:
                self.account.abandon()
        self.retries += 0 if committed else 1
        if self.ledger is not None:
            self.ledger.commit(share.step, p.quorum_id, committed, p.quorum_t)
        if not committed:
            logger.warning(
                "elastic: step %d not committed (quorum %d, %d participants); retrying it with the same samples",
                share.step + 1, p.quorum_id, p.size,
            )

    def annotate(self, record: dict, share: StepShare) -> None:
        """Replica fields of the step record: participants, the quorum id
        it committed under and the wall time its lighthouse answered it (the
        ledger's replay rule reads them), quorum wait, healed, the payload bytes this rank sent to cross-replica
        all-reduces in the step (gradients, token count, loss report), and
        how many gradient bucket groups' sums started during backward."""
        p = self.quorum.participation
        record.update(participants=p.size, quorum=p.quorum_id, quorum_t=p.quorum_t, quorum_s=self.quorum.quorum_wait_s,
                      healed=not p.participating,
                      cross_replica_bytes=self.sums.bytes_sent,
                      cross_replica_early_buckets=self.sums.early_buckets)

    def is_writer(self) -> bool:
        """Whether this replica group writes the shared checkpoints: it was
        participant rank 0 in the last quorum (same answer on all its ranks)."""
        p = self.quorum.participation if self.quorum is not None else None
        return p is not None and p.rank == 0

    # ---------------------------------------------------- leave and status
    # Drain is the control plane's: `omni-ctl drain` reaches every rank of the
    # replica at the same step boundary (ControlPlane.step_boundary returns
    # False), the loop stops and the Trainer calls leave() on every rank.
    def leave(self) -> None:
        if self.quorum is not None and not self.left:
            self.left = True
            self.quorum.leave()
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None

    def describe(self) -> dict:
        """Replica view for ``omni-ctl status`` (training thread): replica id,
        participants and this replica's participant rank in the last quorum,
        quorum id, committed steps, whether the last attempt committed, retries."""
        if self.quorum is None:
            return {"replica_id": self.cfg.replica_id, "lighthouse": self.cfg.lighthouse, "standby": True,
                    "pid": os.getpid()}
        return {
            **self.quorum.describe(),
            "committed_steps": self.state.step,
            "last_step_committed": self.last_committed,
            "uncommitted_attempts": self.retries,
            "healing": self.quorum.healing,
        }

    # ------------------------------------------------ state for joining peers
    def _load_peer_state(self, state: dict) -> None:
        """Apply a peer's state (training thread, inside should_commit, before the update)."""
        self.state.load_state_dict(state)
        logger.info("elastic: healed from a live peer over %s: model, optimizer, LR scheduler at step %d",
                    self.quorum.transport.name, self.state.step)


def build_membership(state: TrainState, cfg: ElasticConfig, dp_rank: int):
    """The membership service of this job (every rank)."""
    if cfg.enabled:
        return ElasticMembership(state, cfg, dp_rank)
    return StaticMembership(state, dp_rank, cfg.ledger_dir, cfg.replica_id)
