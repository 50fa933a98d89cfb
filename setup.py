"""megascale-omni: elastic multimodal LLM training on megatron-core.

Ranges, not pins: the package goes into environments that already have their
own torch (a GPU image's CUDA build) and must not replace it. The exact
versions this project's CPU environment is built and tested with are in
constraints.txt (``make install`` uses it); tools/gpu_ci/prepare_wheels.sh
takes the same versions for a GPU host.

Bounds: a lower bound is the release line we run; an upper bound is the next
release line that may break us. megatron-core and torchft are held to one
minor release because platform/cpu_compat.py and elastic/adapter.py patch
or wrap named internals of exactly those lines.
"""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    # 2.11: the GPU image's CUDA build (NGC-style 2.11.0a0+nv... included, hence the a0);
    # 2.13: this project's CPU environment. megatron-core needs >=2.6, torchft >=2.7.
    "torch>=2.11.0a0,<2.14",
    "megatron-core>=0.16.1,<0.17",
    "torchft>=0.2.0,<0.3",
    "numpy>=2.0,<3",
    "PyYAML>=6.0,<7",
    "webdataset>=1.0,<2",
    "tokenizers>=0.23,<0.24",
    "pillow>=10.0,<14",
    # torch.utils.tensorboard (metrics/writers.py, logging.tensorboard); without it the job logs JSONL only.
    "tensorboard>=2.14,<3",
    "tqdm>=4.60,<5",
    "psutil>=5.9,<8",
    "prometheus-client>=0.17,<1",
]

# Optional features; their imports are lazy and name the extra to install.
# hf/ import and export of Hugging Face checkpoints (transformers reads their configs' defaults)
HF = ["safetensors>=0.4,<1", "transformers>=5.0,<6"]
CHAT = ["transformers>=5.0,<6"]  # data.format=chat (chat templates), HF tokenizer directories
# Offline DiT latent tools only (tools/make_dit_latents.py, tools/sample_dit.py --vae).
LATENTS = ["diffusers>=0.42,<1", "transformers>=5.0,<6"]
# tools/report.py and omni-sched simulate --out only (PNG plots).
REPORT = ["matplotlib>=3.8,<4"]
# parallel.cp_comm_type=a2a+p2p only: megatron-core builds hierarchical CP groups with einops
# (transformer-engine depends on it too, so GPU hosts with TE have it).
CP = ["einops>=0.8,<1"]
# Video samples at ingest (tools/ingest_llava.py: clip decoding, data/video.py) and the clip tests/benchmark.
VIDEO = ["av>=14,<19"]
EXTRAS = {
    "hf": HF,
    "chat": CHAT,
    "latents": LATENTS,
    "report": REPORT,
    "cp": CP,
    "video": VIDEO,
    # The test extra includes every optional feature so CI exercises them end to end.
    "test": ["pytest>=8.3,<10", "pytest-timeout>=2.3,<3", *HF, *LATENTS, *REPORT, *CP, *VIDEO],
    # CUDA hosts only; never imported by a CPU run (model.layer_impl: auto picks TE when installed).
    # transformer-engine: megatron-core 0.16.1 declares >=2.9,<2.12; flash-attn 2.8.x is the newest
    # flash-attn 2 that TE 2.11 accepts (its max_version 2.8.3). Both build against the local CUDA torch.
    # NVIDIA apex is not on the package index and not needed (TE provides the fused kernels);
    # docs/gpu.md shows its source build.
    # nvidia-ml-py (import name pynvml): NVML's ECC and XID counters for the pre-flight checks (docs/preflight.md).
    "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "flash-attn>=2.8,<2.9", "nvidia-ml-py>=12,<14"],
}

setup(
    name="megascale-omni",
    version="0.1.0",
    description="Elastic multimodal LLM training (LLaVA, DiT) on megatron-core",
    # 3.10: megatron-core 0.16.1's floor; 3.12: the GPU image. No 3.11-only syntax or stdlib is used
    # (tests/unit/test_packaging.py checks the stdlib names).
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["megascale_omni", "megascale_omni.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "omni-smoke=megascale_omni.smoke:cli",
            "omni-ctl=megascale_omni.control.cli:cli",
            "omni-run=megascale_omni.launch:main",
            "omni-sched=megascale_omni.scheduler.cli:cli",
            "omni-preflight=megascale_omni.preflight.cli:cli",
        ]
    },
)
