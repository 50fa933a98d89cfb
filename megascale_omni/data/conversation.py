"""Conversations -> token ids + loss mask, rendered by the model's own HF chat template.

Input: a conversation in LLaVA format (``{"from": "system"|"human"|"gpt",
"value": ...}``) or ours (``{"role": "system"|"user"|"assistant", "text"|"content": ...}``):
an optional leading system turn, then user and assistant turns alternating,
user first, assistant last. Each :data:`IMAGE_MARKER` in a user turn stands
for the next image of the sample.

Output (:class:`EncodedConversation`): the ids the template's rendering
tokenises to, with every marker replaced by that image's block of
``image_token_id`` placeholders, and a loss mask that is 1 exactly on the
tokens the assistant produces: each assistant message's content and the
end-of-turn token(s) the template emits after it (``<|im_end|>``,
``<|eot_id|>``, ``</s>``), not the template's whitespace after them.

How the assistant spans are found, and why this way
---------------------------------------------------
``apply_chat_template(..., return_assistant_tokens_mask=True)`` only works for
templates that wrap assistant text in ``{% generation %}`` tags, which the
Llama, Qwen2 and Mistral templates do not. Instead every conversation is
rendered prefix by prefix: ``render(turns[:k], add_generation_prompt=True)``
ends where assistant turn ``k`` starts and ``render(turns[:k+1])`` ends where
it stops. The text between the two is the assistant's span. This works for
any template whose rendering of a prefix is a prefix of the rendering of the
whole conversation; a template that rewrites earlier turns (e.g. one that
drops the reasoning of past assistant turns) is detected and rejected with a
reason rather than mis-masked.

The rendering is tokenised span by span (prompt, assistant, prompt, ...), so
a token never straddles a prompt/answer boundary; that is also how the model
sees it at inference, where generation starts on a fresh token after the
generation prompt.

Truncation to ``max_length`` drops whole trailing (user, assistant) rounds, so
neither an image's placeholder block nor a turn's end is ever cut; if the
first round alone is longer, the conversation is rejected.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

#: How data marks an image's position in a user turn (LLaVA convention).
IMAGE_MARKER = "<image>"
#: How data marks a video's position in a user turn (LLaVA-Video / OneVision convention).
VIDEO_MARKER = "<video>"
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")

_ROLE_NAMES = MappingProxyType(
    {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
)


class ConversationError(ValueError):
    """A conversation that cannot be encoded; the message is the reason."""


@dataclass
class EncodedConversation:
    """One encoded conversation (lists are aligned, one entry per token)."""

    tokens: list[int]
    #: 1 on assistant tokens (content + end-of-turn), else 0.
    loss_mask: list[int]
    #: Images used, i.e. those referenced by the kept turns (the first ``num_images``).
    num_images: int
    #: Assistant turns kept (fewer than in the input when truncated).
    assistant_turns: int
    truncated: bool
    #: Videos used (the first ``num_videos``), as ``num_images``.
    num_videos: int = 0


_ROLE_LABELS = MappingProxyType({"from": "human, gpt or system", "role": "user, assistant or system"})
_TEXT_KEYS = ("value", "text", "content")


def normalize_turns(conversation: Sequence[Mapping[str, Any]], where: str = "turn") -> list[dict[str, str]]:
    """LLaVA or our turn dicts -> ``[{"role", "content"}]``; checks the turn
    order (see module docstring). Raises ConversationError naming the turn
    as ``<where>[i]``, the role as the data spells it and the field."""
    turns = []
    for i, turn in enumerate(conversation):
        at = f"{where}[{i}]"
        if not isinstance(turn, Mapping):
            raise ConversationError(f"{at} is {type_phrase(turn)}, expected an object with 'from' and 'value'")
        key = "from" if "from" in turn else "role" if "role" in turn else None
        if key is None:
            raise ConversationError(f"{at} has no 'from' ({_ROLE_LABELS['from']}) or 'role' "
                                    f"({_ROLE_LABELS['role']}); keys {sorted(map(str, turn))}")
        role = _ROLE_NAMES.get(turn[key]) if isinstance(turn[key], str) else None
        if role is None:
            raise ConversationError(f"{at}.{key} is {turn[key]!r:.40}, expected {_ROLE_LABELS[key]}")
        text_key = next((k for k in _TEXT_KEYS if k in turn), None)
        if text_key is None:
            raise ConversationError(f"{at} ({turn[key]}) has no 'value'; keys {sorted(map(str, turn))}")
        if not isinstance(turn[text_key], str):
            raise ConversationError(f"{at}.{text_key} is {type_phrase(turn[text_key])}, expected a string")
        turns.append({"role": role, "content": turn[text_key], "label": turn[key]})
    body = turns[1:] if turns and turns[0]["role"] == "system" else turns
    if not body:
        raise ConversationError("conversation has no user/assistant turns")
    for i, turn in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if turn["role"] != want:
            raise ConversationError(
                f"{where}[{i + len(turns) - len(body)}] is from {turn['label']!r} ({turn['role']}), expected "
                f"{want!r} (an optional system turn, then user and assistant alternating)")
    if body[-1]["role"] != "assistant":
        raise ConversationError(f"{where}[{len(turns) - 1}] is from {body[-1]['label']!r} (user): the conversation "
                                "ends with a user turn; the last turn must be the assistant's")
    for i, turn in enumerate(turns):
        for marker in (IMAGE_MARKER, VIDEO_MARKER):
            if turn["role"] != "user" and marker in turn["content"]:
                raise ConversationError(f"{where}[{i}] is from {turn['label']!r} ({turn['role']}) and contains "
                                        f"{marker}; images and videos belong in user turns")
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def type_phrase(value: Any) -> str:
    """``"an int"``, ``"a list"``: the type of ``value`` for a reason."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


class ChatEncoder:
    """Encodes conversations with a ``transformers`` tokenizer and its chat template.

    Args:
        tokenizer: a ``PreTrainedTokenizer(Fast)`` with ``chat_template`` set.
        image_token: vocabulary token used for image placeholders.
        tokens_per_image: placeholders per image view (``vision.image_tokens``).
        video_token: vocabulary token used for video placeholders (needed only
            to encode videos).
        video_tokens: frames of a video -> its placeholders (``vision.video_tokens``).
    """

    def __init__(self, tokenizer: Any, image_token: str, tokens_per_image: int, video_token: str = VIDEO_MARKER,
                 video_tokens: Optional[Callable[[int], int]] = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja); use a chat model's tokenizer directory")
        vocab = tokenizer.get_vocab()
        if image_token not in vocab:
            raise ValueError(f"image token {image_token!r} is not in the tokenizer's vocabulary; add it as a "
                             "special token (tokenizer.add_special_tokens) and save, or name an existing one")
        self.tok = tokenizer
        self.image_token = image_token
        self.image_token_id = int(vocab[image_token])
        self.tokens_per_image = tokens_per_image
        self.video_token = video_token
        #: -1: the vocabulary has no ``video_token`` (a video cannot be encoded).
        self.video_token_id = int(vocab.get(video_token, -1))
        self.video_tokens = video_tokens

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, image_token: str, tokens_per_image: int,
                        video_token: str = VIDEO_MARKER, video_tokens: Optional[Callable[[int], int]] = None
                        ) -> "ChatEncoder":
        """From a tokenizer directory (or a ``tokenizer.json`` inside one)."""
        from transformers import AutoTokenizer

        path = Path(path)
        return cls(AutoTokenizer.from_pretrained(str(path.parent if path.is_file() else path)), image_token,
                   tokens_per_image, video_token, video_tokens)

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def pad_id(self) -> int:
        """Padding id for collation (never a target): pad, else eos, else 0."""
        for tid in (self.tok.pad_token_id, self.tok.eos_token_id):
            if tid is not None:
                return int(tid)
        return 0

    # ------------------------------------------------------------ encoding
    def _render(self, turns: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    def spans(self, turns: list[dict[str, str]]) -> list[tuple[str, str]]:
        """The rendering of ``turns`` (normalised) as ``[(prompt text, assistant text)]``,
        one pair per assistant turn; their concatenation is the whole rendering.
        Raises ConversationError for a template that is not prefix-stable."""
        out, done = [], ""
        for k, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before, after = self._render(turns[:k], True), self._render(turns[: k + 1], False)
            if not before.startswith(done) or not after.startswith(before):
                raise ConversationError(
                    f"the chat template renders assistant turn {k} inconsistently with the turns before it "
                    "(it rewrites earlier turns); such templates cannot be masked by prefix rendering"
                )
            out.append((before[len(done):], after[len(before):]))
            done = after
        return out

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) if text else []

    def _prompt_ids(self, text: str, views: Sequence[int], frames: Optional[Sequence[int]]) -> list[int]:
        """``text`` with each marker replaced by its placeholders, in order
        (``frames`` None: videos take none, as in the index's text counts)."""
        ids: list[int] = []
        image = video = 0
        for piece in _MARKERS.split(text):
            if piece == IMAGE_MARKER:
                ids += [self.image_token_id] * (views[image] * self.tokens_per_image)
                image += 1
            elif piece == VIDEO_MARKER:
                if frames is not None:
                    ids += [self.video_token_id] * self.video_tokens(frames[video])
                video += 1
            else:
                ids += self._ids(piece)
        return ids

    def _answer_mask(self, ids: list[int]) -> list[int]:
        """1 up to the last token that is not pure whitespace (the end-of-turn
        token), 0 on the template's separator after it."""
        last = len(ids) - 1
        while last >= 0 and not self.tok.decode([ids[last]]).strip():
            last -= 1
        return [1] * (last + 1) + [0] * (len(ids) - last - 1)

    def encode(self, conversation: Sequence[Mapping[str, Any]], num_images: int,
               max_length: Optional[int] = None, views_per_image: Optional[Sequence[int]] = None,
               frames_per_video: Optional[Sequence[int]] = None) -> EncodedConversation:
        """Encode one conversation.

        Args:
            conversation: turns (see module docstring).
            num_images: images of the sample; must equal the number of markers.
            max_length: token budget (``model.seq_length``); None = no limit.
            views_per_image: tower inputs per image (anyres tiles + overview);
                None = 1 each.
            frames_per_video: frames read of each video (one per ``<video>``
                marker); None: videos take no tokens (the text-only count).

        Raises:
            ConversationError: bad turn order or roles, marker/image count
                mismatch, a template that is not prefix-stable, or a first
                round longer than ``max_length``.
        """
        turns = normalize_turns(conversation)
        markers = sum(t["content"].count(IMAGE_MARKER) for t in turns)
        if markers != num_images:
            raise ConversationError(f"text has {markers} {IMAGE_MARKER} markers but the sample has {num_images} images")
        views = list(views_per_image) if views_per_image is not None else [1] * num_images
        if len(views) != num_images:
            raise ConversationError(f"views_per_image has {len(views)} entries for {num_images} images")
        frames = None if frames_per_video is None else list(frames_per_video)
        if frames is not None:
            self._check_videos(turns, frames)
        tokens: list[int] = []
        mask: list[int] = []
        used = kept = videos = 0
        spans = self.spans(turns)
        for k, (prompt, answer) in enumerate(spans):
            n = prompt.count(IMAGE_MARKER)
            if used + n > num_images:
                raise ConversationError(f"the chat template's rendering has more {IMAGE_MARKER} markers than the "
                                        f"turns ({used + n} > {num_images})")
            nv = prompt.count(VIDEO_MARKER)
            p_ids = self._prompt_ids(prompt, views[used : used + n], None if frames is None else frames[videos:])
            a_ids = self._ids(answer)
            if max_length is not None and len(tokens) + len(p_ids) + len(a_ids) > max_length:
                if k == 0:
                    raise ConversationError(f"the first round alone is {len(p_ids) + len(a_ids)} tokens "
                                            f"> max length {max_length}")
                break
            tokens += p_ids + a_ids
            mask += [0] * len(p_ids) + self._answer_mask(a_ids)
            used += n
            videos += nv
            kept += 1
        if kept == len(spans) and used != num_images:
            raise ConversationError(f"the chat template's rendering has {used} {IMAGE_MARKER} markers, the turns "
                                    f"{num_images}; the template must keep user text verbatim")
        return EncodedConversation(tokens, mask, used, kept, kept < len(spans), videos)

    def _check_videos(self, turns: list[dict[str, str]], frames: list[int]) -> None:
        markers = sum(t["content"].count(VIDEO_MARKER) for t in turns)
        if markers != len(frames):
            raise ConversationError(f"text has {markers} {VIDEO_MARKER} markers but the sample has {len(frames)} "
                                    "videos")
        if frames and (self.video_token_id < 0 or self.video_tokens is None):
            raise ConversationError(f"the tokenizer has no {self.video_token!r} token for video placeholders; add "
                                    "it as a special token or name one with data.video_token")
