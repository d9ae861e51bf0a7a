"""Embeddings throughput through ``EmbeddingBatcher`` vs unbatched, on the simulated engine.

64 concurrent clients each send single-input ``/embeddings`` requests (one text, ~24 words) to one
``SimUpstream`` replica (``build_upstreams(SimConfig())``), either directly (each request its own
call) or through the batcher (``max_batch_size`` 32, ``max_batch_delay_s`` 5 ms, 8192 tokens).
Two workloads: every text distinct, and texts drawn from 256 distinct ones (dedup helps).

The sim's embeddings cost model (``SimReplica._embeddings``): one forward pass per call, in one of
``embedding_concurrency`` passes at once, ``embedding_call_ms`` plus the prefill of the call's
longest item. Merging N items into one call pays the per-call cost once, so batching wins on
distinct texts too, and more through dedup. ``--call-overhead-ms`` adds a fixed per-call cost
that holds a slot on top of it (what a real engine pays per request scheduling).

    .venv/bin/python benchmarks/bench_batching.py [--requests N] [--call-overhead-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable

from carpool.batching import EmbeddingBatcher
from carpool.config import SimConfig
from carpool.upstream.base import UpstreamRequest, UpstreamResponse
from carpool.upstream.sim import VOCABULARY, build_upstreams

CONCURRENCY = 64
Send = Callable[[UpstreamRequest], Awaitable[UpstreamResponse]]


def texts(n: int, distinct: int | None, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    pool_size = distinct or n
    pool = [
        " ".join(rng.choice(VOCABULARY) for _ in range(24)) + f" #{i}" for i in range(pool_size)
    ]
    return pool if distinct is None else [rng.choice(pool) for _ in range(n)]


def with_call_overhead(send: Send, overhead_s: float, slots: int) -> Send:
    """A per-call cost that holds one of the engine's ``slots`` (not modelled by the sim)."""
    semaphore = asyncio.Semaphore(slots)

    async def wrapped(request: UpstreamRequest) -> UpstreamResponse:
        async with semaphore:
            await asyncio.sleep(overhead_s)
        return await send(request)

    return wrapped


async def drive(call: Send, inputs: list[str]) -> float:
    """requests/s with CONCURRENCY clients working through ``inputs``."""
    queue = iter(inputs)

    async def client() -> None:
        for text in queue:
            response = await call(
                UpstreamRequest(
                    "/embeddings",
                    {"model": "emb", "input": text},
                    {"authorization": "Bearer bench"},
                )
            )
            if response.status != 200:
                raise RuntimeError(f"status {response.status}: {response.body[:200]!r}")

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return len(inputs) / (time.perf_counter() - start)


async def run(requests: int, overhead_ms: float) -> None:
    config = SimConfig()
    print(
        f"sim: replicas 1, max_concurrency {config.max_concurrency}, prefill "
        f"{config.prefill_ms_per_token} ms/token, per-call overhead added by this bench: "
        f"{overhead_ms} ms; concurrency {CONCURRENCY}, {requests} requests"
    )
    for label, distinct in (("all distinct", None), ("256 distinct", 256)):
        inputs = texts(requests, distinct)
        results = {}
        for mode in ("unbatched", "batched"):
            upstream = build_upstreams(config)[0]
            send: Send = upstream.send
            if overhead_ms > 0:
                send = with_call_overhead(send, overhead_ms / 1000, config.max_concurrency)
            batcher = EmbeddingBatcher(
                send, max_batch_size=32, max_batch_delay_s=0.005, max_batch_tokens=8192
            )
            rate = await drive(send if mode == "unbatched" else batcher.embed, inputs)
            results[mode] = rate
            calls = upstream.replica.calls.get("embeddings", 0)
            extra = (
                f", batches {batcher.batches}, mean items/batch "
                f"{batcher.items_sent / max(1, batcher.batches):.1f}"
                if mode == "batched"
                else ""
            )
            print(f"  {label:13s} {mode:9s}: {rate:8.0f} req/s, upstream calls {calls}{extra}")
        print(
            f"  {label:13s} ratio batched/unbatched: "
            f"{results['batched'] / results['unbatched']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--call-overhead-ms", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(run(args.requests, args.call_overhead_ms))


if __name__ == "__main__":
    main()
