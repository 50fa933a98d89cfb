"""LLaVA task: shapes dataset (or any dataset in our shard format) + LLaVA model.

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
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megascale_omni.config import ConfigError, JobConfig
from megascale_omni.config.validate import sequence_multiple
from megascale_omni.data.blend import BlendedOrder, ConcatReader
from megascale_omni.data.broadcast import batch_broadcast
from megascale_omni.data.health import check_bad_fraction
from megascale_omni.data.identity import tokenizer_source, train_split_source
from megascale_omni.data.image_preprocess import PREPROCESSOR_FILENAME, ImagePreprocessor
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder
from megascale_omni.data.llava.chat import ChatLlavaEncoder
from megascale_omni.data.llava.plan_scan import PlanScanner
from megascale_omni.data.llava.shapes_dataset import ensure_shapes_dataset
from megascale_omni.data.llava.steps import LlavaSteps
from megascale_omni.data.loader import StepLoader
from megascale_omni.data.packing import Pack, pack_samples, packing_efficiency, pad_to_max_efficiency
from megascale_omni.data.sample_plan import PackedEpochPlan
from megascale_omni.data.shards import ShardedSampleReader
from megascale_omni.models.attention import thd_inputs, thd_pipeline_shape
from megascale_omni.models.llava import build_llava_chunks
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.parallel import ParallelDims, data_parallel_rank
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.parallel.schedules import LOSS_KEY, reduce_reports
from megascale_omni.platform import Platform
from megascale_omni.tasks.base import BadSampleAccount, Task, load_tokenizer, resolve_dataset_root

logger = logging.getLogger(__name__)

#: Where the embedded dataset is generated on first use when data.path is null
#: (one directory per size, so changing the size never clobbers a build).
DEFAULT_DATASET_DIR = "data/shapes-{num_train}-{num_val}-{image_size}px"


def build_default_dataset(cfg: JobConfig) -> Path:
    """The embedded shapes dataset for ``cfg`` (built on first use, every rank)."""
    d = cfg.data
    root = Path(
        DEFAULT_DATASET_DIR.format(num_train=d.default_num_train, num_val=d.default_num_val, image_size=cfg.vision.image_size)
    )
    ensure_shapes_dataset(root, num_train=d.default_num_train, num_val=d.default_num_val, image_size=cfg.vision.image_size)
    return root


def resolve_dataset(cfg: JobConfig) -> Path:
    """Dataset directory (every rank). Builds the embedded default on first
    use; a missing explicit path is a ConfigError."""
    return resolve_dataset_root(cfg, build_default_dataset, "`python tools/make_shapes_dataset.py --out <dir>`")


def _tokenizer_dir(cfg: JobConfig, root: Path) -> Path:
    """The directory of ``data.tokenizer`` (a file's parent), else the dataset's."""
    if not cfg.data.tokenizer:
        return root
    path = Path(cfg.data.tokenizer)
    return path if path.is_dir() else path.parent


def build_encoder(cfg: JobConfig, root: Path) -> LlavaEncoder | ChatLlavaEncoder:
    """The conversation encoder of ``data.format`` (every rank); its ``tok``
    gives the vocabulary size, pad and image token ids."""
    if cfg.data.format == "words":
        return LlavaEncoder(load_tokenizer(cfg, root), cfg.vision.tokens_per_image)
    path = _tokenizer_dir(cfg, root)
    try:
        return ChatLlavaEncoder.from_pretrained(path, cfg.data.image_token, cfg.vision.tokens_per_image,
                                                cfg.model.seq_length)
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
    if source is None and (_tokenizer_dir(cfg, root) / PREPROCESSOR_FILENAME).is_file():
        source = str(_tokenizer_dir(cfg, root) / PREPROCESSOR_FILENAME)
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
        split = Path(source.path) / "train"
        if not (split / "index.json").is_file():
            raise ConfigError(f"data.blend[{i}].path", source.path,
                              "has no train/index.json; give a dataset directory written by tools/ingest_llava.py "
                              "or tools/make_shapes_dataset.py")
        readers.append(ShardedSampleReader(split))
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


#: The evaluation's accuracy metric per ``data.format`` (see :meth:`LlavaTask.evaluate`).
ACCURACY_METRIC = {"words": "image_word_accuracy", "chat": "answer_token_accuracy"}


class LlavaTask(Task):
    """The LLaVA family's :class:`~megascale_omni.tasks.base.Task` (every rank)."""

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims):
        super().__init__(cfg, platform, dims)
        self.seq_length = cfg.model.seq_length
        root = resolve_dataset(cfg)
        self.encoder = build_encoder(cfg, root)
        self.tokenizer = self.encoder.tok
        self.preprocess = build_image_preprocessor(cfg, root)
        vocab = cfg.model.vocab_size or self.tokenizer.vocab_size
        if vocab < self.tokenizer.vocab_size:
            raise ConfigError(
                "model.vocab_size", vocab,
                f"is smaller than the tokenizer's {self.tokenizer.vocab_size}; set 0 to use the tokenizer's",
            )
        self.vocab_size = self.padded_vocab_size(vocab)
        #: Samples are padded to a multiple of this many tokens (2*cp under CP).
        self.multiple = sequence_multiple(cfg)
        self.bad_samples = BadSampleAccount(cfg, dims, platform.device)
        self.scanner = PlanScanner(
            self.encoder, cfg.vision.tokens_per_image, self.seq_length, self.multiple,
            num_views=self.preprocess.num_views if cfg.data.image_mode == "anyres" else None,
            truncates=cfg.data.format == "chat",
        )
        self.train_reader = _train_reader(cfg, root)
        self.val_reader = ShardedSampleReader(root / "val") if (root / "val").is_dir() else None
        if self.val_reader is not None:
            self.scanner.check_index(self.val_reader)  # scanned at the first evaluation: fail at start instead
        self.train_ids, lengths, costs, self.train_images, self.train_views = self._scan(self.train_reader)
        self._identity = _data_identity(cfg, self.train_reader, self.scanner.basis["tokenizer"])
        order = None
        if cfg.data.blend:
            order = BlendedOrder(self.train_reader.source_of(self.train_ids), [b.weight for b in cfg.data.blend],
                                 cfg.train.seed)
            logger.info("blend: %s samples per epoch from %s", order.counts, [b.path for b in cfg.data.blend])
        self.plan = PackedEpochPlan(lengths, self.seq_length, cfg.train.global_batch_size, cfg.train.seed, costs=costs,
                                    order=order)
        self.train_batcher = LlavaBatcher(
            self.train_reader, self.encoder, self.seq_length, self.tokenizer.pad_id, cfg.vision.image_size,
            counter=self.bad_samples.counter, preprocess=self.preprocess, pad_to_multiple_of=self.multiple,
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

    # ----------------------------------------------------------------- setup
    def _scan(self, reader: ShardedSampleReader) -> tuple[np.ndarray, ...]:
        """Ids, lengths, costs, image counts and tower inputs (anyres: views)
        of the usable samples of the training split (from the index when it
        carries costs); the rest are excluded and counted."""
        scan = self.scanner.scan(reader)
        self.bad_samples.exclude(scan.bad, len(reader), str(reader.root))
        views = np.asarray([sum(v) for v in scan.views], dtype=np.int64)
        return scan.ids, scan.lengths, scan.costs, scan.images, views

    def pipeline_shape(self) -> tuple[int, int]:
        return thd_pipeline_shape(self.seq_length, self.cfg.train.micro_batch_size)

    def build_model(self):
        return build_llava_chunks(self.cfg, self.dtype, self.vocab_size, self.tokenizer.image_token_id)

    def lr_mult(self) -> dict[str, float]:
        """``vision.lr_mult`` on the ViT's parameters (the projector keeps ``train.lr``)."""
        return {"*vision_model.*": self.cfg.vision.lr_mult}

    # ------------------------------------------------------------------ data
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

    def data_stats(self) -> dict[str, float]:
        return dict(self.bad_samples.stats())

    def data_identity(self) -> dict[str, dict]:
        """Digests of the train split(s) and the tokenizer (computed at construction)."""
        return self._identity

    def state_dict(self, sharded: bool) -> dict:
        """Data-health totals over all ranks (the data position itself is the
        step: the packed plan is step-indexed)."""
        return self.bad_samples.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.bad_samples.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()

    # ----------------------------------------------------------------- model
    def _images(self, batch: dict) -> Optional[torch.Tensor]:
        """The tower's input (pipeline stage 0); None without images or on a later stage."""
        images = batch.get("images")
        return images.to(self.dtype) if images is not None and images.shape[0] else None

    def _local(self, batch: dict) -> dict:
        """This CP rank's tokens (:meth:`Task.cp_local`), plus ``image_rows``:
        which rows of the micro-batch's image features (all images, every CP
        rank runs the ViT on all of them) its image placeholders take."""
        local = self.cp_local(batch)
        if self.dims.cp > 1:
            is_image = batch["tokens"].reshape(-1) == self.tokenizer.image_token_id
            feature_row = torch.cumsum(is_image, 0) - 1
            mine = local["cp_index"]
            local["image_rows"] = feature_row[mine][is_image[mine]]
        return local

    def forward_step(self, data_iterator: Any, model):
        batch = self._local(next(data_iterator))
        tokens, pos, labels, packed = thd_inputs(batch, self.dims.cp)
        output = model(tokens, pos, packed, images=self._images(batch), labels=labels,
                       image_rows=batch.get("image_rows"))
        return output, partial(masked_token_loss, loss_mask=batch["loss_mask"])

    def eval_forward_step(self, data_iterator: Any, model):
        batch = self._local(next(data_iterator))
        tokens, pos, _, packed = thd_inputs(batch, self.dims.cp)
        logits = model(tokens, pos, packed, images=self._images(batch), labels=None,
                       image_rows=batch.get("image_rows"))
        return logits, partial(_eval_loss, batch=batch, categories=self._word_categories())

    def _word_categories(self) -> dict[str, torch.Tensor]:
        """Token ids of each answer-word category of the shapes dataset, for a
        per-category accuracy breakdown (categories absent from the vocab are dropped)."""
        if not hasattr(self, "_categories"):
            from megascale_omni.data.shapes import COLORS, POSITIONS, SHAPES

            groups = {"color": list(COLORS), "shape": list(SHAPES), "position": list(POSITIONS), "yes/no": ["yes", "no"]}
            self._categories = {}
            for name, words in groups.items():
                ids = [self.tokenizer.token_to_id(w) for w in words]
                ids = [i for i in ids if i is not None]
                if ids:
                    self._categories[name] = torch.tensor(ids)
        return self._categories

    # ------------------------------------------------------------ evaluation
    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Held-out loss and answer accuracy, with real images and with images
        shuffled across samples (control). The accuracy is over the
        image-dependent answer words of the shapes demo (``words`` format,
        ``image_word_accuracy``) or over every assistant token of the real
        tokenizer (``chat`` format, ``answer_token_accuracy``)."""
        if self.val_reader is None:
            return None
        metric = ACCURACY_METRIC[self.cfg.data.format]
        result = {}
        for name, shuffled in (("real", False), ("shuffled", True)):
            totals = self._eval_pass(chunks, shuffled)
            if totals is None:
                continue
            loss_sum, count = totals[LOSS_KEY].tolist()
            correct, total = totals["accuracy"].tolist()
            result[f"{name}/loss"] = loss_sum / max(count, 1.0)
            result[f"{name}/{metric}"] = correct / max(total, 1.0)
            result[f"{name}/scored_tokens"] = total
            for key, value in totals.items():
                if key.startswith("accuracy/") and value[1] > 0:
                    result[f"{name}/{key}"] = (value[0] / value[1]).item()
        if result:
            logger.info("evaluation at step %d (held-out split)\n%s", step, format_eval_table(result, metric))
        return result or None

    def _eval_pass(self, chunks: Sequence[torch.nn.Module], shuffled: bool):
        if not hasattr(self, "_val"):
            scan = self.scanner.scan(self.val_reader)
            check_bad_fraction(scan.bad, len(self.val_reader), self.cfg.data.max_bad_sample_fraction,
                               f"scanning {self.val_reader.root}")
            packs = pack_samples(scan.lengths, self.seq_length)
            self._val = (scan.ids, packs, _shuffled_image_sources(scan.ids, scan.views))
            self.val_batcher = LlavaBatcher(
                self.val_reader, self.encoder, self.seq_length, self.tokenizer.pad_id, self.cfg.vision.image_size,
                preprocess=self.preprocess, pad_to_multiple_of=self.multiple,
            )
        ids, packs, sources = self._val
        dp, rank = self.dims.dp, data_parallel_rank()
        mine = list(packs[rank::dp])
        mbs = self.cfg.train.micro_batch_size
        # Pipeline p2p buffers are [seq, micro_batch_size, hidden]: every
        # micro-batch must be full, so pad the tail with empty rows. The
        # interleaved (VPP) schedule also runs micro-batches in groups of pp
        # and rejects a partial last group: pad to whole groups.
        rows = mbs * (self.dims.pp if self.dims.num_model_chunks > 1 else 1)
        mine += [Pack((), (), ())] * (-len(mine) % rows or (rows if not mine else 0))
        batches = self.broadcast(lambda: [
            self.val_batcher.microbatch(mine[i : i + mbs], ids, sources if shuffled else None)
            for i in range(0, len(mine), mbs)
        ], self.val_batcher.counter)
        return reduce_reports(self.forward_only(chunks, self.eval_forward_step, batches))


def format_eval_table(result: dict[str, float], metric: str = "image_word_accuracy") -> str:
    """Real-vs-shuffled-images table for the log (loss rank)."""
    rows = [("images", "loss", metric.replace("_", " ").replace("image word", "image-word"), "scored tokens")]
    for name in ("real", "shuffled"):
        if f"{name}/loss" in result:
            rows.append((
                name if name == "real" else "shuffled (control)",
                f"{result[f'{name}/loss']:.4f}",
                f"{result[f'{name}/{metric}']:.3f}",
                f"{int(result[f'{name}/scored_tokens'])}",
            ))
    cats = sorted({k.split("/", 2)[2] for k in result if k.startswith("real/accuracy/")})
    for cat in cats:
        real = result.get(f"real/accuracy/{cat}")
        shuf = result.get(f"shuffled/accuracy/{cat}")
        rows.append((f"  {cat} words", "", f"{real:.3f} (control {shuf:.3f})" if shuf is not None else f"{real:.3f}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _eval_loss(
    logits: torch.Tensor, batch: dict, categories: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Last stage, eval only: token loss and argmax accuracy on image-dependent
    answer words. ``logits``: ``[1, t, vocab / tp]`` (THD: the ``[b, s]`` rows
    of ``batch`` flattened)."""
    full = gather_from_tensor_model_parallel_region(logits).float()  # [1, t, vocab]
    labels = batch["labels"].reshape(full.shape[:-1])
    token_loss = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    loss_sum, num_tokens, report = masked_token_loss(token_loss, batch["loss_mask"])
    hit = (full.argmax(-1) == labels).float()
    m = batch["eval_mask"].reshape(labels.shape)
    report["accuracy"] = torch.stack([(hit * m).sum().double(), m.sum().double()])
    for name, ids in categories.items():
        cm = m * torch.isin(labels, ids.to(labels.device)).float()
        report[f"accuracy/{name}"] = torch.stack([(hit * cm).sum().double(), cm.sum().double()])
    return loss_sum, num_tokens, report


def _shuffled_image_sources(ids: np.ndarray, views: Sequence[tuple[int, ...]]) -> dict[int, int]:
    """Map each val sample to a donor sample with the same tower inputs per
    image (``views``; one each unless anyres), so its encoded length is
    unchanged: a rotation within each group, so text stays and images are wrong."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, v in zip(ids.tolist(), views):
        groups.setdefault(tuple(v), []).append(i)
    sources = {}
    for key, members in groups.items():
        n = len(key)
        if n == 0:
            continue
        rng = np.random.default_rng([7, n, *key] if any(v != 1 for v in key) else [7, n])
        order = rng.permutation(len(members))
        for k, idx in enumerate(order):
            sources[members[idx]] = members[order[(k + 1) % len(order)]]
    return sources
