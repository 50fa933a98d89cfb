"""Pretrain a LLaVA model (ViT + projector + GPT) on megatron-core.

    torchrun --nproc-per-node 2 pretrain_llava.py --config examples/llava/tiny_cpu.yaml [k=v ...]
"""

from megascale_omni.entry import run_cli, train_family

if __name__ == "__main__":
    run_cli(lambda: train_family("llava", __doc__))
