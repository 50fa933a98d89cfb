"""GPT smoke task: a tiny megatron GPT on synthetic arithmetic sequences.

Used by the layout-equivalence tests and GPU CI smoke runs. The global batch
of step ``s`` is fixed by the sample plan; each DP rank takes a contiguous
slice and cuts it into micro-batches, so every layout trains on exactly the
same samples per step. Micro-batches take the same THD path as packed LLaVA
rows (:mod:`megascale_omni.models.attention`), one sample per row.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Sequence

import torch

from megascale_omni.config import JobConfig
from megascale_omni.data.balance import microbatch_shares
from megascale_omni.data.packing import packed_cu_seqlens
from megascale_omni.data.sample_plan import SamplePlan
from megascale_omni.data.synthetic_tokens import ArithmeticTokenDataset
from megascale_omni.models.attention import thd_inputs, thd_pipeline_shape
from megascale_omni.models.gpt import build_gpt_chunks, transformer_config
from megascale_omni.models.loss import masked_token_loss
from megascale_omni.parallel import ParallelDims, data_parallel_rank
from megascale_omni.parallel.batch_shape import BatchShape
from megascale_omni.parallel.schedules import reduce_reported_loss
from megascale_omni.platform import Platform
from megascale_omni.tasks.base import Task

#: Synthetic dataset size; large enough that a smoke run never repeats an epoch.
NUM_SAMPLES = 65536


class GptSmokeTask(Task):
    """The GPT family's :class:`~megascale_omni.tasks.base.Task` (every rank)."""

    def __init__(self, cfg: JobConfig, platform: Platform, dims: ParallelDims):
        super().__init__(cfg, platform, dims)
        self.seq_length = cfg.model.seq_length
        self.dataset = ArithmeticTokenDataset(
            NUM_SAMPLES, cfg.model.seq_length, cfg.model.vocab_size, seed=cfg.train.seed
        )
        self.plan = SamplePlan(NUM_SAMPLES, cfg.train.global_batch_size, seed=cfg.train.seed)
        # Held-out samples come from a disjoint seed stream.
        self.eval_dataset = ArithmeticTokenDataset(
            cfg.train.global_batch_size * 2, cfg.model.seq_length, cfg.model.vocab_size, seed=cfg.train.seed + 1
        )

    def pipeline_shape(self) -> tuple[int, int]:
        return thd_pipeline_shape(self.seq_length, self.cfg.train.micro_batch_size)

    def build_model(self):
        config = transformer_config(self.cfg.model, self.cfg.parallel, self.dtype)
        return build_gpt_chunks(
            self.cfg.model, config, vocab_size=self.cfg.model.vocab_size, max_sequence_length=self.seq_length
        )

    # ------------------------------------------------------------------ data
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

    def _split(self, ids, dataset, dp_rank: int, dp_size: int) -> list[dict]:
        per_rank = len(ids) // dp_size
        return self._collate(ids[dp_rank * per_rank : (dp_rank + 1) * per_rank], dataset)

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

    # ----------------------------------------------------------------- model
    def forward_step(self, data_iterator: Any, model):
        batch = self.cp_local(next(data_iterator))
        tokens, position_ids, labels, packed = thd_inputs(batch, self.dims.cp)
        output = model(tokens, position_ids, None, labels=labels, packed_seq_params=packed)
        return output, partial(masked_token_loss, loss_mask=batch["loss_mask"])

    def evaluate(self, chunks: Sequence[torch.nn.Module], step: int) -> Optional[dict[str, float]]:
        """Held-out token loss (every rank; the value on the loss rank)."""
        ids = list(range(len(self.eval_dataset)))
        mbs = self._split(ids, self.eval_dataset, data_parallel_rank(), self.dims.dp)
        loss, _ = reduce_reported_loss(self.forward_only(chunks, self.forward_step, mbs))
        if loss is None:
            return None
        return {"loss": loss}
