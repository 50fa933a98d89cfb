"""Aspect-ratio buckets, dynamic batch sizes and the step-indexed DiT plan.

Mixed-resolution DiT training (seed ``llava-dit-kilo-gpu-practice`` §DiT)
pays twice for naive batching: images padded to the largest size waste
compute, and ranks that draw large images make the others wait. This module
removes both:

* **Buckets.** A table of ``[height, width]`` sizes. Each image goes to the
  bucket whose aspect ratio is closest (log scale) among those it covers
  without upsampling, ties to the larger bucket; it is then resized to cover
  the bucket and centre-cropped. An image smaller than every bucket is
  rejected (the caller skips and counts it).
* **Dynamic batch size.** A micro-batch ("package") holds images of one
  bucket only, ``token_budget // tokens(bucket)`` of them: small images come
  in large batches, large ones in small batches, every package close to the
  same token count. Shapes stay static per bucket (one compiled shape per
  bucket on GPU); only the last package of a bucket in an epoch may be
  partly empty, and its empty slots are the only padding.
* **Plan.** Epoch ``e`` visits samples in ``epoch_permutation(n, seed, e)``
  order and closes a package whenever its bucket's is full; global batch
  ``k`` is packages ``[k*G, (k+1)*G)``. Like every plan here it is a pure
  function of (samples, table, seed, step), so the data position saved in a
  checkpoint is just the step.
* **Balance.** :func:`split_packages` divides a global batch's packages
  among DP ranks with :func:`~megascale_omni.data.balance.split_balanced` on
  token counts, so every rank computes the same number of latent tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megascale_omni.data.balance import imbalance, split_balanced, split_contiguous
from megascale_omni.data.sample_plan import epoch_permutation


@dataclass(frozen=True)
class Bucket:
    """One training resolution, in latent pixels."""

    height: int
    width: int

    @property
    def aspect(self) -> float:
        return self.width / self.height

    def grid(self, patch: int) -> tuple[int, int]:
        """Patch grid ``(rows, cols)``."""
        return self.height // patch, self.width // patch

    def tokens(self, patch: int) -> int:
        rows, cols = self.grid(patch)
        return rows * cols


class BucketTable:
    """Bucket sizes plus the per-bucket batch size from a token budget.

    ``buckets`` is validated by the config (each side a multiple of ``patch``,
    every bucket within the budget); this class assumes valid input.
    """

    def __init__(self, buckets: Sequence[Sequence[int]], patch: int, token_budget: int):
        self.buckets = [Bucket(int(h), int(w)) for h, w in buckets]
        self.patch = patch
        self.token_budget = token_budget
        self.tokens = [b.tokens(patch) for b in self.buckets]
        self.batch_sizes = [token_budget // t for t in self.tokens]
        if min(self.batch_sizes) < 1:
            raise ValueError(f"a bucket exceeds the token budget {token_budget}: tokens {self.tokens}")

    def __len__(self) -> int:
        return len(self.buckets)

    def assign(self, height: int, width: int) -> Optional[int]:
        """Bucket index for an image of ``height x width`` latent pixels, or
        None when the image is smaller than every bucket (would need upsampling)."""
        best: Optional[tuple[float, int, int]] = None
        log_aspect = math.log(width / height)
        for k, b in enumerate(self.buckets):
            if b.height > height or b.width > width:
                continue
            key = (round(abs(log_aspect - math.log(b.aspect)), 9), -b.height * b.width, k)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def package_tokens(self, k: int) -> int:
        """Token slots of one (full) package of bucket ``k``."""
        return self.batch_sizes[k] * self.tokens[k]

    def describe(self) -> str:
        return ", ".join(
            f"{b.height}x{b.width}:{t}tok x{n}" for b, t, n in zip(self.buckets, self.tokens, self.batch_sizes)
        )


@dataclass(frozen=True)
class Package:
    """One micro-batch: ``sample_ids`` (plan indices) of one bucket; ``slots``
    is the bucket's batch size (``slots - len(sample_ids)`` are padding)."""

    bucket: int
    sample_ids: tuple[int, ...]
    slots: int
    tokens_per_image: int

    @property
    def real_tokens(self) -> int:
        return len(self.sample_ids) * self.tokens_per_image

    @property
    def computed_tokens(self) -> int:
        return self.slots * self.tokens_per_image


class BucketPlan:
    """Step-indexed packages for DiT (see module docstring).

    Args:
        bucket_ids: bucket index per sample (plan index = position here).
        table: the bucket table.
        packages_per_step: global batch size in packages (all DP ranks).
        seed: non-negative plan seed.
    """

    def __init__(self, bucket_ids: Sequence[int] | np.ndarray, table: BucketTable, packages_per_step: int, seed: int):
        self.bucket_ids = np.asarray(bucket_ids, dtype=np.int64)
        self.table = table
        self.packages_per_step = packages_per_step
        self.seed = seed
        self._epoch_packages = functools.lru_cache(maxsize=2)(self._build_epoch)
        n_packages = len(self.epoch_packages(0))
        if n_packages < packages_per_step:
            raise ValueError(
                f"{len(self.bucket_ids)} samples make {n_packages} packages per epoch, fewer than one "
                f"global batch of {packages_per_step}; lower train.global_batch_size or add data"
            )

    @property
    def steps_per_epoch(self) -> int:
        # Package count is the same every epoch: it depends only on per-bucket counts.
        return len(self.epoch_packages(0)) // self.packages_per_step

    def _build_epoch(self, epoch: int) -> tuple[Package, ...]:
        order = epoch_permutation(len(self.bucket_ids), self.seed, epoch)
        open_: dict[int, list[int]] = {}
        packages: list[Package] = []
        for sid in order.tolist():
            k = int(self.bucket_ids[sid])
            members = open_.setdefault(k, [])
            members.append(sid)
            if len(members) == self.table.batch_sizes[k]:
                packages.append(self._package(k, members))
                open_[k] = []
        # Partly filled tails, in bucket order (deterministic).
        packages.extend(self._package(k, m) for k, m in sorted(open_.items()) if m)
        return tuple(packages)

    def _package(self, k: int, members: list[int]) -> Package:
        return Package(k, tuple(members), self.table.batch_sizes[k], self.table.tokens[k])

    def epoch_packages(self, epoch: int) -> tuple[Package, ...]:
        return self._epoch_packages(epoch)

    def global_batch(self, step: int) -> list[Package]:
        """Packages of global step ``step`` (pure function of the plan and step).
        Trailing packages that do not fill a global batch are skipped this
        epoch; the next permutation puts those samples elsewhere."""
        epoch, k = divmod(step, self.steps_per_epoch)
        g = self.packages_per_step
        return list(self.epoch_packages(epoch)[k * g : (k + 1) * g])


def split_packages(packages: Sequence[Package], dp_size: int) -> list[list[int]]:
    """Indices of ``packages`` per DP rank, equal counts, balanced on computed tokens."""
    return split_balanced(list(range(len(packages))), [p.computed_tokens for p in packages], dp_size)


def naive_rank_tokens(plan: BucketPlan, step: int, dp_size: int) -> list[int]:
    """Baseline: the same images split by *count* (a DistributedSampler-style
    contiguous share of the step's images in epoch order), each rank then
    batching its share by bucket. Returns latent tokens per rank."""
    epoch = step // plan.steps_per_epoch
    position = np.argsort(epoch_permutation(len(plan.bucket_ids), plan.seed, epoch))
    images = sorted((sid for p in plan.global_batch(step) for sid in p.sample_ids), key=lambda s: position[s])
    tokens = [plan.table.tokens[int(plan.bucket_ids[s])] for s in images]
    return [sum(tokens[i] for i in part) for part in split_contiguous(list(range(len(images))), dp_size)]


@dataclass(frozen=True)
class BucketReport:
    """Padding waste and DP token imbalance of a plan, over its first ``steps`` steps."""

    steps: int
    dp_size: int
    bucket_padding_waste: float
    pad_to_largest_waste: float
    balanced_imbalance_max: float
    balanced_imbalance_mean: float
    naive_imbalance_max: float
    naive_imbalance_mean: float

    def table(self) -> str:
        rows = [
            ("", "bucketed + balanced", "naive"),
            ("padding waste", f"{self.bucket_padding_waste:.2%}", f"{self.pad_to_largest_waste:.2%} (pad to largest)"),
            (
                f"rank token imbalance (max/mean, dp={self.dp_size})",
                f"max {self.balanced_imbalance_max:.3f}  mean {self.balanced_imbalance_mean:.3f}",
                f"max {self.naive_imbalance_max:.3f}  mean {self.naive_imbalance_mean:.3f} (equal image count)",
            ),
        ]
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)) for r in rows)


def bucket_report(plan: BucketPlan, dp_size: int, steps: Optional[int] = None) -> BucketReport:
    """Measure the plan over ``steps`` steps (default one epoch).

    * bucketed waste: empty slots / computed token slots over the epoch's packages;
    * pad-to-largest waste: ``1 - real tokens / (images * largest bucket tokens)``
      for the same images batched at one fixed (largest) size;
    * imbalance: per step, max/mean of latent tokens over DP ranks, for
      :func:`split_packages` and for :func:`naive_rank_tokens`.
    """
    steps = steps or plan.steps_per_epoch
    packages = plan.epoch_packages(0)
    computed = sum(p.computed_tokens for p in packages)
    real = sum(p.real_tokens for p in packages)
    images = sum(len(p.sample_ids) for p in packages)
    largest = max(plan.table.tokens)
    balanced, naive = [], []
    for step in range(steps):
        batch = plan.global_batch(step)
        tokens = [p.computed_tokens for p in batch]
        balanced.append(imbalance([sum(tokens[i] for i in part) for part in split_packages(batch, dp_size)]))
        naive.append(imbalance(naive_rank_tokens(plan, step, dp_size)))
    return BucketReport(
        steps=steps,
        dp_size=dp_size,
        bucket_padding_waste=1.0 - real / computed,
        pad_to_largest_waste=1.0 - real / (images * largest),
        balanced_imbalance_max=max(balanced),
        balanced_imbalance_mean=float(np.mean(balanced)),
        naive_imbalance_max=max(naive),
        naive_imbalance_mean=float(np.mean(naive)),
    )
