"""How long one big prompt holds the gateway's event loop: the longest wait of a small exact hit.

Three processes: the upstream (the simulated engine at no cost, ``carpool.bench.upstream``), the
real gateway in front of it (``carpool.bench.embedded``, semantic cache off) and this one, the
clients. A probe sends the same small chat body (an exact hit after the first) back to back
while one big chat body (an English prompt of ``size`` characters, a miss) is in flight; the
result is the longest wait of a probe, against the median of the probes sent with nothing else
in flight. Every piece runs in a process of its own: an upstream or a client sharing the
gateway's loop would be measured as the gateway's (the test suite's fake upstream, served in
the gateway's loop and tokenizing each prompt in Python, once read 2.4 s for 8 MB).

    .venv/bin/python benchmarks/bench_loop_stall.py [--quick]
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any

import httpx

from carpool.bench import scenario
from carpool.bench.embedded import gateway
from carpool.bench.upstream import upstream
from carpool.config import Config

CHAT = "/v1/chat/completions"
SENTENCES = (
    "How do I reset my router after the power went out last night?",
    "The quarterly report shows that revenue grew by twelve percent while costs stayed flat.",
    "Please explain why the build fails when the cache is cold and the tests run in parallel.",
    "We should move the meeting to Thursday because the client cannot attend on Monday.",
)


def prose(size: int, seed: int) -> str:
    """English text of ``size`` characters, different for each seed (a miss each time)."""
    rng = random.Random(seed)
    words = [rng.choice(SENTENCES) for _ in range(size // 60 + 2)]
    return " ".join(words)[:size]


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def one_size(url: str, size: int, seed: int) -> dict[str, Any]:
    small = chat("What time is it in Paris?")
    with httpx.Client(base_url=url, timeout=600) as client:
        assert client.post(CHAT, json=small).status_code == 200  # (stored: a hit from now on)
        quiet = []
        for _ in range(50):
            start = time.perf_counter()
            assert client.post(CHAT, json=small).headers["x-carpool"] == "hit"
            quiet.append(time.perf_counter() - start)
        waits: list[float] = []
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=url, timeout=600) as prober:
                while True:  # (one probe at least, however soon the big one is done)
                    start = time.perf_counter()
                    assert prober.post(CHAT, json=small).headers["x-carpool"] == "hit"
                    waits.append(time.perf_counter() - start)
                    if done.is_set():
                        return

        big = httpx.Request("POST", url + CHAT, json=chat(prose(size, seed)))  # (built first)
        prober = threading.Thread(target=probe)
        prober.start()
        try:
            response = client.send(big)
        finally:
            done.set()
            prober.join()
    return {
        "size_chars": size,
        "body_bytes": len(big.content),
        "big_status": response.status_code,
        "big_outcome": response.headers.get("x-carpool"),
        "probes": len(waits),
        "quiet_p50_ms": round(statistics.median(quiet) * 1000, 2),
        "worst_wait_ms": round(max(waits, default=0.0) * 1000, 1),
    }


def run(quick: bool) -> dict[str, Any]:
    sizes = [100_000, 1_000_000] if quick else [100_000, 1_000_000, 8_000_000]
    with upstream() as up:
        config = Config(upstreams=[up.url], semantic={"enabled": False})
        with gateway(config) as served:
            rows = [one_size(served.url, size, seed) for seed, size in enumerate(sizes)]
    ok = all(r["big_status"] == 200 and r["big_outcome"] == "miss" for r in rows)
    return {"ok": ok, "sizes": rows}


def summarize(result: dict[str, Any]) -> list[str]:
    return [
        f"loop-stall {r['body_bytes'] / 1e6:5.1f} MB prompt in flight: worst exact-hit wait "
        f"{r['worst_wait_ms']} ms ({r['probes']} probes; alone p50 {r['quiet_p50_ms']} ms) "
        f"[{'OK' if r['big_status'] == 200 else 'FAIL ' + str(r['big_status'])}]"
        for r in result["sizes"]
    ]


if __name__ == "__main__":
    scenario.standalone(__doc__, run, summarize)
