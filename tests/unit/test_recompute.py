"""``model.recompute`` on the local layer spec (fp32, one process): the tiny
LLaVA's gradients are the same under ``none``, ``selective`` and ``full``,
and each recomputes what it says.

Counted by wrapping the forward of the core attention (the local spec's
``PackedCoreAttention``) and of megatron's ``MLP``: without recomputation
one training forward + backward runs each once per layer; ``selective``
runs the core attention of every LM and ViT layer a second time in
backward (megatron's ``core_attn`` checkpoint) and no MLP again; ``full``
reruns whole layers, MLPs included. The projector is one more MLP, never
recomputed. End-to-end training under TP2 + SP + selective recompute:
tests/dist/test_llava_layouts.py.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.mlp import MLP

from megascale_omni.config import load_job_config
from megascale_omni.data.packing import Pack, collate_pack, packed_cu_seqlens
from megascale_omni.models.attention import PackedCoreAttention, thd_inputs
from tests.launcher import REPO

IMAGE_TOKEN, VOCAB, SEQ = 5, 64, 96


@pytest.fixture(scope="module")
def one_rank():
    from megascale_omni.models.standalone import one_process

    with one_process(seed=0):
        yield


def _build(recompute: str):
    from megascale_omni.models.standalone import build_model

    cfg = load_job_config(["--config", str(REPO / "examples/llava/tiny_cpu.yaml"), f"model.vocab_size={VOCAB}",
                           f"model.seq_length={SEQ}", f"model.recompute={recompute}"])
    return build_model(cfg, cfg.model.padded_vocab_size(VOCAB), IMAGE_TOKEN).train(), cfg


def _batch(cfg):
    """One packed row of two samples with an image each, and their images."""
    g = torch.Generator().manual_seed(3)
    p = cfg.vision.tokens_per_image
    members = []
    for before, after in ((3, 9), (5, 7)):
        words = torch.randint(6, VOCAB, (before + after,), generator=g).tolist()
        members.append(words[:before] + [IMAGE_TOKEN] * p + words[before:])
    lengths = [len(m) for m in members]
    row = collate_pack(Pack((0, 1), (0, lengths[0]), tuple(lengths)), members, None, None, seq_length=SEQ, pad_id=0)
    batch = {key: row[key][None] for key in ("tokens", "position_ids", "segment_ids")}
    batch["cu_seqlens"] = packed_cu_seqlens(batch["segment_ids"])
    batch["labels"] = torch.roll(batch["tokens"], -1, dims=1)
    images = torch.randn(2, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g)
    return batch, images


def _counting(monkeypatch, cls) -> list[int]:
    calls = [0]
    original = cls.forward

    def forward(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", forward)
    return calls


def _grads(model, state, batch, images, monkeypatch) -> tuple[dict[str, torch.Tensor], int, int]:
    """Gradients of the summed token loss, and the core-attention and MLP forwards it ran."""
    model.load_state_dict(state)
    attention, mlp = _counting(monkeypatch, PackedCoreAttention), _counting(monkeypatch, MLP)
    tokens, position_ids, labels, params = thd_inputs(batch)
    model.zero_grad(set_to_none=True)
    model(tokens, position_ids, params, images=images, labels=labels).sum().backward()
    monkeypatch.undo()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, attention[0], mlp[0]


def test_selective_and_full_recompute_give_the_same_gradients_and_recompute(one_rank, monkeypatch):
    reference, cfg = _build("none")
    state = reference.state_dict()
    batch, images = _batch(cfg)
    lm, vit = cfg.model.num_layers, cfg.vision.layers_built
    base, attn_none, mlp_none = _grads(reference, state, batch, images, monkeypatch)
    assert (attn_none, mlp_none) == (lm + vit, lm + vit + 1)
    expected = {"selective": (2 * (lm + vit), lm + vit + 1), "full": (2 * (lm + vit), 2 * (lm + vit) + 1)}
    for mode, counts in expected.items():
        model, _ = _build(mode)
        grads, attn, mlp = _grads(model, state, batch, images, monkeypatch)
        assert (attn, mlp) == counts, mode
        assert grads.keys() == base.keys()
        for name, g in grads.items():
            # Recomputation replays the same fp32 ops: the gradients agree to rounding.
            torch.testing.assert_close(g, base[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{mode} {name}: {m}")
