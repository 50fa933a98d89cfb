"""megascale-omni: elastic multimodal LLM training on megatron-core."""

__version__ = "0.1.0"
