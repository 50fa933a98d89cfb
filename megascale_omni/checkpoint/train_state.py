"""TrainState: everything training has learned and where it stands, able to
save and restore itself.

The services receive this, never the Trainer: the Checkpointer writes its
sharded form to disk, and the elastic layer sends its in-memory form to a
joining replica group. Both forms come from one capture (:meth:`TrainState._capture`)
with the same keys::

    "model" | "model0".."model{vpp-1}"  each chunk's weights
    "optimizer"                         megatron optimizer state (in memory:
                                        this rank's shard with the distributed
                                        optimizer, see elastic/peer_state.py)
    "scheduler"                         LR scheduler state_dict()
    "task"                              the task's own state (counters, EMA, ...)
    "trainer": {"step": N}              committed optimizer steps

in memory only, ``"peer"`` (layout, shared config, data digests and
gradient buckets, checked by a joiner before it applies anything), and, in a checkpoint only, ``"rng"`` (a ShardedObject over (pp, tp)),
``"config"`` (the job config as a plain dict), ``"layout"`` and
``"data_plan"`` (what decides each step's samples, with the data digests:
:mod:`megascale_omni.data.plan_record`, checked on resume); beside
the tensors, a checkpoint holds :attr:`TrainState.hf_assets` as files. The data
position is the step: every sample plan is step-indexed. Every method is
called on every rank.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch

from megascale_omni.checkpoint.hf_assets import HFAssets
from megascale_omni.checkpoint.state import (
    DIST_OPT_FORMAT,
    dist_opt_format,
    keep_adam_step,
    prime_adam_state,
    restore_adam_step,
    restore_rng,
    rng_object,
)
from megascale_omni.config import JobConfig, to_dict
from megascale_omni.data.plan_record import CHECKPOINT_KEY as PLAN_KEY
from megascale_omni.data.plan_record import check_resumed_plan, plan_record
from megascale_omni.elastic.peer_state import (
    check_peer_state,
    grad_buckets,
    load_peer_optimizer_state,
    optimizer_layout,
    peer_optimizer_state,
    replica_config,
)
from megascale_omni.parallel import ParallelDims


class StatefulTask(Protocol):
    """The part of a task a TrainState saves (see megascale_omni.tasks.base.Task)."""

    def state_dict(self, sharded: bool) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def data_identity(self) -> dict[str, dict]: ...


class ParamSync(Protocol):
    """What a TrainState needs of the parameter gather (:class:`~megascale_omni.training.param_gather.ParamGather`)."""

    def sync(self) -> None: ...


class TrainState:
    """Model chunks (DDP-wrapped), optimizer, LR scheduler, step and task state
    of one rank."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        optimizer: Any,
        scheduler: Any,
        task: StatefulTask,
        cfg: JobConfig,
        dims: ParallelDims,
        param_gather: Optional[ParamSync] = None,
    ):
        self.chunks = list(chunks)
        #: Completes a pending all-gather of updated parameters
        #: (:class:`~megascale_omni.training.param_gather.ParamGather`); None: nothing is ever pending.
        self.param_gather = param_gather
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.task = task
        self.cfg = cfg
        self.dims = dims
        #: Committed optimizer steps; also the data position.
        self.step = 0
        #: Where the initial weights came from (``checkpoint.pretrained``'s
        #: import record: HF configs, image token); carried into every
        #: checkpoint so an export of the trained model knows it.
        self.provenance: dict = {}
        #: The Hugging Face tokenizer, chat template and processor files of
        #: that import, written into every checkpoint (empty: none).
        self.hf_assets = HFAssets()

    def sync_params(self) -> None:
        """Make the weights whole before anything reads them outside a
        training forward (``parallel.overlap_param_gather``; every rank of
        the DP group at the same point: a collective)."""
        if self.param_gather is not None:
            self.param_gather.sync()

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The chunks without their DDP wrappers."""
        return [getattr(c, "module", c) for c in self.chunks]

    def layout(self) -> dict[str, int]:
        """The parallel layout of this replica group (:meth:`ParallelDims.layout`)."""
        return self.dims.layout()

    # ------------------------------------------------------------ capture
    def _capture(self, sharded: bool, is_loading: bool = False, opt_format: str = DIST_OPT_FORMAT) -> dict[str, Any]:
        modules = self.modules
        weights = [m.sharded_state_dict() if sharded else m.state_dict() for m in modules]
        state: dict[str, Any] = (
            {"model": weights[0]} if len(weights) == 1 else {f"model{i}": w for i, w in enumerate(weights)}
        )
        if sharded:
            # megatron maps optimizer state onto the model's sharded keys.
            state["optimizer"] = self.optimizer.sharded_state_dict(
                dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": opt_format}
            )
        else:
            state["optimizer"] = peer_optimizer_state(self.optimizer)
        state["scheduler"] = self.scheduler.state_dict()
        state["task"] = self.task.state_dict(sharded=sharded)
        state["trainer"] = {"step": self.step}
        return state

    @torch.no_grad()
    def _restore(self, state: dict[str, Any], sharded: bool = True) -> None:
        modules = self.modules
        if len(modules) == 1:
            modules[0].load_state_dict(state["model"])
        else:
            for i, m in enumerate(modules):
                m.load_state_dict(state[f"model{i}"])
        if sharded:
            with keep_adam_step(self.optimizer):
                self.optimizer.load_state_dict(state["optimizer"])
        else:
            load_peer_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["task"]:
            self.task.load_state_dict(state["task"])
        self.step = int(state["trainer"]["step"])

    # --------------------------------------------------- checkpoint (disk)
    def sharded_state_dict(self, is_loading: bool = False, include_rng: bool = True,
                           opt_format: Optional[str] = None) -> dict[str, Any]:
        """megatron ``dist_checkpointing`` state of this rank (the loading
        template when ``is_loading``). ``include_rng=False`` when the TP/PP
        layout changed: RNG streams do not map across it. ``opt_format``:
        the distributed optimizer's format (a loading template takes the
        checkpoint's; None: this run's, :func:`dist_opt_format`)."""
        if is_loading:
            prime_adam_state(self.optimizer)
        opt_format = opt_format or dist_opt_format(self.cfg)
        state = self._capture(sharded=True, is_loading=is_loading, opt_format=opt_format)
        state["dist_opt_format"] = opt_format
        if include_rng:
            state["rng"] = rng_object()
        state["config"] = to_dict(self.cfg)
        state["layout"] = self.layout()
        state[PLAN_KEY] = plan_record(self.cfg, self.task.data_identity())
        if self.provenance:
            state["pretrained"] = self.provenance
        return state

    def check_resume(self, common: dict[str, Any]) -> None:
        """Raise ConfigError (one line, naming the field) if this run would
        plan the remaining steps otherwise than the run that wrote a
        checkpoint (its common state): another setting that decides the
        samples, or other data (:func:`~megascale_omni.data.plan_record.check_resumed_plan`;
        reads only, any rank)."""
        check_resumed_plan(common, self.cfg, self.task.data_identity())

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Apply what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`."""
        self._restore(loaded)
        self.provenance = loaded.get("pretrained") or self.provenance
        restore_adam_step(self.optimizer)
        if "rng" in loaded:
            restore_rng(loaded["rng"])

    # -------------------------------------------------- peer (in memory)
    def peer_facts(self) -> dict[str, Any]:
        """What a joining rank checks before taking this rank's state: the
        layout (with whether the optimizer is distributed), the shared config
        fields (:func:`replica_config`), the content digests of the training
        data (the task's ``data_identity()``), the DDP gradient buckets and
        those of a distributed optimizer (:func:`check_peer_state`)."""
        # Rank r heals from rank r of a peer: with experts, the same experts only under the same ep and etp.
        layout = {**self.layout(), "etp": self.dims.etp,
                  "distributed_optimizer": bool(self.cfg.parallel.use_distributed_optimizer)}
        return {"layout": layout, "config": replica_config(self.cfg), "data": self.task.data_identity(),
                "optimizer_layout": optimizer_layout(self.optimizer),
                "grad_buckets": grad_buckets(self.chunks, self.cfg.parallel.ddp_bucket_size)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as plain tensors, for the same rank of a joining
        replica group (torchft's quorum thread calls this; the weights are
        whole by then: the elastic membership calls :meth:`sync_params`
        before it requests the quorum)."""
        return {**self._capture(sharded=False), "peer": self.peer_facts()}

    def check_peer_state(self, state: dict[str, Any]) -> None:
        """Raise ConfigError (one line) if a peer's :meth:`state_dict` cannot
        be this rank's: another layout, model, config or data (any thread; reads only)."""
        check_peer_state(self.peer_facts(), state.get("peer", {}))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check and apply a peer's :meth:`state_dict` (training thread)."""
        self.check_peer_state(state)
        self._restore(state, sharded=False)
