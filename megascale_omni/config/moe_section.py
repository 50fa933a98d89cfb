"""Config section of a Mixture-of-Experts language model (``moe:``).

Every field maps onto one megatron-core ``TransformerConfig`` MoE field
(docs/moe.md has the table); the builders translate them in
:func:`megascale_omni.models.moe.moe_config_kwargs`. ``num_experts: 0``
keeps every layer a dense MLP. How the experts are laid out over ranks is
``parallel.ep`` / ``parallel.expert_tp``. Relations to other sections
(ranks, families, elastic) are checked in :mod:`.validate`.

A top-level section rather than a field of ``model``: the sections are one
level deep everywhere (``section.field=value`` overrides, the generated
config reference, ``omni-ctl config set``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from megascale_omni.config.constraints import check_fields, checked
from megascale_omni.config.errors import ConfigError


@dataclass
class MoeConfig:
    """Routed experts in place of the dense MLP (GPT and LLaVA's language model)."""

    #: Routed experts per MoE layer; 0 = a dense model (no MoE layer). Megatron ``num_moe_experts``.
    num_experts: int = checked(0, ge=0)
    #: Experts each token is routed to (``moe_router_topk``); at most ``num_experts``.
    topk: int = checked(2, gt=0)
    #: FFN width of one routed expert; ``null`` = ``model.ffn_hidden_size``
    #: (``moe_ffn_hidden_size``). Divisible by ``parallel.expert_tp``.
    ffn_hidden_size: Optional[int] = checked(None, gt=0)
    #: Total FFN width of the shared experts, which see every token
    #: (``moe_shared_expert_intermediate_size``: shared experts x width
    #: each); 0 = none.
    shared_expert_ffn_hidden_size: int = checked(0, ge=0)
    #: Qwen2-MoE's gate on the shared experts' output, ``sigmoid(x @ w)`` per
    #: token (``moe_shared_expert_gate``); needs shared experts.
    shared_expert_gate: bool = False
    #: Router score function (``moe_router_score_function``): ``softmax`` or
    #: ``sigmoid`` (DeepSeek-V3; its top-k scores are always renormalised to sum 1 for topk > 1).
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    #: Softmax over all experts before the top-k (``moe_router_pre_softmax``):
    #: the selected probabilities are used raw, as Qwen2-MoE's
    #: ``norm_topk_prob: false``. False: softmax over the top-k logits only,
    #: so they sum to 1 (Mixtral). ``softmax`` only; required for topk 1.
    pre_softmax: bool = False
    #: Factor on the selected probabilities (``moe_router_topk_scaling_factor``,
    #: DeepSeek's ``routed_scaling_factor``); ``null`` = 1.
    topk_scaling_factor: Optional[float] = checked(None, gt=0)
    #: Load-balancing loss (``moe_router_load_balancing_type``): ``aux_loss``
    #: (Switch/GShard over the tokens of a micro-batch) or ``none`` (e.g. with
    #: ``expert_bias``). megatron's ``seq_aux_loss`` is not offered: our
    #: micro-batches are one packed row, where it would equal ``aux_loss``.
    load_balancing: Literal["aux_loss", "none"] = "aux_loss"
    #: Coefficient of the load-balancing loss (``moe_aux_loss_coeff``); 0 with ``load_balancing: none``.
    aux_loss_coeff: float = checked(1e-2, ge=0)
    #: Aux-loss-free balancing (``moe_router_enable_expert_bias``): a per-expert
    #: bias added to the scores for the top-k choice only, moved each step by
    #: ``bias_update_rate`` towards equal load. Needs ``score_function: sigmoid``.
    expert_bias: bool = False
    #: Step of the expert-bias update per optimizer step (``moe_router_bias_update_rate``).
    bias_update_rate: float = checked(1e-3, gt=0)
    #: Router z-loss coefficient (ST-MoE, ``moe_z_loss_coeff``); 0 = off.
    z_loss_coeff: float = checked(0.0, ge=0)
    #: Expert capacity as a multiple of the even share (``moe_expert_capacity_factor``):
    #: tokens beyond it are dropped (their expert output is 0). ``null`` = dropless.
    capacity_factor: Optional[float] = checked(None, gt=0)
    #: With a capacity: which tokens are dropped first (``moe_token_drop_policy``):
    #: ``probs`` (lowest routing probability) or ``position`` (latest in the micro-batch).
    token_drop_policy: Literal["probs", "position"] = "probs"
    #: With a capacity: pad every expert's input to its capacity (``moe_pad_expert_input_to_capacity``).
    pad_to_capacity: bool = False
    #: Which layers are MoE (``moe_layer_freq``): an integer N makes layers
    #: 0, N, 2N, ... MoE (1: every layer); a list of 0/1, one per
    #: ``model.num_layers``, names them explicitly.
    layer_freq: Union[int, list[int]] = 1
    #: How tokens reach their experts' ranks (``moe_token_dispatcher_type``):
    #: ``alltoall`` (uneven all-to-all over the EP group; gloo has it) or
    #: ``allgather``. ``flex`` (DeepEP) needs CUDA and is not offered.
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"

    def __post_init__(self) -> None:
        check_fields(self, "moe")
        if isinstance(self.layer_freq, int):
            if self.layer_freq < 1:
                raise ConfigError("moe.layer_freq", self.layer_freq,
                                  "must be >= 1 (every N-th layer is MoE) or a list of 0/1 per layer")
        elif not self.layer_freq or any(v not in (0, 1) for v in self.layer_freq):
            raise ConfigError("moe.layer_freq", self.layer_freq,
                              "a list needs one 0 (dense) or 1 (MoE) per model layer")
        if not self.enabled:
            return
        if self.topk > self.num_experts:
            raise ConfigError("moe.topk", self.topk, f"must be <= moe.num_experts={self.num_experts}")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ConfigError("moe.shared_expert_gate", True,
                              "gates the shared experts; set moe.shared_expert_ffn_hidden_size > 0 or the gate false")
        if self.pre_softmax and self.score_function != "softmax":
            raise ConfigError("moe.pre_softmax", True, "applies to score_function: softmax; set it to false")
        if self.topk == 1 and self.score_function == "softmax" and not self.pre_softmax:
            raise ConfigError("moe.pre_softmax", False,
                              "a softmax over one selected logit is always 1 (no gradient to the router); "
                              "set moe.pre_softmax: true for topk 1")
        if self.expert_bias and self.score_function != "sigmoid":
            raise ConfigError("moe.expert_bias", True,
                              "megatron's aux-loss-free bias works on sigmoid scores; set moe.score_function: sigmoid")
        if (self.load_balancing == "none") != (self.aux_loss_coeff == 0):
            raise ConfigError("moe.aux_loss_coeff", self.aux_loss_coeff,
                              f"must be > 0 with load_balancing: {self.load_balancing} (and 0 with none)")
        if self.capacity_factor is None and self.pad_to_capacity:
            raise ConfigError("moe.pad_to_capacity", True, "needs moe.capacity_factor; set it or pad_to_capacity: false")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def layer_pattern(self, num_layers: int) -> list[int]:
        """1 (MoE) or 0 (dense) for each of ``num_layers`` layers, as megatron reads ``layer_freq``."""
        if isinstance(self.layer_freq, int):
            return [1 if i % self.layer_freq == 0 else 0 for i in range(num_layers)]
        return list(self.layer_freq)
