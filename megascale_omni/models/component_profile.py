"""Measure the forward+backward time of each model component on this device.

The pipeline cost model (``parallel/pipeline_cost.py``) needs, per micro-batch,
the time of the vision encoder and projector (per image), the embedding, one
language-model decoder layer and the output layer + loss. FLOPs predict these
poorly where kernels are small or memory-bound (CPU, the embedding, the loss),
so each family's profiler (:func:`profile_gpt_components`,
:func:`profile_llava_components`) times the real megatron modules instead, each in
isolation, on inputs of the configured shapes.

Clock: on CPU the CPU time of the calling thread (``time.thread_time``), so
waiting for a core does not count; on CUDA wall time between device
synchronisations. Each component reports its fastest of ``repeats`` passes:
on a shared host, interference only ever adds time. Call after megatron's parallel state exists (TP as
configured, pp = cp = 1).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from megascale_omni.config import JobConfig
from megascale_omni.models.attention import packed_seq_params
from megascale_omni.parallel.pipeline_cost import EMBEDDING, LM_LAYER, OUTPUT, PROJECTOR, VISION


def single_stage_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` with one LM layer, no pipeline and no context parallelism: the
    model whose pieces are timed, on whole sequences (the planner scales
    them to a CP rank's share)."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, num_layers=1),
        parallel=dataclasses.replace(cfg.parallel, pp=1, vpp=None, cp=1, pipeline_partition="uniform"),
    )


def _timer(cuda: bool) -> Callable[[], float]:
    if cuda:
        def now() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()
        return now
    return time.thread_time


def _best_seconds(step: Callable[[], None], repeats: int, warmup: int, cuda: bool) -> float:
    now = _timer(cuda)
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        t0 = now()
        step()
        samples.append(now() - t0)
    return min(samples)


def _fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """One forward of ``fn`` and a backward from a unit gradient."""
    def step() -> None:
        out = fn()
        if out.requires_grad:  # frozen modules with no trainable input run forward only
            out.backward(torch.ones_like(out))
    return step


def profile_gpt_components(
    cfg: JobConfig, device: torch.device, vocab_size: int, repeats: int = 5, warmup: int = 2
) -> dict[str, float]:
    """Fastest forward+backward seconds of the GPT's ``embedding``, ``lm_layer``
    and ``output`` per micro-batch of ``train.micro_batch_size`` rows of
    ``model.seq_length`` tokens (every TP rank)."""
    from megascale_omni.models.gpt import build_gpt_chunks, transformer_config

    cfg = single_stage_config(cfg)
    m = cfg.model
    (chunk,) = build_gpt_chunks(
        m, transformer_config(m, cfg.parallel, _dtype(cfg, device)), vocab_size=vocab_size,
        max_sequence_length=m.seq_length,
    )
    return _profile_lm(cfg, chunk, chunk, device, vocab_size, repeats=repeats, warmup=warmup)


def profile_llava_components(
    cfg: JobConfig, device: torch.device, vocab_size: int, repeats: int = 5, warmup: int = 2
) -> dict[str, float]:
    """:func:`profile_gpt_components`' keys for the LLaVA language model, plus
    ``vision_per_image`` and ``projector_per_image`` (seconds per image)."""
    from megascale_omni.models.llava import build_llava_chunks

    cfg = single_stage_config(cfg)
    dtype = _dtype(cfg, device)
    (chunk,) = build_llava_chunks(cfg, dtype, vocab_size, image_token_id=vocab_size - 1)
    seconds = _profile_lm(cfg, chunk, chunk.language_model, device, vocab_size, repeats=repeats, warmup=warmup)
    cuda = device.type == "cuda"
    v, b = cfg.vision, cfg.train.micro_batch_size
    gen = torch.Generator().manual_seed(cfg.train.seed + 1)
    n = max(1, round(b * v.images_per_sequence))
    images = torch.rand(n, 3, v.image_size, v.image_size, generator=gen).to(device, dtype)
    p = v.tokens_per_image
    feats = torch.randn(p, n, v.hidden_size, generator=gen).to(device, dtype)
    feats.requires_grad_(not v.freeze)
    vision = _fwd_bwd(lambda: chunk.vision_model(images, attention_mask=None))
    projector = _fwd_bwd(lambda: chunk.vision_projection(feats))
    seconds[f"{VISION}_per_image"] = _best_seconds(vision, repeats, warmup, cuda) / n
    seconds[f"{PROJECTOR}_per_image"] = _best_seconds(projector, repeats, warmup, cuda) / n
    return seconds


def _dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    return torch.float32 if cfg.train.precision == "fp32" or device.type == "cpu" else torch.bfloat16


def _profile_lm(
    cfg: JobConfig, chunk: torch.nn.Module, lm: torch.nn.Module, device: torch.device, vocab_size: int,
    repeats: int, warmup: int,
) -> dict[str, float]:
    """Embedding, one decoder layer and output + loss of the language model
    ``lm`` inside ``chunk`` (a one-layer, one-stage model).

    The layer runs the THD path of training (:mod:`megascale_omni.models.attention`)
    with each of the ``b`` rows one segment: the costliest packing of a row,
    since causal attention over one long segment does the most work."""
    from megascale_omni.models.init import init_layout_invariant

    m, train = cfg.model, cfg.train
    dtype = _dtype(cfg, device)
    b, s = train.micro_batch_size, m.seq_length
    cuda = device.type == "cuda"
    init_layout_invariant([chunk], seed=train.seed, std=m.init_method_std, num_layers=m.num_layers)
    chunk.to(device)
    gen = torch.Generator().manual_seed(train.seed)
    tokens = torch.randint(0, vocab_size, (b, s), generator=gen).to(device)
    positions = torch.arange(s, device=device).expand(b, s)
    packed = packed_seq_params(torch.arange(0, (b + 1) * s, s, device=device))
    hidden = torch.randn(b * s, 1, m.hidden_size, generator=gen).to(device, dtype).requires_grad_()  # [t, 1, h]
    rope = lm.rotary_pos_emb(s) if m.position_embedding_type == "rope" else None
    layer = lm.decoder.layers[0]
    seconds = {
        EMBEDDING: _best_seconds(
            _fwd_bwd(lambda: lm.embedding(input_ids=tokens, position_ids=positions)), repeats, warmup, cuda
        ),
        LM_LAYER: _best_seconds(
            _fwd_bwd(lambda: layer(hidden, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=packed)[0]),
            repeats, warmup, cuda,
        ),
    }
    labels = torch.randint(0, vocab_size, (1, b * s), generator=gen).to(device)

    def output_and_loss() -> torch.Tensor:
        logits, _ = lm.output_layer(lm.decoder.final_layernorm(hidden))
        return lm.compute_language_model_loss(labels, logits).sum()

    seconds[OUTPUT] = _best_seconds(_fwd_bwd(output_and_loss), repeats, warmup, cuda)
    return seconds
