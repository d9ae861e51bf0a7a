"""Take docs/dashboard.png: the live /dashboard after ~20 s of realistic traffic.

    python benchmarks/dashboard_screenshot.py [--seconds 22] [--out docs/dashboard.png]

Runs ``carpool serve`` with its embedded SIMULATED engine (3 replicas, semantic cache on when the
[semantic] extra is installed) on a free port, opens /dashboard in Debian's headless ``chromium``
(driven by Playwright; no browser is downloaded), sends a mix of chat completions (a popular set
of repeated questions, bursts of identical concurrent ones, paraphrases, sampled ones, a third
streamed) at a rate that swells and ebbs, then saves a 1280x900 screenshot.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def semantic_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
        import usearch  # noqa: F401
    except ImportError:
        return False
    return True


async def wait_healthy(
    client: httpx.AsyncClient, process: subprocess.Popen, seconds: float
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"carpool serve exited with {process.returncode}")
        try:
            if (await client.get("/healthz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit("carpool serve did not become healthy")


class Traffic:
    def __init__(self, client: httpx.AsyncClient, seed: int = 7) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.tasks: set[asyncio.Task[None]] = set()
        self.bursts = 0
        self.outcomes: dict[str, int] = {}

    async def chat(self, content: str, *, stream: bool = False, temperature: float = 0) -> None:
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": content}],
            "temperature": temperature,
            "max_tokens": self.rng.choice([16, 24, 32, 48]),
            "stream": stream,
        }
        if stream:
            async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
                await response.aread()
        else:
            response = await self.client.post("/v1/chat/completions", json=body)
        outcome = response.headers.get("x-carpool", "?")
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def one(self) -> None:
        """One request: mostly popular questions (Zipf-like), some new, paraphrased or sampled."""
        r = self.rng.random()
        stream = self.rng.random() < 0.33
        topic = TOPICS[min(int(self.rng.paretovariate(1.1)) - 1, len(TOPICS) - 1)]
        if r < 0.62:
            self.spawn(self.chat(f"Explain {topic} in two sentences.", stream=stream))
        elif r < 0.74:
            self.spawn(self.chat(f"Could you explain {topic} in two sentences?", stream=stream))
        elif r < 0.90:
            self.spawn(
                self.chat(f"Question #{self.rng.randrange(10**6)}: explain {topic}.", stream=stream)
            )
        else:
            self.spawn(self.chat(f"Write a haiku about {topic}.", temperature=0.9))

    def burst(self) -> None:
        """Identical requests at once (a retry storm, a popular prompt): one upstream call."""
        self.bursts += 1
        prompt = f"Summarise today's incident report #{self.bursts} for the on-call channel."
        for i in range(self.rng.randrange(8, 24)):
            self.spawn(self.chat(prompt, stream=i % 3 == 0))

    async def run(self, seconds: float) -> None:
        start = time.monotonic()
        next_burst = start + 1.5
        while (now := time.monotonic()) - start < seconds:
            elapsed = now - start
            rate = 14 + 22 * math.sin(elapsed / seconds * 2.2 * math.pi) ** 2  # req/s, swelling
            if now >= next_burst:
                self.burst()
                next_burst = now + self.rng.uniform(2.0, 4.5)
            self.one()
            await asyncio.sleep(self.rng.expovariate(rate))
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=22)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--replicas", type=int, default=3)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not on PATH (apt-get install chromium)")
    from playwright.async_api import async_playwright

    port = free_port()
    env = {
        **os.environ,
        "CARPOOL_SIM__REPLICAS": str(args.replicas),
        "CARPOOL_SIM__DECODE_MS_PER_TOKEN": "20",  # about 50 tokens/s, like a real GPU
        "CARPOOL_LOG_LEVEL": "warning",
    }
    if semantic_available():
        env["CARPOOL_SEMANTIC__ENABLED"] = "true"
    carpool = Path(sys.executable).with_name("carpool")
    process = subprocess.Popen([str(carpool), "serve", "--port", str(port)], env=env)
    url = f"http://{HOST}:{port}"
    try:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            await wait_healthy(client, process, 60)
            await client.post(
                "/v1/chat/completions",
                json={  # warm up (model load, routes)
                    "model": "sim",
                    "messages": [{"role": "user", "content": "warm up"}],
                },
            )
            async with async_playwright() as playwright:
                browser = await playwright.chromium.launch(
                    executable_path=chromium, args=CHROMIUM_ARGS
                )
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                window = int(args.seconds) + 2
                await page.goto(f"{url}/dashboard?window={window}")
                traffic = Traffic(client)
                load = asyncio.create_task(traffic.run(args.seconds + 3))
                await asyncio.sleep(args.seconds)  # the shot, while it runs
                await page.wait_for_function(  # right after a poll
                    "n => window.carpoolDashboard.ticks > n",
                    arg=await page.evaluate("window.carpoolDashboard.ticks"),
                )
                args.out.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(args.out))
                await browser.close()
                await load
            print(f"{args.out}: {sum(traffic.outcomes.values())} requests {traffic.outcomes}")
    finally:
        process.terminate()
        process.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
