"""The model part of a model family (torchtitan's ``TrainSpec`` model half):
build the chunks, the forward step with its loss, learning-rate factors and
the model's own state (e.g. DiT's EMA).

A family's FLOPs per micro-batch come from the pipeline cost model its
registry entry names (``ModelFamily.cost_model``): the same numbers the
planner balances stages with, so the registry can answer without importing
megatron.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch

from megascale_omni.config import JobConfig
from megascale_omni.models.moe import RouterStats, group_expert_params
from megascale_omni.parallel import ParallelDims
from megascale_omni.platform import Platform


class ModelSpec(ABC):
    """What the training loop runs of one family's model (every rank).

    ``data`` is the family's :class:`~megascale_omni.data.module.DataModule`,
    built first: it knows the vocabulary, the tokenizer and the sequence length.
    Subclasses implement :meth:`build_model` and :meth:`forward_step`.
    """

    #: :meth:`after_step` reads the weights (the Trainer completes a pending
    #: parameter gather first, ``parallel.overlap_param_gather``).
    reads_weights_after_step: bool = False

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims, data: Any):
        self.cfg = cfg
        self.platform = platform
        self.dims = dims
        self.data = data
        self.dtype = platform.default_dtype(cfg.train.precision)
        #: What the MoE routers did each step; subclasses that build MoE
        #: layers replace it in :meth:`build_model` (:meth:`watch_routers`).
        self.router_stats = RouterStats.disabled()

    @abstractmethod
    def build_model(self) -> list[torch.nn.Module]:
        """This rank's model chunks (``vpp`` of them when interleaved)."""

    @abstractmethod
    def forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple[Any, Callable]:
        """megatron ``forward_step_func``: returns (output, loss_func)."""

    def pipeline_shape(self) -> tuple[int, int]:
        """``(seq_length, micro_batch_size)`` for megatron's schedules, which
        size the p2p buffers between stages ``[seq, batch, hidden]``: rows of
        the data's ``seq_length`` by default. Language models override it for
        THD micro-batches (:func:`megascale_omni.models.attention.thd_pipeline_shape`)."""
        return self.data.seq_length, self.cfg.train.micro_batch_size

    def lr_mult(self) -> dict[str, float]:
        """Learning-rate factors by parameter-name pattern (fnmatch) for
        :func:`~megascale_omni.training.optimizer.build_optimizer` (every rank)."""
        return {}

    def watch_routers(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """For MoE models (nothing for a dense one; every rank, once, from
        :meth:`build_model`): count what the routers of ``chunks`` do, and
        group the expert weights as every EP size does
        (:func:`~megascale_omni.models.moe.group_expert_params`). Returns ``chunks``."""
        self.router_stats = RouterStats(chunks, self.cfg.model.num_layers, self.cfg.moe.num_experts,
                                        shares=self.dims.tp * self.dims.cp, enabled=self.cfg.moe.enabled, topk=self.cfg.moe.topk)
        if self.cfg.moe.enabled:
            group_expert_params(chunks)
        return chunks

    def step_stats(self) -> dict:
        """Model fields of the step record (MoE: expert load, aux and z-loss;
        docs/moe.md). Every rank after each committed step: a collective
        when the model has MoE layers."""
        return self.router_stats.read()

    def discard_step_stats(self) -> None:
        """Drop what :meth:`step_stats` would count so far (every rank, no
        collective; before each step attempt: a recomputed or uncommitted
        attempt's forwards must not count)."""
        self.router_stats.discard()

    def after_step(self, step: int) -> None:
        """Called on every rank after each committed optimizer step; ``step``
        already counts it (e.g. DiT's EMA update)."""

    def state_dict(self, sharded: bool) -> dict:
        """The model's own state beyond its weights (EMA, ...); ``sharded`` as
        in :meth:`megascale_omni.tasks.base.Task.state_dict`."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict` (``state`` is the whole task state)."""

    def cp_local(self, batch: dict) -> dict:
        """This CP rank's share of a THD micro-batch (``batch`` itself without
        CP; see :func:`megascale_omni.models.attention.cp_shard_batch`)."""
        if self.dims.cp == 1:
            return batch
        from megatron.core import parallel_state as mpu

        from megascale_omni.models.attention import cp_shard_batch

        return cp_shard_batch(batch, self.dims.cp, mpu.get_context_parallel_rank())
