"""Token data: synthetic arithmetic sequences for the GPT family (every rank).

Used by the layout-equivalence tests and GPU CI smoke runs. The global batch
of step ``s`` is fixed by the sample plan; each DP rank takes a contiguous
slice and cuts it into micro-batches, so every layout trains on exactly the
same samples per step. Micro-batches take the same THD path as packed LLaVA
rows (:mod:`megascale_omni.models.attention`), one sample per row::

    tokens, labels, loss_mask, position_ids   [b, s]
    cu_seqlens                                one segment per row
"""

from __future__ import annotations

from typing import Optional

import torch

from megascale_omni.config import JobConfig
from megascale_omni.data.balance import microbatch_shares
from megascale_omni.data.dataset_root import DefaultDataset
from megascale_omni.data.module import DataModule
from megascale_omni.data.packing import packed_cu_seqlens
from megascale_omni.data.sample_plan import SamplePlan
from megascale_omni.data.synthetic_tokens import ArithmeticTokenDataset
from megascale_omni.parallel import ParallelDims
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.platform import Platform

#: Synthetic dataset size; large enough that a smoke run never repeats an epoch.
NUM_SAMPLES = 65536


class TokensData(DataModule):
    """The GPT family's :class:`~megascale_omni.data.module.DataModule`."""

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims,
                 default_dataset: Optional[DefaultDataset] = None):
        super().__init__(cfg, platform, dims, default_dataset)
        self.seq_length = cfg.model.seq_length
        # The model's rows: padded like an imported checkpoint's (model.padded_vocab_size); the data draws
        # token ids below model.vocab_size only.
        self.vocab_size = cfg.model.padded_vocab_size(cfg.model.vocab_size)
        self.dataset = ArithmeticTokenDataset(NUM_SAMPLES, cfg.model.seq_length, cfg.model.vocab_size,
                                              seed=cfg.train.seed)
        self.plan = SamplePlan(NUM_SAMPLES, cfg.train.global_batch_size, seed=cfg.train.seed)
        # Held-out samples come from a disjoint seed stream.
        self.eval_dataset = ArithmeticTokenDataset(
            cfg.train.global_batch_size * 2, cfg.model.seq_length, cfg.model.vocab_size, seed=cfg.train.seed + 1
        )

    def global_batch_size_of(self, step: int) -> tuple[int, int]:
        return self.cfg.train.global_batch_size, self.cfg.train.global_batch_size * self.seq_length

    def batch_shape(self, step: int) -> BatchShape:
        """Every row is one causal sample of ``seq_length`` tokens."""
        return BatchShape(segments=(self.seq_length,) * self.cfg.train.global_batch_size)

    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict]:
        return self._collate(self.sample_ids(step, dp_rank, dp_size), self.dataset)

    def sample_ids(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """Sample ids of DP rank ``dp_rank``'s share of global batch ``step``:
        a contiguous run of whole micro-batches (see ``microbatch_shares``)."""
        ids = self.plan.global_batch(step)
        shares = microbatch_shares(len(ids), self.cfg.train.micro_batch_size, dp_size)
        start = sum(shares[:dp_rank])
        return list(ids[start : start + shares[dp_rank]])

    def eval_microbatches(self, dp_rank: int, dp_size: int) -> list[dict]:
        """DP rank ``dp_rank``'s equal slice of the held-out samples, as micro-batches."""
        ids = list(range(len(self.eval_dataset)))
        per_rank = len(ids) // dp_size
        return self._collate(ids[dp_rank * per_rank : (dp_rank + 1) * per_rank], self.eval_dataset)

    def _collate(self, mine, dataset) -> list[dict]:
        mbs = self.cfg.train.micro_batch_size
        out = []
        for i in range(0, len(mine), mbs):
            seqs = torch.stack([dataset[j] for j in mine[i : i + mbs]])
            rows = seqs.shape[0]
            out.append(
                {
                    "tokens": seqs[:, :-1].contiguous(),
                    "labels": seqs[:, 1:].contiguous(),
                    "loss_mask": torch.ones(rows, self.seq_length),
                    "position_ids": torch.arange(self.seq_length).expand(rows, -1).contiguous(),
                    # Every row is one sample: one THD segment each.
                    "cu_seqlens": packed_cu_seqlens(torch.zeros(rows, self.seq_length, dtype=torch.int64)),
                }
            )
        return out
