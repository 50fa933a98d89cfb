"""The Hugging Face tokenizer/processor files a checkpoint carries
(:mod:`megascale_omni.checkpoint.hf_assets`): which files an import takes,
how a checkpoint's copy is checked against its commit marker, and what an
export reports missing."""

from __future__ import annotations

import json

import pytest

from megascale_omni.checkpoint import layout
from megascale_omni.checkpoint.errors import CheckpointError
from megascale_omni.checkpoint.hf_assets import ASSET_DIR, HFAssets


def _dir(path, *names):
    path.mkdir()
    for name in names:
        (path / name).write_text(f"{path.name}/{name}")
    return path


def test_llm_plus_tower_import_takes_the_llm_tokenizer_and_the_tower_preprocessor(tmp_path):
    llm = _dir(tmp_path / "llm", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")
    tower = _dir(tmp_path / "tower", "preprocessor_config.json", "tokenizer.json", "config.json")
    HFAssets.from_sources([llm, tower]).write(tmp_path / "out")
    got = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert got == {"tokenizer.json": "llm/tokenizer.json", "tokenizer_config.json": "llm/tokenizer_config.json",
                   "special_tokens_map.json": "llm/special_tokens_map.json",
                   "preprocessor_config.json": "tower/preprocessor_config.json"}


def test_llava_directory_keeps_its_own_preprocessor_and_nothing_is_written_without_files(tmp_path):
    llava = _dir(tmp_path / "llava", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
                 "chat_template.jinja")
    HFAssets.from_sources([llava]).write(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "chat_template.jinja", "processor_config.json", "tokenizer.json", "tokenizer_config.json"]
    bare = HFAssets.from_sources([_dir(tmp_path / "bare", "config.json")])
    assert not bare.enabled
    bare.write(tmp_path / "none")
    assert not (tmp_path / "none").exists()


def _committed(tmp_path, assets: HFAssets):
    step = tmp_path / layout.step_dir_name(3)
    step.mkdir()
    (step / "common.pt").write_bytes(b"tensors")
    assets.write(step / ASSET_DIR, durable=True)
    return step, layout.write_commit(step, 3, {})


def test_a_checkpoint_gives_back_exactly_its_committed_files_and_refuses_a_changed_one(tmp_path):
    assets = HFAssets({"tokenizer.json": b'{"model": 1}', "chat_template.jinja": b"{{ messages }}"})
    step, commit = _committed(tmp_path, assets)
    assert set(commit["files"]) == {"common.pt", "tokenizer/tokenizer.json", "tokenizer/chat_template.jinja"}
    (step / ASSET_DIR / "added_later.json").write_text("{}")  # not committed: not carried
    assert HFAssets.from_checkpoint(step, commit) == assets

    (step / ASSET_DIR / "tokenizer.json").write_bytes(b'{"model": 2}')  # same size, other bytes
    with pytest.raises(CheckpointError) as err:
        HFAssets.from_checkpoint(step, commit)
    assert str(err.value) == (f"checkpoint {step}: tokenizer/tokenizer.json: sha256 mismatch (changed after the "
                              "commit); restore the checkpoint from another tier or a copy")
    # Verification (resume, export, tools/ckpt.py verify) names it as well.
    assert layout.verify(layout.step_info(step)) == ["tokenizer/tokenizer.json: sha256 mismatch"]


def test_a_checkpoint_without_tokenizer_files_carries_none(tmp_path):
    step, commit = _committed(tmp_path, HFAssets())
    assert HFAssets.from_checkpoint(step, commit) == HFAssets() and not (step / ASSET_DIR).exists()


@pytest.mark.parametrize("files,image_processor,missing", [
    ({}, True, ["tokenizer (tokenizer.json)", "tokenizer_config.json", "chat template",
                "image processor (preprocessor_config.json)"]),
    ({"tokenizer.json": b"{}", "tokenizer_config.json": json.dumps({"chat_template": "{{ x }}"}).encode()},
     False, []),
    ({"tokenizer.json": b"{}", "tokenizer_config.json": b"{}"}, False, ["chat template"]),
    ({"tokenizer.json": b"{}", "tokenizer_config.json": b"{}", "chat_template.jinja": b"{{ x }}",
      "processor_config.json": b"{}"}, True, []),
])
def test_what_an_export_would_miss(files, image_processor, missing):
    assert HFAssets(files).missing(image_processor) == missing
