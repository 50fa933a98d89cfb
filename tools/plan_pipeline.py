"""Print the pipeline partition of a config: uniform beside auto (and the
configured explicit split, if any), per pp rank: layers, predicted time per
micro-batch and memory, with the imbalance (slowest rank / mean); then the
configured split's memory per GPU in parts (weights, gradients, optimizer
state, activations; docs/memory.md). Under context parallelism
(parallel.cp) times and memory are one CP rank's.

    python tools/plan_pipeline.py --config examples/llava/pp4_vit_heavy.yaml [section.field=value ...]
        [--world-size N] [--device cpu|cuda]

The cost model is the one ``model.family`` declares
(``megascale_omni.tasks.registry``). Exits 2 with one line when the
configured split cannot run (too few layers, memory, a feature the family
lacks), like the training entry points do before they start.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megascale_omni.config import ConfigError, load_job_config  # noqa: E402
from megascale_omni.entry import run_cli  # noqa: E402
from megascale_omni.tasks.registry import family_of  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    p.add_argument("--world-size", type=int, default=None, help="processes of the job (default: tp*pp*cp, DP=1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="what train.precision: auto means")
    args, rest = p.parse_known_args()
    from megascale_omni.parallel.memory import estimate_memory_per_gpu, format_memory_table
    from megascale_omni.parallel.pipeline_plan import format_plan_table, plan_for, plan_pipeline

    if args.world_size is not None and args.world_size < 1:
        raise ConfigError("--world-size", args.world_size, "must be >= 1 (processes of the job)")
    cfg = load_job_config(rest, description=__doc__)
    world = args.world_size or cfg.parallel.model_parallel_size
    family = family_of(cfg)
    # The plan needs the model and layout, not this host's data or directories.
    family.validate(cfg, world, host_inputs=False)
    cost_model = family.cost_model_fn(cfg)
    if args.device is None:
        import torch

        cuda = torch.cuda.is_available()
    else:
        cuda = args.device == "cuda"
    configured = plan_pipeline(cfg, cost_model, cuda=cuda, world_size=world)
    plans = []
    if cfg.model.num_layers % (cfg.parallel.pp * configured.vpp) == 0:
        plans.append(plan_for(cfg, "uniform", cost_model, cuda, world))
    plans.append(plan_for(cfg, "auto", cost_model, cuda, world) if configured.mode != "auto" else configured)
    if configured.mode == "explicit":
        plans.append(configured)
    par = cfg.parallel
    vpp = f" vpp={par.vpp}" if par.vpp else ""
    dp = max(world // par.model_parallel_size, 1)
    print(f"pp={par.pp}{vpp} tp={par.tp} cp={par.cp} dp={dp} world={world}; times per micro-batch from the "
          f"{configured.source}; configured: {par.pipeline_partition}")
    if par.cp > 1:
        print(f"context parallel: each rank holds {cfg.model.seq_length // par.cp} of {cfg.model.seq_length} "
              "tokens per sequence (LM time and activations 1/cp); the first stage's ViT runs on all images")
    flops_model = cost_model(cfg, cuda, world)
    if flops_model.inputs:
        print(f"planned for: {flops_model.inputs}")
    layer = flops_model.components[flops_model.layer]
    if layer.dispatch_bytes:
        counted = ("in the times above" if configured.unit == "s" else
                   "not in the times above (FLOPs): set logging.peak_tflops or parallel.pipeline_profile")
        print(f"MoE token dispatch ({cfg.moe.token_dispatcher}, ep={par.ep}): {layer.dispatch_bytes / 2**20:.2f} MiB "
              f"sent per rank, layer and micro-batch (forward + backward, even routing), "
              f"{layer.dispatch_seconds * 1e3:.3f} ms at parallel.alltoall_bandwidth_gbs="
              f"{par.alltoall_bandwidth_gbs:g}; {counted}")
    print(format_plan_table(plans))
    for plan in plans:
        print(f"{plan.mode:>9}: layers per chunk {list(plan.counts)}  max/mean {plan.imbalance:.3f}")
    print(f"memory per GPU of the configured split (model.recompute={cfg.model.recompute}, "
          f"sequence_parallel={par.sequence_parallel}, use_distributed_optimizer={par.use_distributed_optimizer}):")
    print(format_memory_table(estimate_memory_per_gpu(cfg, cost_model, cuda=cuda, world_size=world)))


if __name__ == "__main__":
    run_cli(main)
