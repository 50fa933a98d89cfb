"""The one place that sets up megatron-core's ``parallel_state``.

Megatron's process groups are the single global we accept; every other module
asks :class:`ParallelDims` or ``parallel_state`` for ranks and groups.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megascale_omni.config import ParallelConfig
from megascale_omni.config.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one replica group. ``tp * pp * cp * dp == world_size``."""

    tp: int
    pp: int
    cp: int
    dp: int
    vpp: Optional[int]
    world_size: int
    #: ``[a2a size, p2p size]`` of the hierarchical CP groups (``cp_comm_type:
    #: a2a+p2p``, product ``cp``); None builds none.
    hierarchical_cp: Optional[tuple[int, ...]] = None
    #: Expert-parallel size and the tensor-parallel size inside each expert
    #: (MoE layers only; megatron lays ``ep * etp`` ranks inside each pipeline stage).
    ep: int = 1
    etp: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        mp = cfg.tp * cfg.pp * cfg.cp
        hierarchical = tuple(cfg.hierarchical_cp_sizes) if cfg.hierarchical_cp_sizes else None
        return cls(cfg.tp, cfg.pp, cfg.cp, world_size // mp, cfg.vpp, world_size, hierarchical,
                   ep=cfg.ep, etp=cfg.expert_tp_size)

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the ranks of a pipeline stage over ``ep * etp``
        (megatron's expert-data-parallel group, which reduces expert gradients)."""
        return self.world_size // (self.pp * self.ep * self.etp)

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    def layout(self) -> dict[str, int]:
        """``{"tp", "pp", "cp", "dp", "vpp", "world_size"}`` (``vpp`` 1 when not
        interleaved): recorded in checkpoints and reported by ``omni-ctl status``."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "vpp": self.vpp or 1,
                "ep": self.ep, "world_size": self.world_size}

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        ep = f" ep={self.ep} etp={self.etp} expert_dp={self.expert_dp}" if self.ep > 1 or self.etp != self.tp else ""
        return f"tp={self.tp} pp={self.pp} cp={self.cp} dp={self.dp}{vpp}{ep} (world={self.world_size})"


def initialize_parallel(dims: ParallelDims, seed: int) -> None:
    """Create megatron's TP/PP/CP/DP groups and the model-parallel RNG (every rank).

    With ``dims.hierarchical_cp`` megatron also builds the hierarchical CP
    groups transformer-engine's ``a2a+p2p`` reads
    (``get_hierarchical_context_parallel_groups``). The expert groups (EP,
    expert TP, expert DP) come from ``dims.ep`` / ``dims.etp``, laid out by
    megatron's second rank generator inside each pipeline stage.

    Must run after ``torch.distributed`` is initialised and before any model
    is built. Idempotent within a process only via :func:`destroy_parallel`.
    """
    assert dist.is_initialized(), "init_distributed() must run first"
    if dims.hierarchical_cp and importlib.util.find_spec("einops") is None:
        raise ConfigError(
            "parallel.cp_comm_type", "a2a+p2p",
            "megatron builds the hierarchical CP groups with einops (transformer-engine depends on it): "
            "pip install 'megascale-omni[cp]' (einops), or use p2p or a2a",
        )
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        context_parallel_size=dims.cp,
        hierarchical_context_parallel_sizes=list(dims.hierarchical_cp) if dims.hierarchical_cp else None,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
    )
    # Seeds megatron's tracker: per-TP-rank state for TP-sharded dropout,
    # shared state for replicated regions.
    model_parallel_cuda_manual_seed(seed)
    logger.info("parallel layout: %s", dims.describe())


def destroy_parallel() -> None:
    """Tear down megatron groups and the default group (every rank)."""
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def data_parallel_rank() -> int:
    """This rank's DP rank inside its replica group (megatron's DP group)."""
    return mpu.get_data_parallel_rank()


def is_loss_rank() -> bool:
    """True on the rank that owns the loss: last PP stage, TP rank 0, DP rank 0, CP rank 0."""
    return (
        mpu.is_pipeline_last_stage(ignore_virtual=True)
        and mpu.get_tensor_model_parallel_rank() == 0
        and mpu.get_data_parallel_rank() == 0
        and mpu.get_context_parallel_rank() == 0
    )
