"""Image-text conversation data for the LLaVA family (every rank).

Conversations are tokenised word by word (``data.format: words``, the shapes
demo) or by the model's HF chat template (``chat``); images go through the
tower's preprocessing (``data.image_mode``, :mod:`megascale_omni.data.image_preprocess`).

Data position is the step: the global batch of step ``s`` is a pure function
of (seed, s) through :class:`PackedEpochPlan`, split across DP ranks by
estimated compute cost (ViT patches + LM tokens). Within a model replica
only TP rank 0 of pipeline stage 0 reads and decodes a step's samples; the
other TP ranks receive its micro-batches, later pipeline stages their
token-level entries only (:mod:`megascale_omni.data.broadcast`).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.config.validate import sequence_multiple
from megascale_omni.data.bad_samples import BadSampleAccount
from megascale_omni.data.blend import BlendedOrder, ConcatReader
from megascale_omni.data.broadcast import batch_broadcast
from megascale_omni.data.dataset_root import DefaultDataset, load_tokenizer, resolve_dataset_root
from megascale_omni.data.identity import tokenizer_source, train_split_source
from megascale_omni.data.image_preprocess import ImagePreprocessor, find_preprocessor_config
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder
from megascale_omni.data.llava.chat import ChatLlavaEncoder
from megascale_omni.data.llava.plan_scan import PlanScanner, check_exact_sizes
from megascale_omni.data.llava.preflight import HOW_TO_MAKE, blend_train_split, check_vocab_size, tokenizer_dir
from megascale_omni.data.llava.steps import LlavaSteps
from megascale_omni.data.loader import StepLoader
from megascale_omni.data.module import DataModule
from megascale_omni.data.packing import Pack, packing_efficiency, pad_to_max_efficiency
from megascale_omni.data.sample_plan import PackedEpochPlan
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.parallel import ParallelDims
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.platform import Platform

logger = logging.getLogger(__name__)

def build_encoder(cfg: JobConfig, root: Path) -> LlavaEncoder | ChatLlavaEncoder:
    """The conversation encoder of ``data.format`` (every rank); its ``tok``
    gives the vocabulary size, pad and image token ids."""
    v = cfg.vision
    if cfg.data.format == "words":
        tok = load_tokenizer(cfg, root)
        video_id = tok.token_to_id(cfg.data.video_token)
        return LlavaEncoder(tok, v.image_tokens, -1 if video_id is None else video_id, v.video_tokens)
    path = tokenizer_dir(cfg, root)
    try:
        return ChatLlavaEncoder.from_pretrained(path, cfg.data.image_token, v.image_tokens, cfg.model.seq_length,
                                                cfg.data.video_token, v.video_tokens)
    except (OSError, ValueError) as err:
        field = "data.image_token" if "image token" in str(err) else "data.tokenizer"
        raise ConfigError(field, cfg.data.image_token if field == "data.image_token" else str(path),
                          f"data.format=chat needs a Hugging Face tokenizer directory with a chat template: {err}"
                          ) from None


def build_image_preprocessor(cfg: JobConfig, root: Path) -> Optional[ImagePreprocessor]:
    """The tower preprocessing of ``data.image_mode`` (None for ``exact``)."""
    d = cfg.data
    if d.image_mode == "exact":
        return None
    source = d.image_processor
    if source is None and (found := find_preprocessor_config(tokenizer_dir(cfg, root))) is not None:
        source = str(found)
    try:
        pre = ImagePreprocessor.from_config(d.image_mode, cfg.vision.image_size, source)
    except (OSError, ValueError) as err:
        raise ConfigError("data.image_processor", source, f"cannot be used: {err}") from None
    logger.info("images: %s with %s", d.image_mode, source or "mean = std = 0.5 (no preprocessor config)")
    return pre


def _train_reader(cfg: JobConfig, root: Path):
    """The training split: ``root/train``, or the ``data.blend`` sources' train
    splits as one :class:`~megascale_omni.data.blend.ConcatReader`."""
    if not cfg.data.blend:
        return ShardedSampleReader(root / "train")
    readers = []
    for i, source in enumerate(cfg.data.blend):
        readers.append(ShardedSampleReader(blend_train_split(i, source.path)))
    return ConcatReader(readers)


def _data_identity(cfg: JobConfig, train_reader, tokenizer_digest: str) -> dict[str, dict]:
    """The content identity of the training data (:mod:`megascale_omni.data.identity`):
    the train split of ``data.path`` or of every ``data.blend`` member, and the tokenizer."""
    if cfg.data.blend:
        identity = {f"data.blend[{i}]": train_split_source(f"data.blend[{i}].path", source.path, reader.index_digest)
                    for i, (source, reader) in enumerate(zip(cfg.data.blend, train_reader.readers, strict=True))}
    else:
        identity = {"data.path": train_split_source("data.path", cfg.data.path, train_reader.index_digest)}
    identity["tokenizer"] = tokenizer_source(cfg.data.tokenizer, cfg.data.path, tokenizer_digest)
    return identity


class ConversationData(DataModule):
    """The LLaVA family's :class:`~megascale_omni.data.module.DataModule`.

    Besides the training plan it exposes what the model and the evaluators
    read: :attr:`tokenizer` (``image_token_id``), :attr:`vocab_size` (padded),
    :attr:`encoder`, :attr:`preprocess`, :attr:`scanner`, :attr:`multiple`
    and :attr:`val_reader` (None without a ``val/`` split).
    """

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims,
                 default_dataset: Optional[DefaultDataset] = None):
        super().__init__(cfg, platform, dims, default_dataset)
        self.seq_length = cfg.model.seq_length
        root = resolve_dataset_root(cfg, default_dataset, HOW_TO_MAKE)
        self.encoder = build_encoder(cfg, root)
        self.tokenizer = self.encoder.tok
        self.preprocess = build_image_preprocessor(cfg, root)
        check_vocab_size(cfg, self.tokenizer.vocab_size)  # validation could not read every tokenizer
        self.vocab_size = cfg.model.padded_vocab_size(cfg.model.vocab_size or self.tokenizer.vocab_size)
        #: Samples are padded to a multiple of this many tokens (2*cp under CP).
        self.multiple = sequence_multiple(cfg)
        self.bad_samples = BadSampleAccount(cfg, dims, platform.device)
        self.scanner = PlanScanner(
            self.encoder, cfg.vision.image_tokens, self.seq_length, self.multiple,
            num_views=self.preprocess.num_views if cfg.data.image_mode == "anyres" else None,
            truncates=cfg.data.format == "chat", video_frames=cfg.data.video_frames,
            video_tokens=cfg.vision.video_tokens, tower_tokens=cfg.vision.tokens_per_image,
        )
        self.train_reader = _train_reader(cfg, root)
        self.val_reader = ShardedSampleReader(root / "val") if (root / "val").is_dir() else None
        for reader in (self.train_reader, self.val_reader):
            if reader is not None and cfg.data.image_mode == "exact":
                check_exact_sizes(reader, cfg.vision.image_size, cfg.data.max_bad_sample_fraction)
        if self.val_reader is not None:
            self.scanner.check_index(self.val_reader)  # scanned at the first evaluation: fail at start instead
        scan = self.scanner.scan(self.train_reader)
        self.bad_samples.exclude(scan.bad, len(self.train_reader), str(self.train_reader.root))
        self.train_ids, lengths, self.train_images = scan.ids, scan.lengths, scan.images
        #: Usable training samples with videos.
        self.video_samples = scan.video_samples
        #: Id of the video placeholders (``data.video_token``); -1: the vocabulary has none.
        self.video_token_id = self.encoder.video_token_id
        if self.video_samples and self.video_token_id < 0:
            raise ConfigError("data.video_token", cfg.data.video_token, f"is not in the tokenizer's vocabulary, and "
                              f"{self.video_samples} training samples have videos: add it to the tokenizer (a "
                              "special token, or a word of a word-level vocabulary) or name the one it has")
        #: Tower inputs per usable sample (its images' views, anyres: tiles too, and its
        #: video frames), for the model FLOPs.
        self.train_views = np.asarray([sum(v) for v in scan.views], dtype=np.int64) + scan.frames
        self._identity = _data_identity(cfg, self.train_reader, self.scanner.basis["tokenizer"])
        order = None
        if cfg.data.blend:
            order = BlendedOrder(self.train_reader.source_of(self.train_ids), [b.weight for b in cfg.data.blend],
                                 cfg.train.seed)
            logger.info("blend: %s samples per epoch from %s", order.counts, [b.path for b in cfg.data.blend])
        self.plan = PackedEpochPlan(lengths, self.seq_length, cfg.train.global_batch_size, cfg.train.seed,
                                    costs=scan.costs, order=order)
        self.train_batcher = LlavaBatcher(
            self.train_reader, self.encoder, self.seq_length, self.tokenizer.pad_id, cfg.vision.image_size,
            counter=self.bad_samples.counter, preprocess=self.preprocess, pad_to_multiple_of=self.multiple,
            video_frames=cfg.data.video_frames,
        )
        self.steps = LlavaSteps(self.plan, self.train_ids, self.train_batcher, cfg.train.micro_batch_size)
        #: Builds on TP rank 0 of stage 0, hands the batches to the rest of the model replica.
        self.broadcast = batch_broadcast(dims.tp, dims.pp, platform.device)
        # Only the reader builds: the other ranks start no loader workers.
        self.loader = StepLoader(self.steps, cfg.data.num_workers if self.broadcast.reads else 0,
                                 cfg.data.prefetch_steps, cfg.train.steps, pin_memory=platform.is_cuda,
                                 log_level=cfg.logging.level)
        packs0 = self.plan.epoch_packs(0)
        self.packing_efficiency = packing_efficiency(packs0, self.seq_length)
        self.pad_to_max_efficiency = pad_to_max_efficiency(lengths)
        logger.info(
            "train: %d samples, %d packed rows/epoch, %d steps/epoch; packing efficiency %.3f "
            "(pad-to-max %.3f)",
            len(self.train_ids), len(packs0), self.plan.steps_in_epoch(0),
            self.packing_efficiency, self.pad_to_max_efficiency,
        )

    def global_batch_size_of(self, step: int) -> tuple[int, int]:
        packs = self.plan.global_batch(step)
        return sum(p.num_samples for p in packs), sum(p.num_tokens for p in packs)

    def images_of(self, step: int) -> int:
        return int(sum(self.train_images[sid] for p in self.plan.global_batch(step) for sid in p.sample_ids))

    def batch_shape(self, step: int) -> BatchShape:
        """Every packed sample of global batch ``step`` and the tower inputs of its images."""
        packs = self.plan.global_batch(step)
        return BatchShape(segments=tuple(int(s) for p in packs for s in p.lengths),
                          tower_inputs=float(sum(self.train_views[sid] for p in packs for sid in p.sample_ids)))

    def _share(self, step: int, dp_rank: int, dp_size: int) -> list[Pack]:
        """DP rank ``dp_rank``'s packed rows of global batch ``step`` (:meth:`LlavaSteps.share`)."""
        return self.steps.share(step, dp_rank, dp_size)

    def sample_ids(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """Dataset indices of the samples packed into DP rank ``dp_rank``'s share of step ``step``."""
        return [int(self.train_ids[sid]) for pack in self._share(step, dp_rank, dp_size) for sid in pack.sample_ids]

    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        """DP rank ``dp_rank``'s micro-batches of step ``step`` (every rank;
        read on TP rank 0 of stage 0 only, later stages get no ``images``)."""
        # Built ahead in data.num_workers processes, or here (0); skip counts land in bad_samples.counter.
        batches = self.broadcast(partial(self.loader.get, step, dp_rank, dp_size), self.bad_samples.counter)
        # Abort on every rank together when bad samples exceed the limit (collective).
        self.bad_samples.update()
        return batches

    def data_identity(self) -> dict[str, dict]:
        """Digests of the train split(s) and the tokenizer (computed at construction)."""
        return self._identity

    def close(self) -> None:
        self.loader.close()
