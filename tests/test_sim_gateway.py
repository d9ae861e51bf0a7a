"""The gateway in front of its embedded simulated engine (no upstreams configured), over HTTP on
loopback: what it serves of the simulator's own, and how its answers are labelled."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from carpool.config import Config
from carpool.server import create_app
from carpool.wiring import build_gateway
from conftest import run_gateway
from fakes.serving import serve_app


def chat(content: str = "What is a carpool?") -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
    }


async def test_sim_stats_is_served_in_front_of_the_embedded_simulator():
    async with run_gateway([]) as sim:
        await sim.client.post("/v1/chat/completions", json=chat())
        response = await sim.client.get("/sim/stats")
        assert response.status_code == 200
        stats = response.json()
        assert stats["simulated"] is True
        assert [r["replica"] for r in stats["replicas"]] == ["sim-0"]
        assert stats["replicas"][0]["calls"]["chat/completions"] == 1


async def test_sim_stats_needs_the_admin_token_as_stats_does():
    async with run_gateway([], admin_token="s3cret") as sim:
        refused = await sim.client.get("/sim/stats")
        assert refused.status_code == 401
        allowed = await sim.client.get("/sim/stats", headers={"authorization": "Bearer s3cret"})
        assert allowed.status_code == 200 and allowed.json()["simulated"] is True


async def test_sim_stats_is_not_served_in_front_of_real_upstreams(gw):
    assert (await gw.client.get("/sim/stats")).status_code == 404


BODIES = {
    "/v1/chat/completions": chat("labels"),
    "/v1/completions": {"model": "m", "prompt": "labels", "max_tokens": 4, "temperature": 0},
    "/v1/responses": {"model": "m", "input": "labels", "temperature": 0},
    "/v1/messages": {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": "labels"}],
    },
    "/v1/embeddings": {"model": "m", "input": "labels"},
}


def labelled_once(response: httpx.Response) -> bool:
    return response.headers.get_list("x-carpool-simulated") == ["true"]


@contextlib.asynccontextmanager
async def simulated_gateway(http: str, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway in front of its simulator, served by carpool's protocol or by h11 (the ASGI
    path alone)."""
    options = {} if http == "carpool" else {"http": http}
    app = create_app(build_gateway(Config(**config)))
    async with serve_app(app, **options) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client


@pytest.mark.parametrize("http", ["carpool", "h11"])
@pytest.mark.parametrize("path", list(BODIES))
async def test_every_answer_of_a_cached_endpoint_in_front_of_the_simulator_is_labelled(http, path):
    async with simulated_gateway(http, limits={"max_header_bytes": 4096}) as client:
        miss = await client.post(path, json=BODIES[path])
        hit = await client.post(path, json=BODIES[path])
        assert (miss.headers["x-carpool"], hit.headers["x-carpool"]) == ("miss", "hit")
        assert labelled_once(miss) and labelled_once(hit)
        if path != "/v1/embeddings":
            body = {**BODIES[path], "stream": True, "max_tokens": 3}
            body.pop("max_output_tokens", None)
            async with client.stream("POST", path, json=body) as streamed:
                await streamed.aread()
            assert streamed.status_code == 200 and labelled_once(streamed)
        invalid = await client.post(path, content=b"{nope")
        assert invalid.status_code == 400 and labelled_once(invalid)
        refused = await client.post(path, json=BODIES[path], headers={"x-big": "x" * 5000})
        assert refused.status_code == 431 and labelled_once(refused)
        # Not a cached endpoint's answer: the gateway adds nothing to the simulator's own.
        models = await client.get("/v1/models")
        assert labelled_once(models)


async def test_answers_in_front_of_real_upstreams_are_not_labelled(gw):
    response = await gw.client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200
    assert "x-carpool-simulated" not in response.headers
