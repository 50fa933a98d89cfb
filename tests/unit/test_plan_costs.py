"""Per-sample costs in index.json: planning from the index gives the same
lengths as reading every sample; anyres plan lengths equal what the batcher
builds; old or foreign indexes fall back (and say so), anyres without sizes is fatal."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from megascale_omni.config import from_dict
from megascale_omni.config.schema import JobConfig
from megascale_omni.data.errors import DataFileError
from megascale_omni.data.image_preprocess import ImagePreprocessor, PreprocessorSpec
from megascale_omni.data.llava.batches import LlavaBatcher, LlavaEncoder
from megascale_omni.data.llava.chat import ChatLlavaEncoder
from megascale_omni.data.llava.plan_scan import PlanScanner
from megascale_omni.data.packing import Pack
from megascale_omni.data.sample import KIND_MULTI_IMAGE, KIND_SINGLE_IMAGE, KIND_TEXT_ONLY, Sample
from megascale_omni.data.shard_writer import index_shards, write_shards
from megascale_omni.data.shards import INDEX_FILENAME, ShardedSampleReader
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset
from tests.hf_models import chat_tokenizer

P = 4  # tokens per tower input
ANYRES = {"size": {"shortest_edge": 32}, "do_center_crop": True, "crop_size": {"height": 32, "width": 32},
          "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64], [96, 32]]}


def _scan(reader, encoder, seq=512, multiple=1, views=None, truncates=False):
    return PlanScanner(encoder, P, seq, multiple, num_views=views, truncates=truncates).scan(reader)


def _assert_same(a, b):
    assert a.ids.tolist() == b.ids.tolist() and a.lengths.tolist() == b.lengths.tolist()
    assert a.costs.tolist() == b.costs.tolist() and a.images.tolist() == b.images.tolist()
    assert a.views == b.views and a.bad == b.bad


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    make_shapes_dataset(root / "ds", num_train=120, num_val=8, samples_per_shard=50)
    return root / "ds"


def test_shapes_index_carries_costs_and_plans_alone(shapes, tmp_path, caplog):
    doc = json.loads((shapes / "train" / INDEX_FILENAME).read_text())
    assert doc["format_version"] == 3 and doc["cost_basis"]["format"] == "words"
    assert all(s["cost"]["tokens"] > 0 and s["cost"]["images"] in ([], [[32, 32]], [[32, 32], [32, 32]])
               for s in doc["samples"])
    encoder = LlavaEncoder(load_shapes_tokenizer(shapes), P)
    for seq, multiple in ((512, 1), (16, 4)):  # (16, 4): some samples too long, lengths padded
        indexed = _scan(ShardedSampleReader(shapes / "train"), encoder, seq, multiple)
        # The same split re-indexed without token counts is planned from every sample's JSON.
        plain = tmp_path / f"plain{seq}"
        plain.mkdir()
        for shard in (shapes / "train").glob("shard-*.tar"):
            (plain / shard.name).write_bytes(shard.read_bytes())
        index_shards(plain)
        with caplog.at_level(logging.INFO):
            read = _scan(ShardedSampleReader(plain), encoder, seq, multiple)
        assert indexed.from_index == len(indexed.ids) and read.from_index == 0
        _assert_same(indexed, read)
    assert indexed.bad > 0 and "has no token counts: planning from every sample's JSON member" in caplog.text


def test_old_index_falls_back_once_and_anyres_needs_sizes(shapes, tmp_path, caplog):
    split = tmp_path / "old"
    split.mkdir()
    for shard in (shapes / "train").glob("shard-*.tar"):
        (split / shard.name).write_bytes(shard.read_bytes())
    doc = json.loads((shapes / "train" / INDEX_FILENAME).read_text())
    doc["format_version"] = 1  # what the writers produced before costs existed
    del doc["cost_basis"]
    for s in doc["samples"]:
        del s["cost"]
    (split / INDEX_FILENAME).write_text(json.dumps(doc))
    encoder = LlavaEncoder(load_shapes_tokenizer(shapes), P)
    with caplog.at_level(logging.INFO):
        old = _scan(ShardedSampleReader(split), encoder)
    assert old.from_index == 0 and caplog.text.count("has no per-sample costs (format 1)") == 1
    _assert_same(old, _scan(ShardedSampleReader(shapes / "train"), encoder))
    pre = ImagePreprocessor("anyres", PreprocessorSpec.from_dict(ANYRES), 32)
    with pytest.raises(DataFileError, match="anyres needs each image's size") as info:
        _scan(ShardedSampleReader(split), encoder, views=pre.num_views)
    assert info.value.path == str(split / INDEX_FILENAME) and "re-ingest" in info.value.fix


def _img(h, w, value):
    return np.full((h, w, 3), value, dtype=np.uint8)


def _chat_samples():
    ask, say = (lambda t: {"role": "user", "text": t}), (lambda t: {"role": "assistant", "text": t})
    return [
        Sample(0, KIND_SINGLE_IMAGE, [_img(20, 40, 200)],
               [ask("<image> What is in the image?"), say("A red circle."), ask("Which one?"), say("The first.")]),
        Sample(1, KIND_TEXT_ONLY, [], [ask("How many shapes are there?"), say("No, that is all.")]),
        Sample(2, KIND_MULTI_IMAGE, [_img(70, 30, 10), _img(32, 32, 90)],
               [ask("<image> <image> Compare the two images."), say("The first image is brighter.")]),
        Sample(3, KIND_SINGLE_IMAGE, [_img(33, 90, 50)],
               [ask("<image> Describe it."), say("A square."), ask("What is in the image? " * 14), say("Yes.")]),
        Sample(4, KIND_TEXT_ONLY, [], [ask("What is in the image? " * 40), say("No.")]),
    ]


@pytest.fixture(scope="module")
def chat_set(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("chat")
    chat_tokenizer(root)
    encoder = ChatLlavaEncoder.from_pretrained(root, "<image>", P, seq_length=120)
    write_shards(_chat_samples(), root / "train", samples_per_shard=2, coster=encoder)
    write_shards(_chat_samples(), root / "plain", samples_per_shard=2)
    return root, encoder


@pytest.mark.parametrize("mode", ["pad_square", "anyres"])
def test_chat_plan_from_index_matches_reading_and_the_batcher(chat_set, mode):
    root, encoder = chat_set
    pre = ImagePreprocessor(mode, PreprocessorSpec.from_dict(ANYRES), 32)
    views = pre.num_views if mode == "anyres" else None
    reader = ShardedSampleReader(root / "train")
    indexed = _scan(reader, encoder, 120, 2, views, truncates=True)
    read = _scan(ShardedSampleReader(root / "plain"), encoder, 120, 2, views, truncates=True)
    _assert_same(indexed, read)
    # Sample 3 is truncated to its first round (read, not planned from the index); sample 4 is too long.
    assert indexed.ids.tolist() == [0, 1, 2, 3] and indexed.bad == 1 and indexed.from_index == 3
    if mode == "anyres":
        # 1 overview + the tiles of the chosen grid: 20x40 and 32x32 -> 32x64, 70x30 -> 96x32, 33x90 -> 32x64.
        assert indexed.views == [(3,), (), (4, 3), (3,)]
    # The batcher builds exactly the planned lengths and one tower input per planned view.
    batcher = LlavaBatcher(reader, encoder, 120, encoder.tok.pad_id, 32, preprocess=pre, pad_to_multiple_of=2)
    for sid, n, v in zip(indexed.ids.tolist(), indexed.lengths.tolist(), indexed.views):
        batch = batcher.microbatch([Pack((0,), (0,), (n,))], [sid])
        assert int((batch["tokens"] != encoder.tok.pad_id).sum()) <= n
        assert int(batch["cu_seqlens"][1]) == n
        assert int((batch["tokens"] == encoder.tok.image_token_id).sum()) == P * sum(v)
        assert batch["images"].shape[0] == sum(v)


def test_index_for_another_tokenizer_is_not_trusted(chat_set, shapes, caplog):
    root, encoder = chat_set
    # The same tokenizer directory loaded again is the same basis; another template is not.
    assert ChatLlavaEncoder.from_pretrained(root, "<image>", 9, 64).cost_basis() == encoder.cost_basis()
    other = ChatLlavaEncoder.from_pretrained(root, "<image>", P, 120)
    other.chat.tok.chat_template = other.chat.tok.chat_template + " "
    assert other.cost_basis() != encoder.cost_basis()
    words = LlavaEncoder(load_shapes_tokenizer(shapes), P)
    with caplog.at_level(logging.INFO):
        scan = _scan(ShardedSampleReader(root / "train"), words)
    assert scan.from_index == 0 and "has token counts for data.format=chat" in caplog.text


def test_anyres_is_a_config_choice():
    cfg = from_dict(JobConfig, {"model": {"family": "llava"}, "data": {"image_mode": "anyres"}})
    assert cfg.data.image_mode == "anyres"
