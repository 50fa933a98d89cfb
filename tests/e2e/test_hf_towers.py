"""Vision towers at HF's geometry: a patch size that does not divide the
image size (SigLIP-so400m: 384 px / 14 px patches -> a 27 x 27 grid).

Tiny random models from ``transformers`` configs (tests/hf_models.py), no
download. Claims checked here:
- the grid is ``floor(image_size / patch_size)`` and the tower ignores the
  unused bottom/right border exactly as HF's stride-``patch_size`` conv does
  (changing those pixels changes nothing);
- an imported LLaVA with such a tower gives HF's logits within 1e-4 (fp32).
"""

from __future__ import annotations

import pytest
import torch

from megascale_omni.config import ConfigError, JobConfig, from_dict
from tests import hf_models
from tests.hf_models import our_logits, tool_main

pytestmark = pytest.mark.timeout(300)

LOGIT_ATOL = 1e-4
IMAGE_TOKEN = 5


def test_grid_is_the_floor_of_image_over_patch_size():
    v = from_dict(JobConfig, {"vision": {"image_size": 384, "patch_size": 14}}).vision
    assert (v.grid, v.covered_size, v.tokens_per_image) == (27, 378, 729)
    v = from_dict(JobConfig, {"vision": {"image_size": 336, "patch_size": 14}}).vision
    assert (v.grid, v.covered_size, v.tokens_per_image) == (24, 336, 576)
    with pytest.raises(ConfigError) as e:
        from_dict(JobConfig, {"vision": {"image_size": 32, "patch_size": 40}})
    assert e.value.field == "vision.patch_size" and e.value.value == 40 and "<= vision.image_size=32" in e.value.hint


@pytest.mark.parametrize("text,tower,size", [("qwen2", "siglip", 38), ("llama", "clip", 36)])
def test_llava_with_a_tower_the_patch_does_not_divide_matches_transformers(tmp_path, text, tower, size):
    """A 4 x 4 grid of 8-px patches over 38 (36) px: 6 (4) border pixels unused."""
    src, ours = tmp_path / "hf", tmp_path / "ours"
    hf = hf_models.llava(src, text=text, tower=tower, feature_layer=-2 if tower == "clip" else -1,
                         image_size=size, patch_size=8, image_token=IMAGE_TOKEN)
    tool_main("hf_import.py", "--llava", src, "--out", ours)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(6, hf_models.VOCAB, (2, 40), generator=g)
    tokens[0, 3:19] = IMAGE_TOKEN
    tokens[1, 20:36] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, size, size, generator=g)
    with torch.no_grad():
        ref = hf(input_ids=tokens, pixel_values=pixels).logits
    got = our_logits(ours, tokens, pixels, image_token=IMAGE_TOKEN)
    diff = (got - ref).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{tower} {size}px: max abs logit difference {diff:.3g}"
    # The border beyond the 32 covered pixels is never read: new values there change nothing.
    edited = pixels.clone()
    edited[..., 32:, :] = 7.0
    edited[..., :, 32:] = -7.0
    assert torch.equal(our_logits(ours, tokens, edited, image_token=IMAGE_TOKEN), got)
