"""Routing across replicas and embeddings batching, end to end over HTTP (issue 6)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from carpool.clock import ManualClock
from conftest import run_gateway
from fakes.raw_upstream import RawCall, answer, chat_completion, raw_upstream
from fakes.serving import serve_app
from fakes.upstream import FakeUpstream
from fakes.waiting import eventually


@contextlib.asynccontextmanager
async def replicas(n: int):
    async with contextlib.AsyncExitStack() as stack:
        fakes = []
        for _ in range(n):
            fake = FakeUpstream()
            fake.url = await stack.enter_async_context(serve_app(fake)) + "/v1"
            fakes.append(fake)
        yield fakes


async def test_a_dead_replica_fails_over_and_every_request_succeeds():
    async with replicas(2) as (a, b):
        dead = "http://127.0.0.1:9/v1"  # nothing listens there
        async with run_gateway([dead, a.url, b.url], routing={"policy": "round-robin"}) as gw:
            responses = [await gw.chat(f"question {i}") for i in range(9)]
            assert [r.status_code for r in responses] == [200] * 9
            assert a.count() + b.count() == 9
            stats = (await gw.client.get("/stats")).json()
            assert stats["replicas"][dead]["state"] == "down"
            assert stats["routing"].get("failover", 0) >= 1


async def test_misses_sharing_a_long_system_prompt_stay_on_one_replica():
    async with replicas(3) as fakes:
        async with run_gateway([f.url for f in fakes]) as gw:  # cache-aware default
            system = "You are the support assistant of ACME. " * 60  # ~2.3 KB
            for i in range(12):
                await gw.client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "temperature": 0,
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"question number {i}"},
                        ],
                    },
                )
            counts = sorted(f.count() for f in fakes)
            assert counts[-1] >= 11  # affinity: one replica serves them
            assert (await gw.client.get("/stats")).json()["routing"]["prefix_match"] >= 10


async def test_one_tenants_prefix_does_not_steer_another_tenants_request():
    # Cache-aware matched a prompt against every tenant's: a prefix one tenant sent drew
    # another tenant's request to the replica that computed it, whose time to first token
    # then told that tenant what the first had asked (the prefix-cache timing side channel,
    # made sure by routing). Each tenant's prompts now match only its own (and its model's).
    secret = "Patient record: John Q. Public, DOB 1970-01-01, diagnosis: " + "z" * 400

    def where(fakes: list[FakeUpstream], text: str) -> list[int]:
        return [
            i
            for i, fake in enumerate(fakes)
            for call in fake.calls
            if call.body and call.body["messages"][-1]["content"] == text
        ]

    handbook = "Shared handbook, chapter one: " + "y" * 400
    async with replicas(3) as fakes:
        tenant = {"shared_namespaces": ["docs"]}
        async with run_gateway([f.url for f in fakes], tenant=tenant) as gw:  # cache-aware
            alice, mallory = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer mallory"}
            assert (await gw.chat(secret + " summarise", headers=alice)).status_code == 200
            assert (await gw.chat(secret + " guess", headers=mallory)).status_code == 200
            assert (await gw.chat(secret + " again", headers=alice)).status_code == 200
            answered = await gw.chat(secret + " other model", headers=alice, model="other")
            assert answered.status_code == 200
            salted = await gw.chat(secret + " salted", headers=alice, cache_salt="s1")
            assert salted.status_code == 200  # (vLLM's: no hit under another salt)
            # In a shared namespace the tenants share answers already, and prefixes too.
            for text, who in [(" summarise", alice), (" guess", mallory)]:
                shared = {**who, "x-carpool-namespace": "docs"}
                assert (await gw.chat(handbook + text, headers=shared)).status_code == 200
            routing = (await gw.client.get("/stats")).json()["routing"]
    [held] = where(fakes, secret + " summarise")
    assert where(fakes, secret + " guess") != [held]  # (the least loaded: another one)
    assert where(fakes, secret + " again") == [held]  # its own tenant's prefix: followed
    assert where(fakes, secret + " other model") != [held]
    assert where(fakes, secret + " salted") != [held]
    assert where(fakes, handbook + " guess") == where(fakes, handbook + " summarise")
    assert routing == {"least_loaded": 5, "prefix_match": 2}


async def test_96_concurrent_embeddings_of_16_texts_make_few_calls_each_client_its_own_vector(
    fake, gateway_with
):
    # "on": the fake answers lists item by item (test_embeddings_lists.py tests the probe).
    async with gateway_with(batching={"max_batch_delay_ms": 20, "embeddings": "on"}) as gw:
        texts = [f"text number {i}" for i in range(16)]

        async def embed(text):
            response = await gw.client.post("/v1/embeddings", json={"model": "e", "input": text})
            assert response.status_code == 200, response.text
            return text, response.json()["data"][0]["embedding"]

        results = await asyncio.gather(*(embed(texts[i % 16]) for i in range(96)))
        calls = [c for c in fake.calls if c.path == "/v1/embeddings"]
        assert len(calls) <= 12
        assert (
            sum(len(c.body["input"]) if isinstance(c.body["input"], list) else 1 for c in calls)
            <= 16
        )
        singles = {}
        for text in texts:  # each text's own vector, asked alone
            alone = await gw.client.post(
                "/v1/embeddings",
                json={"model": "e", "input": text},
                headers={"Cache-Control": "no-cache"},
            )
            singles[text] = alone.json()["data"][0]["embedding"]
        assert all(vector == singles[text] for text, vector in results)
        stats = (await gw.client.get("/stats")).json()["batching"]
        assert stats["batches"] >= 1 and stats["max_items_seen"] > 1
        metrics = (await gw.client.get("/metrics")).text
        assert "carpool_batch_wait_seconds_count" in metrics


async def test_by_default_a_text_and_a_token_list_never_share_an_embeddings_call(
    fake, gateway_with
):
    """Once the list probe (of texts) had passed, a text and a token list sent together went
    up as one list mixing them, which OpenAI's and vLLM's schemas refuse (400 for both)."""
    async with gateway_with(batching={"max_batch_delay_ms": 50}) as gw:

        def post(given):
            return gw.client.post("/v1/embeddings", json={"model": "e", "input": given})

        await asyncio.gather(post("warm one"), post("warm two"))  # (starts the probe)
        await gw.gateway.layers.batcher.wait_idle()
        fake.calls.clear()
        text, tokens = await asyncio.gather(post("hello world"), post([15339, 1917]))
        assert text.status_code == tokens.status_code == 200
        inputs = [c.body["input"] for c in fake.calls if c.path == "/v1/embeddings"]
        assert "hello world" in inputs or ["hello world"] in inputs
        assert not any(
            isinstance(given, list) and {type(item) for item in given} >= {str, list}
            for given in inputs
        ), inputs


async def test_upstream_calls_count_every_attempt_a_failover_included():
    # Each attempt reaches (or tries to reach) a replica: two calls, one of them failed. Counted
    # once per logical call before, /stats said 1 call and 1 error for a request that cost two.
    async with replicas(2) as (a, b):
        a.fail_status, a.fail_times = 503, 1
        async with run_gateway([a.url, b.url], routing={"policy": "round-robin"}) as gw:
            assert (await gw.chat("question")).status_code == 200
            assert a.count() + b.count() == 2
            stats = (await gw.client.get("/stats")).json()
            assert stats["routing"] == {"failover": 1}
            assert stats["upstream_calls"] == 2 and stats["upstream_errors"] == 1
            metrics = (await gw.client.get("/metrics")).text
            assert "carpool_upstream_calls_total 2.0" in metrics


async def test_every_request_routed_counts_its_decision_a_failed_ones_too():
    # Only a send that returned was counted: /stats said 10 routing decisions for 20 requests
    # when 10 of them failed (its routing told nothing of the calls that failed).
    dead = "http://127.0.0.1:9/v1"  # nothing listens there
    async with run_gateway([dead, dead], routing={"policy": "round-robin"}) as gw:
        responses = [await gw.chat(f"question {i}") for i in range(3)]
        assert [r.status_code for r in responses] == [502] * 3
        stats = (await gw.client.get("/stats")).json()
        assert sum(stats["routing"].values()) == 3 and stats["routing"]["failover"] >= 1
        assert stats["upstream_calls"] == 6  # (each failed over once)


async def test_a_call_a_live_replica_took_and_dropped_is_not_run_on_another_when_its_resend_cannot_connect():
    """Replica A reads a call whole, answers another call meanwhile (alive: it may be running
    the first), then drops the first without a byte of answer and goes down (no connection
    taken). The transport sent the call again on a new connection (the keep-alive race, it
    took the drop for), whose refusal was "unreachable": failed over, B ran it too. It is
    never sent again now: the replica set's rule holds (not run on another), a 502."""
    took, drop = asyncio.Event(), asyncio.Event()

    async def respond(call: RawCall) -> bytes | tuple[bytes, bool]:
        if call.body["messages"][-1]["content"] == "crash":
            took.set()
            await drop.wait()
            return b"", True  # (the engine died mid-generation: nothing answered)
        return answer(200, b"OK", chat_completion())

    async with raw_upstream(respond) as a, replicas(1) as (b,):
        async with run_gateway([a.url, b.url], routing={"policy": "round-robin"}) as gw:
            assert (await gw.chat("warm a")).status_code == 200  # -> A (its kept connection)
            assert (await gw.chat("warm b")).status_code == 200  # -> B
            crash = asyncio.create_task(gw.chat("crash"))  # -> A, on the kept connection
            await asyncio.wait_for(took.wait(), 5)
            assert (await gw.chat("other b")).status_code == 200  # -> B
            assert (await gw.chat("other a")).status_code == 200  # -> A: answered meanwhile
            assert a.server is not None
            a.server.close()  # A goes down: no new connection taken...
            drop.set()  # ...and the call it took is dropped without a byte
            reply = await asyncio.wait_for(crash, 10)
            stats = (await gw.client.get("/stats")).json()
    asked = [call.body["messages"][-1]["content"] for call in a.calls]
    assert asked == ["warm a", "crash", "other a"]  # (sent once)
    assert [c.body["messages"][-1]["content"] for c in b.calls] == ["warm b", "other b"]
    assert reply.status_code == 502 and reply.headers["x-should-retry"] == "false"
    assert "took the call but gave no answer" in reply.json()["error"]["message"]
    assert stats["upstream_calls"] == 5 and stats["routing"].get("failover", 0) == 0


def _created_id(sse: str) -> str:
    """The response id of a Responses stream's first event (``response.created``)."""
    data = next(line for line in sse.splitlines() if line.startswith("data: "))
    event = json.loads(data.removeprefix("data: "))
    assert event["type"] == "response.created"
    return event["response"]["id"]


def _chunk_id(sse: str) -> str:
    """The completion id of a chat stream's first chunk."""
    data = next(line for line in sse.splitlines() if line.startswith("data: "))
    return json.loads(data.removeprefix("data: "))["id"]


@pytest.mark.parametrize("policy", ["cache-aware", "least-loaded", "round-robin"])
async def test_a_stored_response_is_fetched_and_continued_on_the_replica_that_made_it(policy):
    # Each replica keeps its own responses (vLLM, SGLang): a follow-up went where the policy
    # said, which cache-aware and least-loaded made the other replica every time (by load), and
    # got its 404.
    async with replicas(2) as fakes:
        for fake in fakes:
            fake.keeps_responses = True
        async with run_gateway([f.url for f in fakes], routing={"policy": policy}) as gw:
            client = gw.client
            for i in range(4):
                asked = {"model": "m", "input": f"question {i} " + "x" * 100, "temperature": 0}
                made = await client.post("/v1/responses", json=asked)
                assert made.status_code == 200, made.text
                rid = made.json()["id"]
                got = await client.get(f"/v1/responses/{rid}")
                assert got.status_code == 200 and got.json()["id"] == rid
                items = await client.get(f"/v1/responses/{rid}/input_items")
                assert items.status_code == 200, items.text
                shared = {"model": "m", "input": "and then?", "temperature": 0}
                then = await client.post(
                    "/v1/responses", json={**shared, "previous_response_id": rid}
                )
                assert then.status_code == 200, then.text
                # Sampled (a bypass), and continuing the response that follow-up made.
                sampled = {"model": "m", "input": "and?"}
                again = await client.post(
                    "/v1/responses", json={**sampled, "previous_response_id": then.json()["id"]}
                )
                assert again.status_code == 200, again.text
                got = await client.get(f"/v1/responses/{again.json()['id']}")
                assert got.status_code == 200, got.text
                # Streamed: the id is known from the stream's first event.
                streamed = await client.post(
                    "/v1/responses", json={**asked, "input": f"streamed {i}", "stream": True}
                )
                assert streamed.status_code == 200
                got = await client.get(f"/v1/responses/{_created_id(streamed.text)}")
                assert got.status_code == 200, got.text
            routing = (await client.get("/stats")).json()["routing"]
            assert routing["state_holder"] == 4 * 2  # the two POSTs that continued one
            assert sum(f.count() for f in fakes) == 4 * 8


async def test_one_tenants_stored_responses_never_evict_another_tenants_replica():
    # Which replica made each stored response was remembered in one bound for all tenants,
    # least recently used out: a tenant making more than the bound pushed out every other
    # tenant's, whose follow-ups then went where the policy said, and the other replica's
    # false, final 404 came back. A tenant beyond its share now pushes out its own oldest.
    quiet, loud = {"Authorization": "Bearer quiet"}, {"Authorization": "Bearer loud"}
    bound = 10
    async with replicas(2) as fakes:
        for fake in fakes:
            fake.keeps_responses = True
        routing = {"policy": "round-robin", "state_entries": bound}
        async with run_gateway([f.url for f in fakes], routing=routing) as gw:
            client = gw.client

            async def made(headers: dict[str, str], text: str) -> str:
                asked = {"model": "m", "input": text, "temperature": 0}
                answered = await client.post("/v1/responses", json=asked, headers=headers)
                assert answered.status_code == 200, answered.text
                return answered.json()["id"]

            async def fetched(headers: dict[str, str], rid: str) -> list[int]:
                # Twice: in turn, one of the two goes to the replica that did not make it.
                return [
                    (await client.get(f"/v1/responses/{rid}", headers=headers)).status_code
                    for _ in range(2)
                ]

            kept = [await made(quiet, f"quiet question {i}") for i in range(3)]
            flood = [await made(loud, f"loud question {i}") for i in range(3 * bound)]
            assert len(gw.gateway.layers.holders) == bound
            assert {rid: await fetched(quiet, rid) for rid in kept} == {
                rid: [200, 200] for rid in kept
            }
            follow = {"model": "m", "input": "and then?", "temperature": 0}
            for rid in kept:
                then = await client.post(
                    "/v1/responses", json={**follow, "previous_response_id": rid}, headers=quiet
                )
                assert then.status_code == 200, then.text
            # The flood's newest are followed still; its oldest went (the policy's turn: 404).
            assert await fetched(loud, flood[-1]) == [200, 200]
            assert 404 in await fetched(loud, flood[0])


@pytest.mark.parametrize("policy", ["cache-aware", "least-loaded", "round-robin"])
async def test_a_stored_chat_completion_is_fetched_updated_and_deleted_on_the_replica_that_made_it(
    policy,
):
    # A chat completion asked with ``store: true`` is kept by the replica that made it, as a
    # stored response: its retrieve, update, messages and DELETE went where the policy said
    # (the other replica: its 404). One not stored is remembered nowhere.
    async with replicas(2) as fakes:
        for fake in fakes:
            fake.keeps_completions = True
        async with run_gateway([f.url for f in fakes], routing={"policy": policy}) as gw:
            client, made = gw.client, []
            for i in range(4):
                asked = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"question {i} " + "x" * 100}],
                    "temperature": 0,
                    "store": True,
                }
                whole = await client.post("/v1/chat/completions", json=asked)
                assert whole.status_code == 200, whole.text
                streamed = await client.post(
                    "/v1/chat/completions", json={**asked, "seed": i, "stream": True}
                )
                sampled = await client.post(  # (a bypass)
                    "/v1/chat/completions",
                    json={k: v for k, v in asked.items() if k != "temperature"},
                )
                assert streamed.status_code == sampled.status_code == 200
                ids = [whole.json()["id"], _chunk_id(streamed.text), sampled.json()["id"]]
                for cid in ids:
                    got = await client.get(f"/v1/chat/completions/{cid}")
                    assert got.status_code == 200 and got.json()["id"] == cid, got.text
                messages = await client.get(f"/v1/chat/completions/{ids[0]}/messages")
                assert messages.status_code == 200, messages.text
                updated = await client.post(
                    f"/v1/chat/completions/{ids[0]}", json={"metadata": {"k": "v"}}
                )
                assert updated.status_code == 200 and updated.json()["metadata"] == {"k": "v"}
                plain = {**asked, "store": False}
                assert (await client.post("/v1/chat/completions", json=plain)).status_code == 200
                made += ids
            assert len(gw.gateway.layers.holders) == len(made)  # (not the plain ones)
            for cid in made:
                assert (await client.delete(f"/v1/chat/completions/{cid}")).status_code == 200
            assert not any(f.kept_completions for f in fakes)
            assert sum(f.count() for f in fakes) == 4 * 9 + len(made)


@pytest.mark.parametrize("policy", ["cache-aware", "least-loaded", "round-robin"])
async def test_a_file_uploaded_through_the_gateway_is_read_and_batched_on_the_replica_that_keeps_it(
    policy,
):
    # SGLang keeps the files uploaded to it, and the batches made of them, in its own process:
    # a follow-up went where the policy said (the other replica, by load or in turn), whose
    # 404 the client got: the file it had just uploaded, not found.
    async with replicas(2) as fakes:
        for fake in fakes:
            fake.keeps_files = True
        async with run_gateway([f.url for f in fakes], routing={"policy": policy}) as gw:
            client = gw.client
            for i in range(4):
                lines = b'{"custom_id": "%d"}\n' % i
                uploaded = await client.post("/v1/files", content=lines)
                assert uploaded.status_code == 200, uploaded.text
                file_id = uploaded.json()["id"]
                got = await client.get(f"/v1/files/{file_id}")
                assert got.status_code == 200 and got.json()["id"] == file_id, got.text
                content = await client.get(f"/v1/files/{file_id}/content")
                assert content.status_code == 200 and content.content == lines
                asked = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
                batch = await client.post("/v1/batches", json=asked)
                assert batch.status_code == 200, batch.text
                polled = await client.get(f"/v1/batches/{batch.json()['id']}")
                assert polled.status_code == 200, polled.text
                output = await client.get(f"/v1/files/{polled.json()['output_file_id']}/content")
                assert output.status_code == 200, output.text
                cancelled = await client.post(f"/v1/batches/{batch.json()['id']}/cancel")
                assert cancelled.status_code == 200, cancelled.text
                deleted = await client.delete(f"/v1/files/{file_id}")
                assert deleted.status_code == 200, deleted.text
            assert sum(f.count() for f in fakes) == 4 * 8
            # (Each call on an id went to the replica that made it: ids name their fake.)
            assert all(
                f"-{fake.tag}-" in call.path
                or f"_{fake.tag}_" in call.path
                or call.path in ("/v1/files", "/v1/batches")
                for fake in fakes
                for call in fake.calls
            )


async def test_a_follow_up_whose_holder_fails_gets_its_holders_failure_and_its_retry_goes_there():
    # Only the replica that made a response holds it. Its transient 503 was failed over to the
    # other replica, whose final 404 "Response ... not found" the client got (the SDKs retry a
    # 5xx, never a 404), and so did the client's retry: the holder was then in back-off, and
    # the policy chose the other replica again.
    async with replicas(2) as fakes:
        for fake in fakes:
            fake.keeps_responses = True
        async with run_gateway([f.url for f in fakes], routing={"backoff_s": 60}) as gw:
            body = {"model": "m", "input": "question " + "x" * 100, "temperature": 0}
            rid = (await gw.client.post("/v1/responses", json=body)).json()["id"]
            holder, other = fakes if rid in fakes[0].kept else fakes[::-1]
            asked_other = other.count()
            follow = {**body, "input": "and then?", "previous_response_id": rid}
            holder.fail_status, holder.fail_times = 503, 1
            then = await gw.client.post("/v1/responses", json=follow)
            assert then.status_code == 503, then.text  # the holder's own answer
            # Its holder in back-off (60 s): still the one asked, and it answers.
            retry = await gw.client.post("/v1/responses", json=follow)
            assert retry.status_code == 200, retry.text
            assert retry.json()["previous_response_id"] == rid
            holder.fail_status, holder.fail_times = 503, 1
            another = {**follow, "input": "and after that?"}  # (the first is a cache hit now)
            assert (await gw.client.post("/v1/responses", json=another)).status_code == 503
            got = await gw.client.get(f"/v1/responses/{rid}")  # (pass-through, in back-off)
            assert got.status_code == 200 and got.json()["id"] == rid, got.text
            stats = (await gw.client.get("/stats")).json()
    assert other.count() == asked_other  # never asked for what it cannot have
    assert holder.count("/v1/responses") == 4 and holder.count(f"/v1/responses/{rid}") == 1
    assert stats["routing"].get("failover", 0) == 0


@pytest.mark.parametrize("meanwhile", ["nothing", "another call answered", "data first"])
async def test_a_stream_silent_after_its_head_leaves_its_replica_out_when_the_replica_answered_nothing_since(
    fake, meanwhile
):
    # vLLM with a stuck engine answers a stream's head at once, then nothing. Only silence
    # before the head counted: such a replica stayed healthy (0 failures) and every stream
    # sent there failed after upstream_timeout. A stall the replica's other answers belie (it
    # is alive: a long generation is slow), or after some of the stream came, leaves it in.
    fake.chunk_gate, fake.chunk_gate_after = asyncio.Event(), 0  # (never set: it stalls)
    async with run_gateway([fake.url], limits={"upstream_timeout": 0.5}) as gw:

        async def stalled() -> str:
            if meanwhile == "data first":  # (a chat stream's first chunk precedes its words)
                return (await gw.stream_chat("stalls"))[1]
            # A completion's stream has nothing before its words: its head, then nothing.
            asked = {"model": "m", "prompt": "stalls", "temperature": 0, "stream": True}
            return (await gw.client.post("/v1/completions", json=asked)).text

        stream = asyncio.create_task(stalled())
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        if meanwhile == "another call answered":
            assert (await gw.chat("answered meanwhile")).status_code == 200
        text = await stream
        replica = (await gw.client.get("/stats")).json()["replicas"][fake.url]
    assert '"error"' in text and "stalled" in text  # (the stream's client is told either way)
    if meanwhile == "nothing":
        assert (replica["state"], replica["errors"], replica["failures"]) == ("down", 1, 1)
    else:
        assert (replica["state"], replica["errors"], replica["failures"]) == ("healthy", 0, 0)
    assert fake.count() == (2 if meanwhile == "another call answered" else 1)  # (never re-run)


@pytest.mark.parametrize("status", [302, 307, 101, 999])
async def test_a_replica_answering_a_redirect_or_a_status_no_client_can_read_is_failed_over_left_out_and_counted(
    fake, status
):
    # Each such answer is the gateway's 502; counted as the replica answering, a replica behind
    # an http -> https redirect stayed in rotation and failed half the calls for good.
    from fakes.raw_upstream import answer, raw_upstream

    def respond(call):
        if status == 101:
            return answer(101, b"Switching Protocols", content_type=None), True
        return answer(status, b"X", b"{}", headers=((b"location", b"https://elsewhere/v1"),))

    async with raw_upstream(respond) as bad, run_gateway([bad.url, fake.url]) as gw:
        replies = [await gw.chat(f"question {i}") for i in range(8)]
        assert [reply.status_code for reply in replies] == [200] * 8
        assert len(bad.calls) == 1  # tried once, failed over, then left out
        health = (await gw.client.get("/healthz")).json()
        assert health["replicas"]["replica-0"]["state"] == "down"  # (the first: ``bad``)
        # A failed attempt, counted as one (``upstream_errors`` counted 4xx and 5xx only).
        stats = (await gw.client.get("/stats")).json()
        assert (stats["upstream_calls"], stats["upstream_errors"]) == (9, 1)


# ------------------------------------------------------------------------------------------
# Pass-through calls (/v1/models, /v1/rerank, ...) and the replica set


DEAD = "http://127.0.0.1:9/v1"  # nothing listens there: the connection is refused, nothing sent
PROMPTED = "You are the support assistant of ACME. " * 10  # (a prompt of whole blocks)


def _manual_replica_clock(served) -> ManualClock:
    """A clock the test moves for the replica set's back-off (no sleeping it out)."""
    clock = ManualClock()
    served.gateway.replicas.clock = clock.monotonic
    return clock


async def test_a_pass_through_call_a_replica_refuses_is_tried_once_on_another():
    # A refused connection sent nothing: whatever the method, the call is tried on another
    # replica (as a cached endpoint's is). It was answered 502 with a healthy replica there,
    # once per back-off period for as long as the dead one stayed dead.
    async with replicas(1) as (healthy,):
        async with run_gateway([DEAD, healthy.url]) as gw:  # cache-aware, the default
            clock = _manual_replica_clock(gw)
            listed = await gw.client.get("/v1/models")  # (a tie: the first listed, the dead one)
            clock.advance(gw.gateway.config.routing.backoff_s)  # (the next call probes it)
            ranked = await gw.client.post("/v1/rerank", json={"model": "m", "query": "q"})
            dead = (await gw.client.get("/stats")).json()["replicas"][DEAD]
    assert (listed.status_code, ranked.status_code) == (200, 200), ranked.text
    assert healthy.count("/v1/models") == healthy.count("/v1/rerank") == 1
    assert dead["errors"] == 2 and dead["state"] == "down"


async def _dropping(call: RawCall) -> tuple[bytes, bool]:
    return b"", True  # (the call read whole, the connection closed: no byte of answer)


@pytest.mark.parametrize("how", ["dropped", "silent"])
async def test_a_pass_through_call_a_replica_took_is_never_sent_to_another(how):
    # Its bytes reached the replica, which may have acted on them (the method may not be
    # idempotent): a 502 or 504, never run a second time elsewhere.
    async with contextlib.AsyncExitStack() as stack:
        (other,) = await stack.enter_async_context(replicas(1))
        if how == "dropped":
            took = await stack.enter_async_context(raw_upstream(_dropping))
        else:
            (took,) = await stack.enter_async_context(replicas(1))
            took.hang = True
        gw = await stack.enter_async_context(
            run_gateway(
                [took.url, other.url],
                routing={"policy": "round-robin"},
                limits={"upstream_timeout": 0.5},
            )
        )
        reply = await gw.client.post("/v1/rerank", json={"model": "m", "query": "q"})
    assert len(took.calls) == 1 and other.count() == 0
    assert reply.status_code == (502 if how == "dropped" else 504)
    assert reply.headers["x-should-retry"] == "false"


async def test_concurrent_pass_through_calls_are_counted_in_flight_and_spread():
    # Pass-through calls were not counted in flight (/stats said 0 while they ran), and
    # cache-aware broke the tie on load by the size of each replica's prefix record: every
    # one went to the replica that had been sent no prompt yet.
    async with replicas(2) as (a, b):
        async with run_gateway([a.url, b.url]) as gw:  # cache-aware, the default
            assert (await gw.chat(PROMPTED)).status_code == 200  # (-> a: its record grows)
            a.gate = b.gate = asyncio.Event()
            calls = [
                asyncio.create_task(
                    gw.client.post("/v1/rerank", json={"model": "m", "query": f"q{i}"})
                )
                for i in range(4)
            ]
            await eventually(lambda: a.count("/v1/rerank") + b.count("/v1/rerank") == 4)
            during = (await gw.client.get("/stats")).json()["replicas"]
            a.gate.set()
            assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 4
            after = (await gw.client.get("/stats")).json()["replicas"]
    assert [during[f.url]["in_flight"] for f in (a, b)] == [2, 2]
    assert (a.count("/v1/rerank"), b.count("/v1/rerank")) == (2, 2)
    assert [after[f.url]["in_flight"] for f in (a, b)] == [0, 0]


async def test_pass_through_calls_one_at_a_time_are_spread_over_the_replicas():
    # With no prompt, a replica's cache room says nothing of where the call should go: ties on
    # load go to the replica with fewer calls (they all went to the one with no prompt sent).
    async with replicas(2) as (a, b):
        async with run_gateway([a.url, b.url]) as gw:  # cache-aware, the default
            assert (await gw.chat(PROMPTED)).status_code == 200  # (-> a: its record grows)
            for _ in range(4):
                assert (await gw.client.get("/v1/models")).status_code == 200
    assert (a.count("/v1/models"), b.count("/v1/models")) == (2, 2)


async def _head_then_wait(scope, receive, send) -> None:
    """An upstream whose pass-through answer sends its head and a first piece, then nothing
    until its client goes."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b'{"data": [', "more_body": True})
    while (await receive())["type"] != "http.disconnect":
        pass


async def test_a_pass_through_call_its_client_leaves_is_no_longer_counted_in_flight():
    # Its client gone part-way through the body, or before the answer came (its call cancelled
    # with it): the count goes back down.
    async with replicas(1) as (waiting,), serve_app(_head_then_wait) as slow:
        async with run_gateway(
            [waiting.url, slow + "/v1"], routing={"policy": "round-robin"}
        ) as gw:
            waiting.gate = asyncio.Event()
            unanswered = asyncio.create_task(gw.client.get("/v1/models"))  # -> waiting
            await eventually(lambda: gw.gateway.replicas.in_flight == 1)
            async with gw.client.stream("GET", "/v1/models") as reply:  # -> slow
                assert reply.status_code == 200
                await anext(reply.aiter_raw())
                assert gw.gateway.replicas.in_flight == 2
            await eventually(lambda: gw.gateway.replicas.in_flight == 1)
            unanswered.cancel()
            waiting.gate.set()
            await eventually(lambda: gw.gateway.replicas.in_flight == 0)


async def test_a_5xx_answer_to_a_pass_through_call_is_relayed_and_leaves_its_replica_out():
    # A downed replica answering a pass-through call's probe with a 503 was made healthy again
    # (its back-off reset, /healthz "healthy") while it failed every call. The answer is relayed
    # as it is (not tried elsewhere: its body may have been acted on); the replica stays out.
    async with replicas(2) as (a, b):
        a.fail_status = 503
        async with run_gateway([a.url, b.url], routing={"policy": "round-robin"}) as gw:
            clock = _manual_replica_clock(gw)
            assert (await gw.chat("q")).status_code == 200  # (a 503, failed over: a is down)
            clock.advance(gw.gateway.config.routing.backoff_s)  # (its back-off over)
            statuses = [(await gw.client.get("/v1/models")).status_code for _ in range(2)]
            health = (await gw.client.get("/healthz")).json()["replicas"]["replica-0"]
    assert sorted(statuses) == [200, 503]
    assert a.count("/v1/models") == b.count("/v1/models") == 1
    assert health["healthy"] is False and health["failures"] == 2


def _turn(api: str, system: str, turns: list[str], stream: bool = False) -> tuple[str, dict]:
    """The request of a conversation's next turn on ``api``: ``turns`` alternate user and
    assistant texts, the user's last."""
    roles = ["user", "assistant"] * len(turns)
    if api == "completions":
        return "/v1/completions", {
            "model": "m",
            "temperature": 0,
            "prompt": system + "".join(turns),
        }
    if api == "messages":
        messages = [{"role": r, "content": t} for r, t in zip(roles, turns, strict=False)]
        body = {"model": "m", "max_tokens": 50, "system": system, "messages": messages}
        return "/v1/messages", {**body, "temperature": 0}
    if api == "responses":
        items = [
            {"role": "user", "content": t}
            if r == "user"
            else {"role": "assistant", "content": [{"type": "output_text", "text": t}]}
            for r, t in zip(roles, turns, strict=False)
        ]
        return "/v1/responses", {
            "model": "m",
            "temperature": 0,
            "store": False,
            "instructions": system,
            "input": items,
        }
    messages = [{"role": "system", "content": system}]
    messages += [{"role": r, "content": t} for r, t in zip(roles, turns, strict=False)]
    return "/v1/chat/completions", {
        "model": "m",
        "temperature": 0,
        "messages": messages,
        "stream": stream,
    }


@pytest.mark.parametrize(
    "api",
    ["chat", "chat-stream", "completions", "messages", "responses", "sampled", "sampled-stream"],
)
async def test_the_next_turn_of_a_conversation_goes_to_the_replica_that_answered_the_last(api):
    """The replica that answered a turn holds the prompt and the answer in its KV cache (vLLM,
    SGLang keep the generated tokens' blocks), and the next turn's prompt begins with both.
    Only the prompt was recorded, so with an answer longer than its question the next turn
    matched under ``cache_threshold`` and went to the least-loaded replica (about 2 in 3 of
    them elsewhere, its whole context computed again). The answer is recorded too."""
    answer = "The answer, at some length. " * 30  # (~840 characters, longer than the prompt)
    sampled = api.startswith("sampled")
    kind = "chat" if sampled else api.removesuffix("-stream")
    async with replicas(3) as fakes:
        for fake in fakes:
            fake.answer_text = lambda n, body: f"{n}. {answer}"
        async with run_gateway([f.url for f in fakes]) as gw:  # cache-aware by default
            for c in range(6):
                system = f"Conversation {c}: you are a careful assistant. " * 6  # ~300
                first = f"First question of conversation {c}, about its subject?"
                path, body = _turn(kind, system, [first])
                if sampled:  # (no temperature: bypassed, the path sampled chat takes)
                    body.pop("temperature")
                if api.endswith("-stream"):
                    async with gw.client.stream("POST", path, json={**body, "stream": True}) as r:
                        raw = (await r.aread()).decode()
                    text = "".join(
                        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        for line in raw.splitlines()
                        if line.startswith("data: {")
                    )
                else:
                    done = (await gw.client.post(path, json=body)).json()
                    text = {
                        "chat": lambda d: d["choices"][0]["message"]["content"],
                        "completions": lambda d: d["choices"][0]["text"],
                        "messages": lambda d: d["content"][0]["text"],
                        "responses": lambda d: d["output"][0]["content"][0]["text"],
                    }[kind](done)
                assert answer.strip() in text
                then = f"And a second question of conversation {c}?"
                path, body = _turn(kind, system, [first, text, then])
                assert (await gw.client.post(path, json=body)).status_code == 200
            routing = (await gw.client.get("/stats")).json()["routing"]
    served = {  # conversation -> the replicas that served its turns
        c: {
            i for i, fake in enumerate(fakes) for call in fake.calls if tag in json.dumps(call.body)
        }
        for c, tag in ((c, f"Conversation {c}:") for c in range(6))
    }
    assert all(len(where) == 1 for where in served.values()), served
    assert routing.get("prefix_match", 0) == 6, routing
