"""``loadgen.py``'s client, driven for many targets: fresh connections for every block and round.

    python benchmarks/peers/loadgen_peers.py MODE '<json spec>'    # prints one JSON object

The client is ``loadgen.py``'s own (its asyncio protocol + httptools parser, on uvloop, one
request at a time per keep-alive connection), with the same ``latency`` and ``throughput`` modes
and spec. One difference: with five to seven targets in a rotation, a target's connections would
sit idle longer than uvicorn's keep-alive timeout (5 s) while the others run, and the servers
would close them; so each target opens its connections (one for a latency block, ``concurrency``
for a throughput round) right before its turn, outside the timed part, and closes them after.

Each answer is classified by the sign its server gives of a cache hit: ``x-carpool`` (its
value), LiteLLM's ``x-litellm-cache-key`` header (set only when the answer came from its cache:
``litellm:hit``), or GPTCache's ``"gptcache": true`` in the body (``gptcache:hit``); otherwise
``(none)``.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import loadgen as lg  # noqa: E402

GPTCACHE_HIT = b'"gptcache":true'


class PeerConn(lg.Conn):
    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        if len(name) == 19 and name.lower() == b"x-litellm-cache-key" and self.carpool is None:
            self.carpool = "litellm:hit"


async def connect(port: int) -> PeerConn:
    _, conn = await asyncio.get_running_loop().create_connection(PeerConn, lg.HOST, port)
    return conn


async def connect_many(port: int, n: int, batch: int = 250) -> list[PeerConn]:
    conns: list[PeerConn] = []
    for start in range(0, n, batch):
        conns += await asyncio.gather(*(connect(port) for _ in range(min(batch, n - start))))
    return conns


def close(conns: list[PeerConn]) -> None:
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()


def outcome(response: lg.Response) -> str:
    if response.carpool is not None:
        return response.carpool
    if GPTCACHE_HIT in response.body:
        return "gptcache:hit"
    return "(none)"


async def latency(spec: dict[str, Any]) -> dict[str, Any]:
    targets = spec["targets"]
    n, block, warmup = spec["n"], spec["block"], spec["warmup"]
    raws = [lg._raw(t) for t in targets]
    samples: list[list[float]] = [[] for _ in targets]
    outcomes = [collections.Counter() for _ in targets]
    bad = [0 for _ in targets]
    perf = time.perf_counter

    async def run(i: int, count: int, keep: bool) -> None:
        conn = await connect(targets[i]["port"])
        raw, out = raws[i], samples[i]
        try:
            for _ in range(count):
                t = perf()
                response = await conn.request(raw)
                dt = perf() - t
                if response.status != 200:
                    bad[i] += 1
                if keep:
                    out.append(dt)
                    outcomes[i][outcome(response)] += 1
        finally:
            close([conn])

    for i in range(len(targets)):
        await run(i, warmup, False)
    order = list(range(len(targets)))
    for r in range(-(-n // block)):
        size = min(block, n - r * block)
        for i in order if r % 2 == 0 else order[::-1]:
            await run(i, size, True)
    return {
        t["name"]: {"samples_s": samples[i], "outcomes": dict(outcomes[i]), "non_200": bad[i]}
        for i, t in enumerate(targets)
    }


async def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    targets, concurrency = spec["targets"], spec["concurrency"]
    seconds, rounds, warmup = spec["seconds"], spec["rounds"], spec.get("warmup_s", 0.5)
    raws = [lg._raw(t) for t in targets]
    rates: list[list[float]] = [[] for _ in targets]
    outcomes = [collections.Counter() for _ in targets]
    bad = [0 for _ in targets]

    for i, t in enumerate(targets):  # prime: the first identical request fills the cache
        conn = await connect(t["port"])
        response = await conn.request(raws[i])
        close([conn])
        if response.status != 200:
            raise RuntimeError(f"{t['name']}: status {response.status}")

    async def run(i: int, duration: float, keep: bool) -> None:
        pool = await connect_many(targets[i]["port"], concurrency)
        raw, counter = raws[i], outcomes[i]
        stop = time.monotonic() + duration

        async def worker(conn: PeerConn) -> int:
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
            total = sum(await asyncio.gather(*(worker(conn) for conn in pool)))
            elapsed = time.perf_counter() - t0
        finally:
            close(pool)
        if keep:
            rates[i].append(total / elapsed)

    for i in range(len(targets)):
        await run(i, warmup, False)
    order = list(range(len(targets)))
    for r in range(rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            await run(i, seconds, True)
    return {
        t["name"]: {"rps": rates[i], "outcomes": dict(outcomes[i]), "non_200": bad[i]}
        for i, t in enumerate(targets)
    }


MODES = {"latency": latency, "throughput": throughput}


def main() -> None:
    lg.main(MODES)


if __name__ == "__main__":
    main()
