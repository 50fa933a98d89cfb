"""The ``chat`` data format of the LLaVA task: :class:`ChatEncoder` behind the
interface :class:`~megascale_omni.data.llava.batches.LlavaBatcher` and the
task's plan use (``plan_from_metadata``, ``encode``).

Token layout of one sample: whatever the model's chat template renders for
its turns, in order, with each ``<image>`` marker replaced by
``tokens_per_image`` image-token placeholders and each ``<video>`` by
``vision.video_tokens(frames)`` video-token placeholders; ``target_mask`` is 1 on the
assistant tokens (content + end-of-turn) of every kept turn. Samples longer
than ``seq_length`` lose whole trailing rounds (and the images those
reference); a sample whose first round alone is too long, or whose marker
count differs from its image count, is a bad sample (excluded from the plan
and counted).

``eval_mask`` equals ``target_mask``: evaluation scores every assistant
token of the real tokenizer (next-token argmax accuracy, reported as
``answer_token_accuracy``); the image-dependent answer-word accuracy is a
metric of the word-level shapes demo (answer word = token).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from megascale_omni.data.conversation import VIDEO_MARKER, ChatEncoder, ConversationError, EncodedConversation
from megascale_omni.data.costs import fingerprint
from megascale_omni.data.llava.batches import EncodedSample
from megascale_omni.data.sample import Sample, validate_metadata
from megascale_omni.data.shards import BadSampleError


class ChatTokenizerView:
    """The ids the LLaVA task needs from a chat tokenizer (same names as
    :class:`~megascale_omni.data.tokenizer.TextTokenizer`)."""

    def __init__(self, chat: ChatEncoder):
        self._chat = chat

    @property
    def vocab_size(self) -> int:
        return self._chat.vocab_size

    @property
    def pad_id(self) -> int:
        return self._chat.pad_id

    @property
    def image_token_id(self) -> int:
        return self._chat.image_token_id

    @property
    def video_token_id(self) -> int:
        """Id of ``data.video_token``; -1 when the vocabulary has none."""
        return self._chat.video_token_id

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` if it is one vocabulary entry, else None."""
        tid = self._chat.tok.get_vocab().get(token)
        return None if tid is None else int(tid)

    def __repr__(self) -> str:
        return f"ChatTokenizer(vocab_size={self.vocab_size}, pad={self.pad_id}, image={self.image_token_id})"


class ChatLlavaEncoder:
    """LLaVA samples -> :class:`EncodedSample` through the model's chat template."""

    def __init__(self, chat: ChatEncoder, seq_length: int):
        self.chat = chat
        self.seq_length = seq_length
        self.tok = ChatTokenizerView(chat)

    @property
    def video_token_id(self) -> int:
        """Id of the video placeholders; -1 when the vocabulary has none."""
        return self.chat.video_token_id

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, image_token: str, tokens_per_image: int,
                        seq_length: int, video_token: str = VIDEO_MARKER,
                        video_tokens: Optional[Callable[[int], int]] = None) -> "ChatLlavaEncoder":
        return cls(ChatEncoder.from_pretrained(Path(path), image_token, tokens_per_image, video_token, video_tokens),
                   seq_length)

    def cost_basis(self) -> dict[str, str]:
        """What :meth:`text_tokens` are valid for (``index.json``'s ``cost_basis``):
        the tokenizer's vocabulary and rules, its chat template and special tokens."""
        tok = self.chat.tok
        return {"format": "chat", "tokenizer": fingerprint(
            tok.backend_tokenizer.to_str(), str(tok.chat_template),
            json.dumps(tok.special_tokens_map, sort_keys=True, default=str))}

    def _encode(self, sample_id: int, conversation: Sequence[Mapping[str, Any]], num_images: int,
                views: Optional[Sequence[int]] = None, max_length: Optional[int] = -1,
                frames: Optional[Sequence[int]] = None) -> EncodedConversation:
        try:
            return self.chat.encode(conversation, num_images, max_length=self.seq_length if max_length == -1
                                    else max_length, views_per_image=views, frames_per_video=frames)
        except ConversationError as err:
            raise BadSampleError(sample_id, "<encoded>", str(err)) from None

    def text_tokens(self, meta: Mapping) -> int:
        """Length of the whole conversation's rendering (no truncation) without
        image placeholders: the index's ``cost.tokens``. Raises BadSampleError
        or SampleValidationError (ValueErrors) for a sample to exclude."""
        validate_metadata(meta)
        n = meta["num_images"]
        return len(self._encode(int(meta["id"]), meta["conversation"], n, [0] * n, max_length=None).tokens)

    def plan_from_metadata(self, meta: Mapping, views: Optional[Sequence[int]] = None,
                           frames: Sequence[int] = ()) -> tuple[int, int]:
        """(tokens, images) of the encoded, possibly truncated sample from its
        JSON member alone (``views``: tower inputs per image, anyres;
        ``frames``: frames read per video, from the index). Raises
        BadSampleError for a sample to exclude."""
        enc = self._encode(int(meta["id"]), meta["conversation"], int(meta["num_images"]), views, frames=frames)
        return len(enc.tokens), enc.num_images

    def encode(self, sample: Sample, views_per_image: Optional[Sequence[int]] = None,
               frames_per_video: Optional[Sequence[int]] = None) -> EncodedSample:
        """Raises BadSampleError (see module docstring). ``frames_per_video``:
        frames read of each video (default: all of ``sample.videos``); videos
        of truncated rounds are dropped with them (:attr:`EncodedSample.num_videos`)."""
        frames = [len(v) for v in sample.videos] if frames_per_video is None else frames_per_video
        enc = self._encode(sample.id, sample.conversation, sample.num_images, views_per_image, frames=frames)
        return EncodedSample(
            sample.id, enc.tokens, [float(m) for m in enc.loss_mask], [float(m) for m in enc.loss_mask],
            list(sample.images[: enc.num_images]), num_videos=enc.num_videos,
        )
