"""Membership and quorum: which replica groups take part in each step.

A *replica group* is one torchrun job holding a full model copy. Inside it,
megatron's groups (tp, pp, cp, inner dp) never change. Across replica
groups, a torchft ``Manager`` per rank asks the lighthouse for a quorum every
step; :class:`ReplicaQuorum` turns its answer into this replica's
:class:`Participation`, decides whether the step commits, and leaves the
quorum. The sums over the participants are :mod:`.cross_replica`'s.

A replica group alone in its quorum (the steady state of a job that can
grow) skips the cross-replica sums, whose result would be its own tensors:
every rank of the group sees the same quorum, so all skip together. Alone in
the same quorum as its last committed step it also commits without torchft's
vote (:meth:`ReplicaQuorum.should_commit`).

Every method is called by every rank of the replica group, in the same order
on every replica (the cross-replica collectives must line up).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from megascale_omni.config import ElasticConfig
from megascale_omni.elastic import adapter
from megascale_omni.elastic.heal import checkpoint_transport

logger = logging.getLogger(__name__)

#: Seconds between a replica group's quorum requests to a lighthouse that
#: does not answer (torchft's manager server retries; :func:`quorum_retries`).
LIGHTHOUSE_RETRY_S = 1.0


def quorum_retries(quorum_timeout_s: float) -> int:
    """torchft's ``quorum_retries`` that makes a group's manager server ask
    an unreachable lighthouse again about every :data:`LIGHTHOUSE_RETRY_S`
    until ``quorum_timeout_s`` has passed (torchft 0.2.0 sleeps ``quorum
    timeout / (retries + 1)`` after a failed request and reconnects). With
    none (torchft's default) one failed request leaves every rank waiting out
    the whole quorum timeout, then the step raises and the group exits: a
    restarted lighthouse is only found by the groups' replacements."""
    return max(1, int(quorum_timeout_s / LIGHTHOUSE_RETRY_S))


class MembershipChanged(Exception):
    """The quorum of a step that :meth:`ReplicaQuorum.begin_step` assumed
    unchanged gives this replica another participation (every rank of the
    group raises it, before any cross-replica collective): the step's
    micro-batches must be recomputed for ``participation``."""

    def __init__(self, participation: "Participation", expected: "Participation"):
        super().__init__(f"quorum {participation.quorum_id}: participant {participation.rank} of "
                         f"{participation.size}, not {expected.rank} of {expected.size}")
        self.participation = participation


@dataclass(frozen=True)
class Participation:
    """This replica's place in the current step's quorum.

    ``rank`` is the participant rank (None while the replica heals: it then
    contributes zero gradients and takes no samples); ``size`` is the number
    of participants whose samples make up the step.
    """

    rank: Optional[int]
    size: int
    quorum_id: int
    #: time.time() when the lighthouse's answer with this quorum arrived: which
    #: lighthouse incarnation numbered it (quorum ids start over when it restarts).
    quorum_t: Optional[float] = field(default=None, compare=False)

    @property
    def participating(self) -> bool:
        return self.rank is not None


class ReplicaQuorum:
    """torchft ``Manager`` of this rank: quorum, commit, leave (every rank).

    ``state_dict`` / ``load_state_dict`` capture and restore everything a
    joining replica needs from a live peer (model, optimizer or this rank's
    shard of it, LR scheduler, step); torchft moves it from the same group
    rank of a peer through ``cfg.heal_transport`` (:mod:`.heal`).
    ``check_peer_state`` vets a fetched peer state before this replica joins
    any cross-replica collective (raises on a mismatch). ``device``: where
    the gradient buffers live (selects the cross-replica process group, see
    :func:`~megascale_omni.elastic.adapter.process_group_for`).
    ``on_quorum(participation)`` runs each time a step's quorum has been
    awaited (once or twice a step, same participation; on torchft's answer,
    before any cross-replica collective of the step can start): the sample
    ledger's attempt line is written there.
    """

    def __init__(
        self,
        cfg: ElasticConfig,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
        check_peer_state: Optional[Callable[[dict], None]] = None,
        device: torch.device = torch.device("cpu"),
        on_quorum: Optional[Callable[["Participation"], None]] = None,
    ):
        self.cfg = cfg
        self._on_quorum = on_quorum
        self.device = device
        self._check_peer_state = check_peer_state
        self.group_rank = dist.get_rank()
        timeout = timedelta(seconds=cfg.timeout_s)
        self.pg = adapter.process_group_for(device, timeout)
        #: torchft checkpoint transport a joiner fetches this rank's state through (elastic.heal_transport).
        self.transport = checkpoint_transport(cfg.heal_transport, self.pg, device, timeout)
        # Each replica group has its own torchrun store (MASTER_ADDR/PORT),
        # which torchft uses to find the group's manager server.
        self.manager = adapter.new_manager(
            pg=self.pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=True,
            # Ride out a lighthouse restart: the step waits, the model stays in memory.
            quorum_retries=quorum_retries(cfg.quorum_timeout_s),
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timeout,
            rank=self.group_rank,
            world_size=dist.get_world_size(),
            lighthouse_addr=cfg.lighthouse,
            replica_id=cfg.replica_id,
            checkpoint_transport=self.transport,
            # Every replica initialises identically from the seed
            # (layout-invariant init), so step 0 needs no weight sync.
            init_sync=False,
        )
        #: Wall time and step of each quorum answer; unique store prefixes across lighthouse restarts.
        self.answers = adapter.watch_quorum_answers(self.manager)
        self._participation: Optional[Participation] = None
        # Quorum id of the last committed step (None after an uncommitted one).
        self._committed_quorum: Optional[int] = None
        #: Whether the last should_commit asked torchft's vote (False: lone commit).
        self.voted = False
        #: Seconds this step waited for its quorum (and a heal), in begin_step or confirm.
        self.quorum_wait_s = 0.0
        # Alone in the last quorum: cross-replica sums are skipped.
        self._alone = False
        # The participation begin_step assumed, until confirm() checks it.
        self._expected: Optional[Participation] = None

    # ---------------------------------------------------------------- steps
    def begin_step(self, expect: Optional[Participation] = None) -> Participation:
        """Request the next quorum (every rank); returns this replica's
        participation in it.

        Without ``expect`` it waits for the quorum. A joining replica also
        fetches its peer's state then (applied at commit) and checks it
        before any cross-replica collective: a joiner of another layout or
        model raises here, so it never sends mismatched gradients.

        With ``expect`` (this replica's participation in its last committed
        step) it returns ``expect`` at once: the lighthouse round trip then
        overlaps the step's forward and backward, and the quorum is awaited
        by :meth:`confirm` at the first cross-replica collective, which
        raises :class:`MembershipChanged` if the quorum gives this replica
        another rank or participant count (its micro-batches were then the
        wrong share)."""
        self.quorum_wait_s = 0.0
        self.manager.start_quorum()
        if expect is not None:
            self._expected = expect
            return expect
        self._expected = None
        return self._await_quorum()

    def confirm(self) -> Participation:
        """The current quorum's participation, awaited if :meth:`begin_step`
        assumed it (every rank, before any cross-replica collective).
        Raises :class:`MembershipChanged` when it is not the assumed one."""
        expected, self._expected = self._expected, None
        if expected is None:
            return self._participation
        actual = self._await_quorum()
        if (actual.rank, actual.size) != (expected.rank, expected.size):
            raise MembershipChanged(actual, expected)
        return actual

    def sends_allowed(self) -> bool:
        """Whether this step's cross-replica sums may start (every rank,
        before the first; may run in a backward hook). Awaits an assumed
        quorum but never raises :class:`MembershipChanged`: if the quorum is
        not the assumed one nothing is sent, and :meth:`confirm` raises it
        after backward, outside megatron's schedule."""
        if self._expected is not None:
            actual = self._await_quorum()
            if (actual.rank, actual.size) != (self._expected.rank, self._expected.size):
                return False
        return not self._alone

    @property
    def alone(self) -> bool:
        """Whether this replica group is alone in the last awaited quorum
        (then a sum over the participants is its own tensor)."""
        return self._alone

    def allreduce(self, tensor: torch.Tensor):
        """Start the sum of ``tensor`` in place over the quorum (same group
        rank of every replica); returns torchft's work (``.wait()``)."""
        return self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)

    def _await_quorum(self) -> Participation:
        t0 = time.perf_counter()
        rank = self.manager.participating_rank()
        size = self.manager.num_participants()
        self._alone = self._quorum_size() == 1
        self.quorum_wait_s += time.perf_counter() - t0
        self._participation = Participation(
            rank=rank if self.manager.is_participating() else None,
            size=size,
            # The ledger keys attempts by it.
            quorum_id=adapter.quorum_id(self.manager),
            quorum_t=self.answers.wall_time,
        )
        # None when the fetch failed (then the step does not commit and is retried).
        pending = adapter.pending_peer_state(self.manager)
        if self.transport.mismatch is not None:  # the peer uses the other elastic.heal_transport
            raise self.transport.mismatch
        if not self._participation.participating and pending is not None and self._check_peer_state is not None:
            self._check_peer_state(pending)
        if self._on_quorum is not None:
            self._on_quorum(self._participation)
        return self._participation

    def _quorum_size(self) -> int:
        """Replica groups in the current quorum, healing ones included (the
        cross-replica process group's size; 0 when it is not configured)."""
        try:
            return self.pg.size()
        except (AssertionError, RuntimeError):  # configuring the quorum's group failed
            return 0

    @property
    def participation(self) -> Optional[Participation]:
        """The last quorum's :class:`Participation` (None before the first step)."""
        return self._participation

    def resume_at(self, step: int) -> None:
        """Start counting committed steps at ``step`` (after a checkpoint load; every rank)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def should_commit(self) -> bool:
        """Whether every participant finished the step (every rank). A
        joining replica applies its peer's state here, before the update.

        torchft decides by a vote of the group's ranks through its manager
        server. A group that participates alone in the same quorum as its
        last committed step (``elastic.lone_commit``) commits without the
        vote: the quorum is the same on every rank of the group, and none of
        torchft's error sources can have fired (no cross-replica collective
        ran, no process group was reconfigured, nobody healed), so the vote
        could only say yes. torchft's step count advances as the vote would
        advance it (:func:`~megascale_omni.elastic.adapter.commit_without_vote`).
        """
        part = self.confirm()
        self.voted = not (self.cfg.lone_commit and self._alone and part.participating
                          and part.quorum_id == self._committed_quorum and part.size >= self.cfg.min_replicas)
        if self.voted:
            committed = bool(self.manager.should_commit())
        else:
            self._commit_alone(part)
            committed = True
        self._committed_quorum = part.quorum_id if committed else None
        return committed

    def _commit_alone(self, part: Participation) -> None:
        """``Manager.should_commit``'s effect on a committed step, without its vote."""
        # (Not pg.errored(): on NCCL it synchronizes the device, and a group
        # alone issued nothing on it.)
        error = self.manager.errored()
        if error is not None:  # the premise of the lone commit broke: fail, do not commit
            raise RuntimeError(f"elastic: torchft reports an error in an unchanged quorum of one group: {error}")
        adapter.commit_without_vote(self.manager, part.size)

    def current_step(self) -> int:
        """Committed steps according to torchft (equals the trainer's step)."""
        return self.manager.current_step()

    def leave(self) -> None:
        """Stop heartbeats and the state server (every rank). The lighthouse
        drops this replica from the next quorum once its heartbeat times out."""
        self.manager.shutdown(wait=False)
        logger.info("elastic: replica %s left the quorum", self.cfg.replica_id)

    @property
    def healing(self) -> bool:
        """True while this replica is in a quorum it does not yet participate in."""
        return self._participation is not None and not self._participation.participating

    def describe(self) -> dict:
        """``{"replica_id", "participants", "participant_rank", "quorum_id"}`` for status reporting."""
        p = self._participation
        return {
            "replica_id": self.cfg.replica_id,
            "participants": p.size if p else None,
            "participant_rank": p.rank if p else None,
            "quorum_id": p.quorum_id if p else None,
            "lighthouse": self.cfg.lighthouse,
            "pid": os.getpid(),
        }
