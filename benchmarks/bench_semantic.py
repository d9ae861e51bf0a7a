"""The semantic cache's costs: embedding, ANN lookup at 100k entries, memory, and a hit end to end.

- ``embed``: one short prompt through ``LocalEmbedder`` (see bench_embed.py), p50/p90.
- ``ann``: the gateway's own ``VectorIndex`` (usearch HNSW, the configured connectivity and
  expansions) holding 100,000 unit vectors of 384 dimensions; p50/p99 of ``search`` for the
  configured number of candidates. The vectors are random: the hardest case for a graph index
  (real sentence embeddings cluster, which makes search easier). Memory per entry = the index's
  own memory / entries, plus what a ``SemanticEntry`` holds besides the answer.
- ``hit``: a semantic hit end to end over HTTP: the gateway (``semantic.enabled``) in front of the
  benchmarks' upstream (the simulated engine), one answer stored, then sequential paraphrased
  requests from the load generator (``carpool.bench.loadgen``, after 20 of warm-up), each a
  ``semantic-hit`` (a semantic hit stores nothing under the new text, so every one embeds,
  searches and runs the guard: the exact rules and the verifier). Exact hits of the same run for
  comparison. CPU per request: the gateway process's user + system time over the run (all its
  threads: the event loop, the embedder's and the verifier's) divided by the requests.

    python benchmarks/bench_semantic.py [--quick] [--json]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import bench_embed

from carpool.bench import loadgen, scenario
from carpool.bench.client import fetch
from carpool.bench.embedded import gateway
from carpool.bench.stats import summary_ms
from carpool.bench.upstream import upstream
from carpool.config import Config

TARGETS = {"embed_p50_ms": 5.0, "ann_p50_ms": 1.0, "hit_p50_ms": 10.0}


def run_ann(n: int, queries: int) -> dict[str, Any]:
    import numpy as np

    from carpool.config import SemanticConfig
    from carpool.semantic.index import VectorIndex

    config = SemanticConfig()
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(
        384, config.index_connectivity, config.index_expansion_add, config.index_expansion_search
    )
    started = time.perf_counter()
    index.add_many(np.arange(n, dtype=np.uint64), vectors)
    build_s = time.perf_counter() - started
    timings = []
    for i in range(queries):
        query = vectors[i * 7 % n] + 0.05 * rng.standard_normal(384).astype(np.float32)
        t = time.perf_counter()
        index.search(query / np.linalg.norm(query), config.candidates)
        timings.append(time.perf_counter() - t)
    return {
        "entries": n,
        "build_s": round(build_s, 1),
        "lookup": summary_ms(timings),
        "index_bytes_per_entry": round(index.memory_bytes / n),
    }


def run_hit(requests: int) -> dict[str, Any]:
    body = {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": "How do I reset my router to factory settings?"}],
    }
    paraphrase = {
        **body,
        "messages": [
            {"role": "user", "content": "how can I reset my router to its factory settings"}
        ],
    }
    config = Config(log_level="warning", semantic={"enabled": True})
    with upstream() as up, gateway(config.model_copy(update={"upstreams": [up.url]})) as gw:
        _, headers, _ = fetch("POST", gw.url + "/v1/chat/completions", body)
        assert headers["x-carpool"] == "miss", headers
        deadline = time.monotonic() + 30
        while json.loads(fetch("GET", gw.url + "/stats")[2])["layers"]["semantic"]["entries"] < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("the semantic insert never landed")
            time.sleep(0.01)

        def timed(request: dict[str, Any]) -> tuple[list[float], dict[str, int], float]:
            target = {"name": "t", "port": gw.port, "body": request}
            spec = {"warmup": 0, "targets": [target]}
            loadgen.run("latency", {**spec, "n": 20, "block": 20})  # warm-up
            cpu = _cpu_seconds(gw.pid)
            raw = loadgen.run("latency", {**spec, "n": requests, "block": requests})["t"]
            return raw["samples_s"], raw["outcomes"], (_cpu_seconds(gw.pid) - cpu) / requests * 1000

        semantic, outcomes, semantic_cpu = timed(paraphrase)
        exact, _, exact_cpu = timed(body)
    return {
        "requests": requests,
        "outcomes": sorted(outcomes),
        "semantic_hit": {**summary_ms(semantic), "cpu_ms": round(semantic_cpu, 2)},
        "exact_hit": {**summary_ms(exact), "cpu_ms": round(exact_cpu, 3)},
        "ok": set(outcomes) == {"semantic-hit"},
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(quick: bool = False) -> dict[str, Any]:
    embed = bench_embed.run(quick)
    ann = run_ann(20_000 if quick else 100_000, 200 if quick else 1000)
    hit = run_hit(50 if quick else 300)
    return {
        "embed": embed,
        "ann": ann,
        "entry": run_entry_memory(20_000),
        "hit": hit,
        "targets": TARGETS,
    }


def run_entry_memory(n: int) -> dict[str, Any]:
    """Bytes one semantic entry costs besides its answer (shared with the exact cache)."""
    import asyncio
    import tracemalloc

    import numpy as np

    from carpool.answer import Answer
    from carpool.config import SemanticConfig
    from carpool.fingerprint import SemanticView
    from carpool.semantic.cache import SemanticCache
    from carpool.semantic.guard import RulesThenVerifier
    from carpool.semantic.verifier import shared_cross_encoder

    class Dim:  # inserts here carry their vector: no model is needed
        dim, name = 384, "precomputed"

    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((n, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    answer = Answer("chat", b"{}", True)
    cache = SemanticCache(SemanticConfig(), Dim(), RulesThenVerifier(shared_cross_encoder()))

    async def fill() -> None:
        for i in range(n):
            await cache.insert(
                SemanticView("scope", f"How do I reset router model {i}?"), vectors[i], answer, 2e10
            )

    tracemalloc.start()
    asyncio.run(fill())
    python_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    index_bytes = sum(ix.memory_bytes for ix in cache._scopes.values())
    return {
        "entries": n,
        "python_bytes_per_entry": round(python_bytes / n),
        "index_bytes_per_entry": round(index_bytes / n),
        "total_bytes_per_entry": round((python_bytes + index_bytes) / n),
    }


def summarize(result: dict[str, Any]) -> list[str]:
    ann, hit = result["ann"], result["hit"]
    return [
        *bench_embed.summarize(result["embed"]),
        f"semantic/ann       {ann['entries']} entries: lookup p50 {ann['lookup']['p50_ms']:.3f} ms,"
        f" p99 {ann['lookup']['p99_ms']:.3f} ms (target <= 1 ms); index "
        f"{ann['index_bytes_per_entry']} B/entry; built in {ann['build_s']} s",
        f"semantic/entry     memory per entry besides its answer: "
        f"{result['entry']['total_bytes_per_entry']} B (index "
        f"{result['entry']['index_bytes_per_entry']} + Python objects "
        f"{result['entry']['python_bytes_per_entry']})",
        f"semantic/hit       end to end over HTTP p50 {hit['semantic_hit']['p50_ms']:.2f} ms, "
        f"p99 {hit['semantic_hit']['p99_ms']:.2f} ms (target <= 10 ms), CPU "
        f"{hit['semantic_hit']['cpu_ms']:.2f} ms per lookup; exact hit p50 "
        f"{hit['exact_hit']['p50_ms']:.2f} ms, CPU {hit['exact_hit']['cpu_ms']:.3f} ms"
        f"  [{'OK' if hit['ok'] else 'FAIL'}]",
    ]


if __name__ == "__main__":
    scenario.standalone(__doc__, run, summarize)
