"""What decides which samples each step holds: recorded in every checkpoint,
compared when a run resumes, and shared by the replica groups of an elastic job.

Sample plans are step-indexed (:mod:`megascale_omni.data.sample_plan`): the
global batch of step ``s`` is a pure function of the data, these settings
and ``s``. A resumed run therefore continues the checkpoint's plan only if
it plans with the same settings from the same data; otherwise the remaining
steps hold other samples, and some are repeated while others are never
seen. The layout (tp, pp, cp, dp, vpp) and ``train.micro_batch_size`` are
not among them: they cut a step's global batch differently, never change
which samples it holds (``data.pad_to_multiple_of``'s default is 8 at every
layout for that reason, :data:`~megascale_omni.config.validate.DEFAULT_PAD_MULTIPLE`).

The settings (:func:`plan_settings`, ``{"section.field": value}``):

- every ``data.*`` field but how fast the data is read (``num_workers``,
  ``prefetch_steps``), the bad-sample limit (``max_bad_sample_fraction``,
  which decides only whether a run stops) and the paths (``path``,
  ``tokenizer``, each blend member's ``path``): those are compared by the
  content they select, the task's data identity (:mod:`.identity`), so a
  dataset mounted elsewhere still resumes;
- LLaVA's ``data.pad_to_multiple_of`` as resolved (``0`` is the default,
  8; the other families do not pad samples);
- ``model.seq_length`` (row capacity), ``train.seed`` (sample order),
  ``train.global_batch_size`` (rows or samples per step);
- ``train.micro_batch_size`` when ``data.max_vision_tokens_per_microbatch``
  is set (a row's vision-token share is the budget divided by it);
- in a DiT run, ``dit.patch_size``, ``dit.buckets`` and ``dit.token_budget``
  (which images share a micro-batch package).

A checkpoint written before this record existed is read from its saved
config with the padding rule of then (``2 * cp`` under CP, else 1); its data
identity is unknown, which the log says.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

from megascale_omni.config import ConfigError, JobConfig, to_dict
from megascale_omni.config.validate import DEFAULT_PAD_MULTIPLE
from megascale_omni.data.identity import check_data_identity

logger = logging.getLogger(__name__)

#: ``data.*`` fields that do not decide the samples: how fast they are read,
#: and the limit that decides only whether bad samples stop the run.
READING_FIELDS = ("num_workers", "prefetch_steps", "max_bad_sample_fraction")
#: ``data.*`` paths, compared by the content they select (the data identity).
CONTENT_FIELDS = ("path", "tokenizer")
#: Fields outside ``data.*`` that decide the samples.
OTHER_FIELDS = (("model", "seq_length"), ("train", "seed"), ("train", "global_batch_size"))
#: ``dit.*`` fields that decide them in a DiT run.
DIT_FIELDS = ("patch_size", "buckets", "token_budget")
#: Key of the record in a checkpoint's common state.
CHECKPOINT_KEY = "data_plan"


def _settings(plain: Mapping[str, Any], pad_multiple: int) -> dict[str, Any]:
    """:func:`plan_settings` of a config as a plain dict (``to_dict``)."""
    data = plain["data"]
    out = {f"data.{k}": v for k, v in data.items() if k not in READING_FIELDS + CONTENT_FIELDS}
    out["data.blend"] = [{k: v for k, v in source.items() if k != "path"} for source in data["blend"]]
    if plain["model"].get("family") == "llava":  # the one family that pads its samples
        out["data.pad_to_multiple_of"] = pad_multiple
    else:
        out.pop("data.pad_to_multiple_of", None)
    fields = OTHER_FIELDS + (tuple(("dit", f) for f in DIT_FIELDS) if plain["model"].get("family") == "dit" else ())
    if data.get("max_vision_tokens_per_microbatch"):
        fields += (("train", "micro_batch_size"),)
    for section, name in fields:
        if name in plain.get(section, {}):
            out[f"{section}.{name}"] = plain[section][name]
    return out


def plan_settings(cfg: JobConfig) -> dict[str, Any]:
    """Every setting that decides which samples each step holds (module
    docstring), ``{"section.field": value}``; plain values, the same on every rank."""
    return _settings(to_dict(cfg), cfg.data.pad_to_multiple_of or DEFAULT_PAD_MULTIPLE)


def plan_record(cfg: JobConfig, identity: Mapping[str, dict]) -> dict[str, Any]:
    """What a checkpoint records under :data:`CHECKPOINT_KEY`: the settings and
    the task's data identity (``{key: source}``, :mod:`.identity`)."""
    return {"settings": plan_settings(cfg), "identity": dict(identity)}


def saved_plan(common: Mapping[str, Any]) -> tuple[dict[str, Any], Optional[dict]]:
    """``(settings, identity)`` of the run that wrote a checkpoint, from its
    common state (``dist_checkpointing.load_common_state_dict``). A checkpoint
    without the record: the settings its config gives under the padding rule
    of then, identity None (unknown)."""
    if CHECKPOINT_KEY in common:
        record = common[CHECKPOINT_KEY]
        return dict(record["settings"]), dict(record["identity"])
    config, layout = common.get("config", {}), common.get("layout", {})
    if "data" not in config:
        return {}, None
    cp = layout.get("cp", 1)
    return _settings(config, config["data"].get("pad_to_multiple_of") or (2 * cp if cp > 1 else 1)), None


def check_resumed_plan(common: Mapping[str, Any], cfg: JobConfig, identity: Mapping[str, dict]) -> None:
    """Raise ConfigError (one line, naming the field) unless ``cfg`` and the
    data identity plan the steps the way the checkpoint's run did (rank 0
    of a resume; reads only). Settings a checkpoint does not record (fields
    newer than it) are not compared."""
    saved, saved_identity = saved_plan(common)
    for name, value in plan_settings(cfg).items():
        if name not in saved or saved[name] == value:
            continue
        raw = cfg.data.pad_to_multiple_of if name == "data.pad_to_multiple_of" else value
        resolved = f"resolves to {value!r}; " if raw != value else ""
        raise ConfigError(
            name, raw,
            f"{resolved}the checkpoint's run planned with {saved[name]!r}, and it decides which samples each step "
            f"holds: the remaining steps would repeat some samples and skip others; set {name}={saved[name]!r} to "
            "resume this run (at any layout), or start a new run with checkpoint.resume=none",
        )
    if saved_identity is None:
        logger.warning("the checkpoint records no data digests (written before they were): cannot check that "
                       "this run reads the same dataset and tokenizer")
        return
    check_data_identity(identity, saved_identity, against="the checkpoint",
                        why="the remaining steps would train on other samples",
                        alternative=", or start a new run with checkpoint.resume=none")
