"""Mixture-of-Experts language models on megatron-core's MoE layer (every rank).

Nothing here reimplements routing or dispatch: ``moe:`` becomes megatron's
``TransformerConfig`` MoE fields (:func:`moe_config_kwargs`) and its layer
specs (``get_gpt_layer_local_spec(num_experts=...)`` and TE's), which build
``MoELayer`` = ``TopKRouter`` + token dispatcher (``alltoall`` or
``allgather`` over the EP group) + experts (``SequentialMLP`` with the local
spec, ``TEGroupedMLP`` with transformer-engine) + optional shared experts.

The load-balancing and z-losses are not part of the loss function's value:
megatron attaches them to the router's activations with
``MoEAuxLossAutoScaler`` and adds their gradient in backward, scaled for
``calculate_per_token_loss`` (the router multiplies each by its micro-batch's
token count; ``finalize_model_grads`` divides every gradient by the global
loss-token count). The step's reported loss stays the language-model loss;
megatron's aux-loss tracker holds the per-layer values.
"""

from __future__ import annotations

from typing import Optional

import torch

from megascale_omni.config import ModelConfig, MoeConfig, ParallelConfig


def moe_config_kwargs(moe: MoeConfig, model: ModelConfig, parallel: ParallelConfig, impl: str) -> dict:
    """megatron ``TransformerConfig`` MoE fields of ``moe:`` (empty for a dense model).

    ``impl`` is the resolved layer implementation: transformer-engine runs
    the experts as one grouped GEMM (``moe_grouped_gemm``), the local spec as
    a loop over this rank's experts (``SequentialMLP``)."""
    if not moe.enabled:
        return {}
    # With the per-token loss, megatron 0.16.1 multiplies each router loss by the
    # tokens of *this* rank's sequence share before finalize_model_grads divides by
    # the job's loss tokens; the router's gradient is then summed over the TP (SP)
    # and CP ranks, so the router-loss gradients come out 1/(tp*cp) of one process's.
    # Scaling the coefficients restores the objective of docs/moe.md; the losses
    # megatron tracks (and the step record) are divided by the same coefficients.
    split = (parallel.tp if parallel.sequence_parallel else 1) * parallel.cp
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size or model.ffn_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff * split,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=moe.bias_update_rate,
        moe_z_loss_coeff=moe.z_loss_coeff * split or None,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=moe.token_drop_policy,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
        moe_layer_freq=moe.layer_freq,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_grouped_gemm=impl == "transformer_engine",
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp_size,
    )


def chunk_layer_pattern(config, vp_stage: Optional[int]) -> list[bool]:
    """Which layers of this rank's model chunk are MoE (True) or dense, in
    build order: megatron's ``moe_layer_freq`` pattern over all layers, cut
    to this pipeline chunk as ``get_gpt_decoder_block_spec`` cuts it (the
    explicit layout, else the layer offset)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    freq = config.moe_layer_freq
    pattern = ([i % freq == 0 for i in range(config.num_layers)] if isinstance(freq, int)
               else [bool(v) for v in freq])
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return [pattern[i] for i in layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return pattern[offset:offset + get_num_layers_to_build(config, vp_stage=vp_stage)]


def group_expert_params(chunks) -> None:
    """Tag every routed-expert weight of ``chunks`` expert-parallel (every
    rank, before megatron DDP and the optimizer see them).

    megatron tags them (``allreduce = False``) only when ``ep > 1``; at EP1
    they join the dense parameters, one optimizer instead of a chained
    dense + expert pair. Tagging them at every EP size gives every layout the
    same optimizer structure, so a checkpoint reshards across EP sizes
    (docs/moe.md). At EP1 the expert-DP group is the DP group: the same
    reduction, in a separate buffer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for param in module.experts.parameters():
                    param.allreduce = False


class RouterStats:
    """What the routers did in one training step, for the step record
    (every rank builds one; :meth:`read` is a collective of every rank).

    A forward hook on each of this rank's ``TopKRouter`` counts the tokens
    its routing map sends to each expert (after capacity dropping) and the
    router's calls; megatron's aux-loss tracker holds the load-balancing and
    z-loss values of the same forwards. Both count only training forwards
    with autograd on, as megatron's own expert-bias count does: an
    evaluation is not counted, and under full recomputation the first
    (no-grad) forward is not, its recomputation in backward is, so every
    token counts once.

    Every token of a micro-batch is routed on exactly one rank per layer
    (DP and EP ranks hold other tokens, TP ranks their sequence-parallel
    share, CP ranks their part of the sequence, each layer lives on one
    pipeline stage), so one all-reduce over the world sums the job's counts.
    ``shares``: the parts each micro-batch is routed in, ``tp x cp`` (TP
    with sequence parallelism, which MoE requires). ``enabled=False`` (a dense model):
    nothing is hooked and :meth:`read` returns ``{}`` without a collective.
    """

    def __init__(self, chunks=(), num_layers: int = 0, num_experts: int = 0, shares: int = 1, enabled: bool = True,
                 topk: int = 1):
        self.enabled = enabled and num_experts > 0
        self.shares = shares
        self.topk = topk
        self._counts = None
        self._calls = None
        self._dropped = None
        if not self.enabled:
            return
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        device = next(iter(chunks[0].parameters())).device
        self._counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self._calls = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self._dropped = torch.zeros(num_layers, dtype=torch.float64, device=device)
        for router in routers:
            router.register_forward_hook(self._count)

    @classmethod
    def disabled(cls) -> "RouterStats":
        return cls(enabled=False)

    def _count(self, router, inputs, outputs) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        probs, routing_map = outputs
        layer = router.layer_number - 1
        with torch.no_grad():
            self._counts[layer] += routing_map.sum(dim=0).to(self._counts.dtype)
            self._calls[layer] += 1
            # Every token picks topk experts; the capacity drops some of those
            # choices (their probability is zeroed; pad_to_capacity adds
            # zero-probability slots, which are not tokens).
            kept = torch.count_nonzero(probs * routing_map).to(self._dropped.dtype)
            self._dropped[layer] += routing_map.shape[0] * self.topk - kept

    def discard(self) -> None:
        """Forget what the routers did since the last :meth:`read` (every
        rank, no collective): a step attempt that is computed again (an
        elastic membership change, an uncommitted step) must not count twice."""
        if not self.enabled:
            return
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self._counts.zero_()
        self._calls.zero_()
        self._dropped.zero_()
        clear_aux_losses_tracker()

    def read(self) -> dict:
        """This step's router fields of the step record (docs/moe.md, metrics/schema.py),
        then zeroes the counts and megatron's tracker. Every rank."""
        if not self.enabled:
            return {}
        import torch.distributed as dist
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        layers = self._calls.numel()
        zeros = torch.zeros(layers, dtype=torch.float64, device=self._calls.device)
        losses = [tracker[name]["values"].to(torch.float64) if name in tracker else zeros
                  for name in ("load_balancing_loss", "z_loss")]
        packed = torch.cat([self._counts.flatten(), self._calls, self._dropped, *losses])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        packed = packed.cpu()
        counts = packed[: self._counts.numel()].view_as(self._counts)
        calls, dropped, aux, z = packed[self._counts.numel():].view(4, layers)
        self.discard()
        moe_layers = [i for i in range(layers) if calls[i] > 0]
        if not moe_layers:
            return {}
        # Each micro-batch is routed in its tp x cp sequence shares: calls = micro-batches * shares.
        # The aux loss of a micro-batch is the sum of its shares' partial values; the z-loss each
        # share's mean over its own tokens.
        microbatches = calls[moe_layers] / self.shares
        record = {
            "moe_expert_tokens": [[int(v) for v in counts[i].tolist()] for i in moe_layers],
            "moe_load_max": [round(float(counts[i].max() / counts[i].mean()), 6) if counts[i].sum() else 0.0
                             for i in moe_layers],
            "moe_tokens_dropped": [int(dropped[i]) for i in moe_layers],
        }
        if aux.any():
            record["moe_aux_loss"] = float((aux[moe_layers] / microbatches).mean())
        if z.any():
            record["moe_z_loss"] = float((z[moe_layers] / calls[moe_layers]).mean())
        return record
