"""``vision.lr_mult``: the ViT's parameters follow ``train.lr`` x factor through
warm-up and decay; the projector and LM keep ``train.lr``."""

from __future__ import annotations

import pytest
import torch

from megascale_omni.config import ConfigError, load_job_config
from tests.launcher import REPO


@pytest.fixture(scope="module")
def one_rank():
    from megascale_omni.models.standalone import one_process

    with one_process(seed=0):
        yield


def _groups(*overrides: str) -> list[tuple[set[str], float]]:
    """(owners of the group's parameters, lr) per param group after 5 scheduler steps."""
    from megascale_omni.models.llava_spec import LlavaModelSpec
    from megascale_omni.models.standalone import build_model
    from megascale_omni.training.optimizer import build_optimizer, wrap_ddp

    cfg = load_job_config(["--config", str(REPO / "examples/llava/tiny_cpu.yaml"), "model.vocab_size=64",
                           "train.steps=20", "train.lr_warmup_steps=2", *overrides])
    model = build_model(cfg, 128, image_token_id=5)
    chunks = wrap_ddp([model], model.config, cfg.parallel)
    lr_mult = LlavaModelSpec.lr_mult(type("T", (), {"cfg": cfg})())
    optimizer, scheduler = build_optimizer(chunks, cfg.train, cfg.parallel, torch.float32, lr_mult)
    for _ in range(5):
        scheduler.step(increment=1)
    owner = {id(p): name.split(".")[1] for name, p in chunks[0].named_parameters()}
    return [({owner[id(p)] for p in g["params"]}, g["lr"]) for g in optimizer.param_groups]


def test_vision_lr_mult_scales_only_the_vit(one_rank):
    base = {frozenset(o): lr for o, lr in _groups("vision.lr_mult=1")}
    scaled = _groups("vision.lr_mult=0.3")
    default_lr = max(base.values())
    vit = [lr for owners, lr in scaled if owners == {"vision_model"}]
    rest = [lr for owners, lr in scaled if "vision_model" not in owners]
    assert vit and rest, scaled
    assert all(lr == pytest.approx(0.3 * default_lr, rel=1e-9) for lr in vit), (vit, default_lr)
    assert all(lr == pytest.approx(default_lr, rel=1e-9) for lr in rest), (rest, default_lr)
    # Without the option every group (weight-decay split only) runs at train.lr.
    assert all(lr == pytest.approx(default_lr, rel=1e-9) for lr in base.values()), base


def test_vision_lr_mult_must_be_positive():
    with pytest.raises(ConfigError, match="vision.lr_mult"):
        load_job_config(["--config", str(REPO / "examples/llava/tiny_cpu.yaml"), "vision.lr_mult=0"])
