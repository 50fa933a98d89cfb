"""Forward passes and token generation for one-process models (tools/generate.py,
the HF equivalence tests).

No KV cache: every new token re-runs the whole prefix. That is O(n^2) in the
generated length, fine for checking a model and for short answers, and it
runs exactly the training forward: the same THD batch format (each row one
segment, :mod:`megascale_omni.models.attention`) and the same kernels.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megascale_omni.models.attention import thd_inputs


@torch.no_grad()
def logits(model: torch.nn.Module, tokens: torch.Tensor, images: Optional[torch.Tensor] = None,
           videos: Optional[torch.Tensor] = None, video_frames: Sequence[int] = ()) -> torch.Tensor:
    """Logits ``[b, s, padded_vocab]`` (fp32) of a TP1/PP1 ``gpt`` model or
    LLaVA chunk for ``tokens`` ``[b, s]``; ``images`` ``[n, 3, H, W]`` fill
    the image placeholder tokens (LLaVA) in row-major order, ``videos``
    ``[F, 3, H, W]`` (``video_frames`` per video) the video placeholders."""
    b, s = tokens.shape
    batch = {
        "tokens": tokens,
        "position_ids": torch.arange(s, device=tokens.device).expand(b, s),
        "cu_seqlens": torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=tokens.device),
    }
    tokens_thd, position_ids, _, packed = thd_inputs(batch)
    if images is not None or hasattr(model, "vision_model"):
        out = model(tokens_thd, position_ids, packed, images=images, videos=videos,
                    video_frames=torch.tensor(list(video_frames), dtype=torch.int64) if video_frames else None)
    else:
        out = model(tokens_thd, position_ids, None, packed_seq_params=packed)
    return out.float().reshape(b, s, -1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    images: Optional[torch.Tensor] = None,
    eos_id: Optional[int] = None,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    videos: Optional[torch.Tensor] = None,
    video_frames: Sequence[int] = (),
) -> list[int]:
    """New token ids after ``prompt``: greedy when ``temperature`` is 0,
    else sampled from ``softmax(logits / temperature)`` (over the ``top_k``
    most likely tokens when > 0). Stops after ``eos_id`` (included) or
    ``max_new_tokens``. Padding rows beyond ``vocab_size`` are never chosen."""
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        last = logits(model, torch.tensor([tokens]), images, videos, video_frames)[0, -1, :vocab_size]
        if temperature <= 0:
            token = int(last.argmax())
        else:
            scores = last / temperature
            if top_k > 0:
                kth = torch.topk(scores, min(top_k, vocab_size)).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=generator))
        tokens.append(token)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new
