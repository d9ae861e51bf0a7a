"""Workers on one machine: exact-hit throughput with 1 and 2 workers, and the upstream calls of
identical requests spread over 2 workers, alone, sharing through each other, or through Redis.

Every gateway is the real ``carpool serve --workers N`` in a child process
(``carpool.bench.workers``), in front of the benchmarks' upstream (the simulated engine at no
cost, counting its calls: ``carpool.bench.upstream``). Four ways to run the workers:
- ``one_worker``: ``--workers 1``;
- ``two_workers``: ``--workers 2``, no Redis: the workers share through each other (each key's
  upstream calls led by the worker that owns it, asked over a unix socket: ``carpool.peers``);
- ``two_workers_alone``: the same two workers as ``carpool serve`` ran them before they shared
  (uvicorn's workers on ``create_worker_app``, no peers): each computes every key itself;
- ``two_workers_redis``: ``--workers 2 --redis URL`` (a Valkey/Redis server on loopback,
  ``carpool.bench.redis_server``): the exact cache and the flights in Redis.

- **hits**: the same temperature-0 request back to back on ``concurrency`` keep-alive
  connections for ``seconds`` (``carpool.bench.loadgen`` ``throughput``, in a process of its own;
  rounds alternate the targets so that noise hits them alike), every answer an exact hit; and,
  where wrk is installed, the same again with wrk (``carpool.bench.wrk``: a load generator in C,
  which leaves the servers most of the cores; ``hits.wrk``, null without it).
  Reported: requests/s per target (median of the rounds), ``two_over_one`` (the 2-worker
  throughput over the 1-worker one) and how each 2-worker target's hits fell on its workers
  (the kernel spreads the connections). On a machine with fewer free cores than workers plus
  the load generator, the ratio measures the cores, not the gateway: ``cpu_count`` is in the
  document. So the latency of one hit at a time (``loadgen`` ``latency``, a new connection per
  block of requests, blocks alternating the targets) is reported too, and, under wrk, each
  gateway's CPU per hit (its processes', ``/proc``) and the cores wrk took: two workers serve
  ``two_over_one_by_cpu`` times one worker's hits where each has a core of its own.
- **spread**: ``keys`` fresh prompts, each sent ``per_key`` times one after the other, each time on
  a new connection (so that both workers get it): upstream calls per key, outcomes, and the
  latency of the first request of a key (the call) and of the others (p50, from the
  benchmark's process, connection set-up included).
- **burst**: ``burst`` requests at once over ``burst_keys`` fresh prompts, each on its own
  connection, the upstream holding every call until the workers hold them all (``/stats``
  ``waiters`` summed over both workers), then releasing them: upstream calls per key, and the
  time from the release to the last answer.

    .venv/bin/python benchmarks/bench_workers.py [--quick] [--json]   # -> results/workers.json
                                                   # (--quick: results/workers-quick.json)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

from carpool.bench import bodies, loadgen, scenario, wrk
from carpool.bench.client import Address, connect, fetch
from carpool.bench.redis_server import redis_server
from carpool.bench.stats import median, percentile, summary_ms
from carpool.bench.upstream import Options, upstream
from carpool.bench.workers import Workers, served, stats_of_each

RESULTS = Path(__file__).resolve().parent / "results"
SHARING = ("two_workers_alone", "two_workers", "two_workers_redis")


def _launch(
    name: str, upstream_url: str, redis_url: str
) -> contextlib.AbstractContextManager[Workers]:
    if name == "one_worker":
        return served(1, upstream_url)
    if name == "two_workers_alone":
        return served(2, upstream_url, shared=False)
    return served(2, upstream_url, redis=redis_url if name == "two_workers_redis" else None)


def _hits(upstream_url: str, redis_url: str, quick: bool) -> dict[str, Any]:
    names = ["one_worker", "two_workers", "two_workers_alone", "two_workers_redis"]
    spec: dict[str, Any] = {
        "concurrency": 64,
        "seconds": 1.0 if quick else 3.0,
        "rounds": 2 if quick else 6,
        "warmup_s": 1.0,
        # (Opened for each round: an idle one would pass uvicorn's keep-alive timeout meanwhile.)
        "fresh_connections": True,
    }
    body = bodies.chat_body(0)
    with contextlib.ExitStack() as stack:
        gateways = {n: stack.enter_context(_launch(n, upstream_url, redis_url)) for n in names}
        raw = loadgen.run(
            "throughput",
            {
                **spec,
                "targets": [{"name": n, "port": g.port, "body": body} for n, g in gateways.items()],
            },
        )
        # One request at a time, one connection per block (blocks alternate the targets): what
        # one hit costs, whatever the cores.
        latency = loadgen.run(
            "latency",
            {
                "n": 400 if quick else 2000,
                "block": 50 if quick else 100,
                "warmup": 50 if quick else 100,
                "fresh_connections": True,
                "targets": [{"name": n, "port": g.port, "body": body} for n, g in gateways.items()],
            },
        )
        spread = {
            n: sorted(
                (s["hits"] for s in stats_of_each(g.port, len(g.pids)).values()), reverse=True
            )
            for n, g in gateways.items()
        }
        by_wrk = _hits_by_wrk(gateways, body, spec) if wrk.available() else None
    rps = {n: round(median(raw[n]["rps"])) for n in names}
    return {
        "wrk": by_wrk,
        **spec,
        "rps": rps,
        "rps_rounds": {n: [round(x) for x in raw[n]["rps"]] for n in names},
        **_over_one(rps),
        "hits_by_worker": spread,
        "latency_ms": {n: summary_ms(latency[n]["samples_s"]) for n in names},
        "outcomes": {n: raw[n]["outcomes"] for n in names},
        "non_200": {n: raw[n]["non_200"] for n in names},
    }


def _hits_by_wrk(
    gateways: dict[str, Workers], body: dict[str, Any], spec: dict[str, Any]
) -> dict[str, Any]:
    """The hits again with wrk (``carpool.bench.wrk``, one thread): a load generator that leaves
    the servers most of the cores, in rounds alternating the targets (after one short warm-up
    each); requests/s per target (median of the rounds) and the 2-worker ratios; and what the
    cores do not decide: each gateway's CPU per hit (its workers and their supervisor) and the
    cores wrk took, medians of the rounds. ``two_over_one_by_cpu``: what two workers serve
    over one when each has a core of its own and the load generator another (twice one
    worker's CPU per hit over two workers'); 2.0 when a second worker costs a hit nothing."""
    ports = {n: g.port for n, g in gateways.items()}
    pids = {n: g.processes for n, g in gateways.items()}
    taken = wrk.rounds(ports, body, spec["concurrency"], spec["seconds"], spec["rounds"], pids)
    rps = {n: round(median(v)) for n, v in taken.rps.items()}
    pairs = [
        two / one
        for two, one in zip(taken.rps["two_workers"], taken.rps["one_worker"], strict=True)
    ]
    cpu = {n: round(median(v), 2) for n, v in taken.cpu_us_per_request.items()}
    return {
        "threads": 1,
        "rps": rps,
        "rps_rounds": {n: [round(x) for x in v] for n, v in taken.rps.items()},
        **_over_one(rps),
        # (the rounds' pairs, neighbours in time: the best, as the hits' ratio is reported)
        "two_over_one_best_round": round(max(pairs), 3),
        "cpu_us_per_hit": cpu,
        "cpu_us_per_hit_rounds": {
            n: [round(x, 2) for x in v] for n, v in taken.cpu_us_per_request.items()
        },
        "two_over_one_by_cpu": round(2 * cpu["one_worker"] / cpu["two_workers"], 3),
        "wrk_cores": {n: round(median(v), 2) for n, v in taken.wrk_cores.items()},
        "non_2xx": taken.non_2xx,
    }


def _over_one(rps: dict[str, int]) -> dict[str, float]:
    """Each 2-worker way's requests/s over one worker's."""
    one = rps["one_worker"]
    return {
        "two_over_one": round(rps["two_workers"] / one, 3),
        "two_alone_over_one": round(rps["two_workers_alone"] / one, 3),
        "two_redis_over_one": round(rps["two_workers_redis"] / one, 3),
    }


def _spread(workers: Workers, up: Any, keys: int, per_key: int) -> dict[str, Any]:
    up.release()  # (the upstream holds calls only for the burst)
    before = up.count()["chat"]
    outcomes: collections.Counter[str] = collections.Counter()
    first_ms, other_ms = [], []
    for _ in range(keys):
        body = bodies.chat_body(0, nonce=f" [{uuid.uuid4().hex[:8]}]")
        for i in range(per_key):
            t0 = time.perf_counter()
            status, headers, _ = fetch("POST", workers.url + loadgen.CHAT, body)
            elapsed_ms = (time.perf_counter() - t0) * 1000
            if status != 200:
                raise RuntimeError(f"status {status}")
            outcomes[headers.get("x-carpool", "(none)")] += 1
            (first_ms if i == 0 else other_ms).append(elapsed_ms)
    calls = up.count()["chat"] - before
    return {
        "keys": keys,
        "per_key": per_key,
        "upstream_calls": calls,
        "calls_per_key": round(calls / keys, 3),
        "outcomes": dict(outcomes),
        "first_p50_ms": round(percentile(first_ms, 50), 3),
        "others_p50_ms": round(percentile(other_ms, 50), 3),
    }


async def _burst(workers: Workers, up: Any, n: int, keys: int) -> dict[str, Any]:
    up.reset()  # zeroed, and holding calls again
    prompts = [bodies.chat_body(0, nonce=f" [{uuid.uuid4().hex[:8]}]") for _ in range(keys)]
    address = Address.local(workers.port)

    async def one(i: int) -> tuple[int, str]:
        conn = await connect(address)
        try:
            raw = loadgen.raw_request({"port": workers.port, "body": prompts[i % keys]})
            response = await conn.request(raw)
            return response.status, response.carpool or "(none)"
        finally:
            conn.close()

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    held = False
    while loop.time() < t0 + 20 and not held:  # bounded: late ones are hits or joiners
        await asyncio.sleep(0.05)
        stats = await asyncio.to_thread(stats_of_each, workers.port, len(workers.pids))
        held = sum(s["waiters"] for s in stats.values()) >= n
    released = loop.time()
    await asyncio.to_thread(up.release)
    answered = await asyncio.gather(*tasks)
    wall = loop.time() - released
    calls = (await asyncio.to_thread(up.count))["chat"]
    return {
        "n": n,
        "keys": keys,
        "all_held_before_release": held,
        "upstream_calls": calls,
        "calls_per_key": round(calls / keys, 3),
        "statuses": dict(collections.Counter(s for s, _ in answered)),
        "outcomes": dict(collections.Counter(o for _, o in answered)),
        "release_to_last_answer_s": round(wall, 3),
    }


def run(quick: bool = False) -> dict[str, Any]:
    keys, per_key = (6, 6) if quick else (20, 10)
    burst, burst_keys = (100, 4) if quick else (200, 8)
    result: dict[str, Any] = {}
    with redis_server() as redis:
        result["redis_server"] = f"{redis.name} {redis.version}"
        with upstream() as free:
            result["hits"] = _hits(free.url, redis.url, quick)
        result["sharing"] = {}
        with upstream(Options(hold=True)) as held:
            for name in SHARING:
                with _launch(name, held.url, redis.url) as workers:
                    result["sharing"][name] = {
                        "spread": _spread(workers, held, keys, per_key),
                        "burst": scenario.run_async(_burst(workers, held, burst, burst_keys)),
                    }
    sharing = result["sharing"]
    result["ok"] = (
        all(
            sharing[n]["spread"]["calls_per_key"] == 1 for n in ("two_workers", "two_workers_redis")
        )
        and all(
            sharing[n]["burst"]["calls_per_key"] == 1 for n in ("two_workers", "two_workers_redis")
        )
        and not any(result["hits"]["non_200"].values())
    )
    return result


def _rates(what: str, h: dict[str, Any], best: float | None = None) -> str:
    """One summary line: each way's requests/s and its ratio to one worker's."""
    rps = h["rps"]
    best_round = "" if best is None else f"; best round x{best}"
    return (
        f"workers/{what}: 1 worker {rps['one_worker']}, 2 workers {rps['two_workers']} "
        f"(x{h['two_over_one']}{best_round}), 2 alone {rps['two_workers_alone']} "
        f"(x{h['two_alone_over_one']}), 2 on Redis {rps['two_workers_redis']} "
        f"(x{h['two_redis_over_one']})"
    )


def summarize(result: dict[str, Any]) -> list[str]:
    h = result["hits"]
    p50 = {n: v["p50_ms"] for n, v in h["latency_ms"].items()}
    lines = [
        f"workers/exact hit p50 (one at a time): 1 worker {p50['one_worker']:.3f} ms, 2 workers "
        f"{p50['two_workers']:.3f} ms, 2 alone {p50['two_workers_alone']:.3f} ms, 2 on Redis "
        f"{p50['two_workers_redis']:.3f} ms",
        _rates(f"exact hits (req/s, {h['concurrency']} connections)", h),
    ]
    w = h.get("wrk")
    lines.append(
        "workers/exact hits by wrk: (wrk not on PATH)"
        if w is None
        else _rates("exact hits by wrk (req/s, 1 thread)", w, w["two_over_one_best_round"])
    )
    if w is not None and "cpu_us_per_hit" in w:
        cpu, cores = w["cpu_us_per_hit"], w["wrk_cores"]
        lines.append(
            f"workers/CPU per hit under wrk: 1 worker {cpu['one_worker']} us, 2 workers "
            f"{cpu['two_workers']} us (x{w['two_over_one_by_cpu']} with a core each), 2 alone "
            f"{cpu['two_workers_alone']} us, 2 on Redis {cpu['two_workers_redis']} us; wrk took "
            f"{cores['one_worker']} / {cores['two_workers']} cores (1 / 2 workers)"
        )
    for name, s in result["sharing"].items():
        sp, b = s["spread"], s["burst"]
        lines.append(
            f"workers/{name}: spread {sp['calls_per_key']} calls per key (first p50 "
            f"{sp['first_p50_ms']} ms, others {sp['others_p50_ms']} ms); burst of {b['n']} over "
            f"{b['keys']} keys: {b['calls_per_key']} calls per key"
        )
    lines.append(f"workers: {'OK' if result['ok'] else 'FAIL'}")
    return lines


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.monotonic()
    result = run(args.quick)
    doc = scenario.document(
        result,
        {"hits": result["hits"]["rps"], "two_over_one": result["hits"]["two_over_one"]},
        ok=result["ok"],
        errors={},
        quick=args.quick,
        duration_s=time.monotonic() - started,
    )
    scenario.write_json(RESULTS / f"{scenario.result_name('workers', args.quick)}.json", doc)
    print("\n".join(summarize(result)))
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
