"""Loss-function bodies shared by every model family (last pipeline stage only).

megatron's schedules run with ``calculate_per_token_loss=True``: a loss
function returns the *sum* of its token losses and their count, and megatron
divides by the global token count in ``finalize_model_grads``, so DP and
micro-batch splits optimise one objective.
"""

from __future__ import annotations

import torch

from megascale_omni.parallel.schedules import LOSS_KEY


def masked_token_loss(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The triple megatron's schedules expect, from per-token losses.

    ``per_token_loss`` and ``loss_mask`` are ``[batch, seq]``. Returns the
    masked loss sum, the token count, and ``{LOSS_KEY: [sum, count]}`` for
    reporting (see :func:`megascale_omni.parallel.schedules.reduce_reports`).
    """
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(per_token_loss.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {LOSS_KEY: report}
