"""DiT data: aspect-ratio buckets, image/latent shard reading, the embedded shapes set, VAE latents."""
