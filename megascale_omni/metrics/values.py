"""Which step-record values count as one number: shared by every exporter
(Prometheus, the metrics exchange to the control socket) so they agree on the
field set."""

from __future__ import annotations

import numbers
from typing import Any, Optional, Union

Scalar = Union[bool, int, float]


def scalar_value(value: Any) -> Optional[Scalar]:
    """``value`` as a plain bool, int or float, or None when it is not one
    number (None, strings, lists such as ``stragglers``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None
