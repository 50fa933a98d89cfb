"""Tests for the synthetic shapes generator and the dataset builder."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megascale_omni.data.sample import IMAGE_PLACEHOLDER, SAMPLE_KINDS, Sample, SampleValidationError
from megascale_omni.demo.llava_shapes import (
    ensure_shapes_dataset,
    load_shapes_tokenizer,
    make_shapes_dataset,
    open_shapes_split,
)
from megascale_omni.demo.shapes import (
    COLORS,
    POSITIONS,
    SHAPES,
    ShapesConfig,
    ShapeSpec,
    dataset_vocabulary,
    generate_sample,
    generate_samples,
    render_shape,
)
from megascale_omni.demo.vocabulary import vocabulary

SEED = 1234
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def many_samples() -> list[Sample]:
    return list(generate_samples(2000, SEED))


def _lit_colors(image: np.ndarray) -> set[tuple[int, ...]]:
    lit = image.reshape(-1, 3)
    return {tuple(int(v) for v in px) for px in lit[lit.any(axis=1)]}


def _describe(image: np.ndarray) -> tuple[str, str, str]:
    """Recover (color, shape, position) from pixels alone."""
    (rgb,) = _lit_colors(image)  # exactly one colour besides black
    color = next(name for name, value in COLORS.items() if value == rgb)
    ys, xs = np.nonzero(image.any(axis=2))
    half = image.shape[1] // 2
    position = "left" if xs.max() < half else "right"
    assert xs.min() >= half or xs.max() < half, "shape crosses the midline"
    fill = len(xs) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    shape = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"
    return color, shape, position


# ------------------------------------------------------------------ generator
def test_generate_sample_is_a_pure_function_of_seed_and_index():
    batch = list(generate_samples(20, SEED))
    for i in (0, 7, 19):
        again = generate_sample(i, SEED)
        assert again.equals(batch[i]) and again.id == i
    # Random access beyond a batch matches sequential generation with an offset.
    assert generate_sample(105, SEED).equals(next(generate_samples(1, SEED, start=105)))
    assert not generate_sample(3, SEED).equals(generate_sample(3, SEED + 1))


def test_streams_are_disjoint():
    train = list(generate_samples(50, SEED, stream=0))
    val = list(generate_samples(50, SEED, stream=1))
    identical = sum(a.equals(b) for a, b in zip(train, val))
    assert identical <= 5  # a few tiny text-only samples may coincide by chance
    assert any(a.kind != b.kind for a, b in zip(train, val))


def test_kind_proportions(many_samples):
    counts = Counter(s.kind for s in many_samples)
    n = len(many_samples)
    cfg = ShapesConfig()
    for kind, expected in zip(SAMPLE_KINDS, cfg.kind_fractions):
        assert abs(counts[kind] / n - expected) < 0.04, (kind, counts[kind] / n)


def test_custom_fractions_and_invalid_config():
    only_text = ShapesConfig(text_only_fraction=1.0, single_image_fraction=0.0, multi_image_fraction=0.0)
    assert {s.kind for s in generate_samples(30, SEED, only_text)} == {"text_only"}
    with pytest.raises(ValueError, match="sum to 1"):
        ShapesConfig(text_only_fraction=0.5)
    with pytest.raises(ValueError, match="image_size"):
        ShapesConfig(image_size=8)
    with pytest.raises(ValueError, match="question list"):
        ShapesConfig(single_image_questions=("weather",))
    assert ShapesConfig.from_dict(ShapesConfig().to_dict()) == ShapesConfig()


def test_sample_structure(many_samples):
    expected_images = {"text_only": 0, "single_image": 1, "multi_image": 2}
    for s in many_samples:
        s.validate()
        assert s.num_images == expected_images[s.kind]
        assert s.user_text.split().count(IMAGE_PLACEHOLDER) == s.num_images
        assert [t["role"] for t in s.conversation] == ["user", "assistant"]
        for img in s.images:
            assert img.dtype == np.uint8 and img.shape == (32, 32, 3)
        assert (s.kind == "text_only") == (s.image_dependent_words == [])


def test_answers_are_read_off_the_pixels(many_samples):
    """Every image-dependent answer word is recoverable from the image alone."""
    for s in many_samples:
        q, answer = s.user_text, s.answer_text
        described = [_describe(img) for img in s.images]
        if s.kind == "single_image":
            color, shape, position = described[0]
            expected = {"what color is the shape ?": color, "what shape is it ?": shape,
                        "where is the shape ?": position,
                        "describe the image .": f"a {color} {shape} on the {position}"}
            assert answer == expected[q.replace(IMAGE_PLACEHOLDER, "").strip()], s
        elif s.kind == "multi_image":
            if "same color" in q:
                assert answer == ("yes" if described[0][0] == described[1][0] else "no")
            else:
                which = 0 if "first image" in q else 1
                attr = 0 if "what color" in q else 1
                assert answer == described[which][attr]


def test_answer_distributions_are_balanced(many_samples):
    """A blind model must stay near chance: no answer class dominates."""
    same = [s.answer_text for s in many_samples if "same color" in s.user_text]
    assert abs(same.count("yes") / len(same) - 0.5) < 0.1
    colors = Counter(s.answer_text for s in many_samples if s.user_text.endswith("what color is the shape ?"))
    assert set(colors) == set(COLORS) and max(colors.values()) / sum(colors.values()) < 0.25


def test_image_dependent_positions():
    caption = Sample(1, "single_image", [np.zeros((4, 4, 3), np.uint8)],
                     [{"role": "user", "text": "<image> describe the image ."},
                      {"role": "assistant", "text": "a red circle on the left"}],
                     ["red", "circle", "left"])
    assert caption.image_dependent_positions() == [1, 2, 5]
    caption.image_dependent_words = ["left", "red"]  # wrong order
    with pytest.raises(SampleValidationError):
        caption.validate()


def test_sample_validation_catches_placeholder_mismatch():
    s = Sample(0, "single_image", [], [{"role": "user", "text": "<image> what shape is it ?"},
                                       {"role": "assistant", "text": "circle"}], ["circle"])
    with pytest.raises(SampleValidationError, match="placeholders"):
        s.validate()


def test_text_only_tasks():
    samples = [s for s in generate_samples(400, SEED) if s.kind == "text_only"]
    numbers = "zero one two three four five six seven eight nine ten eleven twelve".split()
    for s in samples:
        words = s.user_text.split()
        if words[0] == "repeat":
            assert words[:2] == ["repeat", ":"] and s.answer_text == " ".join(words[2:])
        else:
            n = words[4]
            if n in numbers[:-1]:
                assert s.answer_text == numbers[numbers.index(n) + 1]


def test_render_shape_geometry():
    img = render_shape(ShapeSpec("red", "square", "right", x0=20, y0=5, extent=10), 32)
    ys, xs = np.nonzero(img.any(axis=2))
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (20, 29, 5, 14)
    assert _lit_colors(img) == {(255, 0, 0)}


def test_vocabulary_covers_every_generated_word(many_samples):
    vocab = set(dataset_vocabulary())
    assert IMAGE_PLACEHOLDER not in vocab
    assert set(COLORS) | set(SHAPES) | set(POSITIONS) <= vocab
    for s in many_samples:
        words = set(s.user_text.split()) - {IMAGE_PLACEHOLDER} | set(s.answer_text.split())
        assert words <= vocab, words - vocab


# -------------------------------------------------------------------- builder
def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


BUILD = dict(num_train=60, num_val=20, seed=SEED, image_size=32, samples_per_shard=25)


def test_make_shapes_dataset_is_byte_identical_and_readable(tmp_path):
    desc = make_shapes_dataset(tmp_path / "a", **BUILD)
    make_shapes_dataset(tmp_path / "b", **BUILD)
    a, b = _tree_bytes(tmp_path / "a"), _tree_bytes(tmp_path / "b")
    assert a == b
    assert sorted(a) == ["dataset.json", "tokenizer.json",
                         "train/index.json", "train/shard-000000.tar", "train/shard-000001.tar",
                         "train/shard-000002.tar", "val/index.json", "val/shard-000000.tar"]
    assert desc == json.loads(a["dataset.json"])
    assert desc["splits"]["train"]["num_samples"] == 60 and desc["splits"]["val"]["num_samples"] == 20
    assert sum(desc["splits"]["train"]["kind_counts"].values()) == 60
    # An image-only build: the image samples' words alone (a build with clips adds theirs and <video>).
    assert desc["vocab_size"] == load_shapes_tokenizer(tmp_path / "a").vocab_size == 5 + len(vocabulary(clips=False))
    assert set(dataset_vocabulary()) < set(vocabulary()) and "<video>" in vocabulary()
    assert not list(tmp_path.glob(".*tmp*")), "temporary build directory left behind"

    train, val = open_shapes_split(tmp_path / "a", "train"), open_shapes_split(tmp_path / "a", "val")
    assert train[59].equals(generate_sample(59, SEED, stream=0))
    assert val[0].equals(generate_sample(0, SEED, stream=1))
    assert not val[0].equals(train[0])


def test_a_video_fraction_spreads_clips_among_the_image_samples(tmp_path):
    """``video_fraction`` 0.2: every fifth sample of each split is a clip of
    4 frames at the image size (clip index counting clips only), the image
    samples are those of the image-only build in order, the build records the
    fraction (a dataset without it is not reused) and the clip geometry."""
    from megascale_omni.demo.llava_shapes import clip_config
    from megascale_omni.demo.video_shapes import generate_clip

    desc = make_shapes_dataset(tmp_path / "v", **BUILD, video_fraction=0.2)
    assert desc["vocab_size"] == load_shapes_tokenizer(tmp_path / "v").vocab_size == 5 + len(vocabulary())
    assert desc["build_args"]["video_fraction"] == 0.2 and desc["clips"] == {"frames": 4, "size": 32, "extent": 12}
    assert desc["splits"]["train"]["kind_counts"]["video"] == 12 and desc["splits"]["val"]["kind_counts"]["video"] == 4
    train = open_shapes_split(tmp_path / "v", "train")
    kinds = [train[i].kind for i in range(60)]
    assert [i for i, k in enumerate(kinds) if k == "video"] == list(range(4, 60, 5))
    assert train[9].videos[0].shape == (4, 32, 32, 3)
    clip, image = generate_clip(1, SEED, clip_config(32), stream=0), generate_sample(8, SEED, stream=0)
    clip.id, image.id = 9, 10  # ids are positions in the split
    assert train[9].equals(clip) and train[10].equals(image)
    assert "video_fraction" not in make_shapes_dataset(tmp_path / "i", **BUILD)["build_args"]
    with pytest.raises(ValueError, match="built with"):
        ensure_shapes_dataset(tmp_path / "i", **BUILD, video_fraction=0.2)
    with pytest.raises(ValueError, match="video_fraction must be in"):
        make_shapes_dataset(tmp_path / "x", **BUILD, video_fraction=1.5)


def test_make_shapes_dataset_refuses_non_empty_dir(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        make_shapes_dataset(tmp_path / "ds", **BUILD)
    make_shapes_dataset(tmp_path / "ds", **BUILD, overwrite=True)
    assert not (tmp_path / "ds" / "junk").exists()


def test_ensure_shapes_dataset(tmp_path):
    first = ensure_shapes_dataset(tmp_path / "ds", **BUILD)
    mtime = (tmp_path / "ds" / "dataset.json").stat().st_mtime_ns
    assert ensure_shapes_dataset(tmp_path / "ds", **BUILD) == first
    assert (tmp_path / "ds" / "dataset.json").stat().st_mtime_ns == mtime  # not rebuilt
    with pytest.raises(ValueError, match="built with"):
        ensure_shapes_dataset(tmp_path / "ds", **{**BUILD, "seed": 7})


def test_open_split_errors_name_path_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        open_shapes_split(tmp_path / "nowhere", "train")
    assert str(tmp_path / "nowhere" / "train") in str(info.value)
    assert "tools/make_shapes_dataset.py --out" in str(info.value)
    with pytest.raises(ValueError, match="unknown split"):
        open_shapes_split(tmp_path, "test")


def test_cli(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_shapes_dataset", REPO_ROOT / "tools" / "make_shapes_dataset.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    argv = ["--out", str(tmp_path / "ds"), "--num-train", "30", "--num-val", "10", "--samples-per-shard", "16"]
    assert cli.main(argv) == 0
    assert "vocab_size=65" in capsys.readouterr().out  # image-only: no clip words
    assert json.loads((tmp_path / "ds" / "dataset.json").read_text())["splits"]["train"]["num_shards"] == 2
    assert cli.main(argv) == 1  # refuses to overwrite without --overwrite
    assert cli.main(argv + ["--overwrite"]) == 0
