"""Tests for the word-level TextTokenizer."""

from __future__ import annotations

import pickle
import re

import pytest

from megascale_omni.data.errors import DataFileError
from megascale_omni.data.tokenizer import SpecialTokens, TextTokenizer, build_word_tokenizer
from megascale_omni.demo.shapes import dataset_vocabulary, generate_samples


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_word_tokenizer(dataset_vocabulary(), path)
    return path


@pytest.fixture(scope="module")
def tok(tok_path) -> TextTokenizer:
    return TextTokenizer.from_path(tok_path)


def test_special_token_ids(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id, tok.image_token_id) == (0, 1, 2, 3, 4)
    assert [tok.id_to_token(i) for i in range(5)] == ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
    vocab = dataset_vocabulary()
    assert tok.vocab_size == 5 + len(vocab) == 65
    # Words follow the specials in the given (sorted) order.
    assert [tok.token_to_id(w) for w in vocab] == list(range(5, 5 + len(vocab)))
    assert tok.token_to_id("zebra") is None and tok.id_to_token(10_000) is None


def test_encode_decode_roundtrip(tok):
    text = "<image> <image> what color is the shape in the second image ?"
    ids = tok.encode(text)
    assert ids[:2] == [tok.image_token_id] * 2 and len(ids) == len(text.split())
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "what color is the shape in the second image ?"
    assert tok.encode("repeat : red circle") == [tok.token_to_id(w) for w in ["repeat", ":", "red", "circle"]]
    assert tok.encode("a zebra") == [tok.token_to_id("a"), tok.unk_id]
    assert tok.encode("") == []


def test_no_unknown_tokens_on_dataset(tok):
    for s in generate_samples(1000, 3):
        for turn in s.conversation:
            ids = tok.encode(turn["text"])
            assert tok.unk_id not in ids, turn["text"]
            assert len(ids) == len(turn["text"].split())  # one token per word
            assert tok.decode(ids) == turn["text"]
        assert tok.encode(s.user_text).count(tok.image_token_id) == s.num_images


def test_from_path_accepts_file_or_directory(tok_path, tok):
    from_dir = TextTokenizer.from_path(tok_path.parent)
    assert from_dir.vocab_size == tok.vocab_size
    assert from_dir.encode("what shape is it ?") == tok.encode("what shape is it ?")


def test_from_path_missing(tmp_path):
    missing = tmp_path / "no" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        TextTokenizer.from_path(missing)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in directory"):
        TextTokenizer.from_path(tmp_path)


def test_build_is_deterministic_and_into_directory(tmp_path, tok_path):
    (tmp_path / "d").mkdir()
    built = build_word_tokenizer(dataset_vocabulary(), tmp_path / "d")
    assert (tmp_path / "d" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    assert built.vocab_size == 65


def test_build_dedups_and_rejects_bad_words(tmp_path):
    t = build_word_tokenizer(["b", "a", "b", "<image>"], tmp_path / "t.json")
    assert t.vocab_size == 7 and t.token_to_id("b") == 5 and t.token_to_id("a") == 6
    with pytest.raises(ValueError, match="whitespace"):
        build_word_tokenizer(["two words"], tmp_path / "bad.json")


def test_missing_special_token_rejected(tok_path):
    with pytest.raises(DataFileError, match="image token '<img>'") as info:
        TextTokenizer.from_path(tok_path, SpecialTokens(image="<img>"))
    assert info.value.path == str(tok_path)


def test_pickle_roundtrip(tok):
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("describe the image .") == tok.encode("describe the image .")
    assert clone.image_token_id == tok.image_token_id
