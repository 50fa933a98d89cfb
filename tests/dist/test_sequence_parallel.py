"""Sequence parallelism really splits LLaVA's sequence (two gloo processes,
TP2 + SP, the local layer spec on CPU): each TP rank's decoder receives half
of the 96 tokens, its own half of the embeddings with the image features
spliced in, and every language-model norm weight is tagged for megatron's TP
all-reduce of its gradient, which differs between the ranks before that
reduction (each normalised other tokens). That the reduced training equals
the single-process run is tests/dist/test_llava_layouts.py's ``tp2-sp*``.
"""

from __future__ import annotations

import pytest

from tests.launcher import REPO, gloo_rank, run_spawned_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

WORLD, SEQ, VOCAB, IMAGE_TOKEN, IMAGE_AT = 2, 96, 64, 5, 40


def _worker(rank: int, port: int, out_dir: str) -> None:
    gloo_rank(rank, port, WORLD, out_dir, lambda: _split(rank))


def _split(rank: int) -> dict:
    """One TP2 + SP forward and backward of the tiny LLaVA on one image-bearing row."""
    import torch

    from megascale_omni.config import load_job_config
    from megascale_omni.models.attention import thd_inputs
    from megascale_omni.models.llava import build_llava_chunks
    from megascale_omni.parallel.state import ParallelDims, destroy_parallel, initialize_parallel

    cfg = load_job_config(["--config", str(REPO / "examples/llava/tiny_cpu.yaml"), f"model.vocab_size={VOCAB}",
                           f"model.seq_length={SEQ}", "parallel.tp=2", "parallel.sequence_parallel=true"])
    initialize_parallel(ParallelDims.from_config(cfg.parallel, WORLD), seed=0)
    (chunk,) = build_llava_chunks(cfg, torch.float32, cfg.model.padded_vocab_size(VOCAB), IMAGE_TOKEN)
    g = torch.Generator().manual_seed(0)  # the same batch on both TP ranks
    tokens = torch.randint(6, VOCAB, (1, SEQ), generator=g)
    tokens[0, IMAGE_AT : IMAGE_AT + cfg.vision.tokens_per_image] = IMAGE_TOKEN
    images = torch.randn(1, 3, cfg.vision.image_size, cfg.vision.image_size, generator=g)
    batch = {"tokens": tokens, "position_ids": torch.arange(SEQ)[None], "labels": torch.roll(tokens, -1, 1),
             "cu_seqlens": torch.tensor([0, SEQ], dtype=torch.int32)}
    seen = {}

    def record(module, args, kwargs):
        seen["decoder_input"] = kwargs["hidden_states"].detach()

    chunk.language_model.decoder.register_forward_pre_hook(record, with_kwargs=True)
    tokens, position_ids, labels, params = thd_inputs(batch)
    chunk.train()(tokens, position_ids, params, images=images, labels=labels).sum().backward()
    # The whole spliced sequence, as embed() builds it without the scatter.
    chunk.config.sequence_parallel = False
    with torch.no_grad():
        whole = chunk.embed(tokens, position_ids, images)
    chunk.config.sequence_parallel = True
    half = SEQ // WORLD
    norms = {n: getattr(p, "sequence_parallel", None) for n, p in chunk.language_model.named_parameters()
             if "norm" in n}
    first_norm = chunk.language_model.decoder.layers[0].input_layernorm.weight
    result = {"decoder_input": list(seen["decoder_input"].shape), "whole": list(whole.shape),
              "is_my_half": torch.equal(seen["decoder_input"], whole[rank * half : (rank + 1) * half]),
              "norm_tags": norms, "norm_grad": first_norm.grad.tolist()}
    destroy_parallel()
    return result


def test_tp2_sequence_parallel_splits_the_spliced_sequence(tmp_path):
    ranks = run_spawned_ranks(_worker, WORLD, tmp_path, timeout=240)
    hidden = 128  # examples/llava/tiny_cpu.yaml
    for data in ranks:
        assert data["whole"] == [SEQ, 1, hidden] and data["decoder_input"] == [SEQ // WORLD, 1, hidden]
        # Rank r holds tokens 48r..48r+47 of the spliced sequence (the image's 16 slots, 40..55, straddle both).
        assert data["is_my_half"]
        assert data["norm_tags"] and all(tag is True for tag in data["norm_tags"].values()), data["norm_tags"]
    # Each rank normalised other tokens: partial norm gradients, summed by the TP all-reduce.
    assert ranks[0]["norm_grad"] != ranks[1]["norm_grad"]
