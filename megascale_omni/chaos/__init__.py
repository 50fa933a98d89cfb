"""Chaos harness: an elastic job under a seeded stream of faults, and the
proofs that nothing was lost (docs/operations.md, tools/chaos.py)."""
