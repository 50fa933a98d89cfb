"""What a Mixture-of-Experts layer adds to the pipeline cost model: the MLP
widths a token passes through and a rank holds, and the token dispatch's
bytes and seconds (docs/moe.md, "FLOPs and memory").

Pure Python on the job config, like :mod:`megascale_omni.parallel.pipeline_cost`
(which builds its decoder layer from these).
"""

from __future__ import annotations

from megascale_omni.config.schema import JobConfig


def mlp_widths(cfg: JobConfig) -> tuple[float, float, float]:
    """``(active, stored, router)`` MLP widths of the average language-model
    layer: the FFN width one token passes through, the width one TP rank of
    ``tp`` holds times ``tp`` (the layer cost divides by ``tp``), and the
    experts its router scores. Dense: ``(ffn, ffn, 0)``. MoE layers
    (``moe.layer_freq``) activate ``topk`` experts plus the shared ones and
    hold ``num_experts / ep`` experts of ``expert_tp``-split width; dense
    layers in between count as dense."""
    m, moe, par = cfg.model, cfg.moe, cfg.parallel
    if not moe.enabled:
        return float(m.ffn_size), float(m.ffn_size), 0.0
    share = sum(moe.layer_pattern(m.num_layers)) / m.num_layers
    expert = moe.ffn_hidden_size or m.ffn_size
    shared = moe.shared_expert_ffn_hidden_size
    active = moe.topk * expert + shared
    stored = moe.num_experts // par.ep * expert * par.tp / par.expert_tp_size + shared
    dense = (1 - share) * m.ffn_size
    return dense + share * active, dense + share * stored, share * moe.num_experts


def dispatch_bytes(cfg: JobConfig, tokens: float, dtype_bytes: int) -> float:
    """Bytes one rank sends to the other ranks of its expert group for the
    MoE token dispatch of the average language-model layer, per micro-batch,
    forward + backward, for ``tokens`` tokens of this CP rank (before the
    sequence-parallel split), assuming the router spreads the tokens evenly.

    Per MoE layer the dispatcher moves each of the rank's ``topk`` routed
    copies of a hidden state to its expert's rank and the expert output back
    (combine); backward moves the gradients of both the other way. Under
    ``alltoall`` a copy stays on the rank when its expert is local:
    ``(ep - 1) / ep`` of them leave. Under ``allgather`` every rank gathers
    the hidden states of the whole expert group of ``n = ep * expert_tp``
    ranks and reduce-scatters the outputs: ``n - 1`` times its own tokens
    each way, whatever the routing. The routing probabilities (fp32, a few
    per token) are left out. Dense layers (``moe.layer_freq``) move nothing."""
    moe, par = cfg.moe, cfg.parallel
    if not moe.enabled:
        return 0.0
    share = sum(moe.layer_pattern(cfg.model.num_layers)) / cfg.model.num_layers
    local = tokens / (par.tp if par.sequence_parallel else 1)
    if moe.token_dispatcher == "alltoall":
        copies = local * moe.topk * (par.ep - 1) / par.ep
    else:
        copies = local * (par.ep * par.expert_tp_size - 1)
    # dispatch + combine, each in forward and again (transposed) in backward
    return share * 4 * copies * cfg.model.hidden_size * dtype_bytes


def dispatch_seconds(cfg: JobConfig, nbytes: float) -> float:
    """Seconds one rank spends sending ``nbytes`` of MoE token dispatch
    (:func:`dispatch_bytes`) at ``parallel.alltoall_bandwidth_gbs`` (GB/s,
    1e9 bytes per second, what one rank sends through the exchange). Nothing
    overlaps: megatron's alltoall and allgather dispatchers wait for the
    exchange before the experts run (and so does backward)."""
    return nbytes / (cfg.parallel.alltoall_bandwidth_gbs * 1e9)
