"""Which tokenizer and preprocessor files an HF import copies into OUT/tokenizer/."""

from __future__ import annotations

from megascale_omni.hf.importer import _copy_tokenizer


def _dir(path, *names):
    path.mkdir()
    for name in names:
        (path / name).write_text(f"{path.name}/{name}")
    return path


def test_llm_plus_tower_import_takes_the_llm_tokenizer_and_the_tower_preprocessor(tmp_path):
    llm = _dir(tmp_path / "llm", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json")
    tower = _dir(tmp_path / "tower", "preprocessor_config.json", "tokenizer.json", "config.json")
    _copy_tokenizer([llm, tower], tmp_path / "out")
    got = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert got == {"tokenizer.json": "llm/tokenizer.json", "tokenizer_config.json": "llm/tokenizer_config.json",
                   "special_tokens_map.json": "llm/special_tokens_map.json",
                   "preprocessor_config.json": "tower/preprocessor_config.json"}


def test_llava_directory_keeps_its_own_preprocessor_and_nothing_is_written_without_files(tmp_path):
    llava = _dir(tmp_path / "llava", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")
    _copy_tokenizer([llava], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"]
    _copy_tokenizer([_dir(tmp_path / "bare", "config.json")], tmp_path / "none")
    assert not (tmp_path / "none").exists()
