"""DiT image (or latent) data: bucketed, token-balanced packages (every rank).

Data position is the step: global batch ``s`` is ``train.global_batch_size``
packages of :class:`~megascale_omni.data.dit.buckets.BucketPlan`, a pure
function of (seed, s); it is split across DP ranks so each computes the
same number of latent tokens. Noise, flow time and caption dropout of a
sample are functions of (seed, epoch, sample id) (:mod:`megascale_omni.data.dit.batches`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.data.bad_samples import BadSampleAccount
from megascale_omni.data.balance import imbalance
from megascale_omni.data.costs import fingerprint
from megascale_omni.data.dataset_root import DefaultDataset, load_tokenizer, resolve_dataset_root
from megascale_omni.data.dit.batches import CaptionEncoder, DitBatcher
from megascale_omni.data.dit.preflight import HOW_TO_MAKE
from megascale_omni.data.dit.buckets import BucketPlan, BucketTable, bucket_report, split_packages
from megascale_omni.data.dit.reader import DitSampleReader, load_dataset_description
from megascale_omni.data.identity import dataset_source, tokenizer_source, train_split_source
from megascale_omni.data.module import DataModule
from megascale_omni.data.shards import BadSampleError
from megascale_omni.data.tokenizer import TextTokenizer
from megascale_omni.parallel import ParallelDims
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.platform import Platform

logger = logging.getLogger(__name__)


def resolve_dit_dataset(cfg: JobConfig, default_dataset: Optional[DefaultDataset]) -> tuple[Path, dict]:
    """Dataset root and its description (every rank); builds the embedded default on first use."""
    root = resolve_dataset_root(cfg, default_dataset, HOW_TO_MAKE)
    desc = load_dataset_description(root)
    dit = cfg.dit
    if int(desc.get("in_channels", 3)) != dit.in_channels:
        raise ConfigError("dit.in_channels", dit.in_channels,
                          f"the dataset at {root} has {desc.get('in_channels')} channels; set it to match")
    text = "precomputed" if desc.get("text") == "precomputed" else "learned"
    if text == "precomputed" and dit.text_encoder != "precomputed":
        raise ConfigError("dit.text_encoder", dit.text_encoder,
                          f"the dataset at {root} stores text-encoder states; set dit.text_encoder: precomputed")
    return root, desc


def _data_identity(cfg: JobConfig, reader: DitSampleReader, description: dict,
                   tokenizer: Optional[TextTokenizer]) -> dict[str, dict]:
    """The content identity of the training data (:mod:`megascale_omni.data.identity`):
    the train split, ``dataset.json`` (pixels or latents, channels, text) and
    the caption tokenizer when captions are embedded by the model."""
    path = cfg.data.path
    identity = {
        "data.path": train_split_source("data.path", path, reader.shards.index_digest),
        "dataset.json": dataset_source("data.path", path, "dataset.json",
                                       fingerprint(json.dumps(description, sort_keys=True))),
    }
    if tokenizer is not None:
        identity["tokenizer"] = tokenizer_source(cfg.data.tokenizer, path, fingerprint(tokenizer.to_str()))
    return identity


class DitImageData(DataModule):
    """The DiT family's :class:`~megascale_omni.data.module.DataModule`.

    Exposes :attr:`tokenizer` (None for precomputed text), :attr:`text_vocab`
    (padded; 0 without a learned text encoder), :attr:`captions` and the
    dataset :attr:`description` (``kind``: pixels or latents).
    """

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims,
                 default_dataset: Optional[DefaultDataset] = None):
        super().__init__(cfg, platform, dims, default_dataset)
        d = cfg.dit
        root, self.description = resolve_dit_dataset(cfg, default_dataset)
        self.tokenizer = None
        self.text_vocab = 0
        if d.text_encoder == "learned":
            self.tokenizer = load_tokenizer(cfg, root)
            self.text_vocab = cfg.model.padded_vocab_size(self.tokenizer.vocab_size)
        self.bad_samples = BadSampleAccount(cfg, dims, platform.device)
        self.captions = CaptionEncoder(d, self.tokenizer)
        self.table = BucketTable(d.buckets, d.patch_size, d.token_budget)
        self.reader = DitSampleReader(root / "train", self.description.get("kind", "pixels"))
        self.train_ids, bucket_ids = self._scan(self.reader)
        self._identity = _data_identity(cfg, self.reader, self.description, self.tokenizer)
        try:
            self.plan = BucketPlan(bucket_ids, self.table, cfg.train.global_batch_size, cfg.train.seed)
        except ValueError as err:
            raise ConfigError("train.global_batch_size", cfg.train.global_batch_size, str(err)) from None
        self.batcher = DitBatcher(
            self.reader, self.table, d, self.captions, cfg.train.seed, counter=self.bad_samples.counter
        )
        # Pipeline p2p shapes are communicated per micro-batch (variable_seq_lengths);
        # this is only the schedule's nominal length.
        self.seq_length = max(self.table.tokens) + d.max_text_length + 1
        self.report = bucket_report(self.plan, dims.dp, steps=min(self.plan.steps_per_epoch, 200))
        logger.info(
            "train: %d images, %d packages/epoch, %d steps/epoch; buckets %s\n%s",
            len(self.train_ids), len(self.plan.epoch_packages(0)), self.plan.steps_per_epoch,
            self.table.describe(), self.report.table(),
        )
        self.rank_token_imbalance = 1.0

    def _scan(self, reader: DitSampleReader) -> tuple[np.ndarray, np.ndarray]:
        """Reader index and bucket of every usable sample (JSON only); the rest is excluded and counted."""
        ids, buckets, bad = [], [], 0
        for i in range(len(reader)):
            try:
                meta = reader.metadata(i)
                k = self.table.assign(int(meta["height"]), int(meta["width"]))
                if k is None:
                    raise BadSampleError(meta["id"], reader.root, f"image {meta['height']}x{meta['width']} is smaller "
                                         f"than every bucket (smallest {min(self.table.tokens)} tokens); not upsampled")
                if not str(meta.get("caption", "")).strip():
                    raise BadSampleError(meta["id"], reader.root, "missing caption")
            except (BadSampleError, KeyError, TypeError, ValueError) as err:
                bad += 1
                logger.warning("excluding sample %d from the plan: %s", i, err)
                continue
            ids.append(i)
            buckets.append(k)
        self.bad_samples.exclude(bad, len(reader), str(reader.root))
        return np.asarray(ids), np.asarray(buckets)

    def global_batch_size_of(self, step: int) -> tuple[int, int]:
        packages = self.plan.global_batch(step)
        return sum(len(p.sample_ids) for p in packages), sum(p.real_tokens for p in packages)

    def images_of(self, step: int) -> int:
        return sum(len(p.sample_ids) for p in self.plan.global_batch(step))

    def batch_shape(self, step: int) -> BatchShape:
        """Every package of global batch ``step``: its images' tokens and count (padding slots excluded)."""
        return BatchShape(dit_packages=tuple((p.tokens_per_image, len(p.sample_ids))
                                             for p in self.plan.global_batch(step)))

    def sample_ids(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """Dataset indices of the images in DP rank ``dp_rank``'s packages of step ``step``."""
        packages = self.plan.global_batch(step)
        part = split_packages(packages, dp_size)[dp_rank]
        return [int(self.train_ids[sid]) for i in part for sid in packages[i].sample_ids]

    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """One micro-batch per package of DP rank ``dp_rank`` (every rank;
        layout in :mod:`megascale_omni.data.dit.batches`)."""
        packages = self.plan.global_batch(step)
        parts = split_packages(packages, dp_size)
        self.rank_token_imbalance = imbalance([sum(packages[i].computed_tokens for i in p) for p in parts])
        epoch = step // self.plan.steps_per_epoch
        batches = [self.batcher.microbatch(packages[i], self.train_ids, epoch) for i in parts[dp_rank]]
        self.bad_samples.update()
        return batches

    def data_stats(self) -> dict[str, float]:
        return {**self.bad_samples.stats(), "rank_token_imbalance": self.rank_token_imbalance}

    def data_identity(self) -> dict[str, dict]:
        """Digests of the train split, ``dataset.json`` and tokenizer (computed at construction)."""
        return self._identity

    def state_dict(self, sharded: bool) -> dict:
        """Job-wide skip counters and the caption tokenizer (so sampling needs no dataset)."""
        state: dict[str, Any] = self.bad_samples.state_dict()
        if self.tokenizer is not None:
            state["tokenizer"] = self.tokenizer.to_str()
        return state
