"""Bad-sample accounting shared by every data pipeline.

A rank counts what it read and skipped (:class:`SkipCounter`); the task
reduces the counts over the job and stops the run with
:class:`~megascale_omni.data.errors.DataQualityError` past
``data.max_bad_sample_fraction`` (:func:`check_bad_fraction`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from megascale_omni.data.errors import DataQualityError

logger = logging.getLogger(__name__)


@dataclass
class SkipCounter:
    """Samples read and skipped by this rank (reduced across ranks by the task)."""

    seen: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    def record_skip(self, err: Exception) -> None:
        self.skipped += 1
        if len(self.reasons) < 20:
            self.reasons.append(str(err))
        logger.warning("skipping bad sample: %s", err)


def check_bad_fraction(bad: int, seen: int, limit: float, where: str) -> None:
    """Raise DataQualityError when ``bad / seen`` exceeds ``limit`` (data.max_bad_sample_fraction)."""
    if seen and bad / seen > limit:
        raise DataQualityError(
            f"{bad} of {seen} samples were bad while {where} ({bad / seen:.1%} > "
            f"data.max_bad_sample_fraction={limit:.1%}); fix or rebuild the shards "
            f"(see the warnings above for which samples) or raise the limit"
        )
