"""megascale-omni: elastic multimodal LLM training on megatron-core."""

from megascale_omni import megatron_jit as _megatron_jit

__version__ = "0.1.0"

# Before any of our modules imports megatron: its jit decorators stop importing torch._inductor (megatron_jit.py).
_megatron_jit.install()
