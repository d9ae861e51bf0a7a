"""``carpool bench``: replay a workload against a gateway and compare its upstream calls with the
oracle, the fewest calls any correct deduplicator could make.

One module per concern, each with its contract in its docstring:
- ``workloads``: what a workload is and holds; ``synthetic`` (text from ``catalog``): the
  built-in presets; ``recorded``: the JSONL format;
- ``replay``: the HTTP load generator (open or closed loop) and its per-request measurements;
- ``embedded``: the real gateway app in a child process, in front of the simulated engine;
- ``oracle``: the lower bound on upstream calls, computed from the workload alone;
- ``report``: ``report.json`` and ``report.md``; ``plots``: the PNGs (matplotlib, optional);
- ``runner``: one run from end to end (what the CLI calls).
"""

from typing import Any

from .recorded import load_jsonl
from .synthetic import PRESETS, synthetic
from .workloads import BenchRequest, Workload, WorkloadError


def __getattr__(name: str) -> Any:
    # Lazy, so that ``python -m carpool.bench.embedded`` (the embedded gateway's child process)
    # does not import its own module through the runner first.
    if name in ("BenchOptions", "run_bench"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(name)


__all__ = [
    "PRESETS",
    "BenchOptions",
    "BenchRequest",
    "Workload",
    "WorkloadError",
    "load_jsonl",
    "run_bench",
    "synthetic",
]
