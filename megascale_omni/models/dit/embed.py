"""Patchify / unpatchify and the sinusoidal embeddings of a DiT.

Token order everywhere is row-major over the patch grid: token
``r * cols + c`` is the patch at row ``r``, column ``c``. Tensors are in
megatron's ``[sequence, batch, hidden]`` layout.
"""

from __future__ import annotations

import math

import torch


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[N, B, C * patch * patch]`` with ``N = (H/p) * (W/p)``."""
    b, c, h, w = x.shape
    rows, cols = h // patch, w // patch
    x = x.reshape(b, c, rows, patch, cols, patch).permute(2, 4, 0, 1, 3, 5)  # [rows, cols, B, C, p, p]
    return x.reshape(rows * cols, b, c * patch * patch)


def unpatchify(tokens: torch.Tensor, patch: int, height: int, width: int, channels: int) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[N, B, C * p * p]`` -> ``[B, C, H, W]``."""
    n, b, _ = tokens.shape
    rows, cols = height // patch, width // patch
    x = tokens.reshape(rows, cols, b, channels, patch, patch).permute(2, 3, 0, 4, 1, 5)
    return x.reshape(b, channels, height, width)


def sincos_2d(rows: int, cols: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding ``[rows * cols, dim]``.

    Half of the channels encode the row index, half the column index, each
    as sin/cos at ``dim / 4`` geometric frequencies of the *patch index*.
    Patches are addressed on one integer grid whatever the image's shape, so
    a 16x32 image shares its left half's codes with a 16x16 image: the
    encoding is defined for any aspect ratio and resolution without
    interpolation (``dim`` must be divisible by 4).
    """
    if dim % 4:
        raise ValueError(f"sin-cos 2-D position embedding needs dim % 4 == 0, got {dim}")
    quarter = dim // 4
    freqs = 1.0 / (10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    r = torch.arange(rows, dtype=torch.float64)[:, None].expand(rows, cols).reshape(-1)
    c = torch.arange(cols, dtype=torch.float64)[None, :].expand(rows, cols).reshape(-1)
    ar, ac = r[:, None] * freqs, c[:, None] * freqs
    return torch.cat([ar.sin(), ar.cos(), ac.sin(), ac.cos()], dim=1).float()


def timestep_features(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal features ``[B, dim]`` of flow times ``t`` in [0, 1] (scaled
    by ``scale`` so the frequencies resolve small time differences)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
    args = (t.float() * scale)[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)
