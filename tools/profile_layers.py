"""Time each model component (ViT, projector, embedding, one LM layer,
output layer + loss) on this device and write the profile JSON that
``parallel.pipeline_profile`` points the pipeline partitioner at.

    python tools/profile_layers.py --config examples/llava/pp4_vit_heavy.yaml --out profile.json [k=v ...]

On CPU it times one thread (torch.set_num_threads(1), like torchrun's
OMP_NUM_THREADS=1 per process). With parallel.tp > 1 run it under
``torchrun --nproc-per-node <tp>``; parallel.cp does not count (whole
sequences are timed, and the planner divides the language model's times by
cp). The profile records the shape of the
cost model ``model.family`` declares; a family whose cost model has no
profile shape (DiT) exits 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform as host
import sys

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megascale_omni.config import ConfigError, load_job_config, validate_job  # noqa: E402
from megascale_omni.entry import run_cli  # noqa: E402
from megascale_omni.tasks.registry import family_of  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--repeats", type=int, default=7, help="timed forward+backward passes per component (fastest counts)")
    args, rest = p.parse_known_args()
    cfg = load_job_config(rest, description=__doc__)
    family = family_of(cfg)
    # The FLOP model's shape (not a loaded profile's): what this profile will be checked against.
    cost = family.cost_model_fn(cfg)(cfg, False, None)
    profile = family.profiler_fn()
    if profile is None or cost.shape is None:
        raise ConfigError(
            "model.family", cfg.model.family,
            "this family declares no component profiler (tasks/registry.py); plan it with its FLOP cost "
            "model (parallel.pipeline_profile: null)",
        )
    import torch

    from megascale_omni.models.component_profile import single_stage_config
    from megascale_omni.parallel import ParallelDims, destroy_parallel, initialize_parallel
    from megascale_omni.parallel.pipeline_cost import PROFILE_VERSION, VISION, padded_vocab_size
    from megascale_omni.platform import init_distributed, init_platform

    single = single_stage_config(cfg)
    validate_job(single, int(os.environ.get("WORLD_SIZE", single.parallel.tp)))
    platform = init_platform()
    if not platform.is_cuda:
        torch.set_num_threads(1)
    rank, world = init_distributed(platform)
    initialize_parallel(ParallelDims.from_config(single.parallel, world), cfg.train.seed)
    try:
        seconds = profile(cfg, platform.device, padded_vocab_size(cfg), repeats=args.repeats)
    finally:
        destroy_parallel()
    if rank != 0:
        return
    device = torch.cuda.get_device_name() if platform.is_cuda else f"cpu {host.machine()} (1 thread)"
    record = {
        "version": PROFILE_VERSION,
        "device": device,
        "date": datetime.date.today().isoformat(),
        "clock": "cuda-synchronised wall time" if platform.is_cuda else "thread CPU time",
        "shape": dict(cost.shape),
        "seconds": seconds,
        "images_per_micro_batch_timed": max(1, round(cfg.train.micro_batch_size * cfg.vision.images_per_sequence))
        if VISION in cost.components else 0,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    width = max(map(len, seconds))
    print(f"profile of {cfg.model.family} on {device} -> {args.out}")
    for name, value in seconds.items():
        print(f"  {name:<{width}}  {value * 1e3:9.3f} ms")


if __name__ == "__main__":
    run_cli(main)
