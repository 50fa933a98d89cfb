"""The LLaVA plan's per-sample lengths and costs: from ``index.json`` alone
when it carries costs for this run's tokenizer and format, else from each
sample's JSON member.

A sample is planned from the index when its source's ``cost_basis`` equals
the encoder's and its ``cost.tokens`` is known: its length is ``tokens +
tokens_per_image * views`` (:mod:`megascale_omni.data.costs`). The chat
format truncates a conversation longer than ``model.seq_length`` by whole
rounds, which the total alone cannot reproduce, so such a sample (and every
sample without a known count) is read as before (:func:`plan_sample`). Both
ways give the same lengths, so a plan does not depend on which was used.

Videos: each reads ``min(stored frames, data.video_frames)`` frames, one
tower input each, and takes ``vision.video_tokens(frames)`` LM tokens (the
rule the model lays them out by: pooled frames plus the newline), from the
index's frame counts in both ways (a video sample whose index entry has
none is excluded); the balance cost counts each frame as a tower input. :attr:`PlanScan.video_samples` counts the usable samples with videos.

anyres: a sample's view count comes from the index's image sizes in both
ways; a format-1 index has none, which is fatal (re-ingest or re-index).

exact (the default ``data.image_mode``): images must already be
``vision.image_size`` square. :func:`check_exact_sizes` refuses a split at
start, from the index's image sizes, when more of its samples have other
sizes than ``data.max_bad_sample_fraction`` allows (a LLaVA set of photos
would otherwise be skipped sample by sample until the bad-sample limit
stops the run), naming the image modes that preprocess them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from megascale_omni.config import ConfigError
from megascale_omni.data.balance import sample_cost
from megascale_omni.data.costs import frames_read, is_video_member
from megascale_omni.data.errors import DataFileError
from megascale_omni.data.llava.batches import padded_length, plan_sample
from megascale_omni.data.shards import INDEX_FILENAME, BadSampleError, ShardedSampleReader

logger = logging.getLogger(__name__)

#: Fix offered when an index lacks what the run needs.
REINDEX_FIX = ("re-ingest with tools/ingest_llava.py (or rebuild with tools/make_shapes_dataset.py), or "
               "re-index the split with megascale_omni.data.shard_writer.index_shards(<split dir>, coster=<encoder>)")


def check_exact_sizes(reader, image_size: int, limit: float) -> None:
    """Raise ConfigError naming ``data.image_mode`` when more than ``limit``
    of ``reader``'s samples (a split or a blend) have an image whose size
    in the index is not ``image_size`` square (every rank, at start; reads
    only the index: samples without sizes are checked when read)."""
    wrong, example = 0, None
    for i in range(len(reader)):
        src, j = reader.resolve(i)
        cost = src.index.samples[j].cost
        bad = [hw for hw in (cost.image_hw if cost is not None else ()) if hw != (image_size, image_size)]
        if bad:
            wrong += 1
            example = example or (src.root, src.index.samples[j].id, bad[0])
    if wrong and wrong / len(reader) > limit:
        root, sample_id, (h, w) = example
        raise ConfigError("data.image_mode", "exact",
                          f"needs every image {image_size}x{image_size} (vision.image_size), but {wrong} of "
                          f"{len(reader)} samples have other sizes (e.g. {root} sample {sample_id}: {h}x{w}, "
                          "height x width); set data.image_mode=pad_square (LLaVA-1.5), resize_crop or anyres "
                          "to preprocess them")


@dataclass
class PlanScan:
    """Usable samples of one split (arrays aligned, one entry per usable sample)."""

    #: Reader indices of the usable samples.
    ids: np.ndarray
    #: Padded token lengths.
    lengths: np.ndarray
    #: Balance costs (:func:`~megascale_omni.data.balance.sample_cost`, tower inputs as images).
    costs: np.ndarray
    #: Images kept per sample.
    images: np.ndarray
    #: Tower inputs per image kept (anyres: 1 + tiles), one tuple per sample.
    views: list[tuple[int, ...]]
    #: Samples excluded (bad or too long).
    bad: int
    #: Samples planned from the index alone (the rest read their JSON member).
    from_index: int
    #: Usable samples that have videos.
    video_samples: int = 0
    #: Video frames read per usable sample (tower inputs besides its image views).
    frames: Optional[np.ndarray] = None


class PlanScanner:
    """Lengths and costs of every sample of a split (every rank; a pure
    function of the bytes on disk and the settings, so all ranks agree).

    Args:
        encoder: the run's conversation encoder (``plan_from_metadata``, ``cost_basis``).
        tokens_per_image: LM placeholders per image view (``vision.image_tokens``).
        seq_length: ``model.seq_length``; longer (padded) samples are excluded.
        multiple: samples are padded to a multiple of this many tokens.
        num_views: image ``(height, width)`` -> tower inputs (anyres), or None: one per image.
        truncates: the encoder cuts samples over ``seq_length`` (chat format).
        video_frames: frames read per video (``data.video_frames``; 0: all stored).
        video_tokens: frames of a video -> its LM placeholders (``vision.video_tokens``;
            needed when the data has videos).
        tower_tokens: features of one tower input (``vision.tokens_per_image``;
            default ``tokens_per_image``), for the balance cost.
    """

    def __init__(self, encoder, tokens_per_image: int, seq_length: int, multiple: int,
                 num_views: Optional[Callable[[tuple[int, int]], int]] = None, truncates: bool = False,
                 video_frames: int = 0, video_tokens: Optional[Callable[[int], int]] = None,
                 tower_tokens: Optional[int] = None):
        self.encoder = encoder
        self.tokens_per_image = tokens_per_image
        self.seq_length = seq_length
        self.multiple = multiple
        self.num_views = num_views
        self.truncates = truncates
        self.video_frames = video_frames
        self.video_tokens = video_tokens
        self.tower_tokens = tower_tokens or tokens_per_image
        #: ``encoder.cost_basis()``: the index token counts this run can use.
        self.basis = encoder.cost_basis()

    def check_index(self, reader: ShardedSampleReader) -> None:
        """Raise DataFileError (naming its ``index.json``) if ``reader``'s
        index lacks what this run needs: image sizes under anyres."""
        if self.num_views is not None and not reader.index.has_costs:
            raise DataFileError(reader.root / INDEX_FILENAME, "data.image_mode=anyres needs each image's size, and "
                                f"this index (format {reader.index.format_version}) has none", REINDEX_FIX)

    def _use_index(self, reader: ShardedSampleReader) -> bool:
        """Whether ``reader``'s token counts apply; says why not once per split."""
        path = reader.root / INDEX_FILENAME
        self.check_index(reader)
        if not reader.index.has_costs:
            logger.info("%s has no per-sample costs (format %d): planning from every sample's JSON member; %s "
                        "to start from the index", path, reader.index.format_version, REINDEX_FIX)
            return False
        basis = reader.index.cost_basis
        if basis != self.basis:
            why = "no token counts" if basis is None else (
                f"token counts for data.format={basis['format']} with another tokenizer"
                if basis["format"] == self.basis["format"] else f"token counts for data.format={basis['format']}")
            logger.info("%s has %s: planning from every sample's JSON member; %s with this run's tokenizer to "
                        "start from the index", path, why, REINDEX_FIX)
            return False
        return True

    def _views(self, reader: ShardedSampleReader, idx: int, image_hw) -> list[int]:
        """anyres view counts of sample ``idx``'s images (BadSampleError if the index has no sizes for it)."""
        if image_hw is None:
            loc = reader.index.samples[idx]
            raise BadSampleError(loc.id, reader.root / reader.index.shards[loc.shard].name,
                                 "an image member has no readable header (no size in index.json)")
        return [self.num_views(hw) for hw in image_hw]

    def _frames(self, reader: ShardedSampleReader, idx: int, cost) -> tuple[int, ...]:
        """Frames read of each of sample ``idx``'s videos (BadSampleError when
        it has video members but no frame counts in the index)."""
        loc = reader.index.samples[idx]
        if cost is None and any(is_video_member(s) for s in loc.members):
            raise BadSampleError(loc.id, reader.root / reader.index.shards[loc.shard].name,
                                 "a video frame member has no readable header (no frame count in index.json)")
        return frames_read(cost, self.video_frames)

    def _plan_one(self, reader, i: int, use_index: dict) -> tuple[int, int, tuple[int, ...], bool, int]:
        """(unpadded tokens, images kept, views of the kept images, from the
        index, video frames read) of sample ``i``."""
        src, j = reader.resolve(i)
        key = id(src)
        if key not in use_index:
            use_index[key] = self._use_index(src)
        cost = src.index.samples[j].cost
        video_frames = self._frames(src, j, cost)
        frames = sum(video_frames)
        views = None  # tower inputs per image, when the index knows the images
        if self.num_views is not None:
            views = self._views(src, j, None if cost is None else cost.image_hw)
        elif cost is not None:
            views = [1] * len(cost.image_hw)
        if use_index[key] and cost is not None and cost.tokens is not None:
            n = cost.tokens + self.tokens_per_image * sum(views) + sum(map(self.video_tokens, video_frames))
            if not (self.truncates and n > self.seq_length):
                return n, len(views), tuple(views), True, frames
        n, kept = plan_sample(reader, self.encoder, i, views if self.num_views is not None else None, video_frames)
        return n, kept, tuple(views[:kept]) if views is not None else (1,) * kept, False, frames

    def scan(self, reader) -> PlanScan:
        """Plan every sample of ``reader`` (a split or a blend of splits)."""
        ids, lengths, costs, images, views, frame_counts = [], [], [], [], [], []
        bad = from_index = video_samples = 0
        use_index: dict[int, bool] = {}
        for i in range(len(reader)):
            try:
                n, kept, sample_views, indexed, frames = self._plan_one(reader, i, use_index)
            except BadSampleError as err:
                bad += 1
                logger.warning("excluding sample %d from the plan: %s", i, err)
                continue
            n = padded_length(n, self.multiple)
            if n > self.seq_length:
                bad += 1
                logger.warning("excluding sample %d: %d tokens > model.seq_length %d", i, n, self.seq_length)
                continue
            from_index += indexed
            video_samples += frames > 0
            ids.append(i)
            lengths.append(n)
            costs.append(sample_cost(n, sum(sample_views) + frames, self.tower_tokens))
            images.append(kept)
            views.append(sample_views)
            frame_counts.append(frames)
        logger.info("planned %d of %d samples of %s from index.json alone", from_index, len(reader), reader.root)
        return PlanScan(np.asarray(ids), np.asarray(lengths), np.asarray(costs), np.asarray(images), views, bad,
                        from_index, video_samples, np.asarray(frame_counts, dtype=np.int64))
