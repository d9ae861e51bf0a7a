"""Idempotency keys: the header (``parse_key``), the problem+json errors, and the records contract
run against every backend through one fixture (memory, and a real Valkey per test for Redis)."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import orjson
import pytest
import redis.asyncio as aredis

from carpool.clock import SYSTEM_CLOCK, ManualClock
from carpool.config import Config
from carpool.errors import CarpoolError
from carpool.idempotency import (
    Begin,
    FallbackRecords,
    IdempotencyConflict,
    IdempotencyFormatMismatch,
    IdempotencyKeyInvalid,
    IdempotencyMismatch,
    IdempotencyRecords,
    IdempotencyUnavailable,
    MemoryIdempotencyRecords,
    StoredResponse,
    parse_key,
)
from carpool.idempotency.errors import IdempotencyResponseNotKept
from carpool.redis.idempotency import RedisIdempotencyRecords
from carpool.store.base import StoreUnavailable
from carpool.store.shared import SharedStore
from carpool.wiring import build_idempotency, build_store
from conftest import redis_settings
from fakes.redis_server import RedisServer, assert_each_fails_fast
from fakes.sizing import deep_size
from fakes.waiting import WAIT_S, cancelled_after, eventually

BACKENDS = ["memory", "redis", "redis-cluster"]
FP, OTHER_FP = "f" * 32, "0" * 32

OK = StoredResponse(
    200,
    [  # (the headers a record keeps: ``replayable``)
        (b"content-type", b"application/json; x=\xff\xe9"),
        (b"x-carpool-usage", b"missing"),
        (b"cache-control", b"no-store"),
    ],
    b'{"id":"chatcmpl-1","choices":[]}\n' + bytes(range(256)),
)
BAD_GATEWAY = StoredResponse(
    502,
    [(b"content-type", b"application/json")],
    b'{"error":{"message":"upstream \xc3\xa9chou\xc3\xa9","type":null}}',
)


# --------------------------------------------------------------------------- parse_key


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({}, None),
        ({"content-type": "application/json"}, None),
        (
            {"idempotency-key": '"8e03978e-40d5-43e8-bc93-6894a57f9324"'},
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
        ),
        ({"idempotency-key": "8e03978e-40d5"}, "8e03978e-40d5"),  # bare
        ({"idempotency-key": '  "abc"  '}, "abc"),  # OWS around
        (
            {"idempotency-key": '"a \\"quoted\\" \\\\ key"'},
            'a "quoted" \\ key',
        ),  # sf-string escapes
        ({"idempotency-key": "a b"}, "a b"),
        ({"idempotency-key": '"' + "k" * 255 + '"'}, "k" * 255),
        ({"idempotency-key": "k" * 255}, "k" * 255),
        ({"x-idempotency-key": '"alias"'}, "alias"),  # the X- alias
        ({"x-idempotency-key": "alias"}, "alias"),
        ({"idempotency-key": "main", "x-idempotency-key": "alias"}, "main"),  # the real one wins
        ({"idempotency-key": '"abc";p=1'}, "abc"),  # an Item's parameters: read past, ignored
        ({"idempotency-key": '"abc";a;b=?1;c="x\\"y";d=tok/1:2;e=:AAA=:;f=-1.5'}, "abc"),
    ],
)
def test_parse_key_reads_the_header(headers: dict[str, str], key: str | None) -> None:
    assert parse_key(headers) == key


@pytest.mark.parametrize(
    "value",
    [
        "",
        '""',
        "   ",
        '"   "',  # empty
        "k" * 256,
        '"' + "k" * 256 + '"',  # 256 characters
        "a\tb",
        "a\x00b",
        "a\x1fb",
        "a\x7fb",
        '"a\nb"',
        "ké",
        "日本",  # not printable ASCII
        '"abc',
        '"ab"c"',
        '"a\\nb"',
        '"a\\"',  # malformed sf-strings
        '"abc" x',
        '"abc";',
        '"abc";p=',
        '"abc";P=1',  # not parameters as RFC 8941 spells them
    ],
)
@pytest.mark.parametrize("name", ["idempotency-key", "x-idempotency-key"])
def test_parse_key_refuses_an_invalid_key_with_a_400(name: str, value: str) -> None:
    with pytest.raises(IdempotencyKeyInvalid) as raised:
        parse_key({name: value})
    assert raised.value.status == 400


def test_an_empty_main_header_is_refused_even_with_a_valid_alias() -> None:
    with pytest.raises(IdempotencyKeyInvalid, match="empty"):
        parse_key({"idempotency-key": "", "x-idempotency-key": "fine"})


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (IdempotencyKeyInvalid("The Idempotency-Key header is empty."), 400),
        (IdempotencyConflict(), 409),
        (IdempotencyMismatch(), 422),
    ],
)
def test_errors_are_problem_details(error: CarpoolError, status: int) -> None:
    assert isinstance(error, CarpoolError)
    assert error.status == status
    assert error.headers() == {"content-type": "application/problem+json"}
    body = orjson.loads(error.body())
    assert set(body) == {"type", "title", "status", "detail", "message", "code", "error"}
    assert body["status"] == status and body["detail"] == error.message
    assert body["type"].startswith("https://") and body["title"]
    # Where the SDKs read an error's text and code (the openai SDK said "Error code: 422").
    assert body["message"] == error.message and body["code"] == error.code


@pytest.mark.parametrize(
    "error",
    [
        IdempotencyKeyInvalid("The Idempotency-Key header is empty."),
        IdempotencyConflict(),
        IdempotencyMismatch(),
        IdempotencyFormatMismatch(streamed=True),
        IdempotencyUnavailable(),
        IdempotencyResponseNotKept(),
    ],
)
def test_an_idempotency_problem_carries_openais_error_member_for_sdks_that_read_only_it(
    error: CarpoolError,
) -> None:
    # The Node SDK reads an error's message and code from the body's ``error`` member alone:
    # without it a 422 said "422 status code (no body)" and ``error.code`` was undefined, a
    # key used for another request not told from a stream asked of a whole answer.
    body = orjson.loads(error.body())
    assert body["error"] == {
        "message": error.message,
        "type": error.type,
        "param": None,
        "code": error.code,
    }


def test_a_response_not_kept_tells_the_sdks_not_to_retry_it_and_busy_records_to_retry() -> None:
    # A 507 is answered alike to every retry with the key: the SDKs, which retry a 5xx on
    # their own (twice by default), asked again for the same 507. A 503 of busy records is
    # worth their retry.
    assert IdempotencyResponseNotKept().headers()["x-should-retry"] == "false"
    assert "x-should-retry" not in IdempotencyUnavailable().headers()


def test_an_sdk_reads_an_idempotency_errors_message_and_code() -> None:
    import httpx
    import openai

    error = IdempotencyMismatch()
    response = httpx.Response(
        422,
        content=error.body(),
        headers=error.headers(),
        request=httpx.Request("POST", "http://x"),
    )
    raised = openai.OpenAI(api_key="k")._make_status_error_from_response(response)
    assert isinstance(raised, openai.UnprocessableEntityError)
    assert error.message in raised.message and raised.code == error.code


def test_the_three_errors_have_distinct_titles_and_codes() -> None:
    errors = [IdempotencyKeyInvalid("x"), IdempotencyConflict(), IdempotencyMismatch()]
    assert len({e.title for e in errors}) == len({e.code for e in errors}) == 3


# --------------------------------------------------------------------------- the records contract


class Make:
    """``make(retention=60, lease=60)``: records of the backend under test (the in-process ones'
    ``processing_ttl`` is their lease); the Redis ones made by one test share one server, as
    gateway instances do. ``let_pass(seconds)``: time passes for every record made: the
    in-process ones' clock moves; a Redis server expires records in its own time, so there
    the test waits it out."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.backend = request.param
        self.request = request
        self.clock = ManualClock()
        self.made: list[IdempotencyRecords] = []

    def __call__(self, retention: float = 60.0, lease: float = 60.0) -> IdempotencyRecords:
        if self.backend == "memory":
            records: IdempotencyRecords = MemoryIdempotencyRecords(
                retention, lease, clock=self.clock
            )
        else:
            cluster = self.backend == "redis-cluster"
            server = self.request.getfixturevalue("redis_cluster" if cluster else "redis_server")
            # Generous timeouts: 20 connections opening at once on a busy 2-core machine took
            # over the default 0.25 s once (a contract test of the records, not of outages).
            records = RedisIdempotencyRecords(
                server.url,
                retention=retention,
                lease=lease,
                cluster=cluster,
                clock=self.clock,
                connect_timeout=5.0,
                socket_timeout=5.0,
            )
        self.made.append(records)
        return records

    async def let_pass(self, seconds: float) -> None:
        if self.backend == "memory":
            self.clock.advance(seconds)
        else:
            await asyncio.sleep(seconds)  # (the server's own expiry: real time by design)


@pytest.fixture(params=BACKENDS)
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Make]:
    made = Make(request)
    yield made
    for records in made.made:
        await records.aclose()


@pytest.fixture
def records(make: Make) -> IdempotencyRecords:
    return make()


async def until(condition: Callable[[], Awaitable[bool]], timeout: float = 2.0) -> None:
    """Return once ``await condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"not true within {timeout} s"
        await asyncio.sleep(0.005)


async def begin_new(records: IdempotencyRecords, key: str = "k", fp: str = FP) -> str:
    began = await records.begin(key, fp)
    assert began.state == "new" and began.token and began.response is None
    return began.token


async def begin_and_die(make: Make, records: IdempotencyRecords, key: str = "k") -> str:
    """A record begun by an owner that dies at once: for Redis, another instance (sharing the
    server) that closes without settling it, so nothing renews its lease; in process, a task
    that ends without settling it (while it ran, its lease would not run out)."""
    if not isinstance(records, RedisIdempotencyRecords):
        return await asyncio.create_task(begin_new(records, key))
    owner = make(lease=records.lease)
    token = await begin_new(owner, key)
    await owner.aclose()
    return token


async def test_a_record_keeps_only_the_headers_a_replay_repeats(
    records: IdempotencyRecords,
) -> None:
    """Its content type, its ``x-carpool-usage`` and ``Cache-Control: no-store``, whatever it
    is given: a framing header kept (``content-length``, ``transfer-encoding``) was replayed
    beside the one the transport writes, the body framed twice."""
    token = await begin_new(records)
    others = [
        (b"content-length", b"3"),
        (b"transfer-encoding", b"chunked"),
        (b"x-request-id", b"r1"),
        (b"set-cookie", b"a=1"),
        (b"cache-control", b"no-cache"),
    ]
    assert await records.finish("k", token, replace(OK, headers=[*others, *OK.headers])) is True
    assert (await records.begin("k", FP)).response == OK


@pytest.mark.parametrize("response", [OK, BAD_GATEWAY], ids=["200", "502"])
async def test_new_then_processing_then_done_replays_byte_exact(
    records: IdempotencyRecords, response: StoredResponse
) -> None:
    token = await begin_new(records)
    assert await records.begin("k", FP) == Begin("processing")
    assert await records.finish("k", token, response) is True
    for _ in range(2):  # replayed as often as asked
        done = await records.begin("k", FP)
        assert done.state == "done" and done.token is None
        assert done.response == response
        assert type(done.response.body) is bytes
        assert all(type(n) is bytes and type(v) is bytes for n, v in done.response.headers)


async def test_a_record_keeps_when_its_answer_was_made_for_the_replays_age(
    records: IdempotencyRecords,
) -> None:
    made = StoredResponse(OK.status, OK.headers, OK.body, created=1_712_345_678.123_456_7)
    token = await begin_new(records)
    finished = time.monotonic()
    assert await records.finish("k", token, made) is True
    done = await records.begin("k", FP)
    waited = await records.wait("k", FP, timeout=0)
    # In Redis, as its age on Redis's clock (ms): as much older as Redis time passed meanwhile.
    older_by = time.monotonic() - finished + 0.002
    for read in (done.response, waited):
        assert read is not None and replace(read, created=made.created) == made
        assert read.created is not None
        assert made.created - older_by <= read.created <= made.created + 0.001
    token = await begin_new(records, "unknown")
    await records.finish("unknown", token, OK)
    unknown = await records.begin("unknown", FP)
    assert unknown.response is not None and unknown.response.created is None


async def test_a_redis_record_written_before_the_answers_time_was_kept_replays_without_it(
    redis_server: RedisServer,
) -> None:
    records = RedisIdempotencyRecords(redis_server.url, retention=60)
    try:
        token = await begin_new(records)
        made = StoredResponse(OK.status, OK.headers, OK.body, created=1_712_345_678.5)
        await records.finish("k", token, made)
        client = aredis.Redis.from_url(redis_server.url)
        await client.hdel(records.record_key("k"), "c", "cr")  # as an older gateway left it
        await client.aclose()
        done = await records.begin("k", FP)
        assert done.response == StoredResponse(OK.status, OK.headers, OK.body)
        assert await records.wait("k", FP, timeout=0) == done.response
    finally:
        await records.aclose()


async def test_a_redis_record_of_an_older_gateway_replays_its_writers_wall_clock(
    redis_server: RedisServer,
) -> None:
    # A rolling upgrade: a gateway that kept when the answer was made on its own wall clock
    # (``c``), not on Redis's (``cr``), left the record; it is read as that gateway read it.
    records = RedisIdempotencyRecords(redis_server.url, retention=60)
    try:
        token = await begin_new(records)
        await records.finish("k", token, OK)
        client = aredis.Redis.from_url(redis_server.url)
        await client.hset(records.record_key("k"), "c", "1712345678.5")
        await client.hdel(records.record_key("k"), "cr")
        await client.aclose()
        done = await records.begin("k", FP)
        assert done.response == replace(OK, created=1_712_345_678.5)
        assert await records.wait("k", FP, timeout=0) == done.response
    finally:
        await records.aclose()


async def test_keys_are_independent(records: IdempotencyRecords) -> None:
    a = await begin_new(records, "a")
    await begin_new(records, "b")
    await records.finish("a", a, OK)
    assert (await records.begin("a", FP)).state == "done"
    assert (await records.begin("b", FP)).state == "processing"
    await begin_new(records, "a\n{x} *")  # any text is a key


async def test_another_fingerprint_is_a_mismatch_while_processing_and_once_done(
    records: IdempotencyRecords,
) -> None:
    token = await begin_new(records)
    assert await records.begin("k", OTHER_FP) == Begin("mismatch")
    await records.finish("k", token, OK)
    assert await records.begin("k", OTHER_FP) == Begin("mismatch")
    assert (await records.begin("k", FP)).response == OK


async def test_abandon_lets_a_retry_start_new(records: IdempotencyRecords) -> None:
    token = await begin_new(records)
    assert await records.abandon("k", "not the owner") is False
    assert (await records.begin("k", FP)).state == "processing"
    assert await records.abandon("k", token) is True
    retry = await begin_new(records, fp=OTHER_FP)  # the key is free: any request may use it
    assert retry != token
    assert await records.abandon("k", token) is False  # the old owner cannot drop the new one
    assert (await records.begin("k", OTHER_FP)).state == "processing"


async def test_a_released_record_keeps_the_key_for_its_request_alone(
    records: IdempotencyRecords,
) -> None:
    # (A list whose items did not all succeed: its retry runs again, another request is a 422.)
    token = await begin_new(records)
    assert await records.release("k", "not the owner") is False
    assert await records.release("k", token) is True
    assert await records.begin("k", OTHER_FP) == Begin("mismatch")
    assert await asyncio.wait_for(records.wait("k", FP, timeout=60), 5) is None  # not running
    assert await records.wait("k", OTHER_FP, timeout=0) is None
    retry = await begin_new(records)  # its own request runs again, under a new owner
    assert retry != token
    assert await records.finish("k", token, OK) is False  # the old owner's turn is over
    assert await records.release("k", token) is False
    assert (await records.begin("k", FP)).state == "processing"
    assert await records.begin("k", OTHER_FP) == Begin("mismatch")
    assert await records.finish("k", retry, OK) is True
    assert (await records.begin("k", FP)).response == OK
    assert await records.release("k", retry) is False  # a finished record stays


async def test_a_released_record_wakes_its_waiters(records: IdempotencyRecords) -> None:
    token = await begin_new(records)
    waiter = asyncio.create_task(records.wait("k", FP, timeout=10))
    await eventually(lambda: records.waiters == 1, timeout=2, what="the waiter")  # type: ignore[attr-defined]
    await records.release("k", token)
    assert await asyncio.wait_for(waiter, 2) is None  # (woken: its own timeout is 10 s)


async def test_a_released_record_expires_after_the_retention(make: Make) -> None:
    records = make(retention=0.1)
    await records.release("k", await begin_new(records))
    await make.let_pass(0.1)

    async def expired() -> bool:
        return (await records.begin("k", OTHER_FP)).state == "new"

    await until(expired)


async def test_only_the_owner_token_finishes(records: IdempotencyRecords) -> None:
    token = await begin_new(records)
    assert await records.finish("k", "not the owner", OK) is False
    assert await records.finish("never begun", token, OK) is False
    assert (await records.begin("k", FP)).state == "processing"
    assert await records.finish("k", token, BAD_GATEWAY) is True
    assert await records.finish("k", "not the owner", OK) is False
    assert await records.abandon("k", token) is False  # a finished record stays
    assert await records.renew("k", token) is False
    assert (await records.begin("k", FP)).response == BAD_GATEWAY


async def test_concurrent_begins_have_exactly_one_winner(make: Make) -> None:
    a = make()
    b = make() if isinstance(a, RedisIdempotencyRecords) else a  # two instances, one server
    began = await asyncio.gather(*(r.begin("k", FP) for r in (a, b) * 10))
    assert sorted(x.state for x in began) == ["new"] + ["processing"] * 19


async def test_a_finished_record_expires_after_the_retention(make: Make) -> None:
    records = make(retention=0.1)
    token = await begin_new(records)
    await records.finish("k", token, OK)
    assert (await records.begin("k", FP)).state == "done"
    assert (await records.begin("k", OTHER_FP)).state == "mismatch"  # not yet: still held
    await make.let_pass(0.1)

    async def expired() -> bool:
        return (await records.begin("k", OTHER_FP)).state == "new"

    await until(expired)  # (at once in process; a Redis server expires within its tick)


async def test_a_processing_lease_runs_out_and_the_key_is_taken_over(make: Make) -> None:
    # (Redis runs the lease in real time: the dead owner's closing and the next look took over
    # 0.5 s on a 3-node cluster on a busy host, so a key found free at once is wrong only if
    # the lease had not had its time since the begin was sent.)
    records = make(lease=0.5)
    sent = time.monotonic()
    dead = await begin_and_die(make, records)  # its owner never comes back
    tokens: list[str | None] = []

    async def taken_over() -> bool:
        began = await records.begin("k", FP)
        tokens.append(began.token)
        return began.state == "new"

    if await taken_over():  # only where the host stalled past the lease
        assert time.monotonic() - sent >= 0.5, "taken over while the lease held"
    else:
        await make.let_pass(0.5)
        await until(taken_over)
    owner = tokens[-1]
    assert owner is not None and owner != dead
    assert await records.finish("k", dead, BAD_GATEWAY) is False  # too late for the old owner
    assert await records.renew("k", dead) is False
    assert await records.finish("k", owner, OK) is True
    assert (await records.begin("k", FP)).response == OK


async def test_renew_keeps_the_lease_alive(make: Make) -> None:
    # (Redis runs the lease in real time: a lease found gone is wrong only if it had not had its
    # time since the last renewal, or begin, was sent; on a host that stalled that long the
    # record is begun again and the renewals go on.)
    records = make(lease=0.5)
    renewed = time.monotonic()
    token = await begin_new(records)

    def stalled() -> bool:
        return time.monotonic() - renewed >= 0.5

    for _ in range(13):  # 2.6 leases, renewed every fifth of one
        await make.let_pass(0.1)
        sent = time.monotonic()
        if not await records.renew("k", token):
            assert stalled(), "the lease ran out while renewed"
            token = await begin_new(records)
        renewed = sent
        began = await records.begin("k", FP)
        if began.state == "new":
            assert stalled(), "the lease ran out just after its renewal"
            token = began.token or ""
        else:
            assert began.state == "processing"
    assert await records.finish("k", token, OK) is True


async def test_a_redis_begin_cancelled_on_its_way_leaves_no_record_that_refuses_the_retry(
    redis_server: RedisServer,
) -> None:
    # Its client left while the begin was on its way, at every step of it: where it had
    # landed, its record stayed processing for the lease (nobody renews or settles it), and
    # the client's retry was refused (409) meanwhile. Now taken back at once.
    records = RedisIdempotencyRecords(redis_server.url, retention=60, lease=600)
    try:
        await records.begin("warm", FP)  # (connected: the steps swept are the begin's own)
        for steps in range(40):
            key = f"k{steps}"
            task = await cancelled_after(records.begin(key, FP), steps)
            if task is None:
                break
            assert task.cancelled()

            async def retried_anew(key: str = key) -> bool:
                began = await records.begin(key, FP)
                if began.state == "new":
                    assert began.token is not None
                    await records.release(key, began.token)
                return began.state == "new"

            await until(retried_anew, timeout=WAIT_S)
        else:
            pytest.fail("the begin did not end within 40 steps")
        assert steps > 1
    finally:
        await records.aclose()


async def test_redis_records_renew_their_owners_lease_while_it_works_and_stop_once_settled(
    shared_redis: RedisServer,
) -> None:
    url, cluster = shared_redis.url, shared_redis.cluster
    # A lease long enough that a renewal late on a busy machine still lands in time (at 0.15 s
    # one CI run saw the record lapse): four renewals outlast it all the same.
    records = RedisIdempotencyRecords(url, retention=60, lease=1.2, cluster=cluster)
    other = RedisIdempotencyRecords(url, retention=60, lease=1.2, cluster=cluster)
    try:
        token = await begin_new(records)
        await eventually(lambda: records.renewals >= 4, timeout=10, what="4 renewals (4/3 lease)")
        assert (await other.begin("k", FP)).state == "processing"  # still held, elsewhere too
        assert await records.finish("k", token, OK) is True
        assert records._keepers == {}
        assert (await other.begin("k", FP)).response == OK
    finally:
        await records.aclose()
        await other.aclose()


async def test_wait_returns_the_response_when_another_task_finishes(
    records: IdempotencyRecords,
) -> None:
    token = await begin_new(records)
    waiter = asyncio.create_task(records.wait("k", FP, timeout=10))
    await eventually(lambda: records.waiters == 1, timeout=2, what="the waiter")  # type: ignore[attr-defined]
    assert not waiter.done()
    await records.finish("k", token, OK)
    assert await asyncio.wait_for(waiter, 5) == OK  # (woken: its own timeout is 10 s)
    assert records.waiters == 0  # type: ignore[attr-defined]


async def test_wait_returns_none_on_timeout(records: IdempotencyRecords) -> None:
    await begin_new(records)
    started = time.monotonic()
    assert await records.wait("k", FP, timeout=0.1) is None
    assert time.monotonic() - started >= 0.09  # (not before its timeout)
    assert (await records.begin("k", FP)).state == "processing"  # waiting changed nothing


async def test_wait_returns_none_without_a_record_or_once_abandoned(
    records: IdempotencyRecords,
) -> None:
    # At once, not at its timeout (60 s).
    assert await asyncio.wait_for(records.wait("nothing", FP, timeout=60), 5) is None
    token = await begin_new(records)
    waiter = asyncio.create_task(records.wait("k", FP, timeout=10))
    await eventually(lambda: records.waiters == 1, timeout=2, what="the waiter")  # type: ignore[attr-defined]
    await records.abandon("k", token)
    assert await asyncio.wait_for(waiter, 2) is None


async def test_wait_returns_at_once_when_already_done(records: IdempotencyRecords) -> None:
    token = await begin_new(records)
    await records.finish("k", token, BAD_GATEWAY)
    assert await records.wait("k", FP, timeout=0) == BAD_GATEWAY


async def test_wait_does_not_return_the_answer_to_another_request(make: Make) -> None:
    records = make(lease=0.5)  # (Redis: long enough for the waiter to see the record first)
    await begin_and_die(make, records)  # dies: its lease runs out
    waiter = asyncio.create_task(records.wait("k", FP, timeout=10))
    await eventually(lambda: records.waiters == 1, timeout=2, what="the waiter")  # type: ignore[attr-defined]
    await make.let_pass(0.5)

    async def taken_over() -> bool:
        return (await records.begin("k", OTHER_FP)).state == "new"

    await until(taken_over)
    assert await asyncio.wait_for(waiter, 2) is None  # the key now holds another request


async def test_wait_for_a_record_that_holds_another_request_returns_none_at_once(
    records: IdempotencyRecords,
) -> None:
    token = await begin_new(records, fp=OTHER_FP)
    assert await records.wait("k", FP, timeout=10) is None  # not the waiter's request: no wait
    await records.finish("k", token, OK)
    assert await records.wait("k", FP, timeout=10) is None  # nor its answer


# --------------------------------------------------------------------------- several instances


@pytest.fixture
async def two(
    shared_redis: RedisServer,
) -> AsyncIterator[tuple[RedisIdempotencyRecords, RedisIdempotencyRecords]]:
    """Two instances' records on one server, or on one cluster."""
    url, cluster = shared_redis.url, shared_redis.cluster
    a = RedisIdempotencyRecords(url, retention=60, cluster=cluster)
    b = RedisIdempotencyRecords(url, retention=60, cluster=cluster)
    yield a, b
    await a.aclose()
    await b.aclose()


async def test_two_instances_see_each_other(
    two: tuple[RedisIdempotencyRecords, RedisIdempotencyRecords],
) -> None:
    a, b = two
    token = await begin_new(a)
    assert await b.begin("k", FP) == Begin("processing")
    assert await b.begin("k", OTHER_FP) == Begin("mismatch")
    waiter = asyncio.create_task(b.wait("k", FP, timeout=10))
    await eventually(lambda: b.waiters == 1, timeout=2, what="b's waiter")
    assert await a.finish("k", token, OK) is True
    assert await asyncio.wait_for(waiter, 2) == OK  # b polls: no wake-up from a
    assert (await b.begin("k", FP)).response == OK
    # An abandon on one instance frees the key on the other.
    token = await begin_new(b, "k2")
    assert await a.begin("k2", FP) == Begin("processing")
    assert await b.abandon("k2", token) is True
    await begin_new(a, "k2")


# --------------------------------------------------------------------------- memory only


async def counted(response: StoredResponse, key: str = "k") -> int:
    """What a finished record of ``response`` under a short ``key`` counts in ``bytes``."""
    records = MemoryIdempotencyRecords(60)
    await records.finish(key, await begin_new(records, key), response)
    return records.bytes


async def test_memory_records_are_bounded_in_count_and_bytes(caplog) -> None:
    one = await counted(OK)
    records = MemoryIdempotencyRecords(60, max_records=3, max_bytes=2 * one)
    for key in "abcde":
        await records.finish(key, await begin_new(records, key), OK)
    assert len(records) <= 3 and records.bytes <= 2 * one
    assert (await records.begin("e", FP)).state == "done"  # the newest stay
    assert (await records.begin("a", FP)).state == "new"  # the oldest went
    assert records.evictions >= 2
    big = StoredResponse(200, [], b"x" * (2 * one + 1))
    token = await begin_new(records, "big")
    assert await records.finish("big", token, big) is False  # too large: not kept...
    assert (await records.begin("e", FP)).state == "done"  # ...and evicts nothing
    # (Said: an operator would not learn otherwise why a retry ran again.)
    assert "larger than idempotency.max_bytes" in caplog.text and "runs again" in caplog.text
    await records.aclose()
    assert len(records) == 0 and records.bytes == 0


@pytest.mark.parametrize("behind_redis", [False, True])
async def test_an_eviction_is_said_as_what_it_costs_alone_or_behind_redis(
    behind_redis: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Behind Redis the records here are this instance's copies (its way down): evicting one
    # costs nothing while Redis answers, which replays the retry. The warning said "a retry of
    # theirs runs again; ... or use redis" to an operator using Redis (a churn reviewer).
    caplog.set_level(logging.INFO, logger="carpool.idempotency")
    records = MemoryIdempotencyRecords(60, max_records=1, behind_redis=behind_redis)
    for key in "ab":
        await records.finish(key, await begin_new(records, key), OK)
    assert records.evictions == 1
    (said,) = [r for r in caplog.records if "evicted" in r.getMessage()]
    if behind_redis:
        assert said.levelno == logging.INFO and "use redis" not in said.getMessage()
        assert "Redis" in said.getMessage() and "copies" in said.getMessage()
    else:
        assert said.levelno == logging.WARNING and "runs again" in said.getMessage()
    await records.aclose()


@pytest.mark.parametrize("quiet", ["quiet", "a-quiet-tenant"])  # (records of other sizes)
async def test_one_tenants_flood_of_keys_evicts_its_own_records_not_another_tenants(quiet) -> None:
    """A record's key begins with its requester's scope (``scope_of``). Beyond the bounds the
    oldest finished record of the tenant holding the largest share goes: before, the oldest
    overall went, so a tenant sending many keys evicted a quiet tenant's record within its
    retention, and that tenant's retry ran its generation again."""
    # (The budget of four records of the longest key: the count bounds them, not the bytes,
    # whatever a string costs: 8 bytes less from Python 3.12 on, a record a 16-byte step less.)
    one = await counted(OK, f"{quiet}\nk1")
    records = MemoryIdempotencyRecords(60, max_records=4, max_bytes=4 * one)
    await records.finish(f"{quiet}\nk1", await begin_new(records, f"{quiet}\nk1"), OK)
    for n in range(20):
        key = f"loud\n{n}"
        await records.finish(key, await begin_new(records, key), OK)
    assert len(records) <= 4 and records.bytes <= 4 * one
    assert (await records.begin(f"{quiet}\nk1", FP)).state == "done"  # still replayed
    assert (await records.begin("loud\n19", FP)).state == "done"  # the flood's newest stay
    assert (await records.begin("loud\n0", FP)).state == "new"  # its oldest went
    # The quiet tenant's next record is kept too: the loud one, larger, pays for it.
    await records.finish(f"{quiet}\nk2", await begin_new(records, f"{quiet}\nk2"), OK)
    assert (await records.begin(f"{quiet}\nk1", FP)).state == "done"
    assert (await records.begin(f"{quiet}\nk2", FP)).state == "done"
    # By bytes too: a tenant of a few large records pays for the next large one.
    big = StoredResponse(200, [], b"x" * (2 * one))
    for n in range(3):
        key = f"heavy\n{n}"
        await records.finish(key, await begin_new(records, key), big)
    assert records.bytes <= 4 * one
    assert (await records.begin(f"{quiet}\nk2", FP)).state == "done"
    assert (await records.begin("heavy\n2", FP)).state == "done"


@pytest.mark.parametrize(
    "flood",
    [lambda n: f"loud:cookie-{n}\n{n}", lambda n: f"made-up-{n}\n{n}"],
    ids=["one tenant, a new cookie each", "a new tenant each"],
)
async def test_tenants_made_up_per_record_evict_no_one_sooner_than_a_plain_lru(flood) -> None:
    """A key's tenant is its requester's own, not the digest of its other credentials (a
    cookie changed on each request made a one-record tenant of each, and the quiet tenant,
    then the largest, lost its newest records first); and records of many tenants of one
    record each (keys made up, without client_keys_file) are each at their share: the oldest
    of all goes, as in a plain LRU, never a quiet tenant's newer record before them."""
    records = MemoryIdempotencyRecords(60, max_records=10)
    for n in range(7):
        await records.finish(flood(n), await begin_new(records, flood(n)), OK)
    for n in range(3):
        await records.finish(f"quiet\n{n}", await begin_new(records, f"quiet\n{n}"), OK)
    for n in range(7, 10):
        await records.finish(flood(n), await begin_new(records, flood(n)), OK)
    for n in range(3):
        assert (await records.begin(f"quiet\n{n}", FP)).state == "done"
    assert [(await records.begin(flood(n), FP)).state for n in range(3)] == ["new"] * 3


async def test_equal_shares_evict_another_tenants_record_before_the_one_just_put() -> None:
    records = MemoryIdempotencyRecords(60, max_records=2)
    for key in ("a\n1", "b\n1", "c\n1"):
        await records.finish(key, await begin_new(records, key), OK)
    assert (await records.begin("c\n1", FP)).state == "done"
    assert (await records.begin("b\n1", FP)).state == "done"
    assert (await records.begin("a\n1", FP)).state == "new"  # the least recent gainer went
    assert records.evictions == 1


async def test_a_quiet_newcomers_larger_record_is_kept_and_the_oldest_goes(caplog) -> None:
    """A tenant's first record, larger than the others' (each under its share of the bytes):
    the newcomer held the largest share, so its oldest record, the one just put, was evicted
    (a plain LRU drops the oldest of all; its retry ran the generation again), and said to be
    larger than ``max_bytes`` on its own, which it was not."""
    caplog.set_level(logging.WARNING, logger="carpool.idempotency")
    one = await counted(OK, "t0\nk")
    big = StoredResponse(200, [], OK.body * 4)
    size = await counted(big, "new\nk")
    assert size > one + 2
    # (Every tenant under its share, 11 of them, the newcomer's record past the bound.)
    records = MemoryIdempotencyRecords(60, max_records=100, max_bytes=11 * one + (size - one) // 2)
    for n in range(10):
        await records.finish(f"t{n}\nk", await begin_new(records, f"t{n}\nk"), OK)
    assert await records.finish("new\nk", await begin_new(records, "new\nk"), big) is True
    assert (await records.begin("new\nk", FP)).state == "done"
    assert (await records.begin("t0\nk", FP)).state == "new"  # the oldest of all went
    assert (await records.begin("t1\nk", FP)).state == "done"
    assert not [r for r in caplog.records if "larger than" in r.getMessage()]


def test_a_newcomers_large_record_evicts_the_heavy_tenants_never_the_quiet_ones() -> None:
    """The record just put is never evicted; but with the newcomer then the largest share, the
    oldest of all went, a quiet tenant's, while a heavy tenant held more than its share."""
    from carpool.idempotency.finished import Finished

    finished: Finished[int] = Finished(
        max_records=100, max_bytes=10_000, size=lambda key, size: size, expires=lambda _: math.inf
    )
    finished.put("quiet\nk0", 100)  # the oldest of all
    for n in range(50):
        finished.put(f"heavy\nk{n}", 100)  # 5,000 bytes, 50 records: over its share (3,333, 33)
    assert finished.put("new\nk0", 5_200)  # (10,300 bytes: three records of 100 to go)
    assert "quiet\nk0" in finished and "new\nk0" in finished
    assert sum(key.startswith("heavy") for key in finished) == 47
    assert [f"heavy\nk{n}" in finished for n in range(4)] == [False, False, False, True]


async def test_a_running_record_is_never_evicted_by_the_bounds() -> None:
    """The bounds evict finished records only: a record being processed stayed in the same
    bounded list, kept its place there and was the first to go (its retry ran the generation
    again while the first still ran, and the first's finish was refused)."""
    one = await counted(OK)
    records = MemoryIdempotencyRecords(60, max_records=3, max_bytes=2 * one)
    token = await begin_new(records, "running")  # (this test's task runs on: it is the owner)
    for key in "abcde":
        await records.finish(key, await begin_new(records, key), OK)
    assert (await records.begin("running", FP)).state == "processing"
    assert await records.finish("running", token, OK) is True
    assert (await records.begin("running", FP)).state == "done"
    assert records.evictions >= 3  # (finished ones: counted)


async def test_an_in_process_lease_holds_while_its_owners_task_runs_and_then_counts_again() -> None:
    """In one process an owner cannot die without its task ending, and a stream may outlive
    any fixed lease: a record's lease does not run out while the task that began it runs
    (a retry meanwhile is ``processing``, never run again); once that task has ended without
    settling it, the lease counts from the ``begin`` again."""
    clock = ManualClock()
    records = MemoryIdempotencyRecords(60, processing_ttl=1, clock=clock)
    done, began = asyncio.Event(), asyncio.Event()
    tokens: list[str] = []

    async def owner() -> None:  # a long stream's request: it begins, then works on
        tokens.append(await begin_new(records, "long"))
        began.set()
        await done.wait()

    running = asyncio.create_task(owner())
    await began.wait()
    clock.advance(10)  # ten leases
    assert (await records.begin("long", FP)).state == "processing"
    assert await records.wait("long", FP, timeout=0.01) is None  # (times out: no busy loop)
    assert await records.finish("long", tokens[0], OK) is True
    assert (await records.begin("long", FP)).response == OK
    # A task that ends without settling its record (a bug): its lease runs as before.
    await asyncio.create_task(begin_new(records, "leaked"))
    assert (await records.begin("leaked", FP)).state == "processing"
    clock.advance(1)
    await begin_new(records, "leaked")  # taken over
    done.set()
    await running


async def test_memory_records_sweep_what_expired() -> None:
    clock = ManualClock()
    records = MemoryIdempotencyRecords(0.05, processing_ttl=0.05, sweep_interval=0, clock=clock)
    for key in "abc":  # (each begun by a task that ends: its lease then runs)
        await asyncio.create_task(begin_new(records, key))
    d = await asyncio.create_task(begin_new(records, "d"))
    await records.finish("c", d, OK)  # wrong key: refused
    assert len(records) == 4
    clock.advance(0.05)  # the leases run out
    await begin_new(records, "z")  # sweeps
    assert len(records) == 1 and records.bytes == 0


@pytest.mark.parametrize("settled", ["finished", "released"])
async def test_memory_records_hold_no_more_than_max_bytes(settled: str) -> None:
    """``max_bytes`` bounds what the records hold, not only their responses: filled past it
    with small answers under long keys (255 characters, and an index: a list's items), the
    records took 2.6 to 3.9 times the budget (their keys, fingerprints, tokens, objects and
    places were not counted), and RELEASED ones (no response) counted nothing at all."""
    max_bytes = 400_000
    records = MemoryIdempotencyRecords(60, max_records=1_000_000, max_bytes=max_bytes)
    empty = deep_size(records)
    for n in range(2_000):
        key = f"tenant\n{'K' * 255}\n{n}"
        token = await begin_new(records, key, f"{n:032x}")
        if settled == "finished":  # (objects of its own, as an answer read from upstream)
            small = StoredResponse(
                200,
                [
                    (bytes(bytearray(b"content-type")), bytes(bytearray(b"application/json"))),
                    (bytes(bytearray(b"x-request-id")), f"r-{n:016}".encode()),
                ],
                f'{{"n":{n}}}'.encode(),
                created=time.time(),
            )
            assert await records.finish(key, token, small) is True
        else:
            assert await records.release(key, token) is True
    gc.collect()
    held_now = deep_size(records) - empty
    assert records.bytes <= max_bytes
    assert held_now <= 1.2 * max_bytes, (held_now, records.bytes, len(records))
    # What is counted is what is held (the measured sizes ``_size`` names), not a guess in
    # excess that would keep fewer records than the budget holds.
    assert records.bytes <= 1.1 * held_now, (held_now, records.bytes)


# --------------------------------------------------------------------------- Redis only


def record_key(key: str) -> str:
    return "carpool:idem:{" + hashlib.blake2b(key.encode(), digest_size=20).hexdigest() + "}"


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def test_redis_layout_one_hashed_key_per_record_with_its_ttl(
    redis_server: RedisServer, raw: aredis.Redis
) -> None:
    records = RedisIdempotencyRecords(redis_server.url, retention=3600, lease=60)
    try:
        user_key = "tenant\n{evil} *key*"
        token = await begin_new(records, user_key)
        assert await raw.keys("*") == [record_key(user_key).encode()]
        assert records.record_key(user_key) == record_key(user_key)
        assert 59_000 < await raw.pttl(record_key(user_key)) <= 60_000
        assert await raw.hgetall(record_key(user_key)) == {
            b"s": b"p",
            b"fp": FP.encode(),
            b"t": token.encode(),
        }
        await records.finish(user_key, token, BAD_GATEWAY)
        assert 3_599_000 < await raw.pttl(record_key(user_key)) <= 3_600_000
        stored = await raw.hgetall(record_key(user_key))
        assert stored[b"s"] == b"f" and stored[b"st"] == b"502" and stored[b"b"] == BAD_GATEWAY.body
        token = await begin_new(records, "ok")
        await records.finish("ok", token, OK)
        assert await raw.hget(record_key("ok"), "s") == b"s"
        await records.renew("ok", token)  # a done record keeps its ttl
        assert await raw.pttl(record_key("ok")) > 3_599_000
    finally:
        await records.aclose()


async def test_redis_a_prefix_and_a_client_passed_in(
    redis_server: RedisServer, raw: aredis.Redis
) -> None:
    records = RedisIdempotencyRecords(raw, retention=60, prefix="x:")
    await begin_new(records)
    await records.aclose()
    assert await raw.ping() is True  # still open
    assert [k.decode() for k in await raw.keys("*")] == ["x" + record_key("k")[7:]]
    with pytest.raises(ValueError, match="prefix"):
        RedisIdempotencyRecords(raw, retention=60, prefix="{x}:")
    decoding = aredis.Redis.from_url(redis_server.url, decode_responses=True)
    with pytest.raises(ValueError, match="decode"):
        RedisIdempotencyRecords(decoding, retention=60)
    await decoding.aclose()


async def test_redis_a_dead_server_fails_every_call_fast(killable_redis: RedisServer) -> None:
    records = RedisIdempotencyRecords(
        killable_redis.url, retention=60, cluster=killable_redis.cluster
    )
    try:
        token = await begin_new(records)
        killable_redis.kill()
        calls = [
            records.begin("k", FP),
            records.finish("k", token, OK),
            records.abandon("k", token),
            records.renew("k", token),
            records.wait("k", FP, timeout=5),
        ]
        await assert_each_fails_fast(calls)
        killable_redis.restart()  # empty: the key is free
        await begin_new(records)
    finally:
        await records.aclose()


async def test_a_redis_lease_outlives_a_redis_pause_shorter_than_half_of_it(
    killable_redis: RedisServer,
) -> None:
    """Paused: a single server, or every node of a cluster of the test's own at once (as
    tests/test_redis_scale.py pauses it; the session's shared cluster must not be paused)."""
    import os
    import signal

    url, cluster = killable_redis.url, killable_redis.cluster
    records = RedisIdempotencyRecords(
        url, retention=60, lease=1.2, socket_timeout=0.1, cluster=cluster
    )
    other = RedisIdempotencyRecords(url, retention=60, lease=1.2, cluster=cluster)
    try:
        token = await begin_new(records)
        await eventually(lambda: records.renewals >= 1, timeout=5, what="a first renewal")
        for pid in killable_redis.pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)  # the pause itself is the test's subject
        finally:
            for pid in killable_redis.pids:
                os.kill(pid, signal.SIGCONT)
        renewed = records.renewals
        await eventually(
            lambda: records.renewals >= renewed + 2, timeout=5, what="renewals after the pause"
        )
        assert (await other.begin("k", FP)).state == "processing"  # never lapsed
        assert await records.finish("k", token, OK) is True
    finally:
        await records.aclose()
        await other.aclose()


@pytest.mark.parametrize("killable_redis", ["server"], indirect=True)
async def test_a_finish_tried_again_after_its_first_try_ran_late_keeps_the_older_made_time(
    killable_redis: RedisServer,
) -> None:
    """A finish sent into a stalled Redis times out here, but its bytes may wait in Redis's
    buffer and run when it resumes, stamping the answer as made then less the age it said when
    sent: younger by the whole stall. The finish tried again (same token) says the age as of
    its own sending, truer: it found the record finished and left the young stamp (a replay on
    another instance said an age short by the stall). Each try's stamp is kept if older."""
    import dataclasses

    records = RedisIdempotencyRecords(killable_redis.url, retention=60)
    other = RedisIdempotencyRecords(killable_redis.url, retention=60)
    try:
        token = await begin_new(records)
        now = SYSTEM_CLOCK.now()
        late = dataclasses.replace(OK, created=now)  # (the first try, run late: "age 0")
        assert await records.finish("k", token, late) is True
        truer = dataclasses.replace(OK, created=now - 30)  # (its retry: "made 30 s ago")
        finish = records._finish_command(records._finish, records.record_key("k"), token, truer)
        assert await records._call("finish", finish) == 1
        began = await other.begin("k", FP)
        assert began.state == "done" and began.response is not None
        assert began.response.created is not None and began.response.created < now - 25
        younger = dataclasses.replace(OK, created=now)  # (a younger stamp never replaces it)
        finish = records._finish_command(records._finish, records.record_key("k"), token, younger)
        await records._call("finish", finish)
        again = await other.begin("k", FP)
        assert again.response is not None and again.response.created is not None
        assert again.response.created < now - 25
    finally:
        await records.aclose()
        await other.aclose()


# --------------------------------------------------------------------------- the way down
# FallbackRecords on the instance's one health (the shared store's), built as the gateway builds
# them (``wiring.build_idempotency``).


def shared_records(
    target: RedisServer, **distributed: object
) -> tuple[SharedStore, FallbackRecords]:
    """The shared store (the instance's health) and the records on its client and health.
    Redis's timeouts generous unless given: a connection over 0.25 s on a busy CI machine
    began a record in this process instead (degraded), and a test that needs it begun in Redis
    failed (a dead server refuses at once, so a killed one is still found out at once)."""
    distributed = {"connect_timeout": 5.0, "timeout": 5.0, **distributed}
    config = Config(**redis_settings(target, **distributed))
    store = build_store(config)
    records = build_idempotency(config, store)
    assert isinstance(store, SharedStore) and isinstance(records, FallbackRecords)
    assert isinstance(records.shared, RedisIdempotencyRecords) and records.shared.health is store
    return store, records


async def test_keyed_requests_live_locally_while_redis_is_dead_and_never_rerun_a_key_begun_there(
    killable_redis: RedisServer,
) -> None:
    store, records = shared_records(killable_redis, retry_interval=3600)
    try:
        in_redis = await begin_new(records, "before")
        done = await begin_new(records, "finished")
        assert await records.finish("finished", done, OK) is True
        killable_redis.kill()
        token = await begin_new(records)  # Redis fails: the record lives in this process
        assert store.health()["state"] == "degraded"
        assert (await records.begin("k", FP)).state == "processing"
        assert (await records.begin("k", OTHER_FP)).state == "mismatch"
        # Keys this instance began or finished in Redis are not run again here meanwhile.
        assert (await records.begin("before", FP)).state == "processing"
        assert (await records.begin("before", OTHER_FP)).state == "mismatch"
        assert (await records.begin("finished", FP)).response == OK
        assert await records.renew("k", token) is True
        assert await records.finish("k", token, OK) is True
        assert (await records.begin("k", FP)).response == OK  # replayed from this process
        assert await records.wait("k", FP, timeout=1) == OK
        dropped = await begin_new(records, "dropped")
        assert await records.abandon("dropped", dropped) is True
        await begin_new(records, "dropped")  # free again
        # A record begun in Redis is settled there even now (tried: not kept, and counted).
        errors = store.errors
        assert await records.finish("before", in_redis, OK) is False
        assert store.errors == errors + 1 and store.pool_exhausted == 0
    finally:
        await records.aclose()
        await store.aclose()


async def test_a_wait_for_a_key_begun_in_redis_while_redis_is_dead_lasts_until_it_is_settled(
    killable_redis: RedisServer,
) -> None:
    # ``begin`` says ``processing`` for it; ``wait`` answered None at once, so a retry that waits
    # (on_conflict: wait) went round begin and wait, each a failed call to Redis, until then.
    store, records = shared_records(killable_redis, retry_interval=3600)
    try:
        token = await begin_new(records)
        killable_redis.kill()
        errors = store.errors
        waiter = asyncio.create_task(records.wait("k", FP, timeout=60))
        await eventually(lambda: store.errors == errors + 1, what="the wait's call to Redis")
        assert not waiter.done()
        assert await records.finish("k", token, OK) is False  # (not in Redis: kept here)
        assert await asyncio.wait_for(waiter, 5) == OK  # (woken: its own timeout is 60 s)
        assert store.errors == errors + 2  # the wait's one call, and the finish's
    finally:
        await records.aclose()
        await store.aclose()


async def test_a_key_kept_here_while_redis_could_not_be_read_stands_once_it_answers_again(
    killable_redis: RedisServer,
) -> None:
    """A key run here while Redis was dead, and one whose finish could not reach Redis, have a
    record only here: once Redis answers again (it knows neither), a retry here is answered
    from that record (``processing``, then replayed), never run a second time."""
    store, records = shared_records(killable_redis, retry_interval=0.001)
    try:
        in_redis = await begin_new(records, "finish-failed")
        killable_redis.kill()
        assert await records.finish("finish-failed", in_redis, OK) is False  # not in Redis
        assert (await records.begin("finish-failed", FP)).response == OK  # kept here
        token = await begin_new(records, "run-here")  # Redis fails: run from this process
        killable_redis.restart()  # empty
        await eventually(store.usable, what="Redis due for another attempt")
        await begin_new(records, "probe")  # tried, answered: Redis is up again
        assert store.health()["state"] == "up"
        assert (await records.begin("run-here", FP)).state == "processing"  # not "new"
        assert (await records.begin("run-here", OTHER_FP)).state == "mismatch"
        assert await records.wait("run-here", FP, timeout=0.01) is None  # (here: still open)
        assert await records.finish("run-here", token, OK) is True
        assert (await records.begin("run-here", FP)).response == OK
        assert (await records.begin("finish-failed", FP)).response == OK  # not run again
    finally:
        await records.aclose()
        await store.aclose()


async def test_a_key_this_instance_still_runs_is_not_run_again_here_once_its_redis_record_lapsed(
    redis_server: RedisServer, raw: aredis.Redis
) -> None:
    """A Redis pause longer than the lease lets the record of a key this instance still runs
    lapse there (its renewals failed; its owner is alive). Redis answering again says ``new``
    for it: a retry reaching this instance must be that run's (``processing``, then its answer
    replayed), never a second generation here, and the run's answer, refused by Redis (its
    token no longer the owner's), is kept here for it."""
    store, records = shared_records(redis_server)
    try:
        token = await begin_new(records)
        await raw.delete(record_key("k"))  # what a pause past the lease leaves in Redis
        assert (await records.begin("k", FP)).state == "processing"  # was "new": run twice
        assert (await records.begin("k", OTHER_FP)).state == "mismatch"
        assert await records.wait("k", FP, timeout=0.01) is None  # (still open here)
        waiter = asyncio.create_task(records.wait("k", FP, timeout=60))
        assert await records.finish("k", token, OK) is False  # (Redis: not the owner now)
        assert await asyncio.wait_for(waiter, 5) == OK
        assert (await records.begin("k", FP)).response == OK  # replayed here, not run again
        assert await records.wait("k", FP, timeout=1) == OK
    finally:
        await records.aclose()
        await store.aclose()


async def test_a_redis_that_answers_again_takes_the_records_back(redis_server: RedisServer) -> None:
    store, records = shared_records(redis_server, retry_interval=0.001)
    other = RedisIdempotencyRecords(redis_server.url, retention=60)
    try:
        store.report(StoreUnavailable("another layer's call failed"))
        assert store.health()["state"] == "degraded"
        await eventually(store.usable, what="Redis due for another attempt")
        token = await begin_new(records)  # tried, answered: shared again
        assert store.health()["state"] == "up"
        assert (await other.begin("k", FP)).state == "processing"
        assert await records.finish("k", token, OK) is True
        assert (await other.begin("k", FP)).response == OK
    finally:
        await other.aclose()
        await records.aclose()
        await store.aclose()


async def hold_every_connection(client: aredis.Redis, key: str) -> tuple[asyncio.Task, Callable]:
    """Take the one pooled connection that serves ``key`` (``max_connections`` 1): a BLPOP on a
    key of the same slot, until ``release()`` pushes to it through a client of its own."""
    held = b"held" + key[key.index("{") :].encode()
    node = client.get_node_from_key(held) if hasattr(client, "get_node_from_key") else None
    holder = asyncio.create_task(client.blpop([held], timeout=30))
    if node is None:
        pool = client.connection_pool
        await eventually(lambda: bool(pool._in_use_connections), what="the connection taken")
        url = f"redis://{pool.connection_kwargs['host']}:{pool.connection_kwargs['port']}"
    else:
        await eventually(lambda: len(node._connections) > len(node._free), what="taken")
        url = f"redis://{node.host}:{node.port}"

    async def release() -> None:
        pusher = aredis.Redis.from_url(url)
        try:
            await pusher.rpush(held, b"go")
        finally:
            await pusher.aclose()
        await asyncio.wait_for(holder, 5)

    return holder, release


async def test_a_full_pool_is_counted_and_logged_and_never_runs_the_key_locally(
    shared_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis answers: running the key from this process's records could run it twice (it may
    be running, or have run, on another instance). The request is refused, retryable."""
    store, records = shared_records(shared_redis, max_connections=1, pool_timeout=0.05)
    try:
        await store.redis.client.ping()  # (a cluster: the topology read first)
        _, release = await hold_every_connection(store.redis.client, records.shared.record_key("k"))
        with pytest.raises(IdempotencyUnavailable) as busy:
            await records.begin("k", FP)
        assert busy.value.status == 503 and busy.value.headers()["retry-after"] == "1"
        health = store.health()
        assert health["state"] == "up" and health["errors"] == 0
        assert health["pool_exhausted"] == 1
        assert "every connection to redis stayed busy" in caplog.text
        assert len(records.local) == 0  # nothing begun in this process
        await release()
        token = await begin_new(records)  # in Redis, once a connection is free
        assert await records.finish("k", token, OK) is True
        assert (await records.shared.begin("k", FP)).response == OK
        assert store.errors == 0  # (here: only the finished answer's copy, for replays)
        assert (await records.local.begin("k", FP)).response == OK
    finally:
        await records.aclose()
        await store.aclose()


async def test_a_finish_that_finds_the_pool_full_is_tried_again_not_dropped(
    redis_server: RedisServer,
) -> None:
    """Dropped, the record's lease would run out and a retry run the key again."""
    store, records = shared_records(redis_server, max_connections=1, pool_timeout=0.05)
    try:
        token = await begin_new(records)
        _, release = await hold_every_connection(store.redis.client, records.shared.record_key("k"))
        finishing = asyncio.create_task(records.finish("k", token, OK))
        await eventually(lambda: store.pool_exhausted >= 1, what="the finish found it full")
        await release()
        assert await finishing is True
        assert (await records.shared.begin("k", FP)).response == OK
    finally:
        await records.aclose()
        await store.aclose()


async def test_a_cluster_nodes_full_pool_is_waited_for_up_to_the_pool_timeout(
    redis_cluster: RedisServer,
) -> None:
    """A cluster node's pool does not wait for a free connection (a single server's does): the
    records wait for one themselves, counted once."""
    store, records = shared_records(redis_cluster, max_connections=1, pool_timeout=30)
    try:
        await store.redis.client.ping()
        _, release = await hold_every_connection(store.redis.client, records.shared.record_key("k"))
        began = asyncio.create_task(records.begin("k", FP))
        await eventually(lambda: store.pool_exhausted == 1, what="the full pool counted")
        assert not began.done()
        await release()
        assert (await asyncio.wait_for(began, 10)).state == "new"
        assert store.health()["state"] == "up" and store.pool_exhausted == 1
        assert len(records.local) == 0
    finally:
        await records.aclose()
        await store.aclose()


async def test_a_cancellation_that_comes_while_a_failed_requests_record_is_settled_is_kept():
    # The record of a request that failed is given up shielded (``_shielded``): a cancellation
    # of the request arriving meanwhile was suppressed with the record's own failures, and the
    # request ended with its first error, as if it had never been cancelled. The record's
    # update still runs to its end.
    from carpool.idempotency.once import _shielded

    release, settled = asyncio.Event(), asyncio.Event()

    async def give_up() -> None:
        await release.wait()
        settled.set()

    async def request() -> None:
        try:
            raise CarpoolError("the upstream failed")
        except BaseException:
            await _shielded(give_up())
            raise

    task = asyncio.create_task(request())
    await asyncio.sleep(0)  # (failed, giving its record up)
    task.cancel()
    await asyncio.wait({task})
    assert task.cancelled()
    release.set()
    await settled.wait()  # (the record's update ran on)


async def test_a_records_own_failure_while_a_failed_request_gives_it_up_leaves_the_requests_error():
    from carpool.idempotency.once import _shielded

    async def give_up() -> None:
        raise StoreUnavailable("redis is down")

    with pytest.raises(CarpoolError, match="the upstream failed"):
        try:
            raise CarpoolError("the upstream failed")
        except BaseException:
            await _shielded(give_up())
            raise
