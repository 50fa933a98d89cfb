"""Pretrain a DiT (rectified flow, aspect-ratio buckets) on megatron-core.

    torchrun --nproc-per-node 2 pretrain_dit.py --config examples/dit/tiny_cpu.yaml [k=v ...]
"""

from megascale_omni.entry import run_cli, train_family

if __name__ == "__main__":
    run_cli(lambda: train_family("dit", __doc__))
