"""Embedding latency and throughput of the semantic cache's local model (all-MiniLM-L6-v2).

- ``load_s``: building a ``LocalEmbedder`` the first time in the process (SHA-256 check of the
  weights, loading them, building the ONNX Runtime session).
- ``single``: one short prompt ("How do I reset my router?", 10 tokens), one at a time,
  after warm-up, through the synchronous ``encode([text])`` (tokenizer + model, no batching).
- ``single_await``: the same through ``await embed(text)`` one at a time, which adds the
  micro-batcher and the worker-thread hop; with ``max_delay_s`` 0 (the default) and 2 ms.
- ``batch32``: batches of 32 distinct short prompts through ``encode``: texts per second.
- ``concurrent``: 256 concurrent ``await embed(text)`` calls of distinct prompts: model calls made,
  wall time, texts per second.

Target: single p50 <= 5 ms on the 2-core development machine.

    .venv/bin/python benchmarks/bench_embed.py [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from carpool.bench import scenario
from carpool.bench.stats import median, summary_ms

TARGET_P50_MS = 5.0
PROMPT = "How do I reset my router?"
TOPICS = [
    "router",
    "password",
    "invoice",
    "subscription",
    "printer",
    "laptop battery",
    "wifi signal",
    "email filter",
    "VPN client",
    "phone screen",
    "bank card",
    "parcel",
]


def prompts(n: int, salt: str = "") -> list[str]:
    """``n`` distinct short support questions (8-14 word pieces each)."""
    return [
        f"How do I fix my {TOPICS[i % len(TOPICS)]} problem number {i}{salt}?" for i in range(n)
    ]


def _timed(fn: Any, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


async def _await_latency(embedder: Any, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await embedder.embed(PROMPT)
        samples.append(time.perf_counter() - started)
    return samples


async def _concurrent(embedder: Any, texts: list[str]) -> dict[str, Any]:
    calls = embedder.model_calls
    started = time.perf_counter()
    await asyncio.gather(*(embedder.embed(t) for t in texts))
    wall = time.perf_counter() - started
    return {
        "texts": len(texts),
        "model_calls": embedder.model_calls - calls,
        "wall_ms": round(wall * 1000, 2),
        "texts_per_s": round(len(texts) / wall, 1),
    }


def run(quick: bool = False) -> dict[str, Any]:
    from carpool.semantic.embed import LocalEmbedder

    n_single, n_batches = (200, 5) if quick else (1000, 20)
    started = time.perf_counter()
    embedder = LocalEmbedder()
    load_s = time.perf_counter() - started
    tokens = len(embedder._model.tokenize([PROMPT])[0])

    for _ in range(50):  # warm-up
        embedder.encode([PROMPT])
    single = summary_ms(_timed(lambda: embedder.encode([PROMPT]), n_single))

    batch = prompts(32)
    embedder.encode(batch)
    per_batch = _timed(lambda: embedder.encode(batch), n_batches)
    batch32 = summary_ms(per_batch)
    batch32["texts_per_s"] = round(32 / median(per_batch), 1)

    async def asynchronous() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for delay in (0.0, 0.002):
            e = LocalEmbedder(max_delay_s=delay)  # shares the loaded model
            await _await_latency(e, 20)
            out[f"single_await_delay_{delay * 1000:g}ms"] = summary_ms(
                await _await_latency(e, n_single // 2)
            )
            e.close()
        e = LocalEmbedder()
        await _concurrent(e, prompts(64, " (warm-up)"))
        out["concurrent"] = {**await _concurrent(e, prompts(256)), "max_batch": e.max_batch}
        e.close()
        return out

    result: dict[str, Any] = {
        "machine": scenario.machine(),
        "model": embedder.name,
        "dim": embedder.dim,
        "runtime": embedder.runtime,
        "prompt": PROMPT,
        "prompt_tokens": tokens,
        "load_s": round(load_s, 3),
        "single": single,
        "target_p50_ms": TARGET_P50_MS,
        "meets_target": single["p50_ms"] <= TARGET_P50_MS,
        "batch32": batch32,
    }
    result.update(asyncio.run(asynchronous()))
    embedder.close()
    return result


def summarize(result: dict[str, Any]) -> list[str]:
    s, b, cc = result["single"], result["batch32"], result["concurrent"]
    a2, a0 = result["single_await_delay_2ms"], result["single_await_delay_0ms"]
    return [
        f"embed              {result['model']} on {result['runtime']}, loaded in "
        f"{result['load_s']:.2f} s",
        f"                   one short prompt ({result['prompt_tokens']} tokens): p50 "
        f"{s['p50_ms']:.2f} ms, p90 {s['p90_ms']:.2f} ms (target p50 <= "
        f"{result['target_p50_ms']:.0f} ms) [{'OK' if result['meets_target'] else 'OVER'}]",
        f"                   through await embed(): p50 {a0['p50_ms']:.2f} ms (p90 "
        f"{a0['p90_ms']:.2f}); with a 2 ms batching delay p50 {a2['p50_ms']:.2f} ms",
        f"                   batches of 32: {b['texts_per_s']:.0f} texts/s "
        f"(p50 {b['p50_ms']:.1f} ms a batch)",
        f"                   {cc['texts']} concurrent embed(): {cc['model_calls']} model calls, "
        f"{cc['wall_ms']:.0f} ms, {cc['texts_per_s']:.0f} texts/s",
    ]


if __name__ == "__main__":
    scenario.standalone(__doc__, run, summarize)
