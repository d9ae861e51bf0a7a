"""Fixed coalescing windows vs the adaptive one, on a bursty Zipf workload.

What it measures, for each window policy, on the same arrival traces:
- shared: the share of requests that did not reach upstream (joined a running call, or a finished
  answer lingering in the window). No exact cache here: this is the window's own effect, as for
  `factual` (ttl 0) requests, which are never stored.
- mean_age_ms: the mean age of the answers those shared requests received (0 for those that joined a
  running call; the time since it finished for those served from the window); p95_age_ms:
  their 95th percentile (``carpool.bench.stats.percentile``, as every benchmark's).

How: a discrete-event replay of the trace through the *production* policy classes of
`carpool.window` (the same `arrival`/`window` calls `FlightGroup` makes), with upstream call times
drawn from a log-normal distribution around `--call-s`. Deterministic for a seed; no wall clock.

The workload: keys drawn from a Zipf distribution (popular questions); a steady Poisson background
plus bursts (a key suddenly asked by many users over a few seconds, as after an announcement).

    python benchmarks/bench_window.py [--seconds 600] [--seeds 5]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
from pathlib import Path
from typing import Any

from carpool.bench.stats import percentile
from carpool.bench.synthetic import Zipf
from carpool.config import CoalesceConfig
from carpool.window import FixedWindow
from carpool.wiring import window_policy

FIXED_MS = (100, 500, 1000, 2000)


def bursty_zipf_trace(
    seed: int,
    seconds: float,
    keys: int = 5000,
    background_rps: float = 30.0,
    bursts_per_s: float = 0.3,
    zipf_s: float = 1.1,
) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    draw = Zipf(rng, keys, zipf_s).draw
    trace: list[tuple[float, str]] = []
    t = 0.0
    while True:  # steady background
        t += rng.expovariate(background_rps)
        if t >= seconds:
            break
        trace.append((t, f"q{draw()}"))
    t = 0.0
    while True:  # bursts of one question
        t += rng.expovariate(bursts_per_s)
        if t >= seconds:
            break
        key, size, spread = f"q{draw()}", rng.randint(10, 150), rng.uniform(1.0, 8.0)
        trace.extend((t + rng.expovariate(1 / (spread / 3)), key) for _ in range(size))
    trace.sort()
    return trace


def replay(
    trace: list[tuple[float, str]], policy: Any, call_s: float, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    running: dict[str, float] = {}  # key -> finish time of its running call
    started: dict[str, float] = {}
    lingering: dict[str, tuple[float, float]] = {}  # key -> (finished at, joinable until)
    finishes: list[tuple[float, str]] = []
    shared = calls = 0
    ages: list[float] = []
    for now, key in trace:
        while finishes and finishes[0][0] <= now:  # calls that ended before this arrival
            done, done_key = heapq.heappop(finishes)
            del running[done_key]
            window = policy.window(done_key, done, done - started[done_key])
            lingering[done_key] = (done, done + window)
        if key in running:
            shared += 1
            ages.append(0.0)
            continue
        policy.arrival(key, now)
        window = lingering.get(key)
        if window is not None and now < window[1]:
            shared += 1
            ages.append(now - window[0])
            continue
        calls += 1
        finish = now + rng.lognormvariate(0, 0.5) * call_s
        running[key], started[key] = finish, now
        heapq.heappush(finishes, (finish, key))
    return {
        "requests": len(trace),
        "upstream_calls": calls,
        "shared": shared / len(trace),
        "mean_age_ms": 1000 * statistics.fmean(ages) if ages else 0.0,
        "p95_age_ms": 1000 * percentile(ages, 95) if len(ages) > 20 else 0.0,
    }


def policies() -> dict[str, Any]:
    out: dict[str, Any] = {
        f"fixed {ms} ms": (lambda ms=ms: FixedWindow(ms / 1000)) for ms in FIXED_MS
    }
    # The gateway's own policy, built from the configuration defaults.
    out["adaptive"] = lambda: window_policy(CoalesceConfig())
    return out


def run(quick: bool = False) -> dict[str, object]:
    """For benchmarks/run.py: the full comparison, or a smaller one with ``quick``."""
    return simulate(120 if quick else 600, 2 if quick else 5)


def summarize(result: dict[str, object]) -> list[str]:
    lines = []
    for name, row in result["policies"].items():  # type: ignore[union-attr]
        lines.append(
            f"window/{name:<14} shared {row['shared']:.4f}, mean age "
            f"{row['mean_age_ms']:.0f} ms, p95 age {row['p95_age_ms']:.0f} ms"
        )
    verdict = result["verdict"]
    lines.append(
        f"window/verdict      vs {verdict['best_fixed_by_share']} (best share): adaptive "
        f"shares at least as much: {verdict['adaptive_shares_at_least_as_much']}, "
        f"answers no older: {verdict['adaptive_answers_no_older']}"
    )
    return lines


def simulate(seconds: float = 600, seeds: int = 5, call_s: float = 0.8) -> dict[str, object]:
    results: dict[str, list[dict[str, float]]] = {name: [] for name in policies()}
    for seed in range(seeds):
        trace = bursty_zipf_trace(seed, seconds)
        for name, make in policies().items():
            results[name].append(replay(trace, make(), call_s, seed))
    summary = {
        name: {metric: round(statistics.fmean(r[metric] for r in runs), 4) for metric in runs[0]}
        for name, runs in results.items()
    }
    best_share = max((v for k, v in summary.items() if k != "adaptive"), key=lambda v: v["shared"])
    adaptive = summary["adaptive"]
    verdict = {
        "best_fixed_by_share": next(k for k, v in summary.items() if v is best_share),
        "adaptive_shares_at_least_as_much": adaptive["shared"] >= best_share["shared"],
        "adaptive_answers_no_older": adaptive["mean_age_ms"] <= best_share["mean_age_ms"],
    }
    return {
        "workload": {
            "seconds": seconds,
            "seeds": seeds,
            "call_s": call_s,
            "requests_per_seed": summary["adaptive"]["requests"],
        },
        "policies": summary,
        "verdict": verdict,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--call-s", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = simulate(args.seconds, args.seeds, args.call_s)
    print(f"{'policy':<16}{'shared':>10}{'mean age ms':>14}{'p95 age ms':>12}{'calls':>9}")
    for name, row in result["policies"].items():
        print(
            f"{name:<16}{row['shared']:>10.4f}{row['mean_age_ms']:>14.1f}"
            f"{row['p95_age_ms']:>12.1f}{row['upstream_calls']:>9.0f}"
        )
    print(json.dumps(result["verdict"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
