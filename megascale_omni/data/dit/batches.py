"""DiT packages -> training micro-batches (every rank).

A package (one bucket, ``slots`` images) becomes one micro-batch::

    x_t, target   [slots, C, H, W]   noised input and velocity target (flow.py)
    t             [slots]            flow time
    text          [slots, L] int64   caption token ids (learned text encoder), or
                  [slots, L, D]      precomputed text-encoder states
    text_mask     [slots, L] bool    True at real caption tokens (position 0 always)
    loss_mask     [slots, N] float   1 for the tokens of real images, 0 for empty slots

Noise, time and caption dropout of a sample are drawn from a generator
seeded by ``(seed, epoch, sample id)``: every rank of a replica (and any
parallel layout) builds bit-identical micro-batches, and a retried step
draws the same noise. Bad samples (corrupt image or array, missing
caption) leave their slot empty - skipped, counted and logged.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from megascale_omni.config import DitConfig
from megascale_omni.data.dit.buckets import BucketTable, Package
from megascale_omni.data.dit.flow_pairs import flow_pair, sample_timesteps
from megascale_omni.data.dit.reader import DitSampleReader
from megascale_omni.data.health import SkipCounter
from megascale_omni.data.shards import BadSampleError
from megascale_omni.data.tokenizer import TextTokenizer


def sample_generator(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    """The generator that draws sample ``sample_id``'s noise in ``epoch``."""
    digest = hashlib.sha256(f"dit:{seed}:{epoch}:{sample_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class CaptionEncoder:
    """Caption -> model text input of fixed length ``L`` (learned or precomputed)."""

    def __init__(self, dit: DitConfig, tokenizer: Optional[TextTokenizer]):
        self.length = dit.max_text_length
        self.learned = dit.text_encoder == "learned"
        self.text_dim = dit.text_dim
        self.tok = tokenizer

    def encode(self, caption: str, states: Optional[torch.Tensor], drop: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(text, mask)`` for one sample; ``drop`` gives the empty caption."""
        mask = torch.zeros(self.length, dtype=torch.bool)
        if self.learned:
            ids = [self.tok.bos_id] + ([] if drop else self.tok.encode(caption))
            ids = ids[: self.length]
            text = torch.full((self.length,), self.tok.pad_id, dtype=torch.long)
            text[: len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[: len(ids)] = True
            return text, mask
        text = torch.zeros(self.length, self.text_dim)
        if drop or states is None:
            mask[0] = True  # the empty caption: one zero state, attended to
            return text, mask
        n = min(self.length, states.shape[0])
        if states.shape[-1] != self.text_dim:
            raise ValueError(f"text states have width {states.shape[-1]}, dit.text_dim is {self.text_dim}")
        text[:n] = states[:n]
        mask[:n] = True
        return text, mask

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode("", None, drop=True)


class DitBatcher:
    """Reads and collates packages into micro-batches (every rank)."""

    def __init__(
        self, reader: DitSampleReader, table: BucketTable, dit: DitConfig, captions: CaptionEncoder, seed: int,
        counter: Optional[SkipCounter] = None,
    ):
        self.reader = reader
        self.table = table
        self.dit = dit
        self.captions = captions
        self.seed = seed
        #: Where skipped samples are counted (shared with the task's job-wide account).
        self.counter = counter if counter is not None else SkipCounter()

    def microbatch(self, package: Package, id_map: Sequence[int], epoch: int) -> dict[str, torch.Tensor]:
        """Collate ``package``; ``id_map`` maps plan indices to reader indices."""
        bucket = self.table.buckets[package.bucket]
        c, slots = self.dit.in_channels, package.slots
        x0 = torch.zeros(slots, c, bucket.height, bucket.width)
        noise = torch.zeros_like(x0)
        t = torch.full((slots,), 0.5)
        empty_text, empty_mask = self.captions.empty()
        text = empty_text.unsqueeze(0).repeat(slots, *([1] * empty_text.dim())).clone()
        text_mask = empty_mask.unsqueeze(0).repeat(slots, 1).clone()
        real = torch.zeros(slots)
        for slot, pid in enumerate(package.sample_ids):
            rid = int(id_map[pid])
            try:
                sample = self.reader.load(rid, bucket, need_text_states=not self.captions.learned)
                if sample.data.shape[0] != c:
                    raise BadSampleError(rid, self.reader.root, f"{sample.data.shape[0]} channels, dit.in_channels={c}")
                if sample.text_states is not None and sample.text_states.shape[-1] != self.captions.text_dim:
                    raise BadSampleError(rid, self.reader.root, f"text states of width {sample.text_states.shape[-1]}, "
                                         f"dit.text_dim={self.captions.text_dim}")
            except BadSampleError as err:
                self.counter.record_skip(err)
                continue
            self.counter.seen += 1
            gen = sample_generator(self.seed, epoch, rid)
            noise[slot] = torch.randn(x0.shape[1:], generator=gen)
            t[slot] = sample_timesteps(1, gen, self.dit.timestep_sampling, self.dit.logit_mean, self.dit.logit_std)[0]
            drop = bool(torch.rand(1, generator=gen)[0] < self.dit.caption_dropout)
            text[slot], text_mask[slot] = self.captions.encode(sample.caption, sample.text_states, drop)
            x0[slot] = sample.data
            real[slot] = 1.0
        x_t, target = flow_pair(x0, noise, t)
        tokens = bucket.tokens(self.table.patch)
        return {
            "x_t": x_t,
            "target": target,
            "t": t,
            "text": text,
            "text_mask": text_mask,
            "loss_mask": real[:, None].expand(slots, tokens).contiguous(),
        }

