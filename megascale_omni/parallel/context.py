"""Context parallelism (CP): which tokens of a sequence each CP rank holds.

The split is the load-balanced one of megatron-core and transformer-engine,
so the same batch feeds our ring attention (local spec) and TE's CP
attention: every segment of length ``L`` (a multiple of ``2 * cp``) is cut
into ``2 * cp`` equal chunks of ``m = L / (2 cp)`` tokens, and CP rank ``r``
holds chunk ``r`` followed by chunk ``2 cp - 1 - r``. Under causal attention
chunk ``i`` does work proportional to ``i + 1``, so each rank gets
``(r + 1) + (2 cp - r) = 2 cp + 1`` units: the same on every rank.

Segments are the THD segments of :mod:`megascale_omni.models.attention`
(``cu_seqlens``, global over the whole flattened micro-batch), or one
segment per batch row for ``[s, b]`` layouts. A rank's local tokens are the
concatenation, segment by segment, of its two chunks, so its local segment
boundaries are the global ones divided by ``cp``.

Padding: a segment whose length is not a multiple of ``2 * cp`` is padded at
its end (:func:`pad_segments`); ``PackedSeqParams`` then carries the real
boundaries in ``cu_seqlens_q`` and the padded ones in
``cu_seqlens_q_padded``, transformer-engine's convention. The LLaVA data path
avoids padding here by padding each sample to a multiple of ``2 * cp`` when
it is packed (``data.pad_to_multiple_of``, 8 by default), so its segments are already
divisible.

Everything here is pure tensor code (no process group); it runs on every
rank of a CP group with the same global inputs.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is ``>= n``."""
    return -(-n // multiple) * multiple


def as_ints(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    """Segment boundaries as ints (read to the host when a tensor)."""
    return [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]


def check_divisible(cu_seqlens: torch.Tensor | Sequence[int], cp_size: int) -> list[int]:
    """``cu_seqlens`` as a list, after checking every segment length is a
    multiple of ``2 * cp_size`` (ValueError naming the first that is not)."""
    bounds = as_ints(cu_seqlens)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"segment {i} [{start}, {end}) has {end - start} tokens, not a multiple of 2 * cp = {2 * cp_size}; "
                "pad it (data.pad_to_multiple_of, or pad_segments)"
            )
    return bounds


def cp_token_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token positions held by CP rank ``cp_rank``, in local order.

    Args:
        cu_seqlens_padded: ``[n + 1]`` global segment boundaries, each segment
            a multiple of ``2 * cp_size`` long.

    Returns:
        ``[t / cp_size]`` int64 on ``cu_seqlens_padded.device``: for each
        segment, chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank``.
        The boundaries are read on the host (one copy when they live on a GPU).
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    bounds = check_divisible(cu_seqlens_padded, cp_size)
    device = cu_seqlens_padded.device
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        m = (end - start) // (2 * cp_size)
        if m == 0:
            continue
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + chunk * m, start + (chunk + 1) * m, device=device))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat(parts)


class PaddedSegments(NamedTuple):
    """A THD sequence with every segment padded to a multiple (:func:`pad_segments`)."""

    #: ``[n + 1]`` int32: real segment lengths, laid out back to back (the input).
    cu_seqlens: torch.Tensor
    #: ``[n + 1]`` int32: boundaries of the padded segments.
    cu_seqlens_padded: torch.Tensor
    #: ``[t]`` int64: where each input token sits in the padded sequence.
    position: torch.Tensor

    @property
    def padded_length(self) -> int:
        return int(self.cu_seqlens_padded[-1])


def pad_segments(cu_seqlens: torch.Tensor, multiple: int) -> PaddedSegments:
    """Pad every segment of ``cu_seqlens`` at its end to a multiple of ``multiple``.

    Scatter a ``[t, ...]`` tensor into the padded layout with
    ``padded = x.new_zeros(padded_length, ...); padded[position] = x``.
    Outputs are on ``cu_seqlens.device``.
    """
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    padded = -(-lengths // multiple) * multiple
    cu_padded = torch.cat([cu.new_zeros(1), torch.cumsum(padded, 0)])
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    position = torch.arange(int(cu[-1]), device=cu.device) - cu[seg] + cu_padded[seg]
    return PaddedSegments(cu.to(torch.int32), cu_padded.to(torch.int32), position)


class LocalSegment(NamedTuple):
    """One segment as a CP rank holds it (see :func:`local_segments`)."""

    #: Start of this segment's ``2 * chunk`` local tokens in the local sequence.
    offset: int
    #: Tokens per chunk, ``m = padded length / (2 cp)``.
    chunk: int
    #: Real (unpadded) length of the whole segment.
    valid: int


def local_segments(
    cu_seqlens: torch.Tensor | Sequence[int], cu_seqlens_padded: torch.Tensor | Sequence[int], cp_size: int
) -> list[LocalSegment]:
    """The local layout of every non-empty segment, identical on all CP ranks.

    ``cu_seqlens`` are the real global boundaries and ``cu_seqlens_padded``
    the padded ones (the same when nothing is padded); tensors or ints."""
    padded = check_divisible(cu_seqlens_padded, cp_size)
    real = as_ints(cu_seqlens)
    if len(real) != len(padded):
        raise ValueError(f"cu_seqlens has {len(real) - 1} segments but cu_seqlens_padded {len(padded) - 1}")
    out = []
    for i in range(len(padded) - 1):
        length, valid = padded[i + 1] - padded[i], real[i + 1] - real[i]
        if not 0 <= valid <= length:
            raise ValueError(f"segment {i}: real length {valid} exceeds its padded length {length}")
        if length:
            out.append(LocalSegment(padded[i] // cp_size, length // (2 * cp_size), valid))
    return out


def shard_tokens(
    batch: Mapping[str, torch.Tensor], keys: Sequence[str], index: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``batch`` with each ``[b, s]`` tensor under ``keys`` flattened row-major
    and reduced to the positions ``index`` (``[1, len(index)]``); other
    entries are passed through unchanged."""
    out = dict(batch)
    for key in keys:
        if key in batch:
            out[key] = batch[key].reshape(-1)[index].unsqueeze(0)
    return out
