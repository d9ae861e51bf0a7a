"""The benchmarks' load generator: the same lean client (``client.py``) for every side of every
comparison, in a process of its own so that it never shares an event loop with a server.

    python -m carpool.bench.loadgen MODE '<json spec>'     # prints one JSON object on stdout
    run(mode, spec)                                        # the same, from a benchmark

Targets (``spec["targets"]``): ``{"name", "port", "body", "path"?, "headers"?, "unique"?,
"ttfb"?}`` on 127.0.0.1; ``path`` defaults to chat completions. ``unique``: every request's last
message gets its own number (`` #N``), so that none repeats another (misses, not hits); ``ttfb``
(latency, openloop): the time to the first body bytes is the sample, not to the last (a
stream's first token). Modes:
- ``coalesce``: open ``n`` connections to the gateway (``gateway_port``), send one identical
  request on each at once, wait until the gateway's ``/stats`` shows ``n`` waiters, release the
  held upstream (``upstream_port``: ``POST /bench/release``, ``upstream.py``), collect every
  answer. Reports upstream calls, the ``x-carpool`` outcomes, wall time, and the time from the
  upstream answering (its ``answered_at``) to the last client's answer.
- ``latency``: one connection per target, sequential requests (``n`` after ``warmup``), in blocks
  of ``block`` that alternate between the targets (forward, then backward) so that noise hits
  every target alike. Samples in seconds (``perf_counter`` around each request).
- ``throughput``: ``concurrency`` connections per target, each sending back to back for
  ``seconds``; ``rounds`` rounds alternating the targets, after ``warmup_s`` each; requests/s per
  round. The first request of each target (a cache fill) is sent before.
- ``openloop``: requests *scheduled* at each of ``rates`` (req/s) for ``seconds``, sent on a pool
  of ``connections`` (opened for each run) whatever the answers are doing; latency counts from
  the scheduled time (no coordinated omission). Per target and rate: achieved rate, percentiles (``stats.percentile``).
With ``fresh_connections`` (latency, throughput) a target's connections are opened right before
its block or round, outside the timing, and closed after: with many targets in a rotation, a
kept connection would sit idle past the servers' keep-alive timeout (uvicorn's: 5 s).

Each answer's outcome is its ``x-carpool`` header; for a server without one, its own sign of a
cache hit (``litellm:hit``: LiteLLM's ``x-litellm-cache-key`` header; ``gptcache:hit``:
``"gptcache":true`` in GPTCache's body); otherwise ``(none)``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from .client import Address, Conn, Response, build, close, connect, connect_many
from .process import run_child
from .scenario import run_async
from .stats import percentile

CHAT = "/v1/chat/completions"
GPTCACHE_HIT = b'"gptcache":true'


def outcome(response: Response) -> str:
    if response.carpool is not None:
        return response.carpool
    if response.litellm_hit:
        return "litellm:hit"
    if GPTCACHE_HIT in response.body:
        return "gptcache:hit"
    return "(none)"


def raw_request(target: dict[str, Any]) -> bytes:
    return build(
        "POST",
        target.get("path", CHAT),
        Address.local(target["port"]),
        orjson.dumps(target["body"]),
        target.get("headers"),
    )


class Requests:
    """A target's raw requests: the same bytes every time, or (``unique``) numbered ones."""

    def __init__(self, target: dict[str, Any]) -> None:
        self.target, self.sent = target, 0
        self.same = None if target.get("unique") else raw_request(target)
        self.ttfb = bool(target.get("ttfb"))

    def next(self) -> bytes:
        if self.same is not None:
            return self.same
        self.sent += 1
        body = self.target["body"]
        *earlier, last = body["messages"]
        numbered = {**last, "content": f"{last['content']} #{self.sent}"}
        return raw_request({**self.target, "body": {**body, "messages": [*earlier, numbered]}})

    def sample(self, response: Response, started: float) -> float:
        """Seconds from ``started`` to the answer's end, or its first body bytes (``ttfb``)."""
        end = response.first_at if self.ttfb and response.first_at is not None else response.at
        return end - started


async def get_json(conn: Conn, method: str, path: str, port: int) -> Any:
    response = await conn.request(build(method, path, Address.local(port)))
    return orjson.loads(response.body) if response.body else None


def _per_target(targets: list[dict[str, Any]], **columns: list[Any]) -> dict[str, Any]:
    return {
        t["name"]: {key: column[i] for key, column in columns.items()}
        for i, t in enumerate(targets)
    }


def _rotation(n_targets: int, rounds: int) -> list[int]:
    """Target indices, round after round, forward then backward, so that none is always first."""
    order = list(range(n_targets))
    return [i for r in range(rounds) for i in (order if r % 2 == 0 else order[::-1])]


# ------------------------------------------------------------------------------------------------


async def coalesce(spec: dict[str, Any]) -> dict[str, Any]:
    gw, up, n = spec["gateway_port"], spec["upstream_port"], spec["n"]
    join_timeout = spec.get("join_timeout_s", 20.0)
    conns = await connect_many(Address.local(gw), n)
    ctl_gw, ctl_up = await connect(Address.local(gw)), await connect(Address.local(up))
    await get_json(ctl_up, "POST", "/bench/reset", up)
    before = await get_json(ctl_gw, "GET", "/stats", gw)
    raw = raw_request({"port": gw, "body": spec["body"], "headers": spec.get("headers")})

    t0 = time.monotonic()
    futures = [c.request(raw) for c in conns]
    t_sent = time.monotonic()
    polls, waiters = 0, 0
    while True:  # every request has joined the flight: release the upstream
        stats = await get_json(ctl_gw, "GET", "/stats", gw)
        polls += 1
        waiters = stats["waiters"]
        if waiters >= n or time.monotonic() - t0 > join_timeout:
            break
        await asyncio.sleep(0.002)
    t_joined = time.monotonic()
    await get_json(ctl_up, "POST", "/bench/release", up)
    responses = await asyncio.gather(*futures, return_exceptions=True)
    count = await get_json(ctl_up, "GET", "/bench/count", up)
    after = await get_json(ctl_gw, "GET", "/stats", gw)
    close([*conns, ctl_gw, ctl_up])

    ok = [r for r in responses if isinstance(r, Response)]
    errors = [repr(r) for r in responses if not isinstance(r, Response)]
    done = sorted(r.at for r in ok)
    answered = count["answered_at"]
    return {
        "n": n,
        "upstream_calls": count["calls"],
        "gateway_upstream_calls": after["upstream_calls"] - before["upstream_calls"],
        "outcomes": dict(collections.Counter(r.carpool or "(none)" for r in ok)),
        "statuses": dict(collections.Counter(str(r.status) for r in ok)),
        "distinct_bodies": len({r.body for r in ok}),
        "errors": errors[:5],
        "error_count": len(errors),
        "all_joined": waiters >= n,
        "waiters_seen": waiters,
        "send_s": round(t_sent - t0, 6),
        "join_s": round(t_joined - t0, 6),  # first send -> gateway shows n waiters
        "wall_s": round(done[-1] - t0, 6) if done else None,  # first send -> last answer
        "hold_s": round(answered - t_joined, 6) if answered else None,
        # the upstream starts sending its answer -> first / last client has its whole answer
        "release_first_s": round(done[0] - answered, 6) if answered and done else None,
        "release_last_s": round(done[-1] - answered, 6) if answered and done else None,
        "stats_polls": polls,
    }


async def latency(spec: dict[str, Any]) -> dict[str, Any]:
    targets, fresh = spec["targets"], spec.get("fresh_connections", False)
    n, block, warmup = spec["n"], spec["block"], spec["warmup"]
    kept = [] if fresh else [await connect(Address.local(t["port"])) for t in targets]
    raws = [Requests(t) for t in targets]
    samples: list[list[float]] = [[] for _ in targets]
    outcomes: list[collections.Counter[str]] = [collections.Counter() for _ in targets]
    bad = [0 for _ in targets]

    async def run(i: int, count: int, keep: bool) -> None:
        conn = await connect(Address.local(targets[i]["port"])) if fresh else kept[i]
        requests, out = raws[i], samples[i]
        try:
            for _ in range(count):
                raw = requests.next()
                t = time.monotonic()  # (the clock of ``Response.at`` and ``first_at``)
                response = await conn.request(raw)
                dt = requests.sample(response, t)
                if response.status != 200:
                    bad[i] += 1
                if keep:
                    out.append(dt)
                    outcomes[i][outcome(response)] += 1
        finally:
            if fresh:
                conn.close()

    for i in range(len(targets)):
        await run(i, warmup, False)
    blocks = -(-n // block)
    for k, i in enumerate(_rotation(len(targets), blocks)):
        await run(i, min(block, n - (k // len(targets)) * block), True)
    close(kept)
    return _per_target(
        targets, samples_s=samples, outcomes=[dict(o) for o in outcomes], non_200=bad
    )


async def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    targets, concurrency = spec["targets"], spec["concurrency"]
    seconds, rounds, warmup = spec["seconds"], spec["rounds"], spec.get("warmup_s", 0.5)
    fresh = spec.get("fresh_connections", False)
    pools = (
        []
        if fresh
        else [await connect_many(Address.local(t["port"]), concurrency) for t in targets]
    )
    raws = [raw_request(t) for t in targets]
    rates: list[list[float]] = [[] for _ in targets]
    outcomes: list[collections.Counter[str]] = [collections.Counter() for _ in targets]
    bad = [0 for _ in targets]

    for i, t in enumerate(targets):  # prime: the first identical request fills the cache
        conn = await connect(Address.local(t["port"])) if fresh else pools[i][0]
        response = await conn.request(raws[i])
        if fresh:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"{t['name']}: status {response.status}")

    async def run(i: int, duration: float, keep: bool) -> None:
        pool = (
            await connect_many(Address.local(targets[i]["port"]), concurrency)
            if fresh
            else pools[i]
        )
        raw, counter = raws[i], outcomes[i]
        stop = time.monotonic() + duration

        async def worker(conn: Conn) -> int:
            done = 0
            while time.monotonic() < stop:
                response = await conn.request(raw)
                done += 1
                if keep:
                    counter[outcome(response)] += 1
                    if response.status != 200:
                        bad[i] += 1
            return done

        try:
            t0 = time.perf_counter()
            total = sum(await asyncio.gather(*(worker(c) for c in pool)))
            elapsed = time.perf_counter() - t0
        finally:
            if fresh:
                close(pool)
        if keep:
            rates[i].append(total / elapsed)

    for i in range(len(targets)):
        await run(i, warmup, False)
    for i in _rotation(len(targets), rounds):
        await run(i, seconds, True)
    for pool in pools:
        close(pool)
    return _per_target(targets, rps=rates, outcomes=[dict(o) for o in outcomes], non_200=bad)


async def openloop(spec: dict[str, Any]) -> dict[str, Any]:
    targets, rates, seconds = spec["targets"], spec["rates"], spec["seconds"]
    raws = [Requests(t) for t in targets]
    results: dict[str, dict[str, Any]] = {t["name"]: {} for t in targets}

    async def run(i: int, rate: float) -> dict[str, Any]:
        # Connections of its own, opened now: a pool left idle while other targets ran could
        # be past the server's keep-alive timeout (uvicorn's: 5 s) and closed under it.
        pool = await connect_many(Address.local(targets[i]["port"]), spec["connections"])
        await pool[0].request(raws[i].next())  # prime: the first identical request fills the cache
        idle: asyncio.Queue[Conn] = asyncio.Queue()
        for conn in pool:
            idle.put_nowait(conn)
        latencies: list[float] = []
        outcomes: collections.Counter[str] = collections.Counter()
        requests, loop = raws[i], asyncio.get_running_loop()

        async def one(scheduled: float) -> None:
            raw = requests.next()
            conn = await idle.get()
            try:
                response = await conn.request(raw)
            finally:
                idle.put_nowait(conn)
            latencies.append(requests.sample(response, scheduled))
            ok = response.status == 200
            outcomes[outcome(response) if ok else f"status {response.status}"] += 1

        total = int(rate * seconds)
        t0 = time.monotonic()
        tasks, sent = [], 0
        while sent < total:
            due = min(total, int((time.monotonic() - t0) * rate) + 1)
            for k in range(sent, due):
                tasks.append(loop.create_task(one(t0 + k / rate)))
            sent = due
            await asyncio.sleep(0)  # let answers in between dispatches
            if sent < total:
                await asyncio.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        close(pool)
        ms = [s * 1000 for s in latencies]
        return {
            "rate": rate,
            "achieved_rps": round(total / elapsed),
            "n": total,
            "p50_ms": round(percentile(ms, 50), 4),
            "p90_ms": round(percentile(ms, 90), 4),
            "p99_ms": round(percentile(ms, 99), 4),
            "max_ms": round(max(ms), 4),
            "outcomes": dict(outcomes),
        }

    for rate in rates:
        for i, t in enumerate(targets):  # same rate, targets one after the other
            results[t["name"]][str(rate)] = await run(i, rate)
    return results


Mode = Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]
MODES: dict[str, Mode] = {
    "coalesce": coalesce,
    "latency": latency,
    "throughput": throughput,
    "openloop": openloop,
}


def run(mode: str, spec: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run ``mode`` in a load generator process of its own; return its result."""
    if mode not in MODES:
        raise ValueError(f"unknown load generator mode {mode!r}")
    result: dict[str, Any] = run_child(["-m", __name__, mode], spec, timeout)
    return result


def main() -> None:
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    sys.stdout.write(json.dumps(run_async(MODES[mode](spec))))


if __name__ == "__main__":
    main()
