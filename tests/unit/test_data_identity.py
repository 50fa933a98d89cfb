"""The training data's content identity, compared before a replica group joins
an elastic job: index digests of the train splits (path-independent, changed
by any change of the index), the tasks' identities (LLaVA, LLaVA blends, DiT,
their embedded demo data) and the one-line refusal of a peer on other data."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megascale_omni.config import ConfigError
from megascale_omni.data.identity import check_data_identity
from megascale_omni.data.llava.batches import LlavaEncoder
from megascale_omni.data.shard_writer import index_shards
from megascale_omni.data.shards import INDEX_FILENAME, ShardedSampleReader
from megascale_omni.demo.llava_shapes import load_shapes_tokenizer, make_shapes_dataset
from megascale_omni.elastic.peer_state import check_peer_state, replica_config
from megascale_omni.entry import parse_for_family
from megascale_omni.parallel import ParallelDims
from megascale_omni.platform.device import Platform

REPO = Path(__file__).resolve().parents[2]
LLAVA = ["--config", str(REPO / "examples/llava/tiny_cpu.yaml"), "model.seq_length=128", "data.default_num_train=24", "data.default_num_val=4",
         "train.global_batch_size=2", "train.micro_batch_size=1"]
DIT = ["--config", str(REPO / "examples/dit/tiny_cpu.yaml"), "data.default_num_train=24", "data.default_num_val=4",
       "train.global_batch_size=2", "dit.eval_resolutions=[]"]


def _shapes(path: Path, num_train: int = 24, seed: int = 1) -> Path:
    make_shapes_dataset(path, num_train=num_train, num_val=2, seed=seed, samples_per_shard=8)
    return path


def _reindex(dataset: Path) -> None:
    """Rebuild ``dataset/train/index.json`` as the shapes build writes it (with token counts)."""
    index_shards(dataset / "train", coster=LlavaEncoder(load_shapes_tokenizer(dataset), tokens_per_image=1))


def _digest(split: Path) -> str:
    return ShardedSampleReader(split).index_digest


def _task(family: str, args: list[str]):
    cfg, spec = parse_for_family(family, args, world_size=1)
    return spec.build_task(cfg, Platform(torch.device("cpu"), "gloo", ()), ParallelDims.from_config(cfg.parallel, 1))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return _shapes(tmp_path_factory.mktemp("identity") / "a")


def test_index_digest_is_stable_and_independent_of_where_the_copy_lives(shapes, tmp_path):
    first = _digest(shapes / "train")
    assert len(first) == 64 and _digest(shapes / "train") == first
    copy = shutil.copytree(shapes, tmp_path / "mounted" / "elsewhere")
    assert _digest(copy / "train") == first
    _reindex(copy)  # re-indexing unchanged shards writes the same index
    assert _digest(copy / "train") == first


def test_index_digest_changes_with_a_shard_removed_or_added_or_another_sample_count(shapes, tmp_path):
    base = _digest(shapes / "train")
    older = shutil.copytree(shapes, tmp_path / "older")
    (older / "train" / "shard-000002.tar").unlink()  # an ingest with one shard fewer
    _reindex(older)
    assert len(ShardedSampleReader(older / "train")) == 16
    bigger = _shapes(tmp_path / "bigger", num_train=32)  # the same 24 samples and one more shard
    other_seed = _shapes(tmp_path / "reseeded", seed=2)  # the same counts, other samples
    digests = {base, _digest(older / "train"), _digest(bigger / "train"), _digest(other_seed / "train")}
    assert len(digests) == 4


def test_index_digest_changes_when_one_sample_entry_changes(shapes, tmp_path):
    """E.g. a copy indexed with another tokenizer: one sample's token count differs."""
    copy = shutil.copytree(shapes, tmp_path / "edited")
    index = copy / "train" / INDEX_FILENAME
    text = index.read_text()
    start = text.index('"tokens":') + len('"tokens":')
    end = text.index("}", start)
    index.write_text(f"{text[:start]}{int(text[start:end]) + 1}{text[end:]}")
    assert len(ShardedSampleReader(copy / "train")) == 24  # still a valid index
    assert _digest(copy / "train") != _digest(shapes / "train")


def _facts(identity: dict) -> dict:
    return {"layout": {"tp": 1}, "config": {}, "data": identity, "optimizer_layout": [None]}


def test_llava_identity_covers_train_split_and_tokenizer_not_the_path_string(shapes, tmp_path):
    copy = shutil.copytree(shapes, tmp_path / "copy")
    own = _task("llava", [*LLAVA, f"data.path={shapes}"])
    same = _task("llava", [*LLAVA, f"data.path={copy}"])
    assert set(own.data_identity()) == {"data.path", "tokenizer"}
    assert own.data_identity()["data.path"]["digest"] == _digest(shapes / "train")
    assert replica_config(same.cfg) == replica_config(own.cfg)
    check_peer_state(_facts(own.data_identity()), _facts(same.data_identity()))  # another mount of the same data

    older = shutil.copytree(shapes, tmp_path / "older")
    (older / "train" / "shard-000002.tar").unlink()
    _reindex(older)
    other = _task("llava", [*LLAVA, f"data.path={older}"])
    assert replica_config(other.cfg) == replica_config(own.cfg)  # the field check alone would let it join
    with pytest.raises(ConfigError) as err:
        check_peer_state(_facts(other.data_identity()), _facts(own.data_identity()))
    message = str(err.value)
    assert err.value.field == "data.path" and "\n" not in message
    mine, theirs = other.data_identity()["data.path"]["digest"], own.data_identity()["data.path"]["digest"]
    assert message == (
        f"config error: data.path={str(older)!r}: its train split (train/index.json) differs from the running "
        f"job's (digest {mine[:12]} here, {theirs[:12]} in the running job): every replica group must train on "
        f"the same samples; point data.path at the running job's copy of the dataset")


def test_llava_blend_identity_names_the_member_that_differs(shapes, tmp_path):
    b = _shapes(tmp_path / "b", seed=2)
    b_other = _shapes(tmp_path / "b_other", seed=3)
    blend = "data.blend=[{{path: {a}, weight: 1.0}}, {{path: {b}, weight: 3.0}}]"
    own = _task("llava", [*LLAVA, f"data.path={shapes}", blend.format(a=shapes, b=b)])
    assert set(own.data_identity()) == {"data.blend[0]", "data.blend[1]", "tokenizer"}
    other = _task("llava", [*LLAVA, f"data.path={shapes}", blend.format(a=shapes, b=b_other)])
    assert replica_config(other.cfg) == replica_config(own.cfg)
    with pytest.raises(ConfigError) as err:
        check_peer_state(_facts(other.data_identity()), _facts(own.data_identity()))
    assert err.value.field == "data.blend[1].path" and err.value.value == str(b_other)
    assert "point data.blend[1].path at the running job's copy of the dataset" in str(err.value)


def test_another_tokenizer_is_refused_naming_data_tokenizer(shapes, tmp_path):
    own = _task("llava", [*LLAVA, f"data.path={shapes}"])
    other_tok = _shapes(tmp_path / "other_vocab", seed=2) / "tokenizer.json"
    text = other_tok.read_text()
    other_tok.write_text(text.replace('"square"', '"squares"', 1))
    assert other_tok.read_text() != text
    other = _task("llava", [*LLAVA, f"data.path={shapes}", f"data.tokenizer={other_tok}"])
    with pytest.raises(ConfigError) as err:
        check_peer_state(_facts(other.data_identity()), _facts(own.data_identity()))
    assert err.value.field == "data.tokenizer" and "its tokenizer differs" in str(err.value)
    assert "point data.tokenizer at the running job's tokenizer" in str(err.value)


@pytest.mark.parametrize("family, args", [("llava", LLAVA), ("dit", DIT)])
def test_embedded_demo_data_digests_are_deterministic(family, args, tmp_path, monkeypatch):
    identities = []
    for build in ("first", "second"):  # two nodes, each building its own copy
        (tmp_path / build).mkdir()
        monkeypatch.chdir(tmp_path / build)
        identities.append(_task(family, args).data_identity())
    assert identities[0] == identities[1]
    expected = {"llava": {"data.path", "tokenizer"}, "dit": {"data.path", "dataset.json", "tokenizer"}}[family]
    assert set(identities[0]) == expected
    assert identities[0]["data.path"]["value"] is None
    assert "the embedded default's train split" in identities[0]["data.path"]["what"]
    # A bigger default is other data (its size is also a compared config field).
    monkeypatch.chdir(tmp_path / "first")
    bigger = _task(family, [*args, "data.default_num_train=28"]).data_identity()
    assert bigger["data.path"]["digest"] != identities[0]["data.path"]["digest"]


def test_a_peer_without_data_digests_is_refused():
    own = {"data.path": {"field": "data.path", "value": "/d", "what": "its train split", "digest": "ab" * 32}}
    check_data_identity(own, own)
    with pytest.raises(ConfigError, match=r"digest abababababab here, none in the running job"):
        check_data_identity(own, {})
