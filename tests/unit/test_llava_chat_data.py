"""The chat data format wired into the LLaVA data path: shards -> chat-template
encoding -> tower preprocessing -> packed micro-batches, as ConversationData builds them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megascale_omni.config import ConfigError, JobConfig, from_dict
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder
from megascale_omni.data.llava.chat import ChatLlavaEncoder
from megascale_omni.data.llava.module import build_encoder, build_image_preprocessor
from megascale_omni.data.packing import Pack
from megascale_omni.data.sample import KIND_MULTI_IMAGE, KIND_SINGLE_IMAGE, KIND_TEXT_ONLY, Sample
from megascale_omni.data.shard_writer import write_shards
from megascale_omni.data.shards import ShardedSampleReader
from tests.hf_models import chat_tokenizer

pytest.importorskip("transformers")

SEQ = 160
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]


def _img(h, w, value):
    return np.full((h, w, 3), value, dtype=np.uint8)


def _samples():
    ask, say = (lambda t: {"role": "user", "text": t}), (lambda t: {"role": "assistant", "text": t})
    return [
        Sample(0, KIND_SINGLE_IMAGE, [_img(20, 40, 200)],
               [{"role": "system", "text": "Answer briefly."}, ask("<image> What is in the image?"),
                say("A red circle."), ask("Which one is bigger?"), say("The first.")]),
        Sample(1, KIND_TEXT_ONLY, [], [ask("How many shapes are there?"), say("No, that is all.")]),
        Sample(2, KIND_MULTI_IMAGE, [_img(50, 30, 10), _img(32, 32, 90)],
               [ask("<image> <image> Compare the two images."), say("The first image is brighter.")]),
        # First round alone is longer than SEQ: excluded from the plan.
        Sample(3, KIND_TEXT_ONLY, [], [ask("What is in the image? " * 30), say("No.")]),
    ]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    write_shards(_samples(), root / "train", samples_per_shard=2)
    chat_tokenizer(root)
    (root / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 32}, "do_center_crop": True, "crop_size": {"height": 32, "width": 32},
        "image_mean": CLIP_MEAN, "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
    }))
    return root


def _cfg(**data) -> JobConfig:
    return from_dict(JobConfig, {"model": {"family": "llava", "seq_length": SEQ},
                                 "vision": {"image_size": 32, "patch_size": 8}, "data": data})


def test_chat_format_builds_packed_batches_with_assistant_loss_and_preprocessed_images(dataset):
    cfg = _cfg(format="chat", image_mode="pad_square")
    encoder = build_encoder(cfg, dataset)
    pre = build_image_preprocessor(cfg, dataset)
    assert isinstance(encoder, ChatLlavaEncoder) and pre.spec.image_mean == tuple(CLIP_MEAN)
    reader = ShardedSampleReader(dataset / "train")
    plans = {}
    for i in range(len(reader)):
        try:
            plans[i] = encoder.plan_from_metadata(reader.read_metadata(i))
        except Exception as err:  # noqa: BLE001 - the test checks which one and why
            plans[i] = str(err)
    assert plans[0][1] == 1 and plans[1][1] == 0 and plans[2][1] == 2
    assert "first round alone is" in plans[3]
    lengths = [plans[i][0] for i in range(3)]
    row = Pack((0, 1, 2), tuple(int(x) for x in np.cumsum([0] + lengths[:2])), tuple(lengths))
    batcher = LlavaBatcher(reader, encoder, sum(lengths) + 3, encoder.tok.pad_id, 32, preprocess=pre)
    batch = batcher.microbatch([row], [0, 1, 2])
    assert batcher.counter.skipped == 0 and batcher.counter.seen == 3
    # Images: three tower inputs, CLIP-normalised; the 20x40 image is padded with the mean colour.
    assert batch["images"].shape == (3, 3, 32, 32) and batch["images"].dtype == torch.float32
    assert torch.equal(batch["images"][0], pre(_samples()[0].images[0])[0])
    assert batch["images"][0, :, 0, 0].abs().max() < 0.02  # a padded corner: (int(255 m) / 255 - m) / s ~ 0
    # Placeholders: P = 16 per image, where the markers are.
    tokens = batch["tokens"][0]
    assert int((tokens == encoder.tok.image_token_id).sum()) == 3 * 16
    # Loss: exactly the assistant tokens (labels are the next token, so compare the shifted targets).
    tok = encoder.chat.tok
    answers = ["A red circle.", "The first.", "No, that is all.", "The first image is brighter."]
    targets = batch["labels"][0][batch["loss_mask"][0] > 0].tolist()
    assert targets == sum((tok.encode(a, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
                           for a in answers), [])
    # Evaluation scores every assistant token (answer_token_accuracy).
    assert torch.equal(batch["eval_mask"], batch["loss_mask"]) and batch["eval_mask"].sum() > 0


def test_truncated_sample_drops_the_images_of_dropped_rounds(dataset):
    cfg = _cfg(format="chat")
    full = build_encoder(cfg, dataset).encode(_samples()[0])
    short = ChatLlavaEncoder(build_encoder(cfg, dataset).chat, seq_length=len(full.tokens) - 1)
    one_round = short.encode(_samples()[0])
    assert len(one_round.tokens) < len(full.tokens) and len(one_round.images) == 1
    assert one_round.tokens == full.tokens[: len(one_round.tokens)]


def test_words_format_and_exact_images_stay_the_default(dataset, tmp_path):
    from megascale_omni.data.tokenizer import build_word_tokenizer

    build_word_tokenizer(["a", "b"], tmp_path / "tokenizer.json")
    cfg = _cfg(tokenizer=str(tmp_path / "tokenizer.json"))
    assert isinstance(build_encoder(cfg, dataset), LlavaEncoder)
    assert build_image_preprocessor(cfg, dataset) is None


def test_chat_format_config_errors(dataset, tmp_path):
    with pytest.raises(ConfigError, match="data.image_token.*not in the tokenizer's vocabulary"):
        build_encoder(_cfg(format="chat", image_token="<img>"), dataset)
    with pytest.raises(ConfigError, match="data.tokenizer"):
        build_encoder(_cfg(format="chat", tokenizer=str(tmp_path)), dataset)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": 48, "width": 48}}))
    with pytest.raises(ConfigError, match="data.image_processor.*tower takes 32x32"):
        build_image_preprocessor(_cfg(image_mode="resize_crop", image_processor=str(tmp_path)), dataset)
    with pytest.raises(ConfigError, match="data.image_mode"):
        _cfg(image_mode="tiles")
    assert build_image_preprocessor(_cfg(image_mode="anyres"), dataset).mode == "anyres"
