"""Deterministic synthetic token sequences for the GPT smoke job.

Sample ``i`` is an arithmetic progression modulo the vocabulary,
``(start + stride * k) % vocab``, with ``start`` and ``stride`` drawn from a
generator seeded by ``(seed, i)``. The next token is predictable from the
previous two, so a tiny GPT's loss falls quickly: a real learning signal with
no files on disk.
"""

from __future__ import annotations

import numpy as np
import torch


class ArithmeticTokenDataset:
    """Random-access dataset of ``[seq_length + 1]`` int64 token sequences."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, max_stride: int = 3):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.max_stride = max(1, min(max_stride, vocab_size - 1))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, index])
        start = int(rng.integers(0, self.vocab_size))
        stride = int(rng.integers(1, self.max_stride + 1))
        seq = (start + stride * np.arange(self.seq_length + 1)) % self.vocab_size
        return torch.from_numpy(seq.astype(np.int64))
