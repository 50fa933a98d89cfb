"""The elastic replica dimension: cross-replica gradient sums through torchft.

A *replica group* is one torchrun job holding a full model copy. Inside it,
megatron's groups (tp, pp, cp, inner dp) never change. Across replica
groups, a torchft ``Manager`` per rank asks the lighthouse for a quorum every
step and sums gradients over the participants through a reconfigurable
process group (gloo on CPU, NCCL for CUDA buffers) that connects the same
group rank of every replica.

Seam (why here): megatron's DDP reduces inside the replica, bucket group by
bucket group. Right after it starts a group's inner reduction,
:class:`~megascale_omni.parallel.elastic_buckets.BucketSums` starts the sum
of the gradients this rank's optimizer reads from that group across
replicas (during backward with ``overlap_grad_reduce``), and megatron's
``finalize_model_grads``, run *without* the per-token scaling, awaits them.
:meth:`ElasticReplica.reduce_grads_across_replicas` then sums the token
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

A replica group alone in its quorum (the steady state of a job that can
grow) skips the cross-replica sums, whose result would be its own
tensors: every rank of the group sees the same quorum, so all skip together.
Alone in the same quorum as its last committed step it also commits without
torchft's vote (:meth:`ElasticReplica.should_commit`).

Every method is called by every rank of the replica group, in the same order
on every replica (the cross-replica collectives must line up).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.finalize_model_grads import get_pp_last_rank
from torch.distributed import ReduceOp

from megascale_omni.config import ElasticConfig
from megascale_omni.parallel.elastic_buckets import BucketSums
from megascale_omni.parallel.heal_transport import checkpoint_transport
from megascale_omni.parallel.schedules import model_device

logger = logging.getLogger(__name__)


#: torchft releases whose ``Manager.should_commit`` was read for the lone
#: commit (:meth:`ElasticReplica.should_commit`): for a group alone in an
#: unchanged quorum, with no error, it does nothing but the vote among the
#: group's ranks and ``step += 1``, ``batches_committed += participants``
#: (tests/unit/test_elastic_lone_commit.py checks this against the installed
#: torchft). Other releases always vote.
LONE_COMMIT_TORCHFT = ("0.2.0",)


def import_torchft():
    """Import torchft with its logging quieted; returns the module.

    Imported on demand (seconds of start-up): only elastic jobs need it. A
    standby replica group calls this before it stands by.
    """
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


class _Done:
    """A finished collective (the sum over a quorum of one replica group)."""

    def wait(self) -> bool:
        return True


_DONE = _Done()


class MembershipChanged(Exception):
    """The quorum of a step that :meth:`ElasticReplica.begin_step` assumed
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

    @property
    def participating(self) -> bool:
        return self.rank is not None


class ElasticReplica:
    """torchft ``Manager`` of this rank plus the gradient seam (every rank).

    ``state_dict`` / ``load_state_dict`` capture and restore everything a
    joining replica needs from a live peer (model, optimizer or this rank's
    shard of it, LR scheduler, step); torchft moves it from the same group
    rank of a peer through ``cfg.heal_transport`` (:mod:`.heal_transport`).
    ``check_peer_state`` vets a fetched peer state before this replica joins
    any cross-replica collective (raises on a mismatch). ``device``: where
    the gradient buffers live (selects the cross-replica process group, see
    :func:`process_group_for`).
    """

    def __init__(
        self,
        cfg: ElasticConfig,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
        check_peer_state: Optional[Callable[[dict], None]] = None,
        device: torch.device = torch.device("cpu"),
    ):
        Manager = import_torchft().Manager

        self.cfg = cfg
        self.device = device
        self._check_peer_state = check_peer_state
        self.group_rank = dist.get_rank()
        timeout = timedelta(seconds=cfg.timeout_s)
        self.pg = process_group_for(device, timeout)
        #: torchft checkpoint transport a joiner fetches this rank's state through (elastic.heal_transport).
        self.transport = checkpoint_transport(cfg.heal_transport, self.pg, device, timeout)
        # Each replica group has its own torchrun store (MASTER_ADDR/PORT),
        # which torchft uses to find the group's manager server.
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=True,
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
        self._participation: Optional[Participation] = None
        version = importlib.metadata.version("torchft")
        self._lone_commit = cfg.lone_commit and version in LONE_COMMIT_TORCHFT
        if cfg.lone_commit and not self._lone_commit:
            logger.warning("elastic: torchft %s is not one the lone commit was checked against (%s); "
                           "every step votes", version, ", ".join(LONE_COMMIT_TORCHFT))
        # Quorum id of the last committed step (None after an uncommitted one).
        self._committed_quorum: Optional[int] = None
        #: Whether the last should_commit asked torchft's vote (False: lone commit).
        self.voted = False
        #: Seconds this step waited for its quorum (and a heal), in begin_step or confirm.
        self.quorum_wait_s = 0.0
        #: Payload bytes this rank handed to cross-replica all-reduces since
        #: the last begin_step (gradients, token count, loss report).
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
        # Alone in the last quorum: cross-replica sums are skipped.
        self._alone = False
        # The participation begin_step assumed, until confirm() checks it.
        self._expected: Optional[Participation] = None
        # The per-bucket gradient sums of the model (attach()).
        self._buckets: Optional[BucketSums] = None

    def attach(self, model: Sequence[Any]) -> None:
        """Sum ``model``'s gradients across replicas bucket group by bucket
        group as megatron reduces them inside the group (every rank, once,
        before the first step; :mod:`megascale_omni.parallel.elastic_buckets`)."""
        self._buckets = BucketSums(model, self._sends_allowed, self._allreduce_sum)

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
        self.bytes_sent = 0
        self.early_buckets = 0
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

    def _sends_allowed(self) -> bool:
        """Whether this step's gradient sums may start (every rank, before
        the first; may run in a backward hook). Awaits an assumed quorum but
        never raises :class:`MembershipChanged`: if the quorum is not the
        assumed one nothing is sent, and :meth:`confirm` raises it after
        backward, outside megatron's schedule."""
        if self._expected is not None:
            actual = self._await_quorum()
            if (actual.rank, actual.size) != (self._expected.rank, self._expected.size):
                return False
        return not self._alone

    def _await_quorum(self) -> Participation:
        t0 = time.perf_counter()
        rank = self.manager.participating_rank()
        size = self.manager.num_participants()
        self._alone = self._quorum_size() == 1
        self.quorum_wait_s += time.perf_counter() - t0
        self._participation = Participation(
            rank=rank if self.manager.is_participating() else None,
            size=size,
            # torchft exposes the quorum id only as this attribute (0.2.0);
            # the ledger keys attempts by it.
            quorum_id=int(self.manager._quorum_id),
        )
        # torchft keeps a fetched peer state only in this attribute (0.2.0)
        # until should_commit applies it; None when the fetch failed (then
        # the step does not commit and is retried).
        pending = self.manager._pending_state_dict
        if self.transport.mismatch is not None:  # the peer uses the other elastic.heal_transport
            raise self.transport.mismatch
        if not self._participation.participating and pending is not None and self._check_peer_state is not None:
            self._check_peer_state(pending["user"]["default"])
        return self._participation

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
        self.confirm()
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
        if not self._alone:
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
        self.confirm()
        if tensor.device == self.device:
            self._allreduce_sum(tensor).wait()
        else:  # host-side reports, with NCCL across replicas
            staged = tensor.to(self.device)
            self._allreduce_sum(staged).wait()
            tensor.copy_(staged)
        return tensor

    def _allreduce_sum(self, tensor: torch.Tensor):
        """Start a cross-replica sum of ``tensor`` in place; count its bytes.
        Alone in the quorum the sum is ``tensor`` itself: nothing is sent."""
        if self._alone:
            return _DONE
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)

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
        advance it.
        """
        part = self.confirm()
        self.voted = not (self._lone_commit and self._alone and part.participating
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
        state = self.manager.state_dict()
        self.manager.load_state_dict({"step": state["step"] + 1,
                                      "batches_committed": state["batches_committed"] + part.size})

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
