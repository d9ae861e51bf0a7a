"""How soon two gateway instances share through Redis again once it has restarted empty.

Two instances (in this process, over HTTP on loopback, the default ``distributed`` settings:
``retry_interval`` 1 s, ``lease_ms`` 5000, ``timeout`` 0.5 s) in front of a counting upstream,
on one Valkey server or a 3-master Valkey cluster. The servers, the cluster and the upstream
are the test suite's (``tests/fakes/``: this script puts ``tests/`` on its path). Not a test: a
measurement, run by hand; ``--trials`` runs of each case, on each topology:

- ``outage``: Redis killed (SIGKILL); ``--down`` seconds (2) after both instances say
  ``degraded`` (each is sent a request every 10 ms), it is started again, empty, on the same
  port(s), in a thread while the instances keep serving. "Back" is when it answers again
  (polled every ms: a server's PING; a cluster, every node ``cluster_state:ok``); then
  traffic every 10 ms, each prompt to A then to B: ``up`` is when each instance's health says
  ``up`` again (read every ms), ``shared`` when B first answers A's prompt as a hit (an answer
  stored through Redis by one instance, found there by the other).
- ``mid-call``: A leads a call held at the upstream, B follows it; Redis is killed and started
  again, empty, with this process's event loop blocked meanwhile (the instances see no outage,
  only an empty Redis: a fast failover that lost writes, as in
  ``test_redis_restarted_empty_mid_call_nobody_fails_and_a_retry_may_run_twice``). From then:
  ``takeover``, when B's client gets its answer (B's follower saw the call's lock gone and
  made the call itself), then ``up`` and ``shared`` as above (a stale pooled connection may
  fail a call: 0 when neither instance went degraded).

    PYTHONPATH=src python scripts/measure_redis_restart.py [--trials 5] [--topology both] [--down 2]

Prints one line per trial, then the median and the largest of each figure, in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from carpool.config import Config  # noqa: E402
from carpool.server import create_app  # noqa: E402
from carpool.wiring import build_gateway  # noqa: E402
from fakes.redis_cluster import RedisCluster  # noqa: E402
from fakes.redis_server import RedisServer  # noqa: E402
from fakes.serving import serve_app  # noqa: E402
from fakes.upstream import FakeUpstream  # noqa: E402

PACE = 0.01  # s between two rounds of requests (traffic, and how often health is read)
LIMIT = 30.0  # s: a figure not reached by then is reported as missing
DOWN = 2.0  # s Redis stays down in ``outage`` once both instances say degraded (``--down``)


class Instance:
    def __init__(self, gateway: Any, client: httpx.AsyncClient) -> None:
        self.gateway, self.client = gateway, client

    def state(self) -> str:
        return str(self.gateway.redis_health()["state"])

    async def chat(self, prompt: str) -> httpx.Response:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 0}
        response = await self.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text  # nothing fails because Redis did
        return response


@contextlib.asynccontextmanager
async def two_instances(upstream: str, target: Any) -> AsyncIterator[tuple[Instance, Instance]]:
    config = Config(upstreams=[upstream], redis=target.url, distributed={"cluster": target.cluster})
    async with contextlib.AsyncExitStack() as stack:
        made = []
        for _ in range(2):
            gateway = build_gateway(config)
            url = await stack.enter_async_context(serve_app(create_app(gateway)))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
            made.append(Instance(gateway, client))
        yield made[0], made[1]


async def until(condition: Any, what: str, probe: Any = None) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LIMIT
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError(what)
        if probe is not None:
            await probe()
        await asyncio.sleep(PACE)


class Watch:
    """Each instance's health, read every millisecond from its start: ``up[name]`` is when it
    last became ``up`` (None while degraded; the start if never degraded since). Figures are
    in ms after ``back``, set once Redis answers again."""

    def __init__(self, instances: dict[str, Instance]) -> None:
        self.instances = instances
        self.back = self.now()
        self.up: dict[str, float | None] = dict.fromkeys(instances, self.back)
        self._task = asyncio.create_task(self._run())

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def ms(self, at: float | None = None) -> float:
        return ((self.now() if at is None else at) - self.back) * 1000

    async def _run(self) -> None:
        while True:
            for name, instance in self.instances.items():
                if instance.state() != "up":
                    self.up[name] = None
                elif self.up[name] is None:
                    self.up[name] = self.now()
            await asyncio.sleep(0.001)

    async def until_shared(self, a: Instance, b: Instance, tag: str) -> dict[str, float]:
        """Traffic every ``PACE`` s: each prompt to A, then to B, until both are up and B
        answers A's prompt as a hit. The figures: ``up_a``, ``up_b`` (0 if up before Redis
        was seen answering: within the 1 ms of ``answering``), ``shared``."""
        shared = None
        for i in range(int(LIMIT / PACE)):
            await a.chat(f"{tag} probe {i}")
            if (await b.chat(f"{tag} probe {i}")).headers["x-carpool"] == "hit" and shared is None:
                shared = self.ms()
            if shared is not None and None not in self.up.values():
                break
            await asyncio.sleep(PACE)
        self._task.cancel()
        figures = {f"up_{name}": max(0.0, self.ms(up)) for name, up in self.up.items() if up}
        return figures | ({"shared": shared} if shared is not None else {})


async def answering(target: Any) -> None:
    """Return once Redis answers again: a server's PING; every node of a cluster in
    ``cluster_state:ok``, knowing the others (what ``RedisCluster.restart`` waits for too)."""
    import redis.asyncio as aredis

    nodes = getattr(target, "nodes", [target])
    while True:
        ok = True
        for node in nodes:
            client = aredis.Redis(
                host=node.host, port=node.port, socket_connect_timeout=0.05, socket_timeout=0.05
            )
            try:
                if target.cluster:
                    info = await client.execute_command("CLUSTER", "INFO")
                    ok = (
                        b"cluster_state:ok" in info and f"known_nodes:{len(nodes)}".encode() in info
                    )
                else:
                    ok = bool(await client.ping())
            except Exception:  # not up yet
                ok = False
            finally:
                await client.aclose()
            if not ok:
                break
        if ok:
            return
        await asyncio.sleep(0.001)


async def outage(fake: FakeUpstream, target: Any, trial: int) -> dict[str, float]:
    async with two_instances(fake.url, target) as (a, b):
        await a.chat(f"outage {trial} warm")
        target.kill()

        async def traffic() -> None:
            await a.chat(f"outage {trial} while down")
            await b.chat(f"outage {trial} while down")

        await until(lambda: a.state() == b.state() == "degraded", "both degraded", traffic)
        loop = asyncio.get_running_loop()
        stays_down = loop.time() + DOWN
        while loop.time() < stays_down:  # (the readers' back-off grows meanwhile, as it would)
            await traffic()
            await asyncio.sleep(PACE)
        watch = Watch({"a": a, "b": b})
        restarted = asyncio.create_task(asyncio.to_thread(target.restart))
        await answering(target)
        watch.back = watch.now()
        await restarted
        return await watch.until_shared(a, b, f"outage {trial}")


async def mid_call(fake: FakeUpstream, target: Any, trial: int) -> dict[str, float]:
    question = f"mid-call {trial}"
    async with two_instances(fake.url, target) as (a, b):
        calls = len(fake.calls)
        gate = fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(question))
        await fake.wait_for_calls(calls + 1)
        fake.gate = None  # B's takeover answers at once
        followed = asyncio.create_task(b.chat(question))
        await until(lambda: b.gateway.shared_flights.following == 1, "B following")
        target.restart(kill=True)  # (the loop blocked: the instances see Redis empty at once)
        watch = Watch({"a": a, "b": b})
        await followed
        takeover = watch.ms()
        gate.set()
        await led
        return {"takeover": takeover} | await watch.until_shared(a, b, question)


def cpu() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


async def main() -> None:
    global DOWN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--topology", choices=["server", "cluster", "both"], default="both")
    parser.add_argument("--down", type=float, default=DOWN)
    options = parser.parse_args()
    DOWN = options.down
    print(f"machine: {cpu()}, {os.cpu_count()} CPUs; Python {sys.version.split()[0]}")
    fake = FakeUpstream()
    async with serve_app(fake) as url:
        fake.url = url + "/v1"  # type: ignore[attr-defined]
        for topology in ("server", "cluster"):
            if options.topology not in (topology, "both"):
                continue
            with RedisCluster() if topology == "cluster" else RedisServer() as target:
                server = getattr(target, "nodes", [target])[0]
                print(f"{topology}: {server.name} {server.version}")
                for case in (outage, mid_call):
                    results = []
                    for trial in range(options.trials):
                        figures = await case(fake, target, trial)
                        results.append(figures)
                        shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(figures.items()))
                        print(f"{topology} {case.__name__} #{trial}: {shown} ms")
                    names = sorted({name for figures in results for name in figures})
                    for name in names:
                        values = [figures[name] for figures in results if name in figures]
                        print(
                            f"  {topology} {case.__name__} {name}: median "
                            f"{statistics.median(values):.0f} ms, max {max(values):.0f} ms "
                            f"({len(values)}/{len(results)} trials)"
                        )


if __name__ == "__main__":
    asyncio.run(main())
