"""The gateway in front of its embedded simulated engine (no upstreams configured), over HTTP on
loopback: what it serves of the simulator's own, and how its answers are labelled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from carpool.config import Config, SimConfig
from carpool.server import create_app
from carpool.upstream.sim import SimReplica, embedding_vector
from carpool.upstream.sim_server import create_app as create_sim_app
from carpool.wiring import build_gateway
from conftest import run_gateway
from fakes.serving import serve_app
from fakes.waiting import eventually


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


def sse_data(raw: str) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    return [orjson.loads(line) for line in lines if line != "[DONE]"]


async def test_the_simulator_cuts_chat_and_completions_before_the_first_stop_string():
    async with run_gateway([]) as sim:
        body = {**chat("stop here"), "max_tokens": 40}
        full = (await sim.client.post("/v1/chat/completions", json=body)).json()
        text = full["choices"][0]["message"]["content"]
        words = text.split(" ")
        assert len(words) > 4
        # A stop string inside a word, and a later one: the earliest wins, and is not returned.
        stop = [" " + words[4], words[2][1:] + " " + words[3]]
        expected = text[: text.find(stop[1])]
        cut = (await sim.client.post("/v1/chat/completions", json={**body, "stop": stop})).json()
        assert cut["choices"][0]["message"]["content"] == expected
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["usage"]["completion_tokens"] == len(expected.split(" "))
        async with sim.client.stream(
            "POST", "/v1/chat/completions", json={**body, "stop": stop, "stream": True, "seed": 1}
        ) as response:
            chunks = sse_data((await response.aread()).decode())
        pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
        assert "".join(pieces) == expected
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        prompt = {"model": "m", "prompt": "stop here", "max_tokens": 40, "temperature": 0}
        whole = (await sim.client.post("/v1/completions", json=prompt)).json()
        text = whole["choices"][0]["text"]
        first = text.split(" ")[1]
        cut = (await sim.client.post("/v1/completions", json={**prompt, "stop": first})).json()
        assert cut["choices"][0]["text"] == text[: text.find(first)]
        invalid = await sim.client.post("/v1/completions", json={**prompt, "stop": 3})
        assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "stop"


async def test_the_simulator_ends_a_message_at_a_stop_sequence_and_names_it():
    async with run_gateway([]) as sim:
        body = {**BODIES["/v1/messages"], "max_tokens": 40}
        full = (await sim.client.post("/v1/messages", json=body)).json()
        text = full["content"][0]["text"]
        stop = text.split(" ")[3]
        expected = text[: text.find(stop)]
        cut = await sim.client.post("/v1/messages", json={**body, "stop_sequences": [stop]})
        answer = cut.json()
        assert answer["content"][0]["text"] == expected
        assert (answer["stop_reason"], answer["stop_sequence"]) == ("stop_sequence", stop)
        async with sim.client.stream(
            "POST",
            "/v1/messages",
            json={**body, "stop_sequences": [stop], "stream": True, "max_tokens": 41},
        ) as response:
            events = sse_data((await response.aread()).decode())
        delta = next(e for e in events if e["type"] == "message_delta")["delta"]
        assert (delta["stop_reason"], delta["stop_sequence"]) == ("stop_sequence", stop)


async def test_a_cut_responses_stream_says_how_it_ended_only_in_its_last_event():
    async with run_gateway([]) as sim:
        body = {"model": "m", "input": "cut me", "max_output_tokens": 2, "stream": True}
        async with sim.client.stream("POST", "/v1/responses", json=body) as response:
            events = sse_data((await response.aread()).decode())
        heads = [e for e in events if e["type"] in ("response.created", "response.in_progress")]
        assert len(heads) == 2
        for head in heads:
            assert head["response"]["status"] == "in_progress"
            assert head["response"]["incomplete_details"] is None
            assert head["response"]["error"] is None
        last = events[-1]["response"]
        assert last["status"] == "incomplete"
        assert last["incomplete_details"] == {"reason": "max_output_tokens"}


def spelled(temperature: str) -> bytes:
    return (
        '{"model": "m", "messages": [{"role": "user", "content": "spell it"}], "seed": 5, '
        f'"max_tokens": 8, "temperature": {temperature}, "top_p": {temperature}}}'
    ).encode()


async def posted(client: httpx.AsyncClient, path: str, content: bytes) -> httpx.Response:
    return await client.post(path, content=content, headers={"content-type": "application/json"})


async def test_every_spelling_of_a_number_gets_the_engines_own_answer_through_the_gateway():
    engine = create_sim_app(SimReplica("sim-0", SimConfig()))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=engine), base_url="http://sim"
    ) as alone:
        own = {
            spelling: (await posted(alone, "/v1/chat/completions", spelled(spelling))).json()
            for spelling in ("1", "1.0")
        }
    texts = {s: body["choices"][0]["message"]["content"] for s, body in own.items()}
    assert texts["1"] == texts["1.0"]
    async with run_gateway([]) as sim:
        first = await posted(sim.client, "/v1/chat/completions", spelled("1.0"))
        second = await posted(sim.client, "/v1/chat/completions", spelled("1"))
        assert (first.headers["x-carpool"], second.headers["x-carpool"]) == ("miss", "hit")
        for response in (first, second):
            assert response.json()["choices"][0]["message"]["content"] == texts["1"]


async def test_the_engines_400s_for_its_limits_and_ranges_reach_clients_through_the_gateway():
    async with run_gateway([]) as sim:
        refused = [
            ("/v1/chat/completions", {**chat(), "temperature": 3, "seed": 1}, "temperature"),
            ("/v1/chat/completions", {**chat(), "top_p": 1.5}, "top_p"),
            ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 6}, "logprobs"),
            ("/v1/completions", {"model": "m", "prompt": "hi", "best_of": 1, "n": 2}, "best_of"),
            ("/v1/embeddings", {"model": "m", "input": "hi", "dimensions": 4097}, "dimensions"),
            ("/v1/completions", {"model": "m", "prompt": ["a"] * 17, "n": 128}, "n"),
        ]
        for path, body, param in refused:
            for _ in range(2):  # never stored: the second is the engine's 400 again
                response = await sim.client.post(path, json=body)
                assert response.status_code == 400, (path, body)
                error = response.json()["error"]
                assert (error["type"], error["param"]) == ("invalid_request_error", param)
        calls = (await sim.client.get("/sim/stats")).json()["replicas"][0]["calls"]
        assert sum(calls.values()) == 2 * len(refused)


async def test_the_largest_embeddings_call_the_engine_allows_is_answered_through_the_gateway():
    inputs = [f"item {i}" for i in range(2048)]
    async with run_gateway([]) as sim:
        response = await sim.client.post(
            "/v1/embeddings", json={"model": "e", "input": inputs, "dimensions": 512}
        )
        assert response.status_code == 200
        data = response.json()["data"]
        assert [d["index"] for d in data] == list(range(2048))
        assert all(len(d["embedding"]) == 512 for d in data)
        for i in (0, 1, 1000, 2047):  # (each vector takes as long to check as to make)
            assert data[i]["embedding"] == embedding_vector("e", inputs[i], 512)


async def test_a_call_every_client_left_frees_the_simulators_slot_when_it_runs_apart():
    # `carpool sim` behind the gateway: the gateway cancels a call every client left
    # (coalesce.finish_abandoned: false), closing its connection, to free the engine, as vLLM
    # and SGLang free a request whose connection closed. The simulator kept decoding it.
    released = asyncio.Event()

    async def decoding_until_released(seconds: float) -> None:
        await released.wait()

    engine = SimReplica("sim-0", SimConfig(max_concurrency=1), sleep=decoding_until_released)
    async with serve_app(create_sim_app(engine), http="httptools") as engine_url:
        async with run_gateway([engine_url + "/v1"]) as gw:
            leaving = asyncio.create_task(
                gw.client.post("/v1/chat/completions", json=chat("a question nobody waits for"))
            )
            await eventually(lambda: engine.in_flight == 1, what="the call holding its slot")
            leaving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await leaving
            await eventually(lambda: gw.gateway.stats.abandoned == 1, what="the client gone")
            await eventually(lambda: engine.in_flight == 0, what="the engine's slot freed")
            released.set()
            answered = await gw.client.post("/v1/chat/completions", json=chat("the next one"))
            assert answered.status_code == 200 and answered.headers["x-carpool"] == "miss"
    assert engine.stats()["calls"]["chat/completions"] == 2
    assert engine.completion_tokens == answered.json()["usage"]["completion_tokens"]


async def test_a_message_under_api_version_2026_10_21_with_temperature_is_the_engines_400():
    """As Anthropic answers it (the ``anthropic`` SDK 2.x sends that version by default): the
    docs' way to share Messages (``temperature: 0``) must fail here as it fails there, not
    work in front of the simulator and fail in production. Under 2023-06-01 it is shared."""
    async with run_gateway([]) as sim:
        body = BODIES["/v1/messages"]
        assert "temperature" in body
        for version, outcomes in (("2026-10-21", []), ("2023-06-01", ["miss", "hit"])):
            headers = {"anthropic-version": version}
            got = [await sim.client.post("/v1/messages", json=body, headers=headers) for _ in "ab"]
            if not outcomes:
                assert [r.status_code for r in got] == [400, 400]
                error = got[1].json()
                assert error["type"] == "error" and "temperature" in error["error"]["message"]
            else:
                assert [r.headers["x-carpool"] for r in got] == outcomes
