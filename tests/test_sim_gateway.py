"""The gateway in front of its embedded simulated engine (no upstreams configured), over HTTP on
loopback: what it serves of the simulator's own, and how its answers are labelled."""

from __future__ import annotations

from conftest import run_gateway


def chat(content: str = "What is a carpool?") -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


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
