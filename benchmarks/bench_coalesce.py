"""Coalescing: many identical requests in flight at once cost one upstream call.

Two variants:
- ``http``: 1,000 concurrent identical chat requests (temperature 0) from a load generator process
  (``carpool.bench.loadgen``) to the real gateway (``carpool.bench.embedded``, a child process)
  in front of the simulated engine (``carpool.bench.upstream``, another one, at no cost), which
  holds every call until every request has joined the flight (the gateway's ``/stats`` shows
  1,000 waiters). Reports upstream calls (must be 1), the ``x-carpool``
  outcomes (1 miss + 999 coalesced), wall time, and the time from the upstream sending its answer
  to the last client having its whole answer.
- ``inprocess``: 10,000 concurrent ``gateway.request(...)`` waiters against the simulated engine in
  process behind a gate (``carpool.bench.gate.Gated``); once all 10,000 have joined, it opens. Reports
  the time to release them all, and the memory they hold (RSS delta; tracemalloc in a separate run,
  since tracing slows everything down).

    .venv/bin/python benchmarks/bench_coalesce.py [--quick]
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import time
import tracemalloc
import uuid
from typing import Any

from carpool.bench import bodies, loadgen, scenario
from carpool.bench.embedded import gateway
from carpool.bench.gate import Gated
from carpool.bench.stats import median
from carpool.bench.upstream import Options, upstream
from carpool.config import Config
from carpool.wiring import build_gateway

HTTP_N = 1000
INPROC_N = 10_000


def _fresh_prompt() -> dict[str, Any]:
    return bodies.chat_body(0, nonce=f" [{uuid.uuid4().hex[:8]}]")


def _medians(runs: list[dict[str, Any]], keys: tuple[str, ...], digits: int) -> dict[str, float]:
    return {f"{k}_median": round(median([r[k] for r in runs]), digits) for k in keys}


def _one_call(run: dict[str, Any], n: int) -> bool:
    """``n`` identical requests cost one upstream call: 1 miss, n - 1 coalesced, one answer."""
    return (
        run["upstream_calls"] == 1
        and run["outcomes"] == {"miss": 1, "coalesced": n - 1}
        and run["distinct_bodies"] == 1
    )


def _head(runs: list[dict[str, Any]], n: int, repeats: int, ok: bool) -> dict[str, Any]:
    calls = [r["upstream_calls"] for r in runs]
    return {
        "n": n,
        "repeats": repeats,
        "ok": ok,
        "upstream_calls": calls,
        "outcomes": runs[-1]["outcomes"],
    }


def run_http(n: int = HTTP_N, repeats: int = 3) -> dict[str, Any]:
    runs = []
    with (
        upstream(Options(hold=True)) as up,
        gateway(Config(upstreams=[up.url], log_level="warning")) as gw,
    ):
        for _ in range(repeats):
            spec = {"gateway_port": gw.port, "upstream_port": up.port, "n": n}
            runs.append(loadgen.run("coalesce", {**spec, "body": _fresh_prompt()}))
    ok = all(_one_call(r, n) and r["statuses"] == {"200": n} and r["all_joined"] for r in runs)
    return {
        **_head(runs, n, repeats, ok),
        **_medians(runs, ("join_s", "wall_s", "release_last_s", "release_first_s"), 6),
        "runs": runs,
    }


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _inprocess_once(n: int, trace: bool) -> dict[str, Any]:
    upstream = Gated()
    upstream.gate = asyncio.Event()
    gw = build_gateway(Config(), upstreams=[upstream])
    raw = bodies.json_bytes(_fresh_prompt())
    headers = {"authorization": "Bearer bench"}
    gc.collect()
    rss0 = _rss()
    if trace:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(gw.request(bodies.CHAT, raw, headers)) for _ in range(n)]
    while gw.flights.waiters < n:
        await asyncio.sleep(0.001)
    t_joined = time.perf_counter()
    held = (tracemalloc.get_traced_memory()[0] - base) if trace else None
    rss_held = _rss() - rss0
    t_open = time.perf_counter()
    upstream.gate.set()
    replies = await asyncio.gather(*tasks)
    t_done = time.perf_counter()
    peak = (tracemalloc.get_traced_memory()[1] - base) if trace else None
    if trace:
        tracemalloc.stop()
    outcomes = collections.Counter(r.outcome.value if r.outcome else "(none)" for r in replies)
    statuses = collections.Counter(r.status for r in replies)
    await gw.aclose()
    result = {
        "n": n,
        "upstream_calls": upstream.calls,
        "outcomes": dict(outcomes),
        "statuses": {str(k): v for k, v in statuses.items()},
        "distinct_bodies": len({r.body for r in replies}),
        "join_s": round(t_joined - t0, 6),
        "release_s": round(t_done - t_open, 6),  # gate opens -> all replied
        "release_per_waiter_us": round((t_done - t_open) / n * 1e6, 3),
        "rss_held_bytes": rss_held,
    }
    if trace:
        result.update(
            traced_held_bytes=held,
            traced_peak_bytes=peak,
            traced_bytes_per_waiter=round(held / n) if held is not None else None,
        )
    return result


def run_inprocess(n: int = INPROC_N, repeats: int = 3) -> dict[str, Any]:
    runs = [scenario.run_async(_inprocess_once(n, trace=False)) for _ in range(repeats)]
    traced = scenario.run_async(_inprocess_once(n, trace=True))
    ok = all(_one_call(r, n) for r in [*runs, traced])
    return {
        **_head(runs, n, repeats, ok),
        **_medians(runs, ("join_s", "release_s"), 6),
        **_medians(runs, ("release_per_waiter_us",), 3),
        "rss_held_bytes_median": int(median([r["rss_held_bytes"] for r in runs])),
        "traced_held_bytes": traced["traced_held_bytes"],
        "traced_peak_bytes": traced["traced_peak_bytes"],
        "traced_bytes_per_waiter": traced["traced_bytes_per_waiter"],
        "runs": runs,
        "traced_run": traced,
    }


def run(quick: bool = False) -> dict[str, Any]:
    return {
        "http": run_http(repeats=1 if quick else 5),
        "inprocess": run_inprocess(repeats=1 if quick else 3),
    }


def summarize(result: dict[str, Any]) -> list[str]:
    h, p = result["http"], result["inprocess"]
    return [
        f"coalesce/http      {h['n']} concurrent: upstream calls {h['upstream_calls']}, "
        f"outcomes {h['outcomes']}, wall {h['wall_s_median'] * 1000:.0f} ms, upstream answer -> "
        f"last client {h['release_last_s_median'] * 1000:.1f} ms  [{'OK' if h['ok'] else 'FAIL'}]",
        f"coalesce/inprocess {p['n']} waiters: upstream calls {p['upstream_calls']}, release all "
        f"{p['release_s_median'] * 1000:.1f} ms ({p['release_per_waiter_us_median']:.1f} us each), "
        f"held {p['traced_held_bytes'] / 2**20:.1f} MiB traced "
        f"({p['traced_bytes_per_waiter']} B/waiter), RSS +{p['rss_held_bytes_median'] / 2**20:.1f}"
        f" MiB  [{'OK' if p['ok'] else 'FAIL'}]",
    ]


if __name__ == "__main__":
    scenario.standalone(__doc__, run, summarize)
