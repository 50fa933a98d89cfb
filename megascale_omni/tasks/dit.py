"""DiT task: bucketed, token-balanced rectified-flow pretraining.

Data position is the step: global batch ``s`` is ``train.global_batch_size``
packages of :class:`~megascale_omni.data.dit.buckets.BucketPlan`, a pure
function of (seed, s); it is split across DP ranks so each computes the
same number of latent tokens. Noise, flow time and caption dropout of a
sample are functions of (seed, epoch, sample id) (tasks/dit_batches.py).
So a checkpoint needs only the task state of :meth:`DitTask.state_dict`
(EMA weights, skip counters, the tokenizer) besides the step. The
embedded default dataset is the captioned multi-aspect shapes set
(:mod:`megascale_omni.data.dit.shapes_dataset`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.data.balance import imbalance
from megascale_omni.data.costs import fingerprint
from megascale_omni.data.dit.buckets import BucketPlan, BucketTable, bucket_report, split_packages
from megascale_omni.data.dit.reader import DitSampleReader, load_dataset_description
from megascale_omni.data.dit.shapes_dataset import ensure_dit_shapes_dataset
from megascale_omni.data.identity import dataset_source, tokenizer_source, train_split_source
from megascale_omni.data.shards import BadSampleError
from megascale_omni.data.tokenizer import TextTokenizer
from megascale_omni.models.dit.context import image_token_index
from megascale_omni.models.dit.ema import EMA
from megascale_omni.models.dit.model import build_dit_chunks
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.parallel import ParallelDims, is_loss_rank
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.platform import Platform
from megascale_omni.tasks.base import BadSampleAccount, Task, load_tokenizer, resolve_dataset_root
from megascale_omni.tasks.dit_batches import CaptionEncoder, DitBatcher
from megascale_omni.tasks.dit_sampling import evaluate_colors

logger = logging.getLogger(__name__)

DEFAULT_DATASET_DIR = "data/dit-shapes-{num_train}-{num_val}"


def build_default_dataset(cfg: JobConfig) -> Path:
    """The embedded captioned shapes set (built on first use, every rank)."""
    d = cfg.data
    return ensure_dit_shapes_dataset(
        DEFAULT_DATASET_DIR.format(num_train=d.default_num_train, num_val=d.default_num_val),
        d.default_num_train, d.default_num_val,
    )


def resolve_dit_dataset(cfg: JobConfig) -> tuple[Path, dict]:
    """Dataset root and its description (every rank); builds the embedded default on first use."""
    root = resolve_dataset_root(cfg, build_default_dataset, "tools/make_dit_latents.py")
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


class DitTask(Task):
    """The DiT family's :class:`~megascale_omni.tasks.base.Task` (every rank)."""

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims):
        super().__init__(cfg, platform, dims)
        d = cfg.dit
        root, self.description = resolve_dit_dataset(cfg)
        self.tokenizer = None
        self.text_vocab = 0
        if d.text_encoder == "learned":
            self.tokenizer = load_tokenizer(cfg, root)
            self.text_vocab = self.padded_vocab_size(self.tokenizer.vocab_size)
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
        self.ema: Optional[EMA] = None
        self.chunks: list = []
        self.rank_token_imbalance = 1.0

    # ----------------------------------------------------------------- setup
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

    def build_model(self):
        self.chunks = build_dit_chunks(self.cfg, self.dtype, self.text_vocab)
        return self.chunks

    def _ensure_ema(self) -> Optional[EMA]:
        """The EMA (None when ``dit.ema_decay`` is 0), created from the current
        weights on first use: from the initialised weights when the trainer
        builds a checkpoint template before the first step (resume)."""
        if self.ema is None and self.cfg.dit.ema_decay > 0:
            self.ema = EMA(self.chunks, self.cfg.dit.ema_decay)
        return self.ema

    @property
    def reads_weights_after_step(self) -> bool:
        """The EMA update reads the weights."""
        return self.cfg.dit.ema_decay > 0

    def after_step(self, step: int) -> None:
        """EMA update after each optimizer step (every rank, own shards)."""
        if self._ensure_ema() is not None:
            self.ema.update()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self, sharded: bool) -> dict:
        """EMA weights (for a checkpoint ShardedTensors ``ema.<model key>``,
        resharded with the model), job-wide skip counters and the tokenizer
        (so sampling needs no dataset). Every rank."""
        state: dict[str, Any] = self.bad_samples.state_dict()
        if self._ensure_ema() is not None:
            state["ema"] = self.ema.sharded_state_dict() if sharded else self.ema.state_dict()
        if self.tokenizer is not None:
            state["tokenizer"] = self.tokenizer.to_str()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.bad_samples.load_state_dict(state)
        if self._ensure_ema() is not None:
            self.ema.load_state_dict(state["ema"])

    # ------------------------------------------------------------------ data
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

    # ----------------------------------------------------------------- model
    def forward_step(self, data_iterator: Any, model):
        b = next(data_iterator)
        out = model(b["x_t"].to(self.dtype), b["t"], b["text"], b["text_mask"], target=b["target"].to(self.dtype))
        return out, partial(masked_token_loss, loss_mask=self._local_tokens(b["loss_mask"]))

    def _local_tokens(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` -> this CP rank's ``[B, N / cp]`` (the tokens the model
        computes on this rank, :func:`image_token_index`); itself without CP.
        Loss sums and token counts are then summed over DP x CP by megatron,
        so the objective is the CP1 one."""
        if self.dims.cp == 1:
            return per_token
        from megatron.core import parallel_state as mpu

        index = image_token_index(per_token.shape[1], self.dims.cp, mpu.get_context_parallel_rank())
        return per_token[:, index.to(per_token.device)]

    # ------------------------------------------------------------ evaluation
    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Sample the colour prompts with the EMA weights; write the PNG grid and
        the colour accuracy into the run directory (loss rank). Pixel-space
        data with learned captions only (latents need a VAE decoder: use
        tools/sample_dit.py). Runs under the training layout, CP included
        (``dit.eval_resolutions`` are checked like the buckets)."""
        d = self.cfg.dit
        if not d.eval_resolutions:
            return None
        if self.description.get("kind", "pixels") != "pixels" or self.tokenizer is None:
            logger.info("evaluation: skipped (sampling latent data needs the VAE; see tools/sample_dit.py)")
            return None
        out_dir = Path(self.cfg.logging.output_dir) if is_loss_rank() else None
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            result = evaluate_colors(
                chunks, self.captions, d.eval_resolutions, d.eval_samples_per_prompt,
                d.sample_steps, d.guidance_scale, seed=self.cfg.train.seed, out_dir=out_dir,
                tag=f"step{step}",
            )
        logger.info(
            "evaluation at step %d: colour accuracy %.3f over %d samples (%s)%s", step,
            result["color_accuracy"], int(result["color_samples"]),
            ", ".join(f"{k.split('/')[1]}: {v:.3f}" for k, v in result.items() if k.startswith("color_accuracy/")),
            f"; grid {out_dir / f'samples-step{step}.png'}" if out_dir else "",
        )
        return result
