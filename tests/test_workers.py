"""`carpool serve --workers N`: several processes on one port, sharing one Redis (issue 9)."""

from __future__ import annotations

import httpx

from fakes.instances import free_port, serve_env, start_serve
from test_distributed import until_serving

QUESTION = "What do the workers share?"


async def test_workers_on_one_port_share_the_cache_through_redis(fake, shared_redis, tmp_path):
    """On a cluster too: `carpool serve` sees a cluster node and takes a cluster client."""
    port = free_port()
    env = serve_env()
    log = tmp_path / "workers.log"
    proc = start_serve(
        [
            "--upstream",
            fake.url,
            "--redis",
            shared_redis.url,
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        env,
        log,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as probe:
            await until_serving(probe, proc, log)
        body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
        pids, outcomes = set(), []
        # A new connection per request, so the kernel spreads them over both workers.
        for _ in range(200):
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                outcomes.append(response.headers["x-carpool"])
                pids.add((await client.get("/stats")).json()["pid"])
            if len(pids) == 2 and len(outcomes) >= 20:
                break
        assert len(pids) == 2, "every request landed on one worker"
        assert outcomes[0] == "miss" and set(outcomes[1:]) == {"hit"}
        assert fake.count() == 1  # one upstream call for both workers
    finally:
        proc.terminate()
        proc.wait(10)
