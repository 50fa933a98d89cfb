"""DiT (diffusion transformer) on megatron-core building blocks."""
