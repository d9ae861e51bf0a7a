"""Values in Redis that carpool cannot read, in the keys of its shared flights: a lock or a
leader's stream written by something else (a script, another tool sharing the database, a bug
of another version), never by carpool. Such a lock is no lock held: it is dropped and the
call led anew; such a record is no leader's: its follower takes the leader as gone (it claims
again, and runs the call alone once its takeovers are spent), or, frames relayed already,
breaks its clients' stream as for a dead leader. Never a 500, never the record's words served
as an answer, and never an outage (Redis answered: the instance stays ``up``).

Each test writes the value over a real server with its own client, between two gateways."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest

from test_distributed import QUESTION, content, gateways, sse_text, until_relaying
from test_redis_full import raw

pytest.importorskip("redis")

# (A finished call's lingering flight would answer again; a follow that waits on a lock
# nobody ends gives up within the join timeout, which the tests below must not need.)
COALESCE = {"window_ms": 0, "join_timeout_ms": 3000}
TOKEN = "deadbeefdeadbeef"  # (a leader's token as carpool makes them: 16 hex digits)


async def the_flight_keys(client: Any) -> tuple[str, str]:
    """Of the one answer stored: its lock's name and its streams' start (its entry dropped,
    so that the next request for it is a miss and claims the flight)."""
    (entry,) = [key async for key in client.scan_iter(match="carpool:e:*")]
    ident = entry.decode().split("{", 1)[1].rstrip("}")
    await client.delete(entry)
    return f"carpool:lock:{{{ident}}}", f"carpool:flight:{{{ident}}}:"


async def _string(client: Any, lock: str, value: bytes) -> None:
    await client.set(lock, value)  # (no expiry: what something else wrote stays for ever)


async def _hash(client: Any, lock: str) -> None:
    await client.hset(lock, "field", "another app's")


SPOILED_LOCKS = {
    "a finished call's mark without its end": lambda c, k: _string(c, k, b"=abc"),
    "a finished call's end that is no time": lambda c, k: _string(c, k, b"=" + b"a" * 16 + b":x"),
    "a holder that is no token": lambda c, k: _string(c, k, b"=tok:xyz"),
    "a word where a token belongs": lambda c, k: _string(c, k, b"garbage"),
    "a token without an expiry": lambda c, k: _string(c, k, TOKEN.encode()),
    "a hash where a string belongs (WRONGTYPE)": _hash,
}


def assert_up(*served: Any) -> None:
    for gateway in served:
        health = gateway.gateway.redis_health()
        assert (health["state"], health["errors"]) == ("up", 0), health


@pytest.mark.parametrize("spoil", list(SPOILED_LOCKS))
async def test_a_flight_lock_that_cannot_be_read_is_no_lock_held_and_the_instance_stays_up(
    fake: Any, redis_server: Any, spoil: str
) -> None:
    """Before, the claim's script failed on it (``=abc``: no ``:``; a hash: ``WRONGTYPE``),
    which the instance took for Redis failing: degraded, sharing nothing, on each request for
    that key for as long as the value stayed; or it followed a leader that did not exist until
    the join timeout, on each request."""
    async with (
        raw(redis_server) as client,
        gateways(2, fake, redis_server, coalesce=COALESCE) as (a, b),
    ):
        assert (await a.chat(QUESTION)).headers["x-carpool"] == "miss"
        lock, _ = await the_flight_keys(client)
        await SPOILED_LOCKS[spoil](client, lock)
        led = await b.chat(QUESTION)
        assert (led.status_code, led.headers["x-carpool"]) == (200, "miss")
        assert content(led) == f"answer 2 to {QUESTION}"
        counts = b.gateway.shared_flights.counts
        assert (counts["led"], counts["followed"], counts["alone"]) == (1, 0, 0)
        assert await client.exists(lock) == 0  # (dropped: B's call, ended, took it along)
        assert_up(a, b)
        # Sharing goes on: an answer A stores is B's hit.
        assert (await a.chat("another question")).headers["x-carpool"] == "miss"
        assert (await b.chat("another question")).headers["x-carpool"] == "hit"
        assert fake.count() == 3


META = {"k": "chat", "c": True, "t": 5, "cr": 1.0, "fl": None, "u": None, "l": True, "r": None}
ANSWER = orjson.dumps({"id": "x", "object": "chat.completion", "choices": []})


def _meta(**changed: Any) -> bytes:
    return orjson.dumps({**META, **changed})


SPOILED_STREAMS: dict[str, list[dict[str, Any]] | bytes] = {
    "an entry that is neither a frame nor a final record": [{"x": "y"}],
    "a final record of no kind": [{"e": "q", "m": _meta(), "b": ANSWER}],
    "an answer whose meta is no JSON": [{"e": "a", "m": "garbage", "b": ANSWER}],
    "an answer whose meta is a list": [{"e": "a", "m": "[1,2]", "b": ANSWER}],
    "an answer without its fields": [{"e": "a", "m": '{"k":"chat"}', "b": ANSWER}],
    "an answer whose tokens are no number": [{"e": "a", "m": _meta(t="5"), "b": ANSWER}],
    "an answer of no API": [{"e": "a", "m": _meta(k="nope"), "b": b"{}"}],
    "an answer of another API": [{"e": "a", "m": _meta(k="embedding"), "b": ANSWER}],
    "an answer whose body is no JSON": [{"e": "a", "m": _meta(), "b": "not json"}],
    "an answer whose body is a list": [{"e": "a", "m": _meta(), "b": "[1,2]"}],
    "an answer without its body": [{"e": "a", "m": _meta()}],
    "a frame whose index is no number": [{"i": "zz", "f": "data: {}\n\n"}],
    "a status that is no number": [
        {"e": "x", "m": '{"c":"status","s":"abc","ct":"text/plain"}', "b": "x"}
    ],
    "a status HTTP does not define": [
        {"e": "x", "m": '{"c":"status","s":999,"ct":"text/plain"}', "b": "x"}
    ],
    "a status error of a 2xx": [{"e": "x", "m": '{"c":"status","s":200,"ct":"text/plain"}'}],
    "a status error's retry headers that are no pairs": [
        {"e": "x", "m": '{"c":"status","s":503,"ct":"text/plain","rh":[1]}', "b": "x"}
    ],
    "an error without its fields": [{"e": "x", "m": '{"c":"UpstreamBusy"}'}],
    "an error whose status HTTP does not define": [
        {"e": "x", "m": '{"c":"UpstreamBusy","s":999,"ty":"t","co":null,"msg":"m"}'}
    ],
    "a string where the stream belongs (WRONGTYPE)": b"not a stream",
}


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
@pytest.mark.parametrize("spoil", list(SPOILED_STREAMS))
async def test_a_flight_record_that_cannot_be_read_is_its_leader_gone(
    fake: Any, redis_server: Any, spoil: str, streaming: bool
) -> None:
    """The lock names a leader (its token, as carpool writes it) whose stream holds what
    carpool does not write: B's request takes the leader as gone, claims again (the same), and
    once its takeovers are spent runs the call alone. Before, a 502 "internal error while
    calling upstream" (a traceback in the log), a 500, a status line 999, or a 200
    ``coalesced`` whose body was the record's (``{}``, ``not json``)."""
    async with (
        raw(redis_server) as client,
        gateways(2, fake, redis_server, coalesce=COALESCE) as (a, b),
    ):
        assert (await a.chat(QUESTION)).headers["x-carpool"] == "miss"
        lock, streams = await the_flight_keys(client)
        spoiled = SPOILED_STREAMS[spoil]
        if isinstance(spoiled, bytes):
            await client.set(streams + TOKEN, spoiled, px=20_000)
        else:
            for entry in spoiled:
                await client.xadd(streams + TOKEN, entry)
            await client.pexpire(streams + TOKEN, 20_000)
        await client.set(lock, TOKEN, px=20_000)  # (a leader's lock, alive for the test)
        if streaming:
            answered, raw_sse = await b.stream_chat(QUESTION)
            assert sse_text(raw_sse) == f"answer 2 to {QUESTION}"
        else:
            answered = await b.chat(QUESTION)
            assert content(answered) == f"answer 2 to {QUESTION}"
        assert (answered.status_code, answered.headers["x-carpool"]) == (200, "miss")
        counts = b.gateway.shared_flights.counts
        assert (counts["alone"], counts["broken"]) == (1, 0)
        assert fake.count() == 2
        assert_up(a, b)


async def test_a_flight_record_that_cannot_be_read_after_frames_were_relayed_breaks_the_stream(
    fake: Any, redis_server: Any
) -> None:
    """B relays A's live stream to its client; then a record A did not write comes in A's
    stream. B's client, which has A's first words, gets the error event of a lost leader
    (``upstream_stream_broken``), as for a leader that died, and B stays up; A's own client
    gets the whole answer. Before, B's flight failed with an internal error."""
    async with (
        raw(redis_server) as client,
        gateways(2, fake, redis_server, coalesce=COALESCE) as (a, b),
    ):
        gate = fake.chunk_gate = asyncio.Event()  # A's stream stops after its first words
        leader = asyncio.create_task(a.stream_chat(QUESTION))
        await asyncio.wait_for(fake.chunk_gate_reached.wait(), 5)
        following = asyncio.create_task(b.stream_chat(QUESTION))
        await until_relaying(b, a)
        (stream,) = [key async for key in client.scan_iter(match="carpool:flight:*")]
        await client.xadd(stream, {"e": "a", "m": "garbage", "b": "{}"})
        broken, raw_broken = await asyncio.wait_for(following, 10)
        gate.set()
        _, raw_whole = await asyncio.wait_for(leader, 10)
        assert broken.status_code == 200 and broken.headers["x-carpool"] == "coalesced"
        error = json.loads(raw_broken.strip().splitlines()[-1][len("data: ") :])["error"]
        assert error["code"] == "upstream_stream_broken"
        assert sse_text(raw_whole) == f"answer 1 to {QUESTION}"
        assert b.gateway.shared_flights.counts["broken"] == 1
        assert fake.count() == 1
        assert_up(a, b)


async def test_a_key_of_another_type_under_a_leaders_stream_is_counted_apart_and_the_instance_stays_up(
    fake: Any, redis_server: Any
) -> None:
    """Something else writes a string where A's running call will write its final record:
    the end's script is refused (``WRONGTYPE``). Redis answered: A's client has its answer,
    the refusal is counted apart (``wrong_type``, in ``/stats`` and ``/metrics``), and A stays
    up. Before, any layer's ``WRONGTYPE`` it did not handle began a degraded period: sharing
    off for every key."""
    async with (
        raw(redis_server) as client,
        gateways(1, fake, redis_server, coalesce=COALESCE) as (a,),
    ):
        gate = fake.gate = asyncio.Event()
        led = asyncio.create_task(a.chat(QUESTION))
        await fake.wait_for_calls(1)
        (lock,) = [key async for key in client.scan_iter(match="carpool:lock:*")]
        token = (await client.get(lock)).decode()
        stream = lock.decode().replace("carpool:lock:", "carpool:flight:", 1) + ":" + token
        await client.set(stream, b"not a stream", px=20_000)
        gate.set()
        answered = await asyncio.wait_for(led, 10)
        assert (answered.status_code, answered.headers["x-carpool"]) == (200, "miss")
        health = (await a.client.get("/stats", headers={"Authorization": "Bearer t"})).json()
        metrics = (await a.client.get("/metrics", headers={"Authorization": "Bearer t"})).text
    assert (health["redis"]["state"], health["redis"]["errors"]) == ("up", 0), health["redis"]
    assert health["redis"]["wrong_type"] == 1
    assert "carpool_redis_wrong_type_total 1.0" in metrics
