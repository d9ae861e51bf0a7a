"""Statistics shared by the benchmarks and ``carpool bench``: one percentile, one summary.

Contract:
- ``percentile(values, q)``: the q-th percentile (0..100) with linear interpolation between the
  closest ranks (NumPy's default, "type 7"); NaN for no values.
- ``median(values)``: the 50th percentile (``statistics.median``).
- ``summary_ms(seconds)``: durations given in seconds, summarised in milliseconds rounded to
  0.1 µs: ``n``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``mean_ms``, ``max_ms``; ``{}`` for none.
  Its arguments name other percentiles, roundings and keys (``carpool bench``'s report:
  ``count``, ``p50``, ``p95``, ``p99``, ``mean``, ``max`` to the µs).
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


def summary_ms(
    seconds: Sequence[float],
    quantiles: Sequence[int] = (50, 90, 99),
    *,
    digits: int = 4,
    count: str = "n",
    suffix: str = "_ms",
) -> dict[str, float]:
    if not seconds:
        return {}
    ms = [s * 1000 for s in seconds]
    out: dict[str, float] = {count: len(ms)}
    out.update({f"p{q}{suffix}": round(percentile(ms, q), digits) for q in quantiles})
    out[f"mean{suffix}"] = round(statistics.fmean(ms), digits)
    out[f"max{suffix}"] = round(max(ms), digits)
    return out
