"""The project's one percentile, at the bottom layer so every package can use it.

:func:`percentile` interpolates linearly between order statistics (numpy's default): the latency
percentiles of ``batch-bench``, ``refusion loadtest`` and the serving benchmark, and the token-length
percentiles of ``python -m refusion.tasks``. :mod:`refusion.experiments.stats` re-exports it beside the
paired statistics.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolating linearly between order statistics (the
    sorted values' position ``q / 100 * (n - 1)``: p50 of an even count is the mean of the middle two);
    raises ValueError when ``values`` is empty or ``q`` is outside 0-100."""
    if not len(values):
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in 0-100, got {q}")
    return float(np.percentile(np.asarray(values, dtype=float), q))
