"""The in-memory state one rank sends to the same rank of a joining replica
group, beyond weights: optimizer state (whole, or this rank's shard of the
distributed optimizer) and the facts a joiner checks before using any of it.

With megatron's distributed optimizer each inner-DP rank owns one contiguous
shard of every gradient bucket: fp32 main parameters and Adam moments for
exactly those elements. A joining group's rank ``r`` takes the shard of the
peer group's rank ``r``, which is the same shard only when both groups have
the same layout (tp, pp, cp, vpp, inner dp) and the same model (same bucket
sizes). Beyond the optimizer, every replica group must train the same model
on the same sample plan (:func:`replica_config`) from the same data (the
task's data identity). :func:`check_peer_state` verifies all of it before
anything is applied, so a joiner started with
another config is refused with one line. Every function is called by every
rank (no collectives).
"""

from __future__ import annotations

from typing import Any

from megatron.core.optimizer import DistributedOptimizer

from megascale_omni.checkpoint.state import restore_adam_step
from megascale_omni.config import ConfigError, JobConfig, to_dict
from megascale_omni.data.identity import check_data_identity
from megascale_omni.data.plan_record import plan_settings
from megascale_omni.elastic import adapter


def _optimizers(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_layout(optimizer: Any) -> list:
    """Per sub-optimizer: ``None`` (whole state on every rank) or, for the
    distributed optimizer, the unpadded element count of every bucket of every
    gradient buffer (identical across groups only for the same model and layout)."""
    return [adapter.optimizer_bucket_numel(opt) if isinstance(opt, DistributedOptimizer) else None
            for opt in _optimizers(optimizer)]


def grad_buckets(chunks: Any, bucket_size: Any) -> dict:
    """``{"ddp_bucket_size": bucket_size, "numel": [[elements of each DDP
    bucket] per model chunk]}``. Replica groups sum gradients across each
    other bucket by bucket, so the buckets must be identical: the same model
    and layout, ``parallel.ddp_bucket_size`` and ``overlap_grad_reduce``."""
    numel = [adapter.bucket_numel(chunk) for chunk in chunks]
    return {"ddp_bucket_size": bucket_size, "numel": numel}


def peer_optimizer_state(optimizer: Any) -> list[dict]:
    """Optimizer state of this rank for its peer rank (plain tensors, no copies).

    Distributed optimizer: megatron's ``state_dict()`` (hyper-parameters, step)
    plus this rank's shard (fp32 main params, ``exp_avg``, ``exp_avg_sq`` of
    the bucket ranges it owns) in megatron's bucket-space ``dp_reshardable``
    form, which its ``load_state_dict`` applies. fp32 main params are views of
    the model's parameter buffer, whose storage the weights already carry.
    """
    states = []
    for opt in _optimizers(optimizer):
        state = opt.state_dict()
        if isinstance(opt, DistributedOptimizer):
            shard = opt.get_parameter_state_dp_reshardable()
            for key, per_dtype in shard.items():
                if isinstance(key, int):
                    for buckets in per_dtype.values():
                        for bucket in buckets:
                            for param_state in bucket:
                                # No intra-bucket padding entries in this form.
                                param_state["padding"] = False
            state.update(param_state=shard, param_state_sharding_type="dp_reshardable")
        states.append(state)
    return states


def load_peer_optimizer_state(optimizer: Any, states: list[dict]) -> None:
    """Apply :func:`peer_optimizer_state` of the peer rank (after :func:`check_peer_state`)."""
    for opt, state in zip(_optimizers(optimizer), states, strict=True):
        opt.load_state_dict(state)
    # Without TE/apex megatron's distributed optimizer gives every parameter
    # one shared Adam step tensor, which torch's Adam would then advance once
    # per parameter per step: give each its own again.
    restore_adam_step(optimizer)


def replica_config(cfg: JobConfig) -> dict[str, Any]:
    """The config fields every replica group of an elastic job must share,
    as ``{"section.field": value}``: the model (``model.*``, ``vision.*``,
    ``dit.*``, ``moe.*``: the expert count, routing and balancing), every setting that decides each step's samples
    (:func:`~megascale_omni.data.plan_record.plan_settings`: ``data.*`` but
    how fast it is read and the bad-sample limit, which groups may set
    differently, ``train.seed``, ``train.global_batch_size``), and
    ``train.micro_batch_size`` (groups receive whole micro-batches) and
    ``train.precision``. Dataset and tokenizer paths are left out:
    :func:`check_peer_state` compares the digests of their content instead
    (:mod:`megascale_omni.data.identity`); ``data.blend`` keeps its members'
    weights."""
    plain = to_dict(cfg)
    fields = {f"{section}.{k}": v for section in ("model", "vision", "dit", "moe") for k, v in plain[section].items()}
    fields.update(plan_settings(cfg))
    fields.update((f"train.{k}", plain["train"][k]) for k in ("micro_batch_size", "precision"))
    return fields


def check_peer_state(own: dict, peer: dict) -> None:
    """Raise ConfigError (one line) unless ``peer``'s ``"layout"``,
    ``"config"`` (:func:`replica_config`), ``"data"`` (the task's data
    identity: every digest of ``own`` equal in ``peer``,
    :func:`~megascale_omni.data.identity.check_data_identity`),
    ``"grad_buckets"`` (:func:`grad_buckets`) and ``"optimizer_layout"``
    equal ``own``'s (:meth:`TrainState.peer_facts`).
    Reads only: torchft's quorum thread calls it on a joiner."""
    if peer.get("layout") != own["layout"]:
        raise ConfigError(
            "parallel", _layout_text(own["layout"]),
            f"differs from the running job's replica groups ({_layout_text(peer.get('layout'))}); "
            "start this group with the same parallel.* settings and processes per group",
        )
    theirs = peer.get("config", {})
    for name, value in own["config"].items():
        if name not in theirs or theirs[name] != value:
            running = f"{theirs[name]!r}" if name in theirs else "not set"
            raise ConfigError(
                name, value,
                f"differs from the running job's ({running}): every replica group trains the same model on "
                f"the same data; start this group with the running job's {name}",
            )
    check_data_identity(own.get("data", {}), peer.get("data", {}))
    if "grad_buckets" in own and peer.get("grad_buckets") != own["grad_buckets"]:
        mine, theirs = own["grad_buckets"], peer.get("grad_buckets") or {}
        raise ConfigError(
            "parallel.ddp_bucket_size", mine["ddp_bucket_size"],
            f"gives gradient buckets {mine['numel']}, the running job's are {theirs.get('numel')} (its "
            f"ddp_bucket_size {theirs.get('ddp_bucket_size')}): replica groups sum gradients bucket by bucket; "
            "start this group with the running job's parallel.ddp_bucket_size and parallel.overlap_grad_reduce",
        )
    if peer.get("optimizer_layout") != own["optimizer_layout"]:
        raise ConfigError(
            "model", "gradient buckets " + str(own["optimizer_layout"]),
            f"differ from the running job's ({peer.get('optimizer_layout')}): a different model or "
            "bucketing; start this group with the running job's model.* config",
        )


def _layout_text(layout: Any) -> str:
    if not isinstance(layout, dict):
        return "unknown layout"
    return " ".join(f"{k}={v}" for k, v in layout.items())
