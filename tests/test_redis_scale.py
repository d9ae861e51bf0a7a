"""carpool on Redis under load and faults, with gateway instances as separate processes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal

import httpx
import pytest

from fakes.instances import instances

pytest.importorskip("redis")


QUESTION = "What is carpool?"


def body(prompt: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 0}


async def test_a_burst_of_1000_requests_over_3_instances_makes_one_call_per_prompt(
    fake, shared_redis
):
    prompts = [f"prompt number {i}" for i in range(50)]
    async with instances(3, fake.url, shared_redis.url) as gateways:
        fake.gate = asyncio.Event()

        async def one(i: int):
            gateway = gateways[i % 3]
            return await gateway.client.post("/v1/chat/completions", json=body(prompts[i % 50]))

        tasks = [asyncio.create_task(one(i)) for i in range(1000)]

        async def attached() -> int:  # clients waiting on a flight, all instances
            return sum([(await g.stats())["waiters"] for g in gateways])

        while await attached() < 1000 or fake.count() < 50:
            await asyncio.sleep(0.05)
        fake.gate.set()
        responses = await asyncio.gather(*tasks)
        states = [(await g.stats())["redis"] for g in gateways]
    assert [r.status_code for r in responses] == [200] * 1000
    outcomes = collections.Counter(r.headers["x-carpool"] for r in responses)
    assert fake.count() == 50, (outcomes, states)


def content(response) -> str:
    return response.json()["choices"][0]["message"]["content"]


def sse_text(raw: str) -> str:
    """The content of an SSE chat stream (its deltas joined); fails on an error event."""
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    return "".join(out)


async def stream(instance, prompt: str) -> tuple[int, str]:
    async with instance.client.stream(
        "POST", "/v1/chat/completions", json={**body(prompt), "stream": True}
    ) as response:
        raw = (await response.aread()).decode()
    return response.status_code, raw


async def test_an_instance_killed_holding_an_idempotency_key_frees_it_when_its_lease_ends(
    fake, shared_redis
):
    import redis.asyncio as aredis

    from carpool.config import IdempotencyConfig
    from conftest import redis_keys

    async with instances(2, fake.url, shared_redis.url) as (a, b):
        fake.gate = asyncio.Event()
        key = {"Idempotency-Key": "order-1"}
        first = asyncio.create_task(
            a.client.post("/v1/chat/completions", json=body("charge"), headers=key)
        )
        await fake.wait_for_calls(1)
        a.kill()
        with contextlib.suppress(httpx.HTTPError):
            await first
        # The dead instance's record lives no longer than a lease (none renews it now).
        (record,) = [k for k in await redis_keys(shared_redis) if b"idem:" in k]
        left = []
        for node in getattr(shared_redis, "nodes", [shared_redis]):
            client = aredis.Redis.from_url(node.url)
            with contextlib.suppress(aredis.ResponseError):  # (MOVED: another node's)
                left.append(await client.pttl(record))
            await client.aclose()
        lease_ms = IdempotencyConfig().lease * 1000
        assert any(0 < ms <= lease_ms for ms in left), left
        fake.gate = None  # the retry's call answers at once
        for _ in range(int(lease_ms / 100) * 3):  # (a wait of three leases at most)
            retry = await b.client.post("/v1/chat/completions", json=body("charge"), headers=key)
            if retry.status_code != 409:  # 409: A's record still held
                break
            await asyncio.sleep(0.1)
        assert retry.status_code == 200, "the dead instance's key is still held"
        assert content(retry) == "answer 2 to charge" and fake.count() == 2


async def test_redis_paused_3_s_mid_flight_no_follower_without_bytes_gets_an_error(
    fake, killable_redis
):
    async with instances(2, fake.url, killable_redis.url) as (a, b):
        fake.gate = asyncio.Event()
        led = asyncio.create_task(a.client.post("/v1/chat/completions", json=body(QUESTION)))
        await fake.wait_for_calls(1)
        followers = [
            asyncio.create_task(b.client.post("/v1/chat/completions", json=body(QUESTION))),
            asyncio.create_task(stream(b, QUESTION)),
        ]
        while (await b.stats())["redis"]["flights"]["following"] != 1:
            await asyncio.sleep(0.02)
        for pid in killable_redis.pids:  # a cluster: every node at once
            os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(3)  # the pause itself is the test's subject
        finally:
            for pid in killable_redis.pids:
                os.kill(pid, signal.SIGCONT)
        fake.gate.set()
        plain, (status, raw) = await asyncio.gather(*followers)
        assert (await led).status_code == 200
    assert plain.status_code == 200 and status == 200
    assert content(plain).startswith("answer ") and sse_text(raw).startswith("answer ")


async def test_a_streaming_leaders_instance_killed_followers_without_bytes_get_one_takeover(
    fake, shared_redis
):
    async with instances(2, fake.url, shared_redis.url) as (a, b):
        fake.gate = asyncio.Event()  # A's call sends nothing, not even headers
        leader = asyncio.create_task(stream(a, QUESTION))
        await fake.wait_for_calls(1)
        followers = [
            asyncio.create_task(b.client.post("/v1/chat/completions", json=body(QUESTION))),
            asyncio.create_task(stream(b, QUESTION)),
            asyncio.create_task(stream(b, QUESTION)),
        ]
        while (await b.stats())["waiters"] != 3:
            await asyncio.sleep(0.02)
        fake.gate = None  # the takeover's call answers at once
        a.kill()
        with contextlib.suppress(httpx.HTTPError):
            await leader
        plain, (s1, raw1), (s2, raw2) = await asyncio.gather(*followers)
    assert [plain.status_code, s1, s2] == [200, 200, 200]
    assert content(plain) == sse_text(raw1) == sse_text(raw2) == f"answer 2 to {QUESTION}"
    assert fake.count() == 2


async def test_a_leader_lost_mid_stream_errors_only_clients_that_got_part_of_it(fake, shared_redis):
    """The streaming leader's instance dies after some frames reached B: B's streaming client
    (it got those frames) ends with an error event; B's non-streaming client got nothing, so
    it is answered by one takeover call, as is a request arriving after the death."""
    async with instances(2, fake.url, shared_redis.url, {"distributed": {"lease_ms": 1000}}) as (
        a,
        b,
    ):
        fake.chunk_gate = asyncio.Event()
        leader = asyncio.create_task(stream(a, QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 10)
        streaming = asyncio.create_task(stream(b, QUESTION))
        plain = asyncio.create_task(b.client.post("/v1/chat/completions", json=body(QUESTION)))
        while (await b.stats())["redis"]["flights"]["frames_relayed"] < 2 or (await b.stats())[
            "waiters"
        ] != 2:
            await asyncio.sleep(0.02)
        fake.chunk_gate = None  # the takeover's call runs to its end
        a.kill()
        with contextlib.suppress(httpx.HTTPError):
            await leader
        late = await b.client.post("/v1/chat/completions", json=body(QUESTION))
        (status, raw), answered = await asyncio.gather(streaming, plain)
        flights = (await b.stats())["redis"]["flights"]
    assert status == 200 and "data: [DONE]" not in raw
    assert (
        json.loads(raw.strip().splitlines()[-1][len("data: ") :])["error"]["code"]
        == "upstream_stream_broken"
    )
    assert answered.status_code == 200 and content(answered) == f"answer 2 to {QUESTION}"
    assert late.status_code == 200 and content(late) == f"answer 2 to {QUESTION}"
    assert fake.count() == 2 and flights["broken"] == 1
