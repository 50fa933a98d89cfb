"""Conversation encoding with a chat template: loss mask on exactly the assistant tokens,
image placeholder blocks, truncation by whole rounds, rejected samples."""

from __future__ import annotations

import pytest

from megascale_omni.data.conversation import ChatEncoder, ConversationError
from tests.hf_models import CHATML_TEMPLATE, LLAMA3_TEMPLATE, chat_tokenizer

pytest.importorskip("transformers")

P = 4  # placeholders per image
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_TEMPLATE}

MULTI_TURN = [
    {"from": "human", "value": "<image>\nWhat is in the image?"},
    {"from": "gpt", "value": "A red circle on the left."},
    {"from": "human", "value": "How many shapes are there?"},
    {"from": "gpt", "value": "There are two squares and a blue triangle."},
    {"from": "human", "value": "Compare the two images.\n<image>"},
    {"from": "gpt", "value": "The first image is brighter than the second one."},
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    chat_tokenizer(path, TEMPLATES[request.param])
    enc = ChatEncoder.from_pretrained(path, "<image>", P)
    enc.template_name = request.param
    return enc


def _runs(tokens, mask):
    """Contiguous runs of masked tokens as lists of ids."""
    runs, cur = [], []
    for t, m in zip(tokens, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def _collapse_images(enc, tokens):
    """Decode ``tokens`` with each block of P image placeholders written as one marker."""
    text = enc.tok.decode(tokens, skip_special_tokens=False)
    return text.replace("<image>" * P, "<image>")


def _hf_turns(conv):
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in conv]


@pytest.mark.parametrize("system", [False, True])
def test_multi_turn_loss_mask_is_exactly_the_assistant_tokens(encoder, system):
    conv = ([{"from": "system", "value": "Answer briefly."}] if system else []) + MULTI_TURN
    out = encoder.encode(conv, num_images=2)
    rendered = encoder.tok.apply_chat_template(_hf_turns(conv), tokenize=False)
    # Every token is accounted for: the ids decode to the template's rendering.
    assert _collapse_images(encoder, out.tokens) == rendered
    # The masked runs are, in order, each assistant message + the template's end-of-turn token.
    eot = END_OF_TURN[encoder.template_name]
    answers = [t["value"] for t in conv if t["from"] == "gpt"]
    masked = [encoder.tok.decode(r, skip_special_tokens=False) for r in _runs(out.tokens, out.loss_mask)]
    assert masked == [a + eot for a in answers]
    # ... and those are exactly the ids of content + end-of-turn.
    expected = sum((encoder.tok.encode(a, add_special_tokens=False) + [encoder.tok.convert_tokens_to_ids(eot)]
                    for a in answers), [])
    assert [t for t, m in zip(out.tokens, out.loss_mask) if m] == expected
    assert out.tokens.count(encoder.image_token_id) == 2 * P
    assert (out.num_images, out.assistant_turns, out.truncated) == (2, 3, False)
    if system:
        assert "Answer briefly." in rendered and "helpful assistant" not in rendered


def test_image_blocks_sit_where_the_markers_are(encoder):
    out = encoder.encode(MULTI_TURN, num_images=2)
    idx = [i for i, t in enumerate(out.tokens) if t == encoder.image_token_id]
    first, second = idx[:P], idx[P:]
    assert first == list(range(first[0], first[0] + P)) and second == list(range(second[0], second[0] + P))
    # The second image comes after the second answer (it is referenced in round 3).
    second_answer_end = [i for i, m in enumerate(out.loss_mask) if m][-1]
    assert first[-1] < second[0] < second_answer_end
    assert all(out.loss_mask[i] == 0 for i in idx)
    # Tiled images (anyres) expand to views * P placeholders.
    tiled = encoder.encode(MULTI_TURN, num_images=2, views_per_image=[3, 1])
    assert tiled.tokens.count(encoder.image_token_id) == 4 * P
    assert len(tiled.tokens) == len(out.tokens) + 2 * P


def test_text_only_and_several_images_in_one_turn(encoder):
    text_only = encoder.encode([{"role": "user", "text": "How many shapes are there?"},
                                {"role": "assistant", "text": "No, that is all."}], num_images=0)
    assert encoder.image_token_id not in text_only.tokens and sum(text_only.loss_mask) > 0
    two = encoder.encode([{"from": "human", "value": "<image> <image> Compare the two images."},
                          {"from": "gpt", "value": "The first image is brighter."}], num_images=2)
    assert two.tokens.count(encoder.image_token_id) == 2 * P and two.num_images == 2


def test_truncation_keeps_whole_rounds_and_their_images(encoder):
    full = encoder.encode(MULTI_TURN, num_images=2)
    two_rounds = encoder.encode(MULTI_TURN[:4], num_images=1)
    # Room for two rounds but not three: the third round (and the second image) is dropped whole.
    for limit in (len(two_rounds.tokens), len(full.tokens) - 1):
        out = encoder.encode(MULTI_TURN, num_images=2, max_length=limit)
        assert out.tokens == two_rounds.tokens and out.loss_mask == two_rounds.loss_mask
        assert (out.num_images, out.assistant_turns, out.truncated) == (1, 2, True)
        assert out.tokens == full.tokens[: len(out.tokens)]
        assert out.tokens.count(encoder.image_token_id) == P
    assert encoder.encode(MULTI_TURN, num_images=2, max_length=len(full.tokens)).tokens == full.tokens
    first = encoder.encode(MULTI_TURN[:2], num_images=1)
    with pytest.raises(ConversationError, match=rf"first round alone is {len(first.tokens)} tokens > max length"):
        encoder.encode(MULTI_TURN, num_images=2, max_length=len(first.tokens) - 1)


@pytest.mark.parametrize("conv, images, reason", [
    (MULTI_TURN, 1, "2 <image> markers but the sample has 1 images"),
    (MULTI_TURN, 3, "2 <image> markers but the sample has 3 images"),
    (MULTI_TURN[:3], 1, "ends with a user turn"),
    (MULTI_TURN[1:], 1, r"turn\[0\] is from 'gpt' \(assistant\), expected 'user'"),
    ([MULTI_TURN[0], {"from": "gpt", "value": "see <image>"}], 2,
     r"turn\[1\] is from 'gpt' \(assistant\) and contains <image>"),
    ([{"from": "robot", "value": "hi"}], 0, r"turn\[0\].from is 'robot', expected human, gpt or system"),
    ([{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}], 0,
     r"turn\[0\].value is an int, expected a string"),
    ([{"value": "hi"}], 0, r"turn\[0\] has no 'from' \(human, gpt or system\) or 'role'"),
    ([{"from": "human"}], 0, r"turn\[0\] \(human\) has no 'value'"),
    (["hi"], 0, r"turn\[0\] is a str, expected an object"),
])
def test_bad_conversations_are_rejected_with_a_reason(encoder, conv, images, reason):
    with pytest.raises(ConversationError, match=reason):
        encoder.encode(conv, num_images=images)


def test_template_that_rewrites_earlier_turns_is_rejected(tmp_path):
    rewriting = CHATML_TEMPLATE.replace("message['content'] + '<|im_end|>'",
                                        "(message['content'] if loop.last else '...') + '<|im_end|>'")
    chat_tokenizer(tmp_path, rewriting)
    enc = ChatEncoder.from_pretrained(tmp_path, "<image>", P)
    with pytest.raises(ConversationError, match="rewrites earlier turns"):
        enc.encode(MULTI_TURN, num_images=2)


def test_missing_image_token_or_template_is_refused(tmp_path):
    tok = chat_tokenizer(tmp_path, CHATML_TEMPLATE)
    with pytest.raises(ValueError, match="'<img>' is not in the tokenizer's vocabulary"):
        ChatEncoder(tok, "<img>", P)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        ChatEncoder(tok, "<image>", P)
