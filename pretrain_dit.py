"""Pretrain a DiT (rectified flow, aspect-ratio buckets) on megatron-core.

    torchrun --nproc-per-node 2 pretrain_dit.py --config examples/dit/tiny_cpu.yaml [k=v ...]
"""

from megascale_omni.config import parse_job_config, run_cli


def main() -> None:
    cfg = parse_job_config(description=__doc__)
    from megascale_omni.tasks.dit import DitTask
    from megascale_omni.training.trainer import run_training

    run_training(cfg, DitTask)


if __name__ == "__main__":
    run_cli(main)
