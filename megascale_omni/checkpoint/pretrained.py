"""Model-only checkpoints: written by tools/hf_import.py, read by
``checkpoint.pretrained`` and by the offline tools (export, generation).

A model-only checkpoint is an ordinary checkpoint directory (``step_00000000``
with its commit marker) holding the model's sharded tensors, the job config,
a ``pretrained`` record (where the weights came from) and, for an import, the
Hugging Face tokenizer and processor files (:mod:`~megascale_omni.checkpoint.hf_assets`). Any training
checkpoint is also a valid source: only its model tensors are read, so a
stage-2 run can start from a stage-1 run's checkpoint with a fresh optimizer.
Tensors are stored by megatron's layout-independent keys, so the model loads
under any TP/PP/VPP.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megascale_omni.checkpoint import layout
from megascale_omni.checkpoint.errors import CheckpointError
from megascale_omni.checkpoint.hf_assets import ASSET_DIR, HFAssets
from megascale_omni.checkpoint.state import PRETRAINED_FREE_FIELDS, incompatibilities, shape_mismatches
from megascale_omni.config import ConfigError, JobConfig, from_dict, to_dict

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ModelCheckpoint:
    """A verified checkpoint and what it says about itself."""

    info: layout.CheckpointInfo
    #: The config that wrote it (``parallel`` as it was saved).
    cfg: JobConfig
    #: The non-tensor part (config, layout, ``pretrained`` record, task state, ...).
    common: dict

    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def provenance(self) -> dict:
        """The ``pretrained`` record of an imported checkpoint (``{}`` otherwise)."""
        return self.common.get("pretrained") or {}

    def hf_assets(self) -> HFAssets:
        """Its tokenizer and processor files, checked against the commit marker (empty when none)."""
        return HFAssets.from_checkpoint(self.path, self.info.commit)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """What a run takes from ``checkpoint.pretrained`` besides the weights;
    its checkpoints carry both."""

    #: The import record (HF configs, image token); ``{}`` when none.
    provenance: dict = dataclasses.field(default_factory=dict)
    #: The tokenizer, chat template and processor files (empty when none).
    assets: HFAssets = dataclasses.field(default_factory=HFAssets)


def open_model_checkpoint(path: str | Path, field: str, family: Optional[str] = None,
                          checksums: bool = True) -> ModelCheckpoint:
    """Resolve ``path`` (a checkpoint root: its newest intact checkpoint, or
    one ``step_NNNNNNNN`` directory), verify it and read its config.

    Raises ConfigError (``field``) when it does not exist or is of another
    family than ``family``; CheckpointError when broken. Needs no process group.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(field, str(path), "does not exist; pass a checkpoint root (a tools/hf_import.py output "
                          "or a run's checkpoint.dir) or one of its step_NNNNNNNN directories")
    info = layout.resolve(path, checksums)
    common = dist_checkpointing.load_common_state_dict(str(info.path))
    saved = common.get("config")
    if not isinstance(saved, dict) or "model" not in saved:
        raise CheckpointError(f"{info.path}: no job config in the checkpoint; it was not written by megascale-omni")
    found = saved["model"].get("family")
    if family is not None and found != family:
        raise ConfigError(field, str(info.path), f"holds a {found!r} model but this run trains {family!r}; "
                          "import or train a model of this family")
    return ModelCheckpoint(info, from_dict(JobConfig, saved), common)


def model_template(modules: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """The model part of a training checkpoint's sharded state (same top-level
    keys as :class:`~megascale_omni.checkpoint.train_state.TrainState`)."""
    sharded = [m.sharded_state_dict() for m in modules]
    return {"model": sharded[0]} if len(sharded) == 1 else {f"model{i}": s for i, s in enumerate(sharded)}


@torch.no_grad()
def load_model_weights(modules: Sequence[torch.nn.Module], ckpt: ModelCheckpoint, field: str) -> None:
    """Load ``ckpt``'s model tensors into ``modules`` (this rank's chunks),
    resharded to the current layout (every rank of the model-parallel group).

    Raises ConfigError naming the first differing tensors when the model
    built here is not the checkpoint's (missing tensors or other shapes).
    """
    template = model_template(modules)
    mismatches = shape_mismatches(template, dist_checkpointing.load_tensors_metadata(str(ckpt.path)))
    if mismatches:
        raise ConfigError(field, str(ckpt.path), "the model differs from this checkpoint ("
                          + "; ".join(mismatches[:6]) + "): use the model/vision sections written beside it")
    loaded = dist_checkpointing.load(template, str(ckpt.path))
    keys = list(template)
    for key, module in zip(keys, modules):
        module.load_state_dict(loaded[key])


def load_pretrained(modules: Sequence[torch.nn.Module], cfg: JobConfig) -> Pretrained:
    """``checkpoint.pretrained`` into this rank's freshly built chunks (every
    rank, before the optimizer copies the parameters). Rank 0 verifies the
    checkpoint once; every rank then loads its shards and reads its
    tokenizer files (checked against the commit marker). Returns the
    provenance record and those files (empty when not configured or none)."""
    source = cfg.checkpoint.pretrained
    if not source:
        return Pretrained()
    field = "checkpoint.pretrained"
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            ckpt = open_model_checkpoint(source, field, cfg.model.family, cfg.checkpoint.verify_checksums)
            diffs = incompatibilities(ckpt.common["config"], cfg, PRETRAINED_FREE_FIELDS)
            if diffs:
                raise ConfigError(field, str(ckpt.path), "the model differs from these weights ("
                                  + "; ".join(diffs[:6]) + "): use the model/vision sections written beside them")
            payload = [("ok", str(ckpt.path))]
        except ConfigError as e:
            payload = [("config", (e.field, e.value, e.hint))]
        except CheckpointError as e:
            payload = [("checkpoint", str(e))]
    dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "config":
        raise ConfigError(*value)
    if kind == "checkpoint":
        raise CheckpointError(f"{field}: {value}")
    ckpt = open_model_checkpoint(value, field, cfg.model.family, checksums=False)
    load_model_weights(modules, ckpt, field)
    assets = ckpt.hf_assets()
    origin = ckpt.provenance.get("source") or f"step {ckpt.info.step} of a training run"
    logger.info("loaded pretrained weights from %s (%s)%s", ckpt.path, origin,
                f"; this run's checkpoints carry its {', '.join(assets.files)}" if assets.enabled
                else "; it has no tokenizer files, so an export of this run will have none")
    return Pretrained(ckpt.provenance, assets)


def save_model_checkpoint(module: torch.nn.Module, cfg: JobConfig, root: Path, provenance: dict,
                          assets: HFAssets = HFAssets()) -> Path:
    """Write ``module`` (one process, TP1/PP1) and ``assets`` as the
    model-only checkpoint ``root/step_00000000`` and commit it. Returns the
    step directory."""
    target = root / layout.step_dir_name(0)
    target.mkdir(parents=True, exist_ok=False)
    state = {
        "model": module.sharded_state_dict(),
        "config": to_dict(cfg),
        "layout": {"tp": 1, "pp": 1, "cp": 1, "dp": 1, "vpp": 1, "world_size": 1},
        "trainer": {"step": 0},
        "pretrained": provenance,
    }
    dist_checkpointing.save(state, str(target))
    assets.write(target / ASSET_DIR, durable=True)
    layout.write_commit(target, 0, {"layout": state["layout"], "mode": "pretrained"})
    return target
