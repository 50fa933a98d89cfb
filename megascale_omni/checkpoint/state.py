"""What a checkpoint holds, as one megatron sharded state dict.

    {
      "model" | "model0".."model{vpp-1}":  each chunk's sharded_state_dict()
      "optimizer":  optimizer.sharded_state_dict(...)  (distributed optimizer:
                    ``fully_reshardable``, so DP may change on load)
      "rng":        ShardedObject over (pp, tp); DP rank 0 of each owns it
      "task":       the task's own state (data counters, EMA weights, ...)
      "trainer":    {"step": committed optimizer steps}
      "scheduler":  LR scheduler state_dict()
      "config":     the job config as a plain dict
      "layout":     {"tp", "pp", "vpp", "dp", "world_size"}
    }

The data position is ``trainer.step``: sample plans are step-indexed, so the
global batch of step ``s`` is a function of (seed, s) whatever the DP size.
Every function here is called on every rank.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

from megascale_omni.config import JobConfig, to_dict

#: Distributed-optimizer format: gathers each DP group's shards into whole
#: tensors on save, so a checkpoint loads under any DP size.
DIST_OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}

#: Config fields that may change across a resume without making the
#: checkpoint incompatible (everything else in ``model``/``vision`` is shape).
RESUMABLE_MODEL_FIELDS = frozenset(
    {"attention_dropout", "hidden_dropout", "init_method_std", "layer_impl", "freeze", "freeze_projector"}
)


def layout_of(trainer) -> dict[str, int]:
    d = trainer.dims
    return {"tp": d.tp, "pp": d.pp, "vpp": d.vpp or 1, "dp": d.dp, "world_size": d.world_size}


def model_state(chunks) -> dict[str, Any]:
    """Sharded model state of this rank's chunks (DDP wrappers unwrapped)."""
    modules = [getattr(c, "module", c) for c in chunks]
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}


def _rng_object() -> ShardedObject:
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
        replica_id=mpu.get_data_parallel_rank(),
    )


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _prime_adam_state(optimizer) -> None:
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


def _restore_adam_step(optimizer) -> None:
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


def build_state(trainer, is_loading: bool, include_rng: bool = True) -> dict[str, Any]:
    """The full sharded state dict of ``trainer`` (template when loading)."""
    if is_loading:
        _prime_adam_state(trainer.optimizer)
    state = model_state(trainer.chunks)
    state["optimizer"] = trainer.optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=DIST_OPT_METADATA
    )
    if include_rng:
        state["rng"] = _rng_object()
    task_state = getattr(trainer.task, "checkpoint_state", None)
    state["task"] = task_state() if task_state else {}
    state["trainer"] = {"step": trainer.step}
    state["scheduler"] = trainer.scheduler.state_dict()
    state["config"] = to_dict(trainer.cfg)
    state["layout"] = layout_of(trainer)
    return state


@torch.no_grad()
def apply_state(trainer, loaded: dict[str, Any]) -> None:
    """Copy a loaded state dict into ``trainer`` (inverse of :func:`build_state`)."""
    modules = [getattr(c, "module", c) for c in trainer.chunks]
    if len(modules) == 1:
        modules[0].load_state_dict(loaded["model"])
    else:
        for i, m in enumerate(modules):
            m.load_state_dict(loaded[f"model{i}"])
    trainer.optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_step(trainer.optimizer)
    trainer.scheduler.load_state_dict(loaded["scheduler"])
    if "rng" in loaded:
        _restore_rng(loaded["rng"])
    load_task = getattr(trainer.task, "load_checkpoint_state", None)
    if load_task:
        load_task(loaded["task"])
    trainer.step = int(loaded["trainer"]["step"])


def stage_to_host(state: dict[str, Any]) -> int:
    """Replace every sharded tensor's data by a private host copy, in place.

    After this returns, training may overwrite parameters and optimizer
    state while the background writer serialises the copies. On GPU this is
    the device-to-host copy; on CPU a memcpy. Returns bytes copied.
    """
    copied = 0

    def stage(v):
        nonlocal copied
        if isinstance(v, ShardedBase) and isinstance(getattr(v, "data", None), torch.Tensor):
            v.data = v.data.detach().to("cpu", copy=True)
            copied += v.data.numel() * v.data.element_size()
        return v

    dict_list_map_inplace(stage, state)
    return copied


def incompatibilities(saved: dict, current: JobConfig) -> list[str]:
    """Model/vision fields that differ between a checkpoint's config and ``current``
    (each as ``section.field: checkpoint X, config Y``)."""
    now = to_dict(current)
    diffs = []
    for section in ("model", "vision"):
        old, new = saved.get(section, {}), now.get(section, {})
        for key in sorted(set(old) | set(new)):
            if key in RESUMABLE_MODEL_FIELDS:
                continue
            if old.get(key) != new.get(key):
                diffs.append(f"{section}.{key}: checkpoint {old.get(key)!r}, config {new.get(key)!r}")
    return diffs



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
