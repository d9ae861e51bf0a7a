"""The load generator: a separate process with a lean HTTP/1.1 keep-alive client (asyncio
protocol + httptools parser, on uvloop), the same for every side of a comparison.

    python benchmarks/loadgen.py MODE '<json spec>'     # prints one JSON object on stdout

Modes:
- ``coalesce``: open ``n`` connections to the gateway, send one identical request on each at
  once, wait until the gateway's ``/stats`` shows ``n`` waiters, release the held upstream
  (``POST /release``), collect every answer. Reports upstream calls, the ``x-carpool`` outcomes,
  wall time, and the time from the upstream answering to the last client's answer.
- ``latency``: one connection per target, sequential requests, in blocks that alternate between
  the targets so that machine noise hits every target alike; percentiles per target.
- ``throughput``: ``concurrency`` connections per target, each sending requests back to back for
  ``seconds``; several rounds alternating the targets; requests/s per round.
- ``openloop``: requests *scheduled* at a fixed rate (``rates``, req/s, each for ``seconds``), sent
  on a pool of ``connections`` whatever the answers are doing; latency counts from the scheduled
  time, so a server that falls behind pays for the queue it causes (no coordinated omission).
  Per target and rate: achieved rate, latency percentiles, requests still waiting for a
  connection.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC, system-wide on Linux), so they compare with the
upstream app's ``answered_at``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import httptools
import orjson

HOST = "127.0.0.1"


@dataclass(slots=True)
class Response:
    status: int
    carpool: str | None
    body: bytes
    at: float  # time.monotonic() when the last byte was parsed


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.future: asyncio.Future[Response] | None = None
        self.carpool: str | None = None
        self.body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.future is not None and not self.future.done():
                self.future.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.carpool = None
        self.body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 9 and name.lower() == b"x-carpool":
            self.carpool = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        at = time.monotonic()
        future = self.future
        if future is not None and not future.done():
            future.set_result(
                Response(self.parser.get_status_code(), self.carpool, b"".join(self.body), at)
            )

    def request(self, raw: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.future = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.future


def build(
    method: str, path: str, port: int, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: {HOST}:{port}", f"content-length: {len(body)}"]
    if body:
        lines.append("content-type: application/json")
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def connect(port: int) -> Conn:
    _, conn = await asyncio.get_running_loop().create_connection(Conn, HOST, port)
    return conn


async def connect_many(port: int, n: int, batch: int = 250) -> list[Conn]:
    conns: list[Conn] = []
    for start in range(0, n, batch):
        conns += await asyncio.gather(*(connect(port) for _ in range(min(batch, n - start))))
    return conns


async def get_json(conn: Conn, method: str, path: str, port: int) -> Any:
    response = await conn.request(build(method, path, port))
    return orjson.loads(response.body) if response.body else None


def _raw(target: dict[str, Any]) -> bytes:
    return build(
        "POST",
        target.get("path", "/v1/chat/completions"),
        target["port"],
        orjson.dumps(target["body"]),
        target.get("headers"),
    )


# ------------------------------------------------------------------------------------------------


async def coalesce(spec: dict[str, Any]) -> dict[str, Any]:
    gw, up, n = spec["gateway_port"], spec["upstream_port"], spec["n"]
    join_timeout = spec.get("join_timeout_s", 20.0)
    conns = await connect_many(gw, n)
    ctl_gw, ctl_up = await connect(gw), await connect(up)
    await get_json(ctl_up, "POST", "/reset", up)
    before = await get_json(ctl_gw, "GET", "/stats", gw)
    raw = build("POST", "/v1/chat/completions", gw, orjson.dumps(spec["body"]), spec.get("headers"))

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
    await get_json(ctl_up, "POST", "/release", up)
    responses = await asyncio.gather(*futures, return_exceptions=True)
    count = await get_json(ctl_up, "GET", "/count", up)
    after = await get_json(ctl_gw, "GET", "/stats", gw)

    ok = [r for r in responses if isinstance(r, Response)]
    errors = [repr(r) for r in responses if not isinstance(r, Response)]
    outcomes = collections.Counter(r.carpool or "(none)" for r in ok)
    statuses = collections.Counter(str(r.status) for r in ok)
    bodies = len({r.body for r in ok})
    done = sorted(r.at for r in ok)
    answered = count["answered_at"]
    for c in [*conns, ctl_gw, ctl_up]:
        assert c.transport is not None
        c.transport.close()
    return {
        "n": n,
        "upstream_calls": count["calls"],
        "gateway_upstream_calls": after["upstream_calls"] - before["upstream_calls"],
        "outcomes": dict(outcomes),
        "statuses": dict(statuses),
        "distinct_bodies": bodies,
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
    targets = spec["targets"]
    n, block, warmup = spec["n"], spec["block"], spec["warmup"]
    conns = [await connect(t["port"]) for t in targets]
    raws = [_raw(t) for t in targets]
    samples: list[list[float]] = [[] for _ in targets]
    outcomes = [collections.Counter() for _ in targets]
    bad = [0 for _ in targets]
    perf = time.perf_counter

    async def run(i: int, count: int, keep: bool) -> None:
        conn, raw, out = conns[i], raws[i], samples[i]
        for _ in range(count):
            t = perf()
            response = await conn.request(raw)
            dt = perf() - t
            if response.status != 200:
                bad[i] += 1
            if keep:
                out.append(dt)
                outcomes[i][response.carpool or "(none)"] += 1

    for i in range(len(targets)):
        await run(i, warmup, False)
    rounds = -(-n // block)
    order = list(range(len(targets)))
    for r in range(rounds):
        size = min(block, n - r * block)
        for i in order if r % 2 == 0 else order[::-1]:
            await run(i, size, True)
    for c in conns:
        assert c.transport is not None
        c.transport.close()
    return {
        t["name"]: {"samples_s": samples[i], "outcomes": dict(outcomes[i]), "non_200": bad[i]}
        for i, t in enumerate(targets)
    }


async def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    targets, concurrency = spec["targets"], spec["concurrency"]
    seconds, rounds, warmup = spec["seconds"], spec["rounds"], spec.get("warmup_s", 0.5)
    pools = [await connect_many(t["port"], concurrency) for t in targets]
    raws = [_raw(t) for t in targets]
    rates: list[list[float]] = [[] for _ in targets]
    outcomes = [collections.Counter() for _ in targets]
    bad = [0 for _ in targets]

    for i, pool in enumerate(pools):  # prime: the first identical request fills the cache
        response = await pool[0].request(raws[i])
        if response.status != 200:
            raise RuntimeError(f"{targets[i]['name']}: status {response.status}")

    async def run(i: int, duration: float, keep: bool) -> None:
        raw = raws[i]
        stop = time.monotonic() + duration
        counter = outcomes[i]

        async def worker(conn: Conn) -> int:
            done = 0
            while time.monotonic() < stop:
                response = await conn.request(raw)
                done += 1
                if keep:
                    counter[response.carpool or "(none)"] += 1
                    if response.status != 200:
                        bad[i] += 1
            return done

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*(worker(c) for c in pools[i])))
        elapsed = time.perf_counter() - t0
        if keep:
            rates[i].append(total / elapsed)

    for i in range(len(targets)):
        await run(i, warmup, False)
    order = list(range(len(targets)))
    for r in range(rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            await run(i, seconds, True)
    for pool in pools:
        for c in pool:
            assert c.transport is not None
            c.transport.close()
    return {
        t["name"]: {"rps": rates[i], "outcomes": dict(outcomes[i]), "non_200": bad[i]}
        for i, t in enumerate(targets)
    }


async def openloop(spec: dict[str, Any]) -> dict[str, Any]:
    targets, rates, seconds = spec["targets"], spec["rates"], spec["seconds"]
    pools = [await connect_many(t["port"], spec["connections"]) for t in targets]
    raws = [_raw(t) for t in targets]
    for i, pool in enumerate(pools):  # prime: the first identical request fills the cache
        await pool[0].request(raws[i])
    results: dict[str, dict[str, Any]] = {t["name"]: {} for t in targets}

    async def run(i: int, rate: float) -> dict[str, Any]:
        idle: asyncio.Queue[Conn] = asyncio.Queue()
        for conn in pools[i]:
            idle.put_nowait(conn)
        latencies: list[float] = []
        outcomes: collections.Counter[str] = collections.Counter()
        raw, loop = raws[i], asyncio.get_running_loop()

        async def one(scheduled: float) -> None:
            conn = await idle.get()
            try:
                response = await conn.request(raw)
            finally:
                idle.put_nowait(conn)
            latencies.append(response.at - scheduled)
            outcomes[
                response.carpool or "(none)"
                if response.status == 200
                else f"status {response.status}"
            ] += 1

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
        ordered = sorted(latencies)

        def at(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 4)

        return {
            "rate": rate,
            "achieved_rps": round(total / elapsed),
            "n": total,
            "p50_ms": at(0.50),
            "p90_ms": at(0.90),
            "p99_ms": at(0.99),
            "max_ms": round(ordered[-1] * 1000, 4),
            "outcomes": dict(outcomes),
        }

    for rate in rates:
        for i, t in enumerate(targets):  # same rate, targets one after the other
            results[t["name"]][str(rate)] = await run(i, rate)
    for pool in pools:
        for c in pool:
            assert c.transport is not None
            c.transport.close()
    return results


MODES = {"coalesce": coalesce, "latency": latency, "throughput": throughput, "openloop": openloop}


def main(modes: dict[str, Any] = MODES) -> None:
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(modes[mode](spec))
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main()
