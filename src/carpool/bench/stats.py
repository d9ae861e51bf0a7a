"""Statistics shared by the benchmarks and ``carpool bench``: one percentile, one summary.

Contract:
- ``percentile(values, q)``: the q-th percentile (0..100) with linear interpolation between the
  closest ranks (NumPy's default, "type 7"); NaN for no values.
- ``median(values)``: the 50th percentile (``statistics.median``).
- ``summary_ms(seconds)``: durations given in seconds, summarised in milliseconds rounded to
  0.1 µs: ``n``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``mean_ms``, ``max_ms``; ``{}`` for none.
  (``carpool bench``'s report has its own shape, ``report.summary_ms``, on the same percentile.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    data = sorted(values)
    if not data:
        return math.nan
    k = (len(data) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    if not seconds:
        return {}
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 4),
        "p90_ms": round(percentile(ms, 90), 4),
        "p99_ms": round(percentile(ms, 99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "max_ms": round(max(ms), 4),
    }
