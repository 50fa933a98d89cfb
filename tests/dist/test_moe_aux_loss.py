"""The router's load-balancing and z-losses reach the gradients with the
objective docs/moe.md states, checked against a hand-written loss.

One gloo rank builds the tiny MoE GPT twice from the same init and runs
megatron's schedule (our forward step, megatron DDP and its
``finalize_model_grads``) over two micro-batches whose loss masks drop some
tokens, so the job's loss-token count differs from the tokens routed:

- megatron: ``moe.aux_loss_coeff`` and ``moe.z_loss_coeff`` on, attached by
  megatron's router through ``MoEAuxLossAutoScaler``;
- by hand: both off in megatron; instead the loss function adds, per
  micro-batch and MoE layer, ``n * aux`` and ``n * z`` computed here from the
  router's own logits with the Switch-Transformer formula
  ``aux = coeff * E / (k * n^2) * sum_e (sum_t p_te) * count_e`` and the
  ST-MoE ``z = coeff * mean_t logsumexp(logits_t)^2`` (``n``: tokens of the
  micro-batch), before the division by the job's loss tokens.

Every gradient must agree within 1e-6 of its tensor's largest entry; a
third run without the router losses must not (they change the gradients).
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest

from tests.launcher import run_spawned_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

CONFIG = "examples/gpt/tiny_moe.yaml"
AUX, Z = 0.5, 0.05


def _worker(rank: int, port: int, out_dir: str) -> None:
    try:
        result = _compare(port)
    except Exception:  # reported to the test, which fails with it
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _compare(port: int) -> dict:
    import dataclasses
    from functools import partial

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from megascale_omni.config import JobConfig, apply_overrides, from_dict, load_yaml
    from megascale_omni.models.attention import thd_inputs
    from megascale_omni.models.gpt import build_gpt_chunks, transformer_config
    from megascale_omni.models.init import init_layout_invariant
    from megascale_omni.models.loss import masked_token_loss
    from megascale_omni.models.moe import group_expert_params
    from megascale_omni.parallel.schedules import run_forward_backward
    from megascale_omni.parallel.state import ParallelDims, initialize_parallel
    from megascale_omni.platform import init_platform
    from megascale_omni.training.optimizer import wrap_ddp

    init_platform("cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    cfg = from_dict(JobConfig, apply_overrides(load_yaml(CONFIG), [f"moe.aux_loss_coeff={AUX}",
                                                                    f"moe.z_loss_coeff={Z}"]))
    initialize_parallel(ParallelDims.from_config(cfg.parallel, 1), seed=0)
    m = cfg.model
    gen = torch.Generator().manual_seed(5)
    microbatches = []
    for _ in range(2):
        rows, s = 2, m.seq_length
        loss_mask = torch.ones(rows, s)
        loss_mask[:, :7] = 0  # prompt-like tokens without loss: routed, but not loss tokens
        microbatches.append({
            "tokens": torch.randint(0, m.vocab_size, (rows, s), generator=gen),
            "labels": torch.randint(0, m.vocab_size, (rows, s), generator=gen),
            "position_ids": torch.arange(s).repeat(rows, 1),
            "loss_mask": loss_mask,
            "cu_seqlens": torch.tensor([0, 20, s, 2 * s]),
        })

    def gradients(moe, by_hand: bool) -> dict[str, torch.Tensor]:
        config = transformer_config(m, cfg.parallel, torch.float32, moe)
        chunks = build_gpt_chunks(m, config, vocab_size=m.padded_vocab_size(m.vocab_size),
                                  max_sequence_length=m.seq_length)
        init_layout_invariant(chunks, cfg.train.seed, m.init_method_std, m.num_layers)
        group_expert_params(chunks)
        captured: list[torch.Tensor] = []
        for module in chunks[0].modules():
            if type(module).__name__ == "TopKRouter":
                module.register_forward_hook(lambda r, inputs, out: captured.append(
                    F.linear(inputs[0].reshape(-1, inputs[0].shape[-1]).float(), r.weight.float())))
        (ddp,) = wrap_ddp(chunks, config, cfg.parallel)

        def router_losses() -> torch.Tensor:
            total = torch.zeros(())
            for logits in captured:  # [n, E] of one MoE layer
                n, experts, k = logits.shape[0], logits.shape[1], cfg.moe.topk
                probs = torch.softmax(logits, dim=-1)
                counts = torch.zeros(experts).index_add_(
                    0, probs.topk(k, dim=-1).indices.flatten(), torch.ones(n * k))
                aux = AUX * experts / (k * n * n) * (probs.sum(0) * counts).sum()
                z = Z * torch.logsumexp(logits, dim=-1).square().mean()
                total = total + n * (aux + z)  # megatron's per-token-loss convention: times the routed tokens
            captured.clear()
            return total

        def loss_func(output, loss_mask):
            loss_sum, count, report = masked_token_loss(output, loss_mask)
            if by_hand:
                loss_sum = loss_sum + router_losses()
            captured.clear()
            return loss_sum, count, report

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            tokens, position_ids, labels, packed = thd_inputs(batch)
            output = model(tokens, position_ids, None, labels=labels, packed_seq_params=packed)
            return output, partial(loss_func, loss_mask=batch["loss_mask"])

        ddp.zero_grad_buffer()
        run_forward_backward([ddp], forward_step, microbatches, 2 * m.seq_length, 1)
        return {name: p.main_grad.detach().clone() for name, p in ddp.module.named_parameters()}

    off = dataclasses.replace(cfg.moe, load_balancing="none", aux_loss_coeff=0.0, z_loss_coeff=0.0)
    megatron = gradients(cfg.moe, by_hand=False)
    hand = gradients(off, by_hand=True)
    none = gradients(off, by_hand=False)

    def worst(a: dict, b: dict) -> float:
        return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)) for k in a)

    router = [k for k in megatron if "router" in k]
    return {"vs_hand": worst(megatron, hand), "vs_none": worst(megatron, none), "routers": len(router),
            "keys_equal": sorted(megatron) == sorted(hand)}


def test_router_losses_reach_the_gradients_as_documented(tmp_path):
    (result,) = run_spawned_ranks(_worker, 1, tmp_path, timeout=240)
    print(f"\nrouter losses: megatron vs by hand {result['vs_hand']:.1e}, vs without them {result['vs_none']:.1e}")
    assert result["keys_equal"] and result["routers"] == 4
    assert result["vs_hand"] <= 1e-6, result
    assert result["vs_none"] >= 1e-3, result
