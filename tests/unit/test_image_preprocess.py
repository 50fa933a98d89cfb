"""Image preprocessing vs transformers' PIL image processors, pad-to-square colour, anyres grids."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megascale_omni.data.image_preprocess import (
    ImagePreprocessor,
    PreprocessorSpec,
    find_preprocessor_config,
    pad_to_square,
    select_grid,
)

transformers = pytest.importorskip("transformers")

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
#: Largest |ours - transformers| allowed: both resize the same uint8 image with
#: PIL and normalise in float32, so only float32 rounding may differ.
TOL = 1e-5


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise, so resampling filters matter."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), (xx + yy) * 127 / max(h + w - 2, 1)], -1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def _clip_conf(size: int = 32, crop: int = 32) -> dict:
    return {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": size},
            "do_center_crop": True, "crop_size": {"height": crop, "width": crop}, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
            "resample": 3, "do_convert_rgb": True}


def _siglip_conf(size: int = 32) -> dict:
    return {"image_processor_type": "SiglipImageProcessor", "do_resize": True, "size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "resample": 2}


def _hf(cls, conf: dict, image: np.ndarray, **kwargs) -> torch.Tensor:
    from PIL import Image

    proc = cls(**{k: v for k, v in conf.items() if k != "image_processor_type"}, **kwargs)
    out = proc(images=[Image.fromarray(image)], return_tensors="np")["pixel_values"]
    return torch.from_numpy(np.asarray(out[0], dtype=np.float32))


@pytest.mark.parametrize("hw", [(40, 57), (64, 48), (32, 32), (21, 90)])
def test_resize_crop_matches_clip_image_processor(hw):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    conf = _clip_conf()
    img = _image(*hw)
    ours = ImagePreprocessor("resize_crop", PreprocessorSpec.from_dict(conf), 32)(img)
    theirs = _hf(CLIPImageProcessorPil, conf, img)
    assert ours.shape == (1, 3, 32, 32) and ours.dtype == torch.float32
    assert (ours[0] - theirs).abs().max().item() <= TOL


@pytest.mark.parametrize("hw", [(40, 57), (16, 16)])
def test_siglip_resize_matches_siglip_image_processor(hw):
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    conf = _siglip_conf()
    img = _image(*hw, seed=1)
    ours = ImagePreprocessor("resize_crop", PreprocessorSpec.from_dict(conf), 32)(img)
    theirs = _hf(SiglipImageProcessorPil, conf, img)
    assert (ours[0] - theirs).abs().max().item() <= TOL


@pytest.mark.parametrize("hw", [(40, 57), (57, 40), (30, 30)])
def test_pad_square_matches_llava_image_processor(hw):
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    conf = _clip_conf()
    img = _image(*hw, seed=2)
    ours = ImagePreprocessor("pad_square", PreprocessorSpec.from_dict(conf), 32)(img)
    theirs = _hf(LlavaImageProcessorPil, conf, img, do_pad=True)
    assert (ours[0] - theirs).abs().max().item() <= TOL


def test_pad_to_square_uses_the_mean_colour_and_centres_the_image():
    img = np.full((4, 10, 3), 200, dtype=np.uint8)
    fill = tuple(int(255 * m) for m in CLIP_MEAN)
    assert fill == (122, 116, 104)
    out = pad_to_square(img, fill)
    assert out.shape == (10, 10, 3)
    assert (out[3:7] == 200).all()  # (10 - 4) // 2 = 3 rows of padding above
    assert (out[:3] == np.array(fill, np.uint8)).all() and (out[7:] == np.array(fill, np.uint8)).all()


def test_select_grid_matches_transformers_and_prefers_less_padding():
    from transformers.image_processing_utils import select_best_resolution

    cands = [(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)]
    for hw in [(300, 800), (800, 300), (500, 500), (1000, 320), (336, 336), (100, 1200), (700, 690)]:
        assert select_grid(hw, cands) == tuple(select_best_resolution(hw, cands)), hw
    # Both keep all 320x640 pixels; the 336x672 grid wastes less than 672x672.
    assert select_grid((320, 640), cands) == (336, 672)


def test_anyres_tiles_match_llava_next_image_processor():
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    conf = {**_clip_conf(), "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]}
    pre = ImagePreprocessor("anyres", PreprocessorSpec.from_dict(conf), 32)
    for hw, grid in [((30, 70), (32, 96)), ((30, 60), (32, 64)), ((90, 28), (96, 32)), ((50, 52), (64, 64))]:
        img = _image(*hw, seed=3)
        ours = pre(img)
        tiles = (grid[0] // 32) * (grid[1] // 32)
        assert ours.shape == (1 + tiles, 3, 32, 32)
        assert pre.num_views(hw) == 1 + tiles
        theirs = _hf(LlavaNextImageProcessorPil, conf, img)
        assert theirs.shape == ours.shape
        assert (ours - theirs).abs().max().item() <= TOL


def test_exact_mode_keeps_the_historical_scaling_and_rejects_other_sizes():
    img = _image(32, 32)
    out = ImagePreprocessor("exact", PreprocessorSpec.plain(32), 32)(img)
    assert torch.equal(out[0], torch.from_numpy(img.astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1))
    with pytest.raises(ValueError, match="image shape"):
        ImagePreprocessor("exact", PreprocessorSpec.plain(32), 32)(_image(32, 40))


def test_config_file_and_tower_size_mismatch(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(_clip_conf(size=48, crop=48)))
    pre = ImagePreprocessor.from_config("resize_crop", 48, tmp_path)
    assert pre.spec.image_mean == tuple(CLIP_MEAN) and pre.spec.crop_hw == (48, 48)
    with pytest.raises(ValueError, match="tower takes 32x32"):
        ImagePreprocessor.from_config("resize_crop", 32, tmp_path / "preprocessor_config.json")


def test_a_processor_config_json_from_transformers_5_is_read(tmp_path):
    """transformers 5 saves a LlavaProcessor as one processor_config.json with
    the image processor under ``image_processor``: it is found in a tokenizer
    directory and read as the same settings as a preprocessor_config.json."""
    from PIL import Image

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    assert find_preprocessor_config(tok) is None
    (tok / "processor_config.json").write_text(json.dumps({"processor_class": "LlavaProcessor"}))
    assert find_preprocessor_config(tok) is None  # a processor without an image processor
    (tok / "processor_config.json").write_text(json.dumps(
        {"image_processor": _clip_conf(size=48, crop=48), "patch_size": 8, "processor_class": "LlavaProcessor"}))
    assert find_preprocessor_config(tok) == tok / "processor_config.json"
    spec = PreprocessorSpec.from_file(tok)
    assert spec == PreprocessorSpec.from_dict(_clip_conf(size=48, crop=48)) and spec.image_mean == tuple(CLIP_MEAN)
    # A preprocessor_config.json beside it wins.
    (tok / "preprocessor_config.json").write_text(json.dumps(_siglip_conf(48)))
    assert find_preprocessor_config(tok) == tok / "preprocessor_config.json"
    # What transformers itself writes for a LlavaProcessor gives the same tensors as its image processor.
    saved = tmp_path / "saved"
    image_processor = transformers.CLIPImageProcessor(**{k: v for k, v in _clip_conf(36, 36).items()
                                                         if k != "image_processor_type"})
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer())
    transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                image_token="<image>").save_pretrained(str(saved))
    pre = ImagePreprocessor.from_config("resize_crop", 36, find_preprocessor_config(saved))
    image = _image(40, 57)
    want = _hf(transformers.CLIPImageProcessor, _clip_conf(36, 36), image)
    assert (pre(image)[0] - want).abs().max().item() <= TOL


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<image>": 1, "a": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend
