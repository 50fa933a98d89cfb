"""Model builders on megatron-core: GPT (smoke and LLaVA's LM), LLaVA, DiT."""
