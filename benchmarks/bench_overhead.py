"""What the gateway adds on top of the upstream, over real HTTP on loopback.

Three processes: the upstream app (answers a fixed chat completion at once; uvicorn + uvloop +
httptools), the real gateway in front of it (``gateway_server.py``, same stack), and the load
generator (``loadgen.py``), which is the same client for both sides of every comparison.

- ``latency``: sequential requests on one keep-alive connection, on the *bypass* path (temperature
  0.7, no seed: ``x-carpool: bypass``, so every request goes through the gateway to the upstream),
  direct vs via the gateway, in alternating blocks. Reports p50/p90/p99 of both and the added p50
  (target <= 1 ms), also as the median of the per-block differences. A third target in the same
  rotation, the temperature-0 body via the gateway (an exact hit), gives the hit latency.
- ``openloop``: the same temperature-0 body scheduled at fixed rates (2k-15k req/s, 3 s each) on
  256 connections, gateway hit vs raw upstream app; latency from the scheduled time.
- ``throughput``: ``concurrency`` connections sending back to back, the same temperature-0 body
  (an exact hit after the first request) to the gateway vs the same body to the raw upstream app;
  alternating rounds; requests/s and the ratio gateway-hit / upstream.

    .venv/bin/python benchmarks/bench_overhead.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

TARGET_ADDED_P50_MS = 1.0


def _latency(up: int, gw: int, n: int, warmup: int, block: int) -> dict[str, Any]:
    body = c.chat_body(0.7)  # sampled, no seed: the bypass path
    hit = c.chat_body(0)  # for reference: an exact hit (after the warm-up)
    raw = c.loadgen(
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
    hit_samples = raw["gateway_hit"]["samples_s"]
    direct, via = raw["direct"]["samples_s"], raw["gateway"]["samples_s"]
    blocks = [
        c.median(via[i : i + block]) - c.median(direct[i : i + block])
        for i in range(0, min(len(direct), len(via)), block)
    ]
    d, g = c.summary_ms(direct), c.summary_ms(via)
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
        "added_p50_blockwise_median_ms": round(c.median(blocks) * 1000, 4),
        "target_added_p50_ms": TARGET_ADDED_P50_MS,
        "meets_target": added <= TARGET_ADDED_P50_MS,
        "gateway_hit": c.summary_ms(hit_samples),
        "gateway_outcomes": raw["gateway"]["outcomes"],
        "gateway_hit_outcomes": raw["gateway_hit"]["outcomes"],
        "non_200": {name: raw[name]["non_200"] for name in ("direct", "gateway", "gateway_hit")},
    }


def _throughput(up: int, gw: int, concurrency: int, seconds: float, rounds: int) -> dict[str, Any]:
    body = c.chat_body(0)  # temperature 0: a hit after the first request
    raw = c.loadgen(
        "throughput",
        {
            "concurrency": concurrency,
            "seconds": seconds,
            "rounds": rounds,
            "warmup_s": 0.5,
            "targets": [
                {"name": "upstream", "port": up, "body": body},
                {"name": "gateway_hit", "port": gw, "body": body},
            ],
        },
    )
    up_rps, hit_rps = raw["upstream"]["rps"], raw["gateway_hit"]["rps"]
    ratios = [h / u for h, u in zip(hit_rps, up_rps, strict=True)]
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "rounds": rounds,
        "upstream_rps_median": round(c.median(up_rps)),
        "gateway_hit_rps_median": round(c.median(hit_rps)),
        "ratio_hit_over_upstream": round(c.median(hit_rps) / c.median(up_rps), 3),
        "ratio_per_round_median": round(c.median(ratios), 3),
        "upstream_rps": [round(x) for x in up_rps],
        "gateway_hit_rps": [round(x) for x in hit_rps],
        "gateway_outcomes": raw["gateway_hit"]["outcomes"],
        "non_200": {
            "upstream": raw["upstream"]["non_200"],
            "gateway_hit": raw["gateway_hit"]["non_200"],
        },
    }


def _openloop(up: int, gw: int, rates: list[int], seconds: float) -> dict[str, Any]:
    """Exact hits under load: the same request scheduled at fixed rates (open loop)."""
    body = c.chat_body(0)
    raw = c.loadgen(
        "openloop",
        {
            "rates": rates,
            "seconds": seconds,
            "connections": 256,
            "targets": [
                {"name": "upstream", "port": up, "body": body},
                {"name": "gateway_hit", "port": gw, "body": body},
            ],
        },
    )
    return {"rates": rates, "seconds": seconds, "connections": 256, **raw}


def run(quick: bool = False) -> dict[str, Any]:
    with c.upstream_server() as up, c.gateway_server(up) as gw:
        if quick:
            latency = _latency(up, gw, n=600, warmup=100, block=50)
            throughput = _throughput(up, gw, concurrency=64, seconds=1.0, rounds=2)
            openloop = _openloop(up, gw, rates=[2000, 5000], seconds=1.0)
        else:
            latency = _latency(up, gw, n=2000, warmup=200, block=100)
            throughput = _throughput(up, gw, concurrency=64, seconds=2.0, rounds=6)
            openloop = _openloop(up, gw, rates=[2000, 5000, 10000, 15000], seconds=3.0)
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
        f"{thr['gateway_hit_rps_median']} req/s vs raw upstream app {thr['upstream_rps_median']} "
        f"req/s: ratio {thr['ratio_hit_over_upstream']:.2f}  [{'OK' if result['ok'] else 'FAIL'}]",
        *(
            f"overhead/open-loop {rate:>6} req/s scheduled: gateway hits p50/p99 "
            f"{result['openloop']['gateway_hit'][str(rate)]['p50_ms']:.3f}/"
            f"{result['openloop']['gateway_hit'][str(rate)]['p99_ms']:.3f} ms (achieved "
            f"{result['openloop']['gateway_hit'][str(rate)]['achieved_rps']}), raw upstream app "
            f"{result['openloop']['upstream'][str(rate)]['p50_ms']:.3f}/"
            f"{result['openloop']['upstream'][str(rate)]['p99_ms']:.3f} ms"
            for rate in result["openloop"]["rates"]
        ),
    ]


def main() -> None:
    c.standalone(__doc__, run, summarize)


if __name__ == "__main__":
    main()
