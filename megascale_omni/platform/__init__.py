"""Device/backend choice, seeding, and megatron-core CPU compatibility."""

from megascale_omni.platform.device import Platform, init_distributed, init_platform, seed_everything

__all__ = ["Platform", "init_distributed", "init_platform", "seed_everything"]
