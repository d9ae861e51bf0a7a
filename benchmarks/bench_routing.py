"""Cache-aware routing vs round-robin on the simulated engine, and embeddings batching.

Routing: 4 simulated replicas, each with a KV (prefix) cache that holds about three of the
workload's eight long system prompts (so where a request lands decides whether its prefill is
recomputed). 480 chat requests, each a distinct question after one of the eight prompts (no
duplicates: every one is a miss that reaches routing), sent through the real gateway
(``Gateway.request``, the library path) at a fixed concurrency of 32, once with
``routing.policy: cache-aware`` and once with ``round-robin``: same requests, same order, same
load. Reported from the replicas' own counters (``/sim/stats``): the prefix-cache hit rate
(cached prompt tokens / prompt tokens) and the mean time to first token; and the calls per replica.

Batching has its own benchmark: ``bench_batching.py``.

    python benchmarks/bench_routing.py [--quick] [--json]      # writes routing.json and routing.png
                                                   # (--quick: routing-quick.png)
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from carpool.bench import scenario

RESULTS = Path(__file__).resolve().parent / "results"

PROMPTS, REPLICAS, CONCURRENCY = 8, 4, 32
WORDS = (
    "policy account refund shipping warranty invoice order delivery customer support "
    "product return exchange payment card address store manager schedule item stock"
).split()


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"System prompt {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def run_policy(
    policy: str, requests: list[tuple[int, str]], prompt_words: int, prompts: list[str]
) -> dict[str, Any]:
    from carpool.config import Config
    from carpool.upstream.sim import SimUpstream, build_replicas
    from carpool.wiring import build_gateway

    sim = {
        "replicas": REPLICAS,
        "max_concurrency": 8,
        "prefill_ms_per_token": 0.05,
        "decode_ms_per_token": 1.0,
        "default_max_tokens": 4,
        # Room for about three of the eight prompts per replica.
        "prefix_cache_tokens": prompt_words * 3 + 200,
    }
    config = Config(
        sim=sim,
        routing={
            "policy": policy,
            # The router's memory of a replica ~ the engine's cache.
            "tree_budget_chars": prompt_words * 3 * 8,
        },
    )
    replicas = build_replicas(config.sim)
    gateway = build_gateway(config, upstreams=[SimUpstream(r) for r in replicas])
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(prompt: int, question: str) -> None:
        async with gate:
            reply = await gateway.request(
                "/v1/chat/completions",
                {
                    "model": "sim",
                    "temperature": 0,
                    "max_tokens": 4,
                    "messages": [
                        {"role": "system", "content": prompts[prompt]},
                        {"role": "user", "content": question},
                    ],
                },
            )
            assert reply.status == 200, reply.body

    await asyncio.gather(*(one(p, q) for p, q in requests))
    stats = [r.stats() for r in replicas]
    await gateway.aclose()
    prompt_tokens = sum(s["prompt_tokens"] for s in stats)
    ttft_sum = sum(s["ttft_seconds_sum"] for s in stats)
    ttft_count = sum(s["ttft_count"] for s in stats)
    return {
        "policy": policy,
        "prefix_hit_rate": round(sum(s["cached_prompt_tokens"] for s in stats) / prompt_tokens, 4),
        "mean_ttft_ms": round(1000 * ttft_sum / ttft_count, 2),
        "calls_per_replica": [sum(s["calls"].values()) for s in stats],
        "routing": gateway.snapshot()["routing"],
    }


def run(quick: bool = False) -> dict[str, Any]:
    prompt_words = 1500
    n = 160 if quick else 480
    prompts = [system_prompt(i, prompt_words) for i in range(PROMPTS)]
    rng = random.Random(7)
    requests = [(rng.randrange(PROMPTS), f"Question {i}: what about item {i}?") for i in range(n)]
    routing = {
        policy: asyncio.run(run_policy(policy, requests, prompt_words, prompts))
        for policy in ("round-robin", "cache-aware")
    }
    rr, ca = routing["round-robin"], routing["cache-aware"]
    result = {
        "requests": n,
        "prompts": PROMPTS,
        "replicas": REPLICAS,
        "concurrency": CONCURRENCY,
        "routing": routing,
        "ttft_ratio_round_robin_over_cache_aware": round(
            rr["mean_ttft_ms"] / ca["mean_ttft_ms"], 2
        ),
    }
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(result["routing"])
    rows = [result["routing"][p] for p in policies]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.bar(policies, [r["mean_ttft_ms"] for r in rows], color=["#999999", "#2a7ab9"])
    left.set_ylabel("mean time to first token (ms)")
    right.bar(policies, [100 * r["prefix_hit_rate"] for r in rows], color=["#999999", "#2a7ab9"])
    right.set_ylabel("prefix-cache hit rate (%)")
    fig.suptitle(
        f"{result['requests']} requests, {result['prompts']} shared system prompts, "
        f"{result['replicas']} simulated replicas, concurrency {result['concurrency']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(result: dict[str, Any]) -> list[str]:
    lines = []
    for policy, row in result["routing"].items():
        lines.append(
            f"routing/{policy:<12} prefix-cache hit rate {100 * row['prefix_hit_rate']:.1f}%,"
            f" mean TTFT {row['mean_ttft_ms']:.1f} ms, calls per replica "
            f"{row['calls_per_replica']}"
        )
    lines.append(
        f"routing/ratio        round-robin TTFT / cache-aware TTFT: "
        f"{result['ttft_ratio_round_robin_over_cache_aware']}x (goal >= 1.5x)"
    )
    return lines


def run_and_plot(quick: bool = False) -> dict[str, Any]:
    """``run``, its figures and plot written together: routing.json and routing.png (a quick
    run's: routing-quick.*), as ``run.py --only routing`` writes them."""
    result = run(quick)
    name = scenario.result_name("routing", quick)
    scenario.write_json(RESULTS / f"{name}.json", result)
    plot(result, RESULTS / f"{name}.png")
    return result


if __name__ == "__main__":
    scenario.standalone(__doc__, run_and_plot, summarize)
