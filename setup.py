"""megascale-omni: elastic multimodal LLM training on megatron-core."""

from setuptools import find_packages, setup

# Exact pins: megatron-core 0.16.1 is the last release for Python 3.11 and our
# CPU compatibility layer patches named call sites of exactly that version.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "torchft==0.2.0",
    "numpy==2.4.6",
    "PyYAML==6.0.4",
    "webdataset==1.0.2",
    "tokenizers==0.23.3",
    "pillow==13.0.0",
    "tensorboard==2.21.0",
    "tqdm==4.70.1",
    "psutil==7.2.2",
    "prometheus-client==0.26.0",
]

# Offline DiT latent tools only (tools/make_dit_latents.py, tools/sample_dit.py --vae);
# training and the CPU demo never import them. The test extra includes them so
# CI exercises the latent tool end to end.
LATENTS = ["diffusers==0.42.1", "transformers==5.23.0"]
# tools/report.py and omni-sched simulate --out only (PNG plots); training never imports it.
REPORT = ["matplotlib==3.11.2"]
EXTRAS = {
    "test": ["pytest==9.2.0", "pytest-timeout==2.4.0", *LATENTS, *REPORT],
    "latents": LATENTS,
    "report": REPORT,
    # CUDA hosts only; never imported by a CPU run (model.layer_impl: auto picks TE when installed).
    # transformer-engine: megatron-core 0.16.1 declares >=2.9,<2.12; flash-attn 2.8.3 is the newest
    # flash-attn 2 that TE 2.11 accepts (its max_version). Both build against the local CUDA torch.
    # NVIDIA apex is not on the package index and not needed (TE provides the fused kernels);
    # README "GPU" shows its source build.
    "gpu": ["transformer-engine[pytorch]==2.11.0", "flash-attn==2.8.3"],
}

setup(
    name="megascale-omni",
    version="0.1.0",
    description="Elastic multimodal LLM training (LLaVA, DiT) on megatron-core",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["megascale_omni", "megascale_omni.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "omni-smoke=megascale_omni.smoke:cli",
            "omni-ctl=megascale_omni.control.cli:cli",
            "omni-run=megascale_omni.launch:main",
            "omni-sched=megascale_omni.scheduler.cli:cli",
        ]
    },
)
