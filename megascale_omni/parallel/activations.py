"""Activation memory of one transformer layer under the memory levers.

The levers are tensor parallelism (``tp``), sequence parallelism
(``parallel.sequence_parallel``) and activation recomputation
(``model.recompute``: ``none``, ``selective``, ``full``). The accounting is
that of Korthikanti et al., *Reducing Activation Recomputation in Large
Transformer Models* (MLSys 2023, arXiv:2205.05198, section 4), where one
layer of a GPT (MHA, ``ffn = 4h``, dropout on, 16-bit activations) keeps
between forward and backward, for ``s`` tokens, batch ``b``, width ``h`` and
``a`` heads::

    none, no TP:       s*b*h * (34 + 5*a*s/h)            bytes
    none, TP t:        s*b*h * (10 + 24/t + 5*a*s/(h*t))
    none, TP t + SP:   s*b*h * (34/t + 5*a*s/(h*t))
    selective (+ SP):  s*b*h * 34/t   (the 5*a*s/h attention-core term is recomputed)
    selective, no SP:  s*b*h * (10 + 24/t)
    full:              2*s*b*h        (only the layer input; / t with SP)

Where the terms come from, per token (``e`` bytes per element, 2 at 16-bit):

- the *replicated* part (the "10": what TP does not split, SP does):
  the inputs of both norms, of the QKV projection and of fc1 (4 tensors of
  ``h``: ``4 e h``), and the two 1-byte dropout masks after attention and MLP
  (``2 h``, only when ``model.hidden_dropout > 0``);
- the *TP-split* part (the "24"): Q, K, V (``h + 2 kv``; ``kv = h`` without
  GQA), the attention-projection input (``h``), fc1's output (the activation
  input; ``2 f`` for SwiGLU's gate and up) and fc2's input (``f``):
  ``e (2 h + 2 kv + 2 f)`` = ``24 h`` at ``e = 2``, ``f = 4 h``;
- the *attention core* (the "5 a s / h"), per query-key pair and head: the
  softmax output (``e``), and with ``model.attention_dropout > 0`` its
  1-byte mask and the dropout output (``1 + e``); 5 bytes at 16-bit with
  dropout. Selective recomputation (megatron's ``core_attn``) keeps only Q, K
  and V, already counted above.

Generalised beyond the paper: ``e`` follows ``train.precision`` (4 in fp32),
GQA shrinks K and V, the MLP width and gating are the model's, the dropout
terms vanish without dropout, and ``pairs`` is what attention really scores
(causal packed segments, or the ``b * s * s`` square the planner assumes).
The paper's attention materialises the score matrix, as the local layer
spec does; transformer-engine's fused (flash) attention does not: it keeps
the softmax statistics, one fp32 value per query and head (``4 a`` bytes
per token, TP-split), and recomputes the scores in its own backward, so
there ``selective`` saves next to nothing (megatron says as much when
``core_attn`` is recomputed with fused attention). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``model.recompute`` values.
RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL = "none", "selective", "full"


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer as the activation formula sees it."""

    #: Model width ``h``.
    hidden: int
    #: MLP width ``f`` (per gate for SwiGLU).
    ffn: int
    #: Attention heads ``a``.
    heads: int
    #: Width of K (and of V): ``query_groups * head_dim`` (``h`` without GQA).
    kv_hidden: int
    #: SwiGLU MLP: fc1 outputs ``2 f`` (gate and up).
    gated: bool = False
    #: ``model.hidden_dropout > 0``: two 1-byte masks per token.
    hidden_dropout: bool = False
    #: ``model.attention_dropout > 0``: a 1-byte mask and a dropped copy per score.
    attention_dropout: bool = False
    #: Fused (flash) attention: no score matrix, fp32 softmax statistics per query and head.
    fused_attention: bool = False


def layer_activation_bytes(
    shape: LayerShape, tokens: float, pairs: float, dtype_bytes: int, tp: int,
    sequence_parallel: bool, recompute: str,
) -> float:
    """Bytes one TP rank keeps from forward to backward for one layer and one
    micro-batch (module docstring). ``tokens``: positions through the layer
    on this rank (after any CP split); ``pairs``: query-key pairs its
    attention scores (over all heads' shared mask, i.e. per head);
    ``dtype_bytes``: bytes per activation element (2 bf16, 4 fp32)."""
    h, e = shape.hidden, dtype_bytes
    replicated = tokens * (4.0 * e * h + (2.0 * h if shape.hidden_dropout else 0.0))
    f_out = (2 if shape.gated else 1) * shape.ffn
    split = tokens * e * (2.0 * h + 2.0 * shape.kv_hidden + f_out + shape.ffn)
    if shape.fused_attention:
        core = tokens * shape.heads * 4.0
    else:
        core = pairs * shape.heads * (e + (1.0 + e if shape.attention_dropout else 0.0))
    # SP shards the replicated part over the TP ranks too.
    replicated_share = replicated / tp if sequence_parallel else replicated
    if recompute == RECOMPUTE_FULL:
        layer_input = tokens * e * h
        return layer_input / tp if sequence_parallel else layer_input
    if recompute == RECOMPUTE_SELECTIVE:
        return replicated_share + split / tp
    if recompute == RECOMPUTE_NONE:
        return replicated_share + (split + core) / tp
    raise ValueError(f"unknown recompute {recompute!r}; expected none, selective or full")


def recompute_forward_flops(attention_core_flops: float, layer_forward_flops: float, recompute: str) -> float:
    """Extra forward FLOPs per micro-batch that ``recompute`` spends in
    backward: the attention core again (selective), or the whole layer (full)."""
    return {RECOMPUTE_NONE: 0.0, RECOMPUTE_SELECTIVE: attention_core_flops,
            RECOMPUTE_FULL: layer_forward_flops}[recompute]
