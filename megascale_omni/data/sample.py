"""The interchange record for image-text conversation samples.

A :class:`Sample` is what generators produce, what shard writers serialise and
what shard readers return. It deliberately knows nothing about tokenisation or
batching: text is kept as whitespace-separated words, images as raw pixels.

Contract
--------
* ``images``: list of ``np.uint8`` arrays of shape ``[H, W, 3]`` (RGB), in the
  order they are referenced in the user text.
* ``conversation``: alternating turns ``{"role": "user"|"assistant", "text": str}``,
  starting with a user turn and ending with an assistant turn, optionally
  after one leading ``{"role": "system", ...}`` turn (rendered by a chat
  template in the ``chat`` data format; the word-level encoder ignores it).
* The user turns together contain the literal word :data:`IMAGE_PLACEHOLDER`
  exactly ``len(images)`` times; the i-th occurrence stands for ``images[i]``.
* ``videos``: list of ``np.uint8`` arrays ``[F, H, W, 3]`` (``F >= 1``
  frames), the i-th standing for the i-th :data:`VIDEO_PLACEHOLDER` word of
  the user turns (count equal to ``len(videos)``). A sample with videos has
  ``kind`` :data:`KIND_VIDEO` and a JSON member with ``num_videos``
  (absent: 0, as in every set written before videos).
* ``image_dependent_words``: the answer words (whitespace-split words of the
  assistant turns, in order) whose correctness depends on the images. They form
  an ordered subsequence of the answer words; see
  :meth:`Sample.image_dependent_positions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"

KIND_TEXT_ONLY = "text_only"
KIND_SINGLE_IMAGE = "single_image"
KIND_MULTI_IMAGE = "multi_image"
SAMPLE_KINDS = (KIND_TEXT_ONLY, KIND_SINGLE_IMAGE, KIND_MULTI_IMAGE)
#: A sample with one or more videos (and any images); not drawn by the shapes demo.
KIND_VIDEO = "video"

_ROLES = ("user", "assistant")
#: Fields of a sample's JSON member (:meth:`Sample.metadata`).
METADATA_FIELDS = ("id", "kind", "conversation", "image_dependent_words", "num_images")


class SampleValidationError(ValueError):
    """A sample violates the :class:`Sample` contract (raised by ``validate``)."""


@dataclass(eq=False)  # arrays make field-wise == ambiguous; use Sample.equals
class Sample:
    """One conversation with zero or more images. See the module docstring."""

    id: int
    kind: str
    images: list[np.ndarray]
    conversation: list[dict[str, str]]
    image_dependent_words: list[str] = field(default_factory=list)
    #: ``[F, H, W, 3]`` uint8 per ``<video>`` marker, in order.
    videos: list[np.ndarray] = field(default_factory=list)

    # ------------------------------------------------------------------ views
    @property
    def num_images(self) -> int:
        return len(self.images)

    @property
    def num_videos(self) -> int:
        return len(self.videos)

    @property
    def user_text(self) -> str:
        """All user turns joined by a single space."""
        return " ".join(t["text"] for t in self.conversation if t["role"] == "user")

    @property
    def answer_text(self) -> str:
        """All assistant turns joined by a single space."""
        return " ".join(t["text"] for t in self.conversation if t["role"] == "assistant")

    def image_dependent_positions(self) -> list[int]:
        """Indices into ``answer_text.split()`` of the image-dependent words.

        Matching is greedy left-to-right, so the result is well defined even if
        a dependent word also occurs elsewhere in the answer. With a word-level
        tokenizer these are also the answer-token positions to score.
        """
        positions: list[int] = []
        wanted = self.image_dependent_words
        for pos, word in enumerate(self.answer_text.split()):
            if len(positions) < len(wanted) and word == wanted[len(positions)]:
                positions.append(pos)
        if len(positions) != len(wanted):
            raise SampleValidationError(
                f"sample {self.id}: image_dependent_words {wanted} are not an ordered "
                f"subsequence of the answer {self.answer_text!r}"
            )
        return positions

    # ------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check the contract in the module docstring; raise SampleValidationError."""
        if self.kind not in (*SAMPLE_KINDS, KIND_VIDEO):
            raise SampleValidationError(f"sample {self.id}: unknown kind {self.kind!r}")
        if not self.conversation:
            raise SampleValidationError(f"sample {self.id}: empty conversation")
        system = 1 if isinstance(self.conversation[0], dict) and self.conversation[0].get("role") == "system" else 0
        if system and len(self.conversation) == 1:
            raise SampleValidationError(f"sample {self.id}: a system turn alone is not a conversation")
        for i, turn in enumerate(self.conversation):
            if not isinstance(turn, dict) or set(turn) != {"role", "text"}:
                raise SampleValidationError(
                    f"sample {self.id}: turn {i} must be a dict with keys 'role' and 'text'"
                )
            if i >= system and turn["role"] != _ROLES[(i - system) % 2]:
                raise SampleValidationError(
                    f"sample {self.id}: turn {i} has role {turn['role']!r}, "
                    f"expected {_ROLES[(i - system) % 2]!r} (turns alternate, user first, after an optional "
                    f"system turn)"
                )
        if self.conversation[-1]["role"] != "assistant":
            raise SampleValidationError(f"sample {self.id}: last turn must be the assistant's")
        for i, img in enumerate(self.images):
            if not (isinstance(img, np.ndarray) and img.dtype == np.uint8
                    and img.ndim == 3 and img.shape[2] == 3):
                raise SampleValidationError(
                    f"sample {self.id}: image {i} must be np.uint8 [H, W, 3], got "
                    f"{getattr(img, 'dtype', type(img))} {getattr(img, 'shape', '')}"
                )
        n_placeholders = self.user_text.split().count(IMAGE_PLACEHOLDER)
        if n_placeholders != self.num_images:
            raise SampleValidationError(
                f"sample {self.id}: user text has {n_placeholders} {IMAGE_PLACEHOLDER} "
                f"placeholders but the sample has {self.num_images} images"
            )
        if IMAGE_PLACEHOLDER in self.answer_text.split():
            raise SampleValidationError(f"sample {self.id}: assistant text contains {IMAGE_PLACEHOLDER}")
        for i, video in enumerate(self.videos):
            if not (isinstance(video, np.ndarray) and video.dtype == np.uint8 and video.ndim == 4
                    and video.shape[0] >= 1 and video.shape[3] == 3):
                raise SampleValidationError(
                    f"sample {self.id}: video {i} must be np.uint8 [F >= 1, H, W, 3], got "
                    f"{getattr(video, 'dtype', type(video))} {getattr(video, 'shape', '')}"
                )
        n_video = self.user_text.split().count(VIDEO_PLACEHOLDER)
        if n_video != self.num_videos:
            raise SampleValidationError(f"sample {self.id}: user text has {n_video} {VIDEO_PLACEHOLDER} "
                                        f"placeholders but the sample has {self.num_videos} videos")
        if VIDEO_PLACEHOLDER in self.answer_text.split():
            raise SampleValidationError(f"sample {self.id}: assistant text contains {VIDEO_PLACEHOLDER}")
        if (self.kind == KIND_VIDEO) != bool(self.videos):
            raise SampleValidationError(f"sample {self.id}: kind {self.kind!r} with {self.num_videos} videos "
                                        f"(kind {KIND_VIDEO!r} iff the sample has videos)")
        self.image_dependent_positions()  # raises if not a subsequence

    # ---------------------------------------------------------- serialisation
    def metadata(self) -> dict[str, Any]:
        """JSON-serialisable fields (everything except pixels); ``num_videos``
        only when there are videos (samples without stay byte-identical)."""
        meta = {
            "id": int(self.id),
            "kind": self.kind,
            "conversation": [dict(t) for t in self.conversation],
            "image_dependent_words": list(self.image_dependent_words),
            "num_images": self.num_images,
        }
        if self.videos:
            meta["num_videos"] = self.num_videos
        return meta

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form: :meth:`metadata` plus ``"images"`` (list of arrays)."""
        out = self.metadata()
        out["images"] = list(self.images)
        out["videos"] = list(self.videos)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        """Inverse of :meth:`to_dict`. Raises KeyError for a missing field and
        SampleValidationError if the result violates the contract."""
        sample = cls(
            id=int(d["id"]),
            kind=d["kind"],
            images=list(d.get("images", [])),
            conversation=[dict(t) for t in d["conversation"]],
            image_dependent_words=list(d["image_dependent_words"]),
            videos=list(d.get("videos", [])),
        )
        if "num_images" in d and int(d["num_images"]) != sample.num_images:
            raise SampleValidationError(
                f"sample {sample.id}: num_images={d['num_images']} but {sample.num_images} images given"
            )
        if int(d.get("num_videos", 0)) != sample.num_videos:
            raise SampleValidationError(
                f"sample {sample.id}: num_videos={d.get('num_videos', 0)} but {sample.num_videos} videos given"
            )
        sample.validate()
        return sample

    def equals(self, other: "Sample") -> bool:
        """Field-wise equality including pixel values (dataclass ``==`` cannot
        compare arrays)."""
        return (
            self.metadata() == other.metadata()
            and all(np.array_equal(a, b) for a, b in zip(self.images, other.images))
            and all(np.array_equal(a, b) for a, b in zip(self.videos, other.videos))
        )


def validate_metadata(meta: Any) -> None:
    """Check a sample's JSON member (the :meth:`Sample.metadata` form) against
    the contract without its images: all of :data:`METADATA_FIELDS` present
    with their types (``id``/``num_images`` ints, texts and words strs, turns
    ``{"role", "text"}`` objects), ``num_images`` equal to the placeholder
    count, plus everything :meth:`Sample.validate` checks. A pure function of
    ``meta``, so every rank that scans a sample decides alike.

    Raises:
        SampleValidationError: saying which rule is broken.
    """
    if not isinstance(meta, dict):
        raise SampleValidationError(f"json member is a {type(meta).__name__}, expected an object")
    missing = [f for f in METADATA_FIELDS if f not in meta]
    if missing:
        raise SampleValidationError(f"json member lacks field(s) {missing}")
    for name in ("id", "num_images"):
        if not isinstance(meta[name], int) or isinstance(meta[name], bool) or (name == "num_images" and meta[name] < 0):
            raise SampleValidationError(f"json field {name!r}={meta[name]!r:.40} is not a non-negative int")
    conversation, words = meta["conversation"], meta["image_dependent_words"]
    if not isinstance(meta["kind"], str):
        raise SampleValidationError(f"json field 'kind'={meta['kind']!r:.40} is not a str")
    if not isinstance(conversation, list) or not all(
        isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("text"), str) for t in conversation
    ):
        raise SampleValidationError("json field 'conversation' must be a list of {\"role\": str, \"text\": str}")
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise SampleValidationError("json field 'image_dependent_words' must be a list of str")
    placeholders = " ".join(t["text"] for t in conversation if t["role"] == "user").split().count(IMAGE_PLACEHOLDER)
    if placeholders != meta["num_images"]:
        raise SampleValidationError(f"sample {meta['id']}: num_images={meta['num_images']} but the user text has "
                                    f"{placeholders} {IMAGE_PLACEHOLDER} placeholders")
    num_videos = meta.get("num_videos", 0)
    if not isinstance(num_videos, int) or isinstance(num_videos, bool) or num_videos < 0:
        raise SampleValidationError(f"json field 'num_videos'={num_videos!r:.40} is not a non-negative int")
    stand_in = np.zeros((1, 1, 3), dtype=np.uint8)
    Sample(meta["id"], meta["kind"], [stand_in] * placeholders, [dict(t) for t in conversation], list(words),
           [stand_in[None]] * num_videos).validate()
