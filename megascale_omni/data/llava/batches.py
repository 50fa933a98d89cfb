"""LLaVA samples -> packed, fixed-shape micro-batches.

Token layout of one sample (word-level tokenizer, ``P`` = tokens per image)::

    <bos> user words with each <image> repeated P times  answer words <eos>
    loss:  0 ...................................0        1 ..........  1
    eval:  0 ...................................0        1 on image-dependent answer words

(``P`` = ``vision.image_tokens``; each ``<video>`` becomes
``vision.video_tokens(frames)`` video placeholders.)

Packed rows come from :mod:`megascale_omni.data.packing`; images of a
micro-batch are stacked in the order their placeholder blocks appear in the
row-major ``[batch, seq]`` token tensor, which is the order the model writes
their features back.

Bad samples (corrupt image, missing field, wrong types) are excluded when
the plan is built (:func:`plan_sample`) or skipped when read, counted and
logged. Within a model replica one rank builds the micro-batches and the
others receive them (:mod:`megascale_omni.data.broadcast`), so all of them
skip the same sample; data-parallel ranks build disjoint shares of the plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from megascale_omni.data.costs import fingerprint
from megascale_omni.data.health import SkipCounter
from megascale_omni.data.image_preprocess import ImagePreprocessor
from megascale_omni.data.packing import Pack, collate_pack, packed_cu_seqlens
from megascale_omni.data.sample import (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Sample, SampleValidationError,
                                        validate_metadata)
from megascale_omni.data.shards import BadSampleError, ShardedSampleReader
from megascale_omni.data.tokenizer import TextTokenizer
from megascale_omni.data.video import subsample

logger = logging.getLogger(__name__)


@dataclass
class EncodedSample:
    """One sample as token ids plus per-token masks (unshifted, aligned with tokens)."""

    sample_id: int
    tokens: list[int]
    #: 1 where the token is a training target (answer words and <eos>).
    target_mask: list[float]
    #: 1 where the token is an image-dependent answer word (evaluation only).
    eval_mask: list[float]
    #: ``[H, W, 3]`` uint8 images, in placeholder order (after
    #: :class:`LlavaBatcher` preprocessing: float32 ``[n, 3, S, S]`` tensors).
    images: list
    #: Per ``<video>``: after :class:`LlavaBatcher`, float32 ``[frames, 3, S, S]`` (one tower input per frame).
    videos: list = field(default_factory=list)
    #: Videos whose placeholders ``tokens`` hold: the sample's first ``num_videos``
    #: (the chat format drops those of truncated rounds).
    num_videos: int = 0


class LlavaEncoder:
    """Turns conversations into token ids with expanded image and video placeholders.

    ``views_per_image`` (anyres): tower inputs per image, each expanded to
    ``tokens_per_image`` placeholders (``vision.image_tokens``); None = one
    view per image. Each ``<video>`` word becomes ``video_tokens(frames)``
    placeholders (``vision.video_tokens``) holding ``video_token_id`` (the
    vocabulary's ``<video>``; -1: it has none and videos cannot be encoded)."""

    def __init__(self, tokenizer: TextTokenizer, tokens_per_image: int, video_token_id: int = -1,
                 video_tokens: Optional[Callable[[int], int]] = None):
        self.tok = tokenizer
        self.tokens_per_image = tokens_per_image
        self.video_token_id = video_token_id
        self.video_tokens = video_tokens

    def cost_basis(self) -> dict[str, str]:
        """What this encoder's :meth:`text_tokens` are valid for (``index.json``'s ``cost_basis``)."""
        return {"format": "words", "tokenizer": fingerprint(self.tok.to_str())}

    def _prompt_ids(self, user_text: str, views: Optional[Sequence[int]] = None,
                    frames: Optional[Sequence[int]] = None) -> list[int]:
        """``frames`` None: ``<video>`` words take no tokens (the text-only count)."""
        ids: list[int] = [self.tok.bos_id]
        image = 0
        for k, piece in enumerate(user_text.split(VIDEO_PLACEHOLDER)):
            if k and frames is not None:
                ids.extend(self._video_ids(frames, k - 1))
            for tid in self.tok.encode(piece):
                if tid != self.tok.image_token_id:
                    ids.append(tid)
                    continue
                if views is not None and image >= len(views):
                    raise ValueError(f"text has more {IMAGE_PLACEHOLDER} than the {len(views)} image views given")
                ids.extend([tid] * (self.tokens_per_image * (1 if views is None else views[image])))
                image += 1
        if frames is not None and len(frames) != user_text.count(VIDEO_PLACEHOLDER):
            raise ValueError(f"text has {user_text.count(VIDEO_PLACEHOLDER)} {VIDEO_PLACEHOLDER} but "
                             f"{len(frames)} videos are given")
        return ids

    def _video_ids(self, frames: Sequence[int], video: int) -> list[int]:
        if video >= len(frames):
            raise ValueError(f"text has more {VIDEO_PLACEHOLDER} than the {len(frames)} videos given")
        if self.video_token_id < 0 or self.video_tokens is None:
            raise ValueError(f"the tokenizer has no {VIDEO_PLACEHOLDER} token for video placeholders; add the word "
                             f"{VIDEO_PLACEHOLDER} to its vocabulary")
        return [self.video_token_id] * self.video_tokens(frames[video])

    def length_from_metadata(self, meta: Mapping, views: Optional[Sequence[int]] = None,
                             frames: Optional[Sequence[int]] = None) -> int:
        """Encoded length computed from the JSON member alone (no image decode;
        ``frames``: frames read per video, None: videos count no tokens)."""
        user = " ".join(t["text"] for t in meta["conversation"] if t["role"] == "user")
        answer = " ".join(t["text"] for t in meta["conversation"] if t["role"] == "assistant")
        return len(self._prompt_ids(user, views, frames)) + len(self.tok.encode(answer)) + 1

    def plan_from_metadata(self, meta: Mapping, views: Optional[Sequence[int]] = None,
                           frames: Sequence[int] = ()) -> tuple[int, int]:
        """(tokens, images) of the encoded sample from its JSON member alone
        (``frames``: frames read per video, from the index)."""
        return self.length_from_metadata(meta, views, frames), int(meta["num_images"])

    def text_tokens(self, meta: Mapping) -> int:
        """Encoded length without image placeholders (the index's ``cost.tokens``).
        Raises SampleValidationError (a ValueError) for metadata violating the contract."""
        validate_metadata(meta)
        user = " ".join(t["text"] for t in meta["conversation"] if t["role"] == "user")
        if self.tok.encode(user).count(self.tok.image_token_id) != meta["num_images"]:
            raise ValueError(f"the tokenizer finds another number of {IMAGE_PLACEHOLDER} than num_images")
        return self.length_from_metadata(meta, [0] * meta["num_images"])

    def encode(self, sample: Sample, views_per_image: Optional[Sequence[int]] = None,
               frames_per_video: Optional[Sequence[int]] = None) -> EncodedSample:
        """``frames_per_video``: frames read of each video (default: all of ``sample.videos``)."""
        views = [1] * sample.num_images if views_per_image is None else list(views_per_image)
        frames = [len(v) for v in sample.videos] if frames_per_video is None else list(frames_per_video)
        markers = self.tok.encode(sample.user_text).count(self.tok.image_token_id)
        if markers != sample.num_images or len(views) != sample.num_images:
            raise BadSampleError(
                sample.id, "<encoded>", f"text has {markers} {IMAGE_PLACEHOLDER} but the sample has "
                f"{sample.num_images} images"
            )
        try:
            prompt = self._prompt_ids(sample.user_text, views, frames)
        except ValueError as err:
            raise BadSampleError(sample.id, "<encoded>", str(err)) from None
        answer = self.tok.encode(sample.answer_text)
        dependent = set(sample.image_dependent_positions())
        tokens = prompt + answer + [self.tok.eos_id]
        target = [0.0] * len(prompt) + [1.0] * (len(answer) + 1)
        evalm = [0.0] * len(prompt) + [1.0 if i in dependent else 0.0 for i in range(len(answer))] + [0.0]
        return EncodedSample(sample.id, tokens, target, evalm, list(sample.images), num_videos=len(frames))


def plan_sample(reader: ShardedSampleReader, encoder: "LlavaEncoder", idx: int,
                views: Optional[Sequence[int]] = None, frames: Sequence[int] = ()) -> tuple[int, int]:
    """(tokens, images) of sample ``idx`` from its JSON member alone, as the
    plan is built (every rank; a pure function of the bytes on disk, so every
    rank excludes the same samples). ``views``: tower inputs per image
    (anyres; None = 1 each); ``frames``: frames read per video (from the
    index); ``images`` counts the images kept (chat truncation drops trailing ones).

    Raises:
        BadSampleError: the sample must be excluded (unreadable or corrupt
            JSON, a field missing or of the wrong type, a conversation
            violating the :class:`~megascale_omni.data.sample.Sample`
            contract, or one the encoder rejects).
        DataFileError: the sample's shard is missing or fails its checksum (fatal).
    """
    reader, idx = reader.resolve(idx)
    meta = reader.read_metadata(idx)
    loc = reader.index.samples[idx]
    try:
        validate_metadata(meta)
        return encoder.plan_from_metadata(meta, views, frames)
    except (SampleValidationError, KeyError, TypeError, ValueError) as err:
        raise BadSampleError(loc.id, reader.root / reader.index.shards[loc.shard].name, str(err)) from None


def padded_length(num_tokens: int, multiple: int) -> int:
    """Tokens a sample of ``num_tokens`` occupies in a packed row after :func:`pad_encoded`."""
    return -(-num_tokens // multiple) * multiple


def pad_encoded(enc: EncodedSample, multiple: int, pad_id: int) -> EncodedSample:
    """``enc`` with ``pad_id`` tokens appended up to a multiple of ``multiple``.

    The padding stays in the sample's THD segment (it is not a segment of its
    own, so segment lengths stay multiples); it has no loss and, attention
    being causal, no real token attends to it."""
    extra = padded_length(len(enc.tokens), multiple) - len(enc.tokens)
    if extra == 0:
        return enc
    return EncodedSample(
        enc.sample_id, enc.tokens + [pad_id] * extra, enc.target_mask + [0.0] * extra,
        enc.eval_mask + [0.0] * extra, enc.images, enc.videos, enc.num_videos,
    )


def images_to_tensor(images: Sequence[np.ndarray], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n x [H, W, 3] uint8`` -> ``[n, 3, H, W]`` scaled to [-1, 1]."""
    if not images:
        return torch.zeros(0, 3, 1, 1, dtype=dtype)
    arr = np.stack(images).astype(np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous().to(dtype)


class LlavaBatcher:
    """Reads, encodes and collates packs into micro-batches (the reader of each
    model replica, :mod:`megascale_omni.data.broadcast`)."""

    def __init__(
        self,
        reader: ShardedSampleReader,
        encoder: LlavaEncoder,
        seq_length: int,
        pad_id: int,
        image_size: int,
        counter: Optional[SkipCounter] = None,
        preprocess: Optional[ImagePreprocessor] = None,
        pad_to_multiple_of: int = 1,
        video_frames: int = 0,
    ):
        self.reader = reader
        #: A :class:`LlavaEncoder` or anything with its ``encode`` (the chat format's encoder).
        self.encoder = encoder
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.image_size = image_size
        #: Tower preprocessing (``data.image_mode``); None: images must be
        #: ``image_size`` square already and are scaled to [-1, 1].
        self.preprocess = preprocess
        #: Every sample is padded at its end to a multiple of this many tokens
        #: (context parallelism cuts each into ``2 * cp`` equal chunks); the
        #: plan must have packed the padded lengths (:func:`padded_length`).
        self.pad_to_multiple_of = pad_to_multiple_of
        #: Frames read per video (``data.video_frames``; 0: every stored frame).
        self.video_frames = video_frames
        #: Where skipped samples are counted (shared with the task's job-wide account).
        self.counter = counter if counter is not None else SkipCounter()

    def _load(self, sample_id: int, image_source: Optional[int], shuffle_frames: bool = False
              ) -> Optional[EncodedSample]:
        try:
            sample = self.reader[sample_id]
            if image_source is not None and image_source != sample_id:
                donor = self.reader[image_source]
                if donor.num_images != sample.num_images:
                    raise ValueError(f"image donor {image_source} has {donor.num_images} images")
                sample.images = list(donor.images)
            for img in sample.images if self.preprocess is None else ():
                if img.shape != (self.image_size, self.image_size, 3):
                    raise BadSampleError(
                        sample_id, self.reader.root, f"image shape {img.shape} != "
                        f"({self.image_size}, {self.image_size}, 3); re-run data preparation at this resolution",
                    )
            frames = [len(subsample(video, self.video_frames)) for video in sample.videos]
            views = None
            if self.preprocess is not None and self.preprocess.mode == "anyres":
                views = [self.preprocess.num_views(img.shape[:2]) for img in sample.images]
            enc = self.encoder.encode(sample, views_per_image=views, frames_per_video=frames)
            if self.preprocess is not None:
                enc.images = [self._preprocess(sample_id, img) for img in enc.images]
            enc.videos = [self._video(sample_id, video, shuffle_frames) for video in sample.videos[: enc.num_videos]]
        except BadSampleError as err:
            self.counter.record_skip(err)
            return None
        self.counter.seen += 1
        return pad_encoded(enc, self.pad_to_multiple_of, self.pad_id)

    def _preprocess(self, sample_id: int, image: np.ndarray) -> torch.Tensor:
        try:
            return self.preprocess(image)
        except ValueError as err:
            raise BadSampleError(sample_id, self.reader.root, f"image preprocessing failed: {err}") from None

    def _video(self, sample_id: int, video: np.ndarray, shuffle_frames: bool = False) -> torch.Tensor:
        """uint8 ``[F, H, W, 3]`` -> float32 ``[f, 3, S, S]``: ``data.video_frames``
        of the stored frames (:func:`~megascale_omni.data.video.subsample`),
        each preprocessed as an image (``data.image_mode``; anyres: its
        overview only, as LLaVA-OneVision treats video frames).
        ``shuffle_frames``: those frames in a random order (the time-shuffled
        control; the permutation is a function of ``sample_id``)."""
        frames = subsample(video, self.video_frames)
        if shuffle_frames:
            frames = frames[np.random.default_rng([7, sample_id]).permutation(len(frames))]
        if self.preprocess is None:
            if frames.shape[1:] != (self.image_size, self.image_size, 3):
                raise BadSampleError(sample_id, self.reader.root, f"video frame shape {frames.shape[1:]} != "
                                     f"({self.image_size}, {self.image_size}, 3); set data.image_mode")
            return images_to_tensor(list(frames))
        try:
            return torch.cat([self.preprocess.frame(f) for f in frames])
        except ValueError as err:
            raise BadSampleError(sample_id, self.reader.root, f"video frame preprocessing failed: {err}") from None

    def microbatch(
        self, packs: Sequence[Pack], id_map: Sequence[int], image_sources: Optional[Mapping[int, int]] = None,
        shuffle_frames: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Collate ``packs`` (one row each) into one micro-batch.

        ``id_map`` maps a pack's sample ids to reader indices;
        ``image_sources`` gives a sample another's images and
        ``shuffle_frames`` plays its videos' frames in a random order (the
        evaluation's controls). Returns
        ``tokens, labels, loss_mask, eval_mask, video_mask, position_ids: [b, s]``
        (``video_mask``: 1 on every token of a sample with a video),
        ``cu_seqlens: [k + 1]`` int32 (the ``k`` samples and padding tails of
        the rows flattened row-major, :func:`packed_cu_seqlens`; the model
        attends within each only) and ``images: [n, 3, H, W]`` float32
        (``n`` counts tower inputs: anyres tiles each count). A micro-batch
        with videos also has ``videos: [f, 3, H, W]`` float32 (every video's
        frames, in token order) and ``video_frames: [v]`` int64 (frames per
        video), whose ``vision.video_tokens`` placeholders the tokens hold.
        """
        rows, images, videos = [], [], []
        for pack in packs:
            encoded = []
            for sid in pack.sample_ids:
                rid = int(id_map[sid])
                enc = self._load(rid, None if image_sources is None else image_sources.get(rid), shuffle_frames)
                if enc is not None:
                    encoded.append(enc)
            lengths = [len(e.tokens) for e in encoded]
            offsets = [int(x) for x in np.cumsum([0] + lengths[:-1])] if lengths else []
            # Survivors are re-laid contiguously: a skipped sample only adds padding.
            row_pack = Pack(tuple(e.sample_id for e in encoded), tuple(offsets), tuple(lengths))
            rows.append(collate_pack(
                row_pack, [e.tokens for e in encoded], None, [e.target_mask for e in encoded],
                self.seq_length, self.pad_id, extra_masks={
                    "eval_mask": [e.eval_mask for e in encoded],
                    "video_mask": [[float(e.num_videos > 0)] * len(e.tokens) for e in encoded]},
            ))
            images.extend(img for e in encoded for img in e.images)
            videos.extend(v for e in encoded for v in e.videos)
        keys = ("tokens", "labels", "loss_mask", "eval_mask", "video_mask", "position_ids")
        batch = {k: torch.stack([r[k] for r in rows]) for k in keys}
        batch["cu_seqlens"] = packed_cu_seqlens(torch.stack([r["segment_ids"] for r in rows]))
        if self.preprocess is None or not images:
            batch["images"] = images_to_tensor(images)
        else:
            batch["images"] = torch.cat(images)
        if videos:
            batch["videos"] = torch.cat(videos)
            batch["video_frames"] = torch.tensor([len(v) for v in videos], dtype=torch.int64)
        return batch
