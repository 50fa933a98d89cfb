"""Pieces of checkpoint state that need care: RNG streams, Adam state on CPU
megatron, and the compatibility checks run before a load.
What a checkpoint holds is :class:`megascale_omni.checkpoint.train_state.TrainState`'s
contract. Every function here is called on every rank.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megascale_omni.config import JobConfig, ModelConfig, MoeConfig, VisionConfig, to_dict

#: Distributed-optimizer format: gathers each DP group's shards into whole
#: tensors on save, so a checkpoint loads under any DP size.
DIST_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

#: Config fields that may change across a resume without making the
#: checkpoint incompatible (everything else in ``model``/``vision`` is shape).
RESUMABLE_MODEL_FIELDS = frozenset(
    {"attention_dropout", "hidden_dropout", "init_method_std", "layer_impl", "freeze", "freeze_projector",
     "token_dispatcher"}
)


def rng_object() -> ShardedObject:
    """This rank's RNG streams (Python, numpy, torch, CUDA, megatron's tracker)
    as one ShardedObject over (pp, tp). The ranks of a (pp, tp) coordinate
    across DP and CP replicate it; the first of its DP x CP group writes it
    (``replica_id`` 0, as megatron numbers its own replicas) and all of them
    load it."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        state,
        (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()),
        (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
        replica_id=mpu.get_data_parallel_rank(with_context_parallel=True),
    )


def restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def prime_adam_state(optimizer) -> None:
    """Give every parameter of a fresh optimizer its Adam state (zeros, step 0).

    Before the first step torch's Adam has no per-parameter state, and
    megatron's DistributedOptimizer.state_dict() asserts on the per-parameter
    ``step`` when neither TE nor apex is installed (the CPU case), so a
    loading template cannot be built. Loading overwrites these values.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(
                        exp_avg=torch.zeros_like(p.data), exp_avg_sq=torch.zeros_like(p.data), step=torch.tensor(0.0)
                    )


def restore_adam_step(optimizer) -> None:
    """Re-apply the loaded Adam step to every parameter.

    Without TE/apex, megatron's DistributedOptimizer restores the step into
    ``param_groups[i]["step"]`` and then overwrites the per-parameter state
    with the loading template's (step 0), which would reset Adam's bias
    correction. The param-group value is the checkpoint's.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


#: Fields a run may also change when it only starts from a checkpoint's
#: weights (``checkpoint.pretrained``): sequence length and RoPE scaling
#: (context extension), memory settings, the vocabulary as written (its
#: padded size is checked with the tensors), and the ViT's learning-rate
#: factor (the optimizer starts fresh, so its parameter groups may differ) and
#: the video pooling stride (no weight depends on it).
PRETRAINED_FREE_FIELDS = RESUMABLE_MODEL_FIELDS | frozenset(
    {"seq_length", "recompute", "images_per_sequence", "vocab_size", "rope_scaling", "rope_scaling_factor",
     "lr_mult", "video_pool_stride",
     # moe: how the router is trained, not what the weights compute (an imported
     # Mixtral may fine-tune with a z-loss, another aux-loss coefficient or a capacity).
     "aux_loss_coeff", "load_balancing", "z_loss_coeff", "capacity_factor", "token_drop_policy", "pad_to_capacity",
     "bias_update_rate"}
)


#: The sections :func:`incompatibilities` compares, and their config types.
SECTION_TYPES = {"model": ModelConfig, "vision": VisionConfig, "moe": MoeConfig}


def incompatibilities(saved: dict, current: JobConfig, free: frozenset[str] = RESUMABLE_MODEL_FIELDS) -> list[str]:
    """Model/vision fields that differ between a checkpoint's config and ``current``
    (each as ``section.field: checkpoint X, config Y``), except those in ``free``."""
    now = to_dict(current)
    diffs = []
    for section in SECTION_TYPES:
        # Checkpoints written before the moe section existed hold dense models;
        # a field added to a section since (e.g. vision.image_newline) reads
        # as its default, as loading that checkpoint's config would.
        defaults = to_dict(SECTION_TYPES[section]())
        old, new = {**defaults, **saved.get(section, {})}, now.get(section, {})
        for key in sorted(set(old) | set(new)):
            if key in free:
                continue
            if old.get(key) != new.get(key):
                diffs.append(f"{section}.{key}: checkpoint {old.get(key)!r}, config {new.get(key)!r}")
    return diffs


def describe_layout(layout: dict) -> str:
    """A checkpoint's or a job's ``layout`` as ``tp1 pp2 dp4``; ``cp`` and
    ``ep`` are named when they are not 1 (``tp1 pp1 cp2 dp1``, ``tp1 pp1 dp2 ep2``)."""
    cp, ep = layout.get("cp", 1), layout.get("ep", 1)
    return (f"tp{layout.get('tp', 0)} pp{layout.get('pp', 0)}" + (f" cp{cp}" if cp != 1 else "")
            + f" dp{layout.get('dp', 0)}" + (f" ep{ep}" if ep != 1 else ""))


def shape_mismatches(template: dict[str, Any], saved_metadata: dict[str, Any]) -> list[str]:
    """Sharded tensors of ``template`` whose global shape differs from the
    checkpoint's (``load_tensors_metadata`` output), or that it lacks."""
    problems = []

    def check(v):
        if isinstance(v, ShardedTensor):
            saved = saved_metadata.get(v.key)
            if saved is None:
                problems.append(f"{v.key}: not in the checkpoint")
            elif tuple(saved.global_shape) != tuple(v.global_shape):
                problems.append(f"{v.key}: checkpoint shape {tuple(saved.global_shape)}, model {tuple(v.global_shape)}")
        return v

    dict_list_map_inplace(check, template)
    return problems
