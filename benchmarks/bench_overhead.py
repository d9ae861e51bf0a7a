"""What the gateway adds on top of the upstream, over real HTTP on loopback.

Four processes: the upstream (the simulated engine at no cost, ``carpool.bench.upstream``), the
real gateway in front of it (``carpool.bench.embedded``), the fixed-bytes app
(``carpool.bench.fixed``: uvicorn's bare minimum, answering the same bytes as a hit) and the
load generator (``carpool.bench.loadgen``), the same client for every side of every comparison.

- ``latency``: sequential requests on one keep-alive connection, on the *bypass* path (temperature
  0.7, no seed: ``x-carpool: bypass``, so every request goes through the gateway to the upstream),
  direct to the upstream vs via the gateway, in alternating blocks. Reports p50/p90/p99 of both
  and the added p50 (target <= 1 ms), also as the median of the per-block differences. A third
  target in the same rotation, the temperature-0 body via the gateway (an exact hit), gives the
  hit latency.
- ``openloop``: the same temperature-0 body scheduled at fixed rates (2k-15k req/s, 3 s each) on
  256 connections, gateway hit vs the fixed-bytes app; latency from the scheduled time.
- ``throughput``: ``concurrency`` connections sending back to back, the same temperature-0 body
  (an exact hit after the first request) to the gateway vs the same body to the fixed-bytes app;
  alternating rounds; requests/s and the ratio gateway-hit / fixed-bytes app. (The keys keep
  their names: ``upstream`` there is the fixed-bytes app.)

    .venv/bin/python benchmarks/bench_overhead.py [--quick]
"""

from __future__ import annotations

from typing import Any

from carpool.bench import bodies, loadgen, scenario
from carpool.bench.embedded import gateway
from carpool.bench.fixed import fixed_app
from carpool.bench.stats import median, summary_ms
from carpool.bench.upstream import upstream
from carpool.config import Config

TARGET_ADDED_P50_MS = 1.0


def _latency(up: int, gw: int, n: int, warmup: int, block: int) -> dict[str, Any]:
    body = bodies.chat_body(0.7)  # sampled, no seed: the bypass path
    hit = bodies.chat_body(0)  # for reference: an exact hit (after the warm-up)
    raw = loadgen.run(
        "latency",
        {
            "n": n,
            "warmup": warmup,
            "block": block,
            "targets": [
                {"name": "direct", "port": up, "body": body},
                {"name": "gateway", "port": gw, "body": body},
                {"name": "gateway_hit", "port": gw, "body": hit},
            ],
        },
    )
    direct, via = raw["direct"]["samples_s"], raw["gateway"]["samples_s"]
    blocks = [
        median(via[i : i + block]) - median(direct[i : i + block])
        for i in range(0, min(len(direct), len(via)), block)
    ]
    d, g = summary_ms(direct), summary_ms(via)
    added = round(g["p50_ms"] - d["p50_ms"], 4)
    return {
        "n": n,
        "warmup": warmup,
        "block": block,
        "direct": d,
        "gateway": g,
        "added_p50_ms": added,
        "added_p90_ms": round(g["p90_ms"] - d["p90_ms"], 4),
        "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 4),
        "added_p50_blockwise_median_ms": round(median(blocks) * 1000, 4),
        "target_added_p50_ms": TARGET_ADDED_P50_MS,
        "meets_target": added <= TARGET_ADDED_P50_MS,
        "gateway_hit": summary_ms(raw["gateway_hit"]["samples_s"]),
        "gateway_outcomes": raw["gateway"]["outcomes"],
        "gateway_hit_outcomes": raw["gateway_hit"]["outcomes"],
        "non_200": {name: raw[name]["non_200"] for name in ("direct", "gateway", "gateway_hit")},
    }


def _hit_targets(fixed: int, gw: int) -> list[dict[str, Any]]:
    """The temperature-0 body (a hit after the first request) to the fixed-bytes app and the
    gateway; named as before the fixed-bytes app stood in for the upstream: ``upstream``."""
    body = bodies.chat_body(0)
    return [
        {"name": "upstream", "port": fixed, "body": body},
        {"name": "gateway_hit", "port": gw, "body": body},
    ]


def _throughput(
    fixed: int, gw: int, concurrency: int, seconds: float, rounds: int
) -> dict[str, Any]:
    raw = loadgen.run(
        "throughput",
        {
            "concurrency": concurrency,
            "seconds": seconds,
            "rounds": rounds,
            "warmup_s": 0.5,
            "targets": _hit_targets(fixed, gw),
        },
    )
    up_rps, hit_rps = raw["upstream"]["rps"], raw["gateway_hit"]["rps"]
    ratios = [h / u for h, u in zip(hit_rps, up_rps, strict=True)]
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "rounds": rounds,
        "upstream_rps_median": round(median(up_rps)),
        "gateway_hit_rps_median": round(median(hit_rps)),
        "ratio_hit_over_upstream": round(median(hit_rps) / median(up_rps), 3),
        "ratio_per_round_median": round(median(ratios), 3),
        "upstream_rps": [round(x) for x in up_rps],
        "gateway_hit_rps": [round(x) for x in hit_rps],
        "gateway_outcomes": raw["gateway_hit"]["outcomes"],
        "non_200": {
            "upstream": raw["upstream"]["non_200"],
            "gateway_hit": raw["gateway_hit"]["non_200"],
        },
    }


def _openloop(fixed: int, gw: int, rates: list[int], seconds: float) -> dict[str, Any]:
    """Exact hits under load: the same request scheduled at fixed rates (open loop)."""
    spec = {"rates": rates, "seconds": seconds, "connections": 256}
    raw = loadgen.run("openloop", {**spec, "targets": _hit_targets(fixed, gw)})
    return {**spec, **raw}


def run(quick: bool = False) -> dict[str, Any]:
    with (
        upstream() as up,
        gateway(Config(upstreams=[up.url], log_level="warning")) as gw,
        fixed_app() as fixed,
    ):
        if quick:
            latency = _latency(up.port, gw.port, n=600, warmup=100, block=50)
            throughput = _throughput(fixed.port, gw.port, concurrency=64, seconds=1.0, rounds=2)
            openloop = _openloop(fixed.port, gw.port, rates=[2000, 5000], seconds=1.0)
        else:
            latency = _latency(up.port, gw.port, n=2000, warmup=200, block=100)
            throughput = _throughput(fixed.port, gw.port, concurrency=64, seconds=2.0, rounds=6)
            openloop = _openloop(fixed.port, gw.port, [2000, 5000, 10000, 15000], seconds=3.0)
    ok = (
        latency["gateway_outcomes"] == {"bypass": latency["n"]}
        and latency["gateway_hit_outcomes"] == {"hit": latency["n"]}
        and set(throughput["gateway_outcomes"]) == {"hit"}
        and not any(latency["non_200"].values())
        and not any(throughput["non_200"].values())
        and all(set(r["outcomes"]) == {"hit"} for r in openloop["gateway_hit"].values())
    )
    return {"ok": ok, "latency": latency, "throughput": throughput, "openloop": openloop}


def summarize(result: dict[str, Any]) -> list[str]:
    lat, thr = result["latency"], result["throughput"]
    d, g, h = lat["direct"], lat["gateway"], lat["gateway_hit"]
    return [
        f"overhead/bypass    p50/p90/p99 ms: direct {d['p50_ms']:.3f}/{d['p90_ms']:.3f}/"
        f"{d['p99_ms']:.3f}, via gateway {g['p50_ms']:.3f}/{g['p90_ms']:.3f}/{g['p99_ms']:.3f}; "
        f"added p50 {lat['added_p50_ms']:.3f} ms "
        f"(blockwise {lat['added_p50_blockwise_median_ms']:.3f};"
        f" target <= {lat['target_added_p50_ms']:.0f} ms) "
        f"[{'OK' if lat['meets_target'] else 'OVER'}]",
        f"overhead/hit-lat   exact hit via gateway p50/p90/p99 ms: {h['p50_ms']:.3f}/"
        f"{h['p90_ms']:.3f}/{h['p99_ms']:.3f}",
        f"overhead/hit-rps   concurrency {thr['concurrency']}: gateway hits "
        f"{thr['gateway_hit_rps_median']} req/s vs fixed-bytes app {thr['upstream_rps_median']} "
        f"req/s: ratio {thr['ratio_hit_over_upstream']:.2f}  [{'OK' if result['ok'] else 'FAIL'}]",
        *(
            f"overhead/open-loop {rate:>6} req/s scheduled: gateway hits p50/p99 "
            f"{result['openloop']['gateway_hit'][str(rate)]['p50_ms']:.3f}/"
            f"{result['openloop']['gateway_hit'][str(rate)]['p99_ms']:.3f} ms (achieved "
            f"{result['openloop']['gateway_hit'][str(rate)]['achieved_rps']}), fixed-bytes app "
            f"{result['openloop']['upstream'][str(rate)]['p50_ms']:.3f}/"
            f"{result['openloop']['upstream'][str(rate)]['p99_ms']:.3f} ms"
            for rate in result["openloop"]["rates"]
        ),
    ]


if __name__ == "__main__":
    scenario.standalone(__doc__, run, summarize)
