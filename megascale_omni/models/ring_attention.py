"""Ring attention over the context-parallel group, for the local layer spec.

Each CP rank holds ``t / cp`` tokens of every sequence, in the load-balanced
split of :mod:`megascale_omni.parallel.context` (chunks ``r`` and
``2 cp - 1 - r`` of each segment). Keys and values travel around the ring
(rank ``r`` sends to ``r + 1`` and receives from ``r - 1``, point-to-point,
the next block in flight while the current one is computed). After ``cp``
steps every query block has met every key block; the partial softmax results
are merged with their log-sum-exp, in fp32.

Which blocks are computed (causal, per segment, query chunks ``{r, 2cp-1-r}``
against key chunks ``{j, 2cp-1-j}`` of source rank ``j``):

* ``j == r``: both local chunks, causal (their concatenation is in order);
* ``j < r``: all local queries against chunk ``j`` only, no mask;
* ``j > r``: the second local query chunk against both key chunks, no mask.

Bidirectional attention computes every pair without a mask, and leaves out
padding keys (positions past a segment's real length; they are a suffix of
the segment, so a prefix of each block is valid). Outputs at padding
positions are zero and receive no gradient. Causal attention needs no
padding mask: a real query never precedes a padding key.

Backward is a hand-written ring, not autograd through the forward ring:
autograd would keep every received key/value block (``cp`` times the local
K/V) alive until backward, which is the memory CP exists to save. The
backward sends the key/value blocks around again, together with their
gradient accumulators; each rank adds its queries' contribution and passes
the accumulator on, and a last hop brings it home. Block gradients use the
merged output and log-sum-exp, so they are exact, not approximations.

Block kernels: torch's fused attention kernels that return the log-sum-exp,
so memory stays linear in the block length: CPU flash attention; on CUDA
flash attention (fp16/bf16) or memory-efficient attention (fp32); a plain
matmul/softmax version only for other devices. GPUs with transformer-engine
use megatron's own CP attention instead (:mod:`megascale_omni.models.specs`).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megascale_omni.parallel.context import LocalSegment

Tensor = torch.Tensor


# ----------------------------------------------------------------- kernels


def _expand_groups(k: Tensor, heads: int) -> Tensor:
    """``[B, ng, L, d]`` -> ``[B, heads, L, d]`` (query head ``i`` uses group ``i // (heads / ng)``)."""
    groups = heads // k.shape[1]
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _fold_groups(dk: Tensor, groups: int) -> Tensor:
    """Sum ``[B, heads, L, d]`` gradients back onto their ``groups`` key/value heads."""
    b, heads, length, d = dk.shape
    if heads == groups:
        return dk
    return dk.view(b, groups, heads // groups, length, d).sum(2)


def _kernel(q: Tensor) -> str:
    """Which fused block kernel runs ``q``: ``cpu`` (torch's CPU flash
    attention), ``flash`` (CUDA fp16/bf16, head dim % 8 == 0 and <= 256),
    ``efficient`` (other CUDA: torch's memory-efficient attention), else
    ``dense`` (matmul/softmax, ``[Lq, Lk]`` scores per block)."""
    if q.device.type == "cpu":
        return "cpu"
    if q.is_cuda:
        d = q.shape[-1]
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256 else "efficient"
    return "dense"


#: Query rows of the memory-efficient kernel's log-sum-exp come in multiples of this.
_EFFICIENT_LSE_ALIGN = 32


def block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of one block: ``q [B, n, Lq, d]``, ``k``/``v [B, ng, Lk, d]``
    -> ``(out [B, n, Lq, d], lse [B, n, Lq] fp32)``. ``causal`` needs ``Lq == Lk``.
    Fused kernels keep memory linear in the block length."""
    k, v = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    kernel = _kernel(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    if kernel == "efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
        return out, lse[..., : q.shape[2]]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_causal_mask(q.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def block_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *merged* ``out`` and ``lse`` of its
    query rows: ``(dq [B, n, Lq, d], dk, dv [B, ng, Lk, d])``."""
    groups = k.shape[1]
    ke, ve = _expand_groups(k, q.shape[1]), _expand_groups(v, q.shape[1])
    kernel = _kernel(q)
    dout, q, ke, ve, out, lse = (x.contiguous() for x in (dout, q, ke, ve, out, lse))
    if kernel == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, scale=scale
        )
    elif kernel in ("flash", "efficient"):
        # No dropout, so the kernels never read their RNG state; None passes
        # torch's undefined tensor (no varlen offsets, no bias).
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        if kernel == "flash":
            length_q, length_k = q.shape[2], ke.shape[2]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse.float(), None, None, length_q, length_k, 0.0, causal, rng, rng,
                scale=scale,
            )
        else:
            # The kernel reads log-sum-exp rows in tiles: give it the padded layout its forward returns.
            pad = -q.shape[2] % _EFFICIENT_LSE_ALIGN
            lse = torch.nn.functional.pad(lse.float(), (0, pad))
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                dout, q, ke, ve, None, out, lse, rng, rng, 0.0, [True, True, True, False], causal, scale=scale
            )
    else:
        qf, kf, vf, df = q.float(), ke.float(), ve.float(), dout.float()
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(_causal_mask(q.shape[2], q.device), float("-inf"))
        p = torch.exp(scores - lse.float().unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), df)
        dp = torch.matmul(df, vf.transpose(-1, -2))
        ds = p * (dp - (df * out.float()).sum(-1, keepdim=True))
        dq = torch.matmul(ds, kf) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
        dq, dk, dv = dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
    return dq, _fold_groups(dk, groups), _fold_groups(dv, groups)


def _causal_mask(length: int, device: torch.device) -> Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).triu(1)


# --------------------------------------------------------- which blocks run


def _plan(seg: LocalSegment, rank: int, source: int, cp: int, causal: bool) -> Optional[tuple[slice, int, bool]]:
    """The block of segment ``seg`` computed when this rank (``rank``) holds
    source rank ``source``'s keys: ``(local query rows of the segment, number
    of leading key rows, causal)``, or None when nothing is computed."""
    m = seg.chunk
    if causal:
        if source == rank:
            return slice(0, 2 * m), 2 * m, True
        if source < rank:
            return slice(0, 2 * m), m, False
        return slice(m, 2 * m), 2 * m, False
    # Bidirectional: every pair, without the padding keys (a suffix of the segment).
    keys = _valid_in_chunk(seg, source) + _valid_in_chunk(seg, 2 * cp - 1 - source)
    return (slice(0, 2 * m), keys, False) if keys else None


def _blocks(
    segments: Sequence[LocalSegment], rank: int, source: int, cp: int, causal: bool
) -> Iterator[tuple[slice, slice, bool]]:
    """Every block computed at the ring step where this rank holds ``source``'s
    keys: ``(local query rows, local key rows, causal)``, segment by segment."""
    for seg in segments:
        plan = _plan(seg, rank, source, cp, causal)
        if plan is not None:
            rows, keys, block_causal = plan
            yield slice(seg.offset + rows.start, seg.offset + rows.stop), slice(seg.offset, seg.offset + keys), block_causal


def _valid_in_chunk(seg: LocalSegment, chunk: int) -> int:
    return max(0, min(seg.chunk, seg.valid - chunk * seg.chunk))


def _query_valid_mask(segments: Sequence[LocalSegment], rank: int, cp: int, length: int) -> Optional[Tensor]:
    """``[length]`` bool, False at padding positions of this rank; None without padding."""
    if all(seg.valid == 2 * cp * seg.chunk for seg in segments):
        return None
    mask = torch.zeros(length, dtype=torch.bool)
    for seg in segments:
        for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            start = seg.offset + half * seg.chunk
            mask[start : start + _valid_in_chunk(seg, chunk)] = True
    return mask


# ---------------------------------------------------------- communication


class _Ring:
    """Point-to-point neighbours of this rank in ``group`` (send to ``r + 1``,
    receive from ``r - 1``)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: Tensor) -> tuple[Tensor, list]:
        """Start sending ``tensor`` to the next rank and receiving the previous
        rank's into a new buffer; returns the buffer and the requests."""
        buffer = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, buffer, self.prev, self.group),
        ]
        return buffer, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


# ----------------------------------------------------------- the operator


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segments, causal, scale, group):
        ring = _Ring(group)
        out = torch.zeros(q.shape, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=out.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.size):
            pending = ring.shift(kv) if step + 1 < ring.size else None
            source = (ring.rank - step) % ring.size
            for qs, ks, block_causal in _blocks(segments, ring.rank, source, ring.size, causal):
                blk_out, blk_lse = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], block_causal, scale)
                _merge(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
            if pending is not None:
                kv, requests = pending
                _wait(requests)
        valid = _query_valid_mask(segments, ring.rank, ring.size, q.shape[2])
        if valid is not None:
            # masked_fill, not boolean indexing: no device-to-host sync for the mask's count.
            out.masked_fill_(~valid.to(q.device)[None, None, :, None], 0.0)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.causal, ctx.scale, ctx.group, ctx.valid = segments, causal, scale, group, valid
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        segments, causal, scale = ctx.segments, ctx.causal, ctx.scale
        if ctx.valid is not None:
            dout = dout.masked_fill(~ctx.valid.to(dout.device)[None, None, :, None], 0.0)
        acc = torch.float32 if q.dtype != torch.float64 else q.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        for step in range(ring.size):
            pending = ring.shift(kv) if step + 1 < ring.size else None
            source = (ring.rank - step) % ring.size
            for qs, ks, block_causal in _blocks(segments, ring.rank, source, ring.size, causal):
                d_q, d_k, d_v = block_backward(
                    dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                    block_causal, scale,
                )
                dq[:, :, qs] += d_q
                dkv[0][:, :, ks] += d_k
                dkv[1][:, :, ks] += d_v
            if pending is not None:
                kv, requests = pending
                _wait(requests)
            # The accumulator follows its key/value block; after the last step
            # this hop brings every rank's own gradients home.
            dkv, requests = ring.shift(dkv)
            _wait(requests)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _merge(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor) -> None:
    """Fold one block's ``(out, lse)`` into the running result, in place."""
    blk_lse = blk_lse.to(lse.dtype)
    new = torch.logaddexp(lse, blk_lse)
    # Rows not yet reached have lse = -inf: their old weight is exp(-inf) = 0.
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(blk_out.to(out.dtype) * torch.exp(blk_lse - new).unsqueeze(-1))
    lse.copy_(new)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segments: Sequence[LocalSegment],
    *,
    causal: bool,
    scale: float,
    group: dist.ProcessGroup,
) -> Tensor:
    """Attention of this rank's queries against the keys of the whole CP group.

    Args:
        q: ``[B, n, T, d]`` local queries (``T = t / cp``), heads first.
        k, v: ``[B, ng, T, d]`` local keys and values (``n % ng == 0``).
        segments: the local layout, :func:`~megascale_omni.parallel.context.local_segments`;
            every batch row shares it (THD: ``B = 1``; ``[s, b]``: one segment per row).
        causal: causal inside each segment, else bidirectional.
        scale: softmax scale.
        group: the CP group; every rank calls this with the same segments.

    Returns:
        ``[B, n, T, d]`` in ``q.dtype``; zero at padding positions.
    """
    if q.shape[2] != k.shape[2] or k.shape != v.shape or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return _RingAttention.apply(q, k, v, tuple(segments), causal, scale, group)
