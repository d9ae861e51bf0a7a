"""Values in Redis that carpool cannot read: written by something else (a script, another tool
sharing the database, a bug of another version), never by carpool. Such a value is a miss or,
for an idempotency record, a request that ran and whose response was not kept: never a 500,
never served, and never an outage (Redis answered: the instance stays ``up``). A cache entry
that cannot be read is dropped, so that it costs one miss, not one per request until its TTL.

Each test writes the value over a real server with its own client."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from carpool.redis.keys import ENTRY_ID
from test_distributed import gateways
from test_redis_full import raw

aredis = pytest.importorskip("redis.asyncio")

ADMIN = {"Authorization": "Bearer t"}
NO_WINDOW = {"window_ms": 0}  # (a finished call's lingering flight would answer again)

Spoil = Callable[[Any, bytes], Awaitable[object]]


async def _field(client: Any, key: bytes, field: str, value: bytes) -> None:
    await client.hset(key, field, value)


async def _string(client: Any, key: bytes) -> None:
    ttl = await client.pttl(key)
    await client.delete(key)
    await client.set(key, b"\xff\xfe not a hash", px=ttl)


async def _cut_short(client: Any, key: bytes) -> None:
    body = await client.hget(key, "b")
    await client.hset(key, "b", body[: len(body) // 2])


async def _header(client: Any, key: bytes, **changed: Any) -> None:
    header = orjson.loads(await client.hget(key, "m"))
    await client.hset(key, "m", orjson.dumps({**header, **changed}))


SPOILED_ENTRIES: dict[str, Spoil] = {
    "a header that is no JSON": lambda c, k: _field(c, k, "m", b"\xff\x00garbage"),
    "a header that is a list": lambda c, k: _field(c, k, "m", b"[1,2]"),
    "a header without its fields": lambda c, k: _field(c, k, "m", b'{"v":1,"x":9999999999}'),
    "frame lengths past the frames": lambda c, k: _field(
        c,
        k,
        "m",
        b'{"v":1,"k":"chat","c":true,"t":1,"cr":1,"x":9999999999,"u":null,'
        b'"fl":[5,5],"tags":[],"ns":""}',
    ),
    "a string where a hash belongs (WRONGTYPE)": _string,
    # (Served before as a hit: the body cut short to a JSON client, the other API's answer to
    # both; and a 500 to a streaming client, whose stream is made from the body, until the TTL.)
    "a body cut short": _cut_short,
    "another API's kind": lambda c, k: _header(c, k, k="responses"),
}


async def the_entry(client: Any) -> bytes:
    (key,) = [key async for key in client.scan_iter(match="carpool:e:*")]
    return key


async def read(gateway: Any, shape: str) -> Any:
    """The answer to "q", as JSON or as a stream (read to its end)."""
    return await gateway.chat("q") if shape == "json" else (await gateway.stream_chat("q"))[0]


@pytest.mark.parametrize("shape", ["json", "stream"])
@pytest.mark.parametrize("spoil", list(SPOILED_ENTRIES))
async def test_a_cache_entry_in_redis_that_cannot_be_read_is_a_miss_and_is_dropped(
    fake: Any, redis_server: Any, spoil: str, shape: str
) -> None:
    async with (
        raw(redis_server) as client,
        gateways(2, fake, redis_server, coalesce=NO_WINDOW) as (a, b),
    ):
        assert (await a.chat("q")).headers["x-carpool"] == "miss"
        key = await the_entry(client)
        await SPOILED_ENTRIES[spoil](client, key)
        # (an answer without its finish reason, served but not stored: B's own answer is not
        # put where the spoiled value was, which must be gone)
        fake.omit_finish_reason = True
        first = await read(b, shape)
        assert (first.status_code, first.headers["x-carpool"]) == (200, "miss")
        assert await client.exists(key) == 0
        fake.omit_finish_reason = False
        assert (await b.chat("q")).headers["x-carpool"] == "miss"
        assert (await a.chat("q")).headers["x-carpool"] == "hit"
        assert fake.count() == 3
        for served in (a, b):
            health = served.gateway.redis_health()
            assert (health["state"], health["errors"]) == ("up", 0)


async def test_a_stored_answer_that_cannot_be_made_a_stream_is_a_miss_and_is_dropped(
    fake: Any, redis_server: Any
) -> None:
    """A body of its length and its API's kind that is no answer of that API (something else
    wrote it): a hit does not parse the body, so a JSON client would be served it, but a
    streaming client, whose stream is made from it, gets a miss, and the entry goes. (Before,
    a 500 to every streaming client until its TTL.)"""
    async with (
        raw(redis_server) as client,
        gateways(2, fake, redis_server, coalesce=NO_WINDOW) as (a, b),
    ):
        assert (await a.chat("q")).headers["x-carpool"] == "miss"
        key = await the_entry(client)
        body = await client.hget(key, "b")
        await client.hset(key, "b", b"x" * len(body))
        fake.omit_finish_reason = True  # (as above: B's own answer is not stored)
        first, _ = await b.stream_chat("q")
        assert (first.status_code, first.headers["x-carpool"]) == (200, "miss")
        assert await client.exists(key) == 0
        fake.omit_finish_reason = False
        assert (await b.stream_chat("q"))[0].headers["x-carpool"] == "miss"
        again, text = await a.stream_chat("q")
        assert (again.headers["x-carpool"], text.endswith("data: [DONE]\n\n")) == ("hit", True)
        assert fake.count() == 3
        for served in (a, b):
            health = served.gateway.redis_health()
            assert (health["state"], health["errors"]) == ("up", 0)


async def test_an_invalidation_passes_over_a_value_it_cannot_read(
    fake: Any, redis_server: Any
) -> None:
    tagged = {"x-carpool-tags": "faq"}
    async with (
        raw(redis_server) as client,
        gateways(1, fake, redis_server, coalesce=NO_WINDOW) as (a,),
    ):
        await a.chat("q", headers=tagged)
        key = await the_entry(client)
        await _string(client, key)
        by_tag = await a.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
        assert by_tag.status_code == 200
        assert await client.exists(key) == 0
        await a.chat("r", headers=tagged)
        await _field(client, await the_entry(client), "xm", b"not a number")
        by_tag = await a.client.post("/admin/invalidate", json={"tag": "faq"}, headers=ADMIN)
        assert by_tag.status_code == 200
        assert [key async for key in client.scan_iter(match="carpool:e:*")] == []
        assert a.gateway.redis_health()["state"] == "up"


SELECTORS = {  # the request's headers, its prompt, the invalidation, its index's key pattern
    "tag": ({"x-carpool-tags": "faq"}, "q", {"tag": "faq"}, "carpool:tag:*"),
    "namespace": ({"x-carpool-namespace": "n1"}, "q", {"namespace": "n1"}, "carpool:ns:*"),
    "prompt prefix": ({}, "question one", {"prefix": "question"}, "carpool:prefixes"),
}


async def _foreign_member(client: Any, index: bytes, member: bytes) -> None:
    await client.zadd(index, {member: 9e15})


SPOILED_INDEXES: dict[str, Spoil] = {
    "a member that is no UTF-8": lambda c, k: _foreign_member(c, k, b"\xff\xfe\nquestion"),
    "a member that names no entry": lambda c, k: _foreign_member(c, k, b"../e:{x}\nquestion"),
    "a string where a sorted set belongs (WRONGTYPE)": lambda c, k: c.set(k, b"v0"),
}


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("spoil", list(SPOILED_INDEXES))
async def test_an_invalidation_passes_over_an_index_it_cannot_read_and_drops_what_it_names(
    fake: Any, redis_server: Any, spoil: str, selector: str
) -> None:
    # Something else wrote the index: a member that was no UTF-8 made the invalidation a 500
    # and left the answer served; an index of another type made it a 503 "retry it" for good.
    headers, prompt, invalidation, pattern = SELECTORS[selector]
    async with (
        raw(redis_server) as client,
        gateways(2, fake, redis_server, coalesce=NO_WINDOW) as (a, b),
    ):
        assert (await a.chat(prompt, headers=headers)).headers["x-carpool"] == "miss"
        (index,) = [key async for key in client.scan_iter(match=pattern)]
        if spoil.endswith("(WRONGTYPE)"):
            await client.delete(index)
        await SPOILED_INDEXES[spoil](client, index)
        done = await b.client.post("/admin/invalidate", json=invalidation, headers=ADMIN)
        assert (done.status_code, done.json()) == (200, {"invalidated": 1})
        assert [key async for key in client.scan_iter(match="carpool:e:*")] == []
        assert (await a.chat(prompt, headers=headers)).headers["x-carpool"] == "miss"
        assert b.gateway.redis_health()["state"] == "up"
        left = [m async for m, _ in client.zscan_iter(index)] if spoil[-1] != ")" else []
        assert not [m for m in left if not ENTRY_ID.fullmatch(m.partition(b"\n")[0])]


@pytest.mark.parametrize(
    "spoiled", [b"not a count", b"12x", b"9" * 30], ids=["word", "mixed", "huge"]
)
async def test_an_invalidation_count_that_is_no_count_is_made_anew_never_a_500(
    fake: Any, redis_server: Any, spoiled: bytes
) -> None:
    # Read before every shared call and counted up by every invalidation, it has no TTL: a
    # value that was no count made every miss a 500 and every invalidation fail, for good.
    async with (
        raw(redis_server) as client,
        gateways(1, fake, redis_server, coalesce=NO_WINDOW) as (a,),
    ):
        await client.set("carpool:generation", spoiled)
        missed = await a.chat("q")
        assert (missed.status_code, missed.headers["x-carpool"]) == (200, "miss")
        assert int(await client.get("carpool:generation")) > 0
        await client.set("carpool:generation", spoiled)
        done = await a.client.post("/admin/invalidate", json={"all": True}, headers=ADMIN)
        assert done.status_code == 200
        assert int(await client.get("carpool:generation")) > 0
        assert (await a.chat("q")).headers["x-carpool"] == "miss"
        assert (await a.chat("q")).headers["x-carpool"] == "hit"


SPOILED_RECORDS: dict[str, Spoil] = {
    "headers that are no JSON": lambda c, k: _field(c, k, "h", b"\xff not json"),
    "headers that are no pairs": lambda c, k: _field(c, k, "h", b'[["a"]]'),
    "a header value that ends its line": lambda c, k: _field(
        c, k, "h", b'[["content-type","application/json\\r\\nset-cookie: a=b"]]'
    ),
    "a status that is no number": lambda c, k: _field(c, k, "st", b"abc"),
    "a status no HTTP answer has": lambda c, k: _field(c, k, "st", b"9999"),
    "no body": lambda c, k: c.hdel(k, "b"),
    # (Its writer keeps only a content type, what it says of its usage and ``no-store``: a
    # framing header replayed beside the one the transport writes framed the body twice.)
    "a content-length of its own": lambda c, k: _field(
        c, k, "h", b'[["content-type","application/json"],["content-length","3"]]'
    ),
    "a transfer-encoding of its own": lambda c, k: _field(
        c, k, "h", b'[["content-type","application/json"],["transfer-encoding","chunked"]]'
    ),
    "a header its writer never keeps": lambda c, k: _field(
        c, k, "h", b'[["content-type","application/json"],["set-cookie","a=b"]]'
    ),
    # (Taken for no record: its request ran again.)
    "no state": lambda c, k: c.hdel(k, "s"),
    "a string where a hash belongs (WRONGTYPE)": _string,
}


@pytest.mark.parametrize("spoil", list(SPOILED_RECORDS))
async def test_an_idempotency_record_that_cannot_be_read_is_a_response_not_kept(
    fake: Any, redis_server: Any, spoil: str
) -> None:
    """The request ran (the record says so, or may have): never again under its key, and its
    retries are told so (507), as when a full Redis kept that it ran but not its response."""
    key = {"Idempotency-Key": "order-1"}
    async with raw(redis_server) as client, gateways(2, fake, redis_server) as (a, b):
        assert (await a.chat("q", headers=key)).status_code == 200
        (record,) = [k async for k in client.scan_iter(match="carpool:idem:*")]
        await SPOILED_RECORDS[spoil](client, record)
        for _ in range(2):
            retry = await b.chat("q", headers=key)
            assert retry.status_code == 507
            assert retry.json()["code"] == "idempotency_response_not_kept"
            # (The SDKs retry a 5xx on their own, twice by default: each got the same 507.)
            assert retry.headers["x-should-retry"] == "false"
        assert fake.count() == 1
        health = b.gateway.redis_health()
        assert (health["state"], health["errors"]) == ("up", 0)
        # (Redis refused the read: counted apart, as every layer's WRONGTYPE is; it was counted
        # nowhere.)
        assert health["wrong_type"] == (2 if spoil.endswith("(WRONGTYPE)") else 0)


async def test_a_retry_of_an_idempotency_record_that_cannot_be_read_is_told_so_not_that_redis_was_full(
    fake: Any, redis_server: Any
) -> None:
    """The 507 says why its response cannot be replayed: its record could not be read (Redis
    is not full), in either format. (Before, the message the record's reading made was
    dropped, and every such retry was told that the shared store was full.)"""
    key = {"Idempotency-Key": "order-1"}
    async with raw(redis_server) as client, gateways(2, fake, redis_server) as (a, b):
        assert (await a.chat("q", headers=key)).status_code == 200
        (record,) = [k async for k in client.scan_iter(match="carpool:idem:*")]
        await client.hset(record, "st", b"abc")
        for retry in (await b.chat("q", headers=key), (await b.stream_chat("q", headers=key))[0]):
            assert retry.status_code == 507
            problem = retry.json()
            assert problem["code"] == "idempotency_response_not_kept"
            assert "its record could not be read" in problem["detail"]
            assert "full" not in problem["detail"]
            assert problem["message"] == problem["detail"]
        assert fake.count() == 1


async def test_an_idempotency_record_made_before_any_clock_is_replayed_with_the_greatest_age(
    fake: Any, redis_server: Any
) -> None:
    """A made time something else wrote, aeons ago: the replay's ``age`` is RFC 9111's greatest
    (2147483648, section 1.2.2), not a number of 300 digits."""
    key = {"Idempotency-Key": "order-1"}
    async with raw(redis_server) as client, gateways(2, fake, redis_server) as (a, b):
        first = await a.chat("q", headers=key)
        (record,) = [k async for k in client.scan_iter(match="carpool:idem:*")]
        await client.hset(record, "cr", b"-1e300")
        retry = await b.chat("q", headers=key)
        assert (retry.status_code, retry.headers["age"]) == (200, "2147483648")
        assert retry.json() == first.json() and fake.count() == 1
