"""Take docs/dashboard.png: the live /dashboard after ~20 s of realistic traffic.

    python benchmarks/dashboard_screenshot.py [--seconds 22] [--out docs/dashboard.png]

Runs the gateway (``carpool.bench.embedded``: the app of ``carpool serve``) with its embedded
SIMULATED engine (3 replicas, semantic cache on when the [semantic] extra is installed) on a free
port, opens /dashboard in Debian's headless ``chromium`` (driven by Playwright; no browser is
downloaded), replays a mix of chat completions (``carpool.bench.replay``: a popular set of
repeated questions, bursts of identical concurrent ones, paraphrases, sampled ones, a third
streamed) at a rate that swells and ebbs, then saves a 1280x900 screenshot.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from carpool.bench.client import fetch
from carpool.bench.embedded import embedded_gateway
from carpool.bench.replay import replay
from carpool.bench.workloads import CHAT, BenchRequest, Workload
from carpool.config import Config

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TOPICS = [
    "the capital of France",
    "photosynthesis",
    "a Python list comprehension",
    "TCP slow start",
    "the Krebs cycle",
    "a B-tree",
    "compound interest",
    "the French revolution",
    "how vaccines work",
    "a hash map",
    "the speed of light",
    "quantum entanglement",
    "an index fund",
    "garbage collection in Java",
    "the water cycle",
    "a Kalman filter",
    "the Pythagorean theorem",
    "HTTP/2 multiplexing",
    "inflation",
    "plate tectonics",
    "a mutex",
    "the Doppler effect",
    "black holes",
    "a REST API",
    "Bayes' theorem",
    "the immune system",
    "a linked list",
    "supply and demand",
    "continental drift",
    "a neural network",
]


def semantic_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
        import usearch  # noqa: F401
    except ImportError:
        return False
    return True


def traffic(seconds: float, seed: int = 7) -> Workload:
    """Chat completions over ``seconds``: mostly popular questions (Zipf-like), some new,
    paraphrased or sampled, at a rate that swells and ebbs, with bursts of identical requests
    at once (a retry storm, a popular prompt: one upstream call) every 2-4.5 s."""
    rng = random.Random(seed)
    requests: list[BenchRequest] = []

    def chat(t: float, content: str, stream: bool, temperature: float = 0) -> None:
        body: dict[str, Any] = {
            "model": "sim",
            "messages": [{"role": "user", "content": content}],
            "temperature": temperature,
            "max_tokens": rng.choice([16, 24, 32, 48]),
            "stream": stream,
        }
        requests.append(BenchRequest(t, CHAT, body))

    t, next_burst, bursts = 0.0, 1.5, 0
    while t < seconds:
        rate = 14 + 22 * math.sin(t / seconds * 2.2 * math.pi) ** 2  # req/s, swelling
        if t >= next_burst:
            bursts += 1
            prompt = f"Summarise today's incident report #{bursts} for the on-call channel."
            for i in range(rng.randrange(8, 24)):
                chat(t, prompt, stream=i % 3 == 0)
            next_burst = t + rng.uniform(2.0, 4.5)
        r, stream = rng.random(), rng.random() < 0.33
        topic = TOPICS[min(int(rng.paretovariate(1.1)) - 1, len(TOPICS) - 1)]
        if r < 0.62:
            chat(t, f"Explain {topic} in two sentences.", stream)
        elif r < 0.74:
            chat(t, f"Could you explain {topic} in two sentences?", stream)
        elif r < 0.90:
            chat(t, f"Question #{rng.randrange(10**6)}: explain {topic}.", stream)
        else:
            chat(t, f"Write a haiku about {topic}.", False, temperature=0.9)
        t += rng.expovariate(rate)
    return Workload("dashboard", requests)


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=22)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not on PATH (apt-get install chromium)")
    from playwright.async_api import async_playwright

    config = Config(
        log_level="warning",
        # about 50 tokens/s, like a real GPU
        sim={"replicas": args.replicas, "decode_ms_per_token": 20},
        semantic={"enabled": semantic_available()},
    )
    with tempfile.TemporaryDirectory(prefix="carpool-dashboard-") as tmp:
        async with embedded_gateway(config, Path(tmp) / "gateway.log") as url:
            warm_up = {"model": "sim", "messages": [{"role": "user", "content": "warm up"}]}
            await asyncio.to_thread(fetch, "POST", url + CHAT, warm_up)  # model load, routes
            async with async_playwright() as playwright:
                browser = await playwright.chromium.launch(
                    executable_path=chromium, args=CHROMIUM_ARGS
                )
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                await page.goto(f"{url}/dashboard?window={int(args.seconds) + 2}")
                workload = traffic(args.seconds + 3)
                arrivals = [r.t for r in workload.requests]
                load = asyncio.create_task(replay(workload, url, arrivals=arrivals))
                await asyncio.sleep(args.seconds)  # the shot, while it runs
                await page.wait_for_function(  # right after a poll
                    "n => window.carpoolDashboard.ticks > n",
                    arg=await page.evaluate("window.carpoolDashboard.ticks"),
                )
                args.out.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(args.out))
                await browser.close()
                run = await load
    outcomes = collections.Counter(r.outcome or "?" for r in run.results)
    print(f"{args.out}: {len(run.results)} requests {dict(outcomes)}")


if __name__ == "__main__":
    asyncio.run(main())
