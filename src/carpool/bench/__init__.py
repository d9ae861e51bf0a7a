"""``carpool bench``: replay a workload against a gateway and compare its upstream calls with the
oracle, the fewest calls any correct deduplicator could make; and the pieces every benchmark
under ``benchmarks/`` is made of.

One module per concern, each with its contract in its docstring:
- ``workloads``: what a workload is and holds; ``synthetic`` (text from ``catalog``): the
  built-in presets; ``recorded``: the JSONL format;
- ``replay``: a workload sent open or closed loop, with its per-request measurements;
- ``oracle``: the lower bound on upstream calls, computed from the workload alone;
- ``report``: ``report.json`` and ``report.md``; ``plots``: the PNGs (matplotlib, optional);
- ``runner``: one run from end to end (what the CLI calls).
Shared with the benchmarks:
- ``client``: the one HTTP/1.1 client (asyncio + httptools), under ``replay`` and ``loadgen``;
- ``loadgen``: the benchmarks' load generator (coalesce, latency, throughput, open loop);
- ``embedded``: the real gateway app in a child process (the one gateway launcher);
- ``upstream``: the simulated engine as the upstream, in a child process, with controls in front
  (counting, hold and release, per-tenant answers, ``faults``); ``gate``: the same in process;
- ``fixed``: the fixed-bytes reference app; ``bodies``: the benchmarks' request and its answer;
- ``stats``: percentiles and summaries; ``scenario``: machine facts, result documents, the
  command line; ``process``: child processes; ``redis_server``: a Valkey/Redis server.
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
