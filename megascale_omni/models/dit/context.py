"""Context parallelism (CP) for the DiT: which image tokens a CP rank holds.

Every image of a micro-batch is one sequence of ``N`` tokens (row-major
patches, :mod:`megascale_omni.models.dit.embed`), cut with the load-balanced
split of :mod:`megascale_omni.parallel.context`: ``2 * cp`` chunks of
``N / (2 cp)`` tokens, CP rank ``r`` holding chunk ``r`` then chunk
``2 cp - 1 - r``. ``N`` must be a multiple of ``2 * cp`` (checked per bucket
at config time). All images of a micro-batch share ``N``, so one index
serves every batch row. Caption states and the condition are not split.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megascale_omni.parallel.context import cp_token_index


def image_token_index(n: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[n / cp_size]`` int64: the image tokens CP rank ``cp_rank`` holds, in its local order."""
    return cp_token_index(torch.tensor([0, n]), cp_size, cp_rank)


def gather_image_tokens(local: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every CP rank (a collective over ``group``): this rank's tokens
    ``[n / cp, B, D]`` -> all ``n`` tokens ``[n, B, D]`` in image order.

    No gradient flows through the gather; it serves sampling (under
    ``torch.no_grad``), while training computes the loss on local tokens.
    """
    if torch.is_grad_enabled() and local.requires_grad:
        raise RuntimeError("gather_image_tokens has no backward; call it under torch.no_grad (sampling only)")
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    order = torch.cat([image_token_index(n, cp_size, r) for r in range(cp_size)]).to(local.device)
    full = local.new_empty(n, *local.shape[1:])
    full[order] = torch.cat(parts)
    return full
