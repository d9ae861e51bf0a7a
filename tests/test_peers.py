"""The workers' sharing without Redis (``carpool.peers``), with two gateways in this process,
each on its own port and its own peer socket, as two workers of one run are."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool import peers
from carpool.config import Config
from carpool.errors import RETRY_HEADERS, LeaderLost
from carpool.fingerprint import fingerprint
from carpool.peers import Peers, claim
from carpool.peers.server import PeerServer
from carpool.peers.slots import socket_path, spare_path
from carpool.peers.workers import ASKS, OWN, STALE_SPARE_S
from carpool.pipeline import Gateway
from carpool.redis.flight_relay import LOST
from carpool.request import ClientRequest, parse
from carpool.rundir import run_directory
from carpool.server import create_app
from carpool.store.base import state_tag
from carpool.wiring import build_gateway
from conftest import Served
from fakes.serving import serve_app
from fakes.waiting import WAIT_S, eventually


def meeting_place(count: int) -> Path:
    """A directory made the meeting place of ``count`` workers, as ``carpool serve`` makes its
    run's (``carpool.rundir``, which locks it; not named as a run's: a run starting meanwhile,
    pytest -n, would take this unlocked one for a dead run's and remove it)."""
    directory = Path(tempfile.mkdtemp(prefix="cp-peers-", dir=peers.parent_directory(count)))
    peers.prepare(directory)
    return directory


@dataclass
class Pair:
    a: Served
    b: Served


@contextlib.asynccontextmanager
async def two_workers(
    upstream_url: str | None, b_listens: bool = True, **settings: object
) -> AsyncIterator[Pair]:
    """Workers 0 (``a``) and 1 (``b``) of one run; ``b_listens``: false, b is down. No
    ``upstream_url``: each on its own embedded simulated engine, as ``carpool serve``'s."""
    directory = meeting_place(2)
    config = Config(upstreams=[upstream_url] if upstream_url else [], **settings)
    try:
        gateways = []
        for _ in range(2):
            slot = claim(directory, 2)
            assert slot is not None
            gateways.append(build_gateway(config, peers=Peers(slot, config)))
        a, b = gateways
        async with contextlib.AsyncExitStack() as stack:
            url_a = await stack.enter_async_context(serve_app(create_app(a)))
            client_a = await stack.enter_async_context(httpx.AsyncClient(base_url=url_a))
            if b_listens:
                url_b = await stack.enter_async_context(serve_app(create_app(b)))
                client_b = await stack.enter_async_context(httpx.AsyncClient(base_url=url_b))
            else:
                url_b, client_b = "", httpx.AsyncClient()
            yield Pair(Served(url_a, a, client_a), Served(url_b, b, client_b))
        if not b_listens:
            await b.aclose()
    finally:
        peers.remove(directory)


@contextlib.asynccontextmanager
async def workers(
    n: int, upstream_url: str, wrap: Any = None, **settings: object
) -> AsyncIterator[list[Served]]:
    """Workers 0..n-1 of one run; ``wrap(i, peers)`` may change worker i's ``Peers`` first."""
    directory = meeting_place(n)
    config = Config(upstreams=[upstream_url], **settings)
    try:
        gateways = []
        for i in range(n):
            slot = claim(directory, n)
            assert slot is not None
            worker = Peers(slot, config)
            if wrap is not None:
                wrap(i, worker)
            gateways.append(build_gateway(config, peers=worker))
        async with contextlib.AsyncExitStack() as stack:
            served = []
            for gateway in gateways:
                url = await stack.enter_async_context(serve_app(create_app(gateway)))
                client = await stack.enter_async_context(httpx.AsyncClient(base_url=url))
                served.append(Served(url, gateway, client))
            yield served
    finally:
        peers.remove(directory)


def key_of(gateway: Gateway, question: str, headers: dict[str, str] | None = None) -> str:
    body = httpx.Request("POST", "/", json=_chat(question)).content
    request = parse(ClientRequest("/v1/chat/completions", body, headers or {}), 1 << 20)
    key = fingerprint(request, gateway.config, gateway.accepted).key
    assert key is not None
    return key


def owned_by(
    gateway: Gateway,
    worker: int,
    prefix: str = "Which worker leads me",
    headers: dict[str, str] | None = None,
) -> str:
    """A question whose key ``worker`` owns, as ``gateway`` sees it (asked with ``headers``)."""
    assert gateway.peers is not None
    for i in range(1000):
        question = f"{prefix}, {i}?"
        owner = gateway.peers.owner_of(key_of(gateway, question, headers))
        if (worker if worker != gateway.peers.index else None) == owner:
            return question
    raise AssertionError("no such question")


def idempotency_key_owned_by(gateway: Gateway, worker: int) -> str:
    """An Idempotency-Key whose record ``worker`` owns, as ``gateway`` sees it."""
    assert gateway.peers is not None
    return next(
        f"order-{i}"
        for i in range(1000)
        if gateway.peers.owner_of(scope_of_key(gateway, f"order-{i}")) == worker
    )


def _chat(question: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0}


async def test_the_owner_makes_the_call_and_both_keep_the_answer(fake):
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1)
        first = await pair.a.chat(question)
        assert first.headers["x-carpool"] == "miss"
        assert (await pair.b.chat(question)).headers["x-carpool"] == "hit"
        assert (await pair.a.chat(question)).headers["x-carpool"] == "hit"
        assert fake.count() == 1
        a, b = pair.a.gateway.snapshot(), pair.b.gateway.snapshot()
        assert (a["upstream_calls"], a["peer_calls"]) == (0, 1)
        assert (b["upstream_calls"], b["peers"]["served"]) == (1, 1)


async def test_the_secret_never_reaches_the_upstream_nor_the_fingerprint(fake):
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1)
        headers = {"authorization": "Bearer client-key", "x-carpool-tags": "t1"}
        assert (await pair.a.chat(question, headers=headers)).status_code == 200
        sent = fake.calls[0].headers
        assert "x-carpool-peer" not in sent and sent["authorization"] == "Bearer client-key"
        # Same tenant, same key on the owner: a hit there for the client's own request.
        hit = await pair.b.chat(question, headers=headers)
        assert hit.headers["x-carpool"] == "hit"
        # Another tenant's is not.
        other = await pair.b.chat(question, headers={"authorization": "Bearer another"})
        assert other.headers["x-carpool"] == "miss"


async def test_an_owner_that_is_down_fails_nothing(fake):
    async with two_workers(fake.url, b_listens=False) as pair:
        question = owned_by(pair.a.gateway, 1)
        response = await pair.a.chat(question)
        assert response.status_code == 200 and response.headers["x-carpool"] == "miss"
        assert fake.count() == 1
        snapshot = pair.a.gateway.snapshot()
        assert snapshot["peers"]["unreachable"] == 1 and snapshot["upstream_calls"] == 1
        assert (await pair.a.chat(question)).headers["x-carpool"] == "hit"


async def test_a_keyed_request_waiting_for_its_owner_goes_on_as_the_worker_stops(fake):
    """A keyed request whose record's owner is out of reach waits for it (its replacement
    starting: ``OWNER_RETURN_S``, 10 s); once this worker stops, none is coming: the wait went
    on to its bound, a generation begun seconds into the shutdown."""
    async with two_workers(fake.url, b_listens=False) as pair:
        key = {"Idempotency-Key": idempotency_key_owned_by(pair.a.gateway, 1)}
        keyed = asyncio.create_task(
            pair.a.client.post("/v1/chat/completions", json=_chat("Charge my card"), headers=key)
        )
        await asyncio.sleep(0)  # (on its way: the wait begins, or the stop comes first)
        pair.a.gateway.begin_draining()
        answered = await asyncio.wait_for(keyed, 5)
    assert answered.status_code == 200 and fake.count() == 1


async def aged_at_the_owner(pair: Any, question: str, seconds: float) -> tuple[str, Any]:
    """``question`` answered by worker b (its owner) and kept there, ``seconds`` old now: its
    key and the owner's entry."""
    assert (await pair.b.chat(question)).headers["x-carpool"] == "miss"
    key = key_of(pair.b.gateway, question)
    await pair.b.gateway.store.get(key)  # (a first hit unpacks a copy; a second keeps it)
    original = await pair.b.gateway.store.get(key)
    assert original is not None and await pair.b.gateway.store.get(key) is original
    original.answer.created -= seconds
    return key, original


async def test_an_answer_from_the_owners_cache_keeps_its_age(fake):
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1)
        key, original = await aged_at_the_owner(pair, question, 100)
        relayed = await pair.a.chat(question)
        assert relayed.headers["x-carpool"] == "hit" and int(relayed.headers["age"]) >= 100
        kept = await pair.a.gateway.store.get(key)
        assert kept is not None
        # Never younger than the original: it expires no later than the original would.
        assert kept.answer.created <= original.answer.created
        assert kept.expires <= original.answer.created + pair.b.gateway.config.ttl_for(None)
        assert fake.count() == 1


async def test_a_hit_from_the_owners_cache_says_its_age_to_streaming_clients_too(fake):
    """Hits carry ``age``: a streaming client's, relayed frame by frame from the owner's cached
    answer, as a whole answer's."""
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1)
        key, original = await aged_at_the_owner(pair, question, 100)
        streamed, text = await pair.a.stream_chat(question)
        assert streamed.headers["x-carpool"] == "hit" and int(streamed.headers["age"]) >= 100
        assert text.rstrip().endswith("data: [DONE]")
        whole = await pair.a.chat(question)  # (from a's own cache now)
        assert whole.headers["x-carpool"] == "hit" and int(whole.headers["age"]) >= 100
        assert fake.count() == 1


async def test_an_owners_answer_expired_here_by_its_age_is_relayed_but_not_stored(fake):
    """The owner serves its answer until its TTL; relayed in its last second, its ``age`` (whole
    seconds, counted up: ``Exchange.fetch``) makes it expired here: it takes no room in this
    worker's cache."""
    async with two_workers(fake.url, semantic={"enabled": True}) as pair:
        question = owned_by(pair.a.gateway, 1)
        key, _ = await aged_at_the_owner(pair, question, pair.b.gateway.config.ttl_for(None) - 0.5)
        relayed = await pair.a.chat(question)
        assert relayed.status_code == 200 and relayed.headers["x-carpool"] == "hit"
        store = pair.a.gateway.store
        assert not store.holds(key) and (store.entries, store.bytes, store.evictions) == (0, 0, 0)
        semantic = pair.a.gateway.layers.semantic
        assert semantic is not None and semantic.entries == 0
        assert fake.count() == 1


async def test_an_answer_the_upstream_says_no_shared_cache_may_store_is_stored_on_no_worker(fake):
    """Relayed from the worker owning its key, the upstream's ``no-store`` (RFC 9111 5.2.2.3)
    reached only the owner: the worker that asked stored it, and served it as a hit."""
    async with two_workers(fake.url, semantic={"enabled": True}) as pair:
        fake.response_headers = [(b"cache-control", b"private")]
        question = owned_by(pair.a.gateway, 1)
        first = await pair.a.chat(question)
        assert first.status_code == 200 and first.headers["x-carpool"] == "miss"
        assert first.headers["cache-control"] == "no-store"  # (for the caches past this one)
        assert pair.a.gateway.store.entries == pair.b.gateway.store.entries == 0
        semantic = pair.a.gateway.layers.semantic
        assert semantic is not None and semantic.entries == 0
        again = await pair.a.chat(question)
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2
        assert again.json()["choices"][0]["message"]["content"].startswith("answer 2 to")


async def test_a_streaming_joiner_of_the_owners_no_store_call_stores_nothing_either(fake):
    """A streaming client asked here joins, at the owner, a call asked whole whose answer the
    upstream said no cache may store: the owner's stream of it says so, and is not stored here."""
    async with two_workers(fake.url) as pair:
        fake.response_headers = [(b"cache-control", b"no-store")]
        fake.gate = asyncio.Event()
        question = owned_by(pair.a.gateway, 1)
        leader = asyncio.create_task(pair.b.chat(question))
        await fake.wait_for_calls(1)
        joiner = asyncio.create_task(pair.a.stream_chat(question))
        await eventually(
            lambda: sum(f.clients for f in pair.b.gateway.flights.running()) == 2,
            what="the relayed joiner on the owner's flight",
        )
        fake.gate.set()
        whole, (streamed, raw) = await asyncio.gather(leader, joiner)
        assert (whole.headers["x-carpool"], streamed.headers["x-carpool"]) == ("miss", "coalesced")
        assert raw.rstrip().endswith("data: [DONE]") and fake.count() == 1
        assert pair.a.gateway.store.entries == pair.b.gateway.store.entries == 0
        fake.gate = None
        assert (await pair.a.chat(question)).headers["x-carpool"] == "miss"
        assert fake.count() == 2


async def test_a_joiner_with_max_age_does_not_take_the_owners_old_answer_its_leader_took(fake):
    """The leader on ``a`` takes ``b``'s cached answer (100 s old); a client asking at most
    10 s old arrives within the flight's window: its own call, with its own headers."""
    async with two_workers(fake.url, coalesce={"window_ms": 60_000, "adaptive": False}) as pair:
        question = owned_by(pair.a.gateway, 1)
        key, _ = await aged_at_the_owner(pair, question, 100)
        leader = await pair.a.chat(question)
        assert leader.headers["x-carpool"] == "hit" and int(leader.headers["age"]) >= 100
        fresh = await pair.a.chat(question, headers={"cache-control": "max-age=10"})
        assert fresh.status_code == 200 and int(fresh.headers.get("age", "0")) < 10
        assert fresh.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_an_owners_hit_does_not_count_as_the_upstream_accepting_the_requester(fake):
    """Credentials are accepted on what the upstream itself answered them: another worker's
    cached answer says nothing of them (its own upstream call, a miss there, does)."""
    async with two_workers(fake.url) as pair:
        key = {"authorization": "Bearer sk-client"}  # (its own tenant: its own keys' owners)
        question = owned_by(pair.a.gateway, 1, headers=key)
        assert (await pair.b.chat(question, headers=key)).headers["x-carpool"] == "miss"
        relayed = await pair.a.chat(question, headers=key)
        assert relayed.headers["x-carpool"] == "hit" and fake.count() == 1
        assert len(pair.a.gateway.accepted) == 0 and len(pair.b.gateway.accepted) == 1
        other = owned_by(pair.a.gateway, 1, "And where is this one led", headers=key)
        assert (await pair.a.chat(other, headers=key)).headers["x-carpool"] == "miss"
        assert len(pair.a.gateway.accepted) == 1  # the owner's own call for this request


async def test_a_key_the_upstream_refused_on_one_worker_is_taken_back_on_every_worker(fake):
    """Each worker accepts credentials by itself: a 401 on one took the key's acceptances back
    there only, and another worker let it read the shared namespaces on until
    `tenant.accepted_ttl`. The refusal is passed on to every worker now."""
    from fakes.waiting import eventually

    fake.valid_keys = {"sk-r"}
    key = {"authorization": "Bearer sk-r"}
    async with two_workers(fake.url, tenant={"shared_namespaces": ["pub"]}) as pair:
        for index, worker in enumerate((pair.a, pair.b)):
            question = owned_by(worker.gateway, index, headers=key)  # its own call
            assert (await worker.chat(question, headers=key)).headers["x-carpool"] == "miss"
        assert len(pair.a.gateway.accepted) == 1 and len(pair.b.gateway.accepted) == 1
        fake.valid_keys = set()  # revoked upstream
        refused = owned_by(pair.a.gateway, 0, "Refused here", headers=key)
        assert (await pair.a.chat(refused, headers=key)).status_code == 401
        await eventually(
            lambda: len(pair.b.gateway.accepted) == 0, what="the refusal passed on to B"
        )
        # One telling of a tenant at a time: a flood of 401s sends no more.
        peers = pair.a.gateway.peers
        assert peers is not None
        peers.tell_refused("t")
        peers.tell_refused("t")
        assert len(peers._telling) == 1


async def test_a_refusal_passed_on_that_names_no_tenant_is_a_400_and_takes_nothing_back(fake):
    # Only a peer sends {"refused": ...}; one whose tenant is not a string (another release,
    # a bug) is refused by name, every acceptance kept and the worker serving on.
    fake.valid_keys = {"sk-r"}
    key = {"authorization": "Bearer sk-r"}
    async with two_workers(fake.url, tenant={"shared_namespaces": ["pub"]}) as pair:
        question = owned_by(pair.b.gateway, 1, headers=key)
        assert (await pair.b.chat(question, headers=key)).headers["x-carpool"] == "miss"
        assert len(pair.b.gateway.accepted) == 1
        peers = pair.a.gateway.peers
        assert peers is not None
        b_door = socket_path(peers.directory, 1)
        for tenant in (5, None, ["t"], {"t": 1}):
            answer = await peers._admin_on(b_door, "/admin/invalidate", {"refused": tenant}, "t")
            assert answer is not None and answer[0] == 400, (tenant, answer)
            assert "refused names a tenant" in str(answer[1]), answer
        assert len(pair.b.gateway.accepted) == 1
        assert (await pair.b.chat(question, headers=key)).headers["x-carpool"] == "hit"


async def test_a_stream_led_by_the_owner_is_relayed_frame_by_frame(fake):
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1)
        response, text = await pair.a.stream_chat(question)
        assert response.headers["x-carpool"] == "miss"
        assert text.endswith("data: [DONE]\n\n") and text.count("data: ") > 3
        again, same = await pair.b.stream_chat(question)
        assert again.headers["x-carpool"] == "hit"
        assert fake.count() == 1


async def test_an_owners_refusal_reaches_the_client_with_when_to_retry(fake):
    """Asked of its key's owner, a flight's refusal lost its Retry-After, retry-after-ms and
    x-should-retry: the SDK retried a 429 at once, and ran a 504's generation (which may be
    running) three times where it landed on the other worker."""
    fake.fail_status = 429
    fake.response_headers = [
        (b"retry-after", b"7"),
        (b"retry-after-ms", b"7000"),
        (b"x-should-retry", b"false"),
    ]
    async with two_workers(fake.url) as pair:
        for stream in (False, True):
            question = owned_by(pair.a.gateway, 1, f"Refused, streamed {stream}")
            response = await pair.a.client.post(
                "/v1/chat/completions", json={**_chat(question), "stream": stream}
            )
            assert response.status_code == 429, response.text
            retry = {name: response.headers.get(name) for name in RETRY_HEADERS}
            assert retry == {
                "retry-after": "7",
                "retry-after-ms": "7000",
                "x-should-retry": "false",
            }
        assert pair.b.gateway.peers is not None and fake.count() == 2


_RESPONSES_EVENTS = b"".join(
    b'event: %s\ndata: {"type":"%s","sequence_number":%d}\n\n' % (name, name, number)
    for number, name in enumerate((b"response.created", b"response.in_progress"))
)


@pytest.mark.parametrize(
    ("path", "whole"),
    [
        (
            "/v1/chat/completions",
            b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n',
        ),
        ("/v1/responses", _RESPONSES_EVENTS),
    ],
)
async def test_a_keyed_stream_whose_owner_dies_mid_event_ends_with_whole_events_then_its_error(
    fake, path, whole
):
    """The owner running a keyed stream died with an event half written: the half reached the
    client as an event of its own (the SDK raised a JSONDecodeError, not an APIError). The
    error event is numbered after the events relayed, where the API numbers its events."""
    directory = meeting_place(2)
    config = Config(upstreams=[fake.url])
    door = PeerServer()

    async def dies_mid_event(scope, receive, send):
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        half = b'data: {"id":"c","object":"chat.completion.chunk","choi'
        await send({"type": "http.response.body", "body": whole + half, "more_body": True})
        raise RuntimeError("the owner died")

    try:
        slot, owner = claim(directory, 2), claim(directory, 2)
        assert slot is not None and owner is not None
        await door.start(dies_mid_event, owner.socket_path(1), 1, 75)
        gateway = build_gateway(config, peers=Peers(slot, config))
        key = idempotency_key_owned_by(gateway, 1)
        body = {"model": "m", "input": "Charge my card", "temperature": 0}
        if path == "/v1/chat/completions":
            body = _chat("Charge my card")
        async with serve_app(create_app(gateway)) as url, httpx.AsyncClient(base_url=url) as c:
            response = await c.post(
                path, json={**body, "stream": True}, headers={"idempotency-key": key}
            )
        events = [event for event in response.text.split("\n\n") if event]
        assert "".join(f"{event}\n\n" for event in events[:-1]).encode() == whole
        payloads = [orjson.loads(event.partition("data: ")[2]) for event in events]
        assert "went away" in payloads[-1]["error"]["message"]
        if path == "/v1/responses":
            assert [p["sequence_number"] for p in payloads] == [0, 1, 2]
        assert fake.count() == 0
    finally:
        await door.aclose()
        peers.remove(directory)


async def test_the_meeting_place_is_private(fake):
    with run_directory(peers.parent_directory(2)) as directory:
        peers.prepare(directory)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(directory / "secret").st_mode) == 0o600
        first, second = claim(directory, 2), claim(directory, 2)
        assert first is not None and second is not None
        assert (first.index, second.index) == (0, 1) and first.secret == second.secret
        assert claim(directory, 2) is None  # every slot held
        os.close(first.lock_fd)  # (as when its worker dies)
        successor = claim(directory, 2)
        assert successor is not None and successor.index == 0


async def test_a_long_temporary_directory_puts_the_meeting_place_in_tmp(monkeypatch, tmp_path):
    """A socket's path in a long ``TMPDIR`` would not fit a Unix socket's (107 bytes): the
    directory goes to /tmp, and the workers listen there. A slot's repr hides the secret."""
    long = tmp_path / ("d" * 100)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    directory = meeting_place(8)
    door = PeerServer()
    try:
        assert directory.parent == Path("/tmp")
        slot = claim(directory, 8)
        assert slot is not None and slot.secret.decode() not in repr(slot)

        async def app(scope, receive, send):
            pass

        await door.start(app, slot.socket_path(7), 1, 75)  # (the longest of the run's paths)
        assert slot.socket_path(7).exists()
    finally:
        await door.aclose()
        peers.remove(directory)
    monkeypatch.undo()
    short = meeting_place(2)  # (a short TMPDIR is kept)
    try:
        assert short.parent == Path(tempfile.gettempdir())
    finally:
        peers.remove(short)


async def test_an_owner_that_dies_before_its_first_frame_costs_no_client_anything(fake):
    """The owner takes the request and dies before its stream says anything: nothing was
    relayed, so the call is made here, for streaming and non-streaming clients alike."""
    directory = meeting_place(2)
    config = Config(upstreams=[fake.url])
    door = PeerServer()
    try:
        slot = claim(directory, 2)
        dying = claim(directory, 2)
        assert slot is not None and dying is not None

        async def dies(scope, receive, send):
            assert scope["type"] == "http"
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            # (An SSE comment: the stream has begun, and says nothing.)
            await send({"type": "http.response.body", "body": b": hi\n\n", "more_body": True})
            raise RuntimeError("the owner died")

        await door.start(dies, dying.socket_path(1), 1, 75)
        gateway = build_gateway(config, peers=Peers(slot, config))
        async with serve_app(create_app(gateway)) as url, httpx.AsyncClient(base_url=url) as c:
            served = Served(url, gateway, c)
            response, text = await served.stream_chat(owned_by(gateway, 1))
            assert response.headers["x-carpool"] == "miss" and text.endswith("[DONE]\n\n")
            whole = await served.chat(owned_by(gateway, 1, "And me"))
            assert whole.status_code == 200 and whole.headers["x-carpool"] == "miss"
            assert fake.count() == 2
            snapshot = gateway.snapshot()
            assert snapshot["upstream_calls"] == 2
            # The owner took both; the stream was lost (and taken over here), the whole answer
            # never came (and was asked of the upstream here).
            assert (snapshot["peers"]["calls"], snapshot["peers"]["unreachable"]) == (2, 1)
    finally:
        await door.aclose()
        peers.remove(directory)


SSE = [(b"content-type", b"text/event-stream")]


async def test_a_stream_whose_owner_dies_after_its_first_frame_says_its_leading_worker_was_lost(
    fake,
):
    """The owner leading a stream's call died after a frame reached the client: its error event
    said "worker 1 stream broke (malformed or truncated answer)", blaming the upstream. It is a
    leader lost, as with Redis (``flight_relay.LOST``): said so, under the same code."""
    directory = meeting_place(2)
    config = Config(upstreams=[fake.url])
    door = PeerServer()
    whole = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
    )
    try:
        slot, owner = claim(directory, 2), claim(directory, 2)
        assert slot is not None and owner is not None

        async def dies_after_a_frame(scope, receive, send):
            assert scope["type"] == "http"
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            await send({"type": "http.response.body", "body": whole, "more_body": True})
            raise RuntimeError("the owner died")

        await door.start(dies_after_a_frame, owner.socket_path(1), 1, 75)
        gateway = build_gateway(config, peers=Peers(slot, config))
        async with serve_app(create_app(gateway)) as url, httpx.AsyncClient(base_url=url) as c:
            response, text = await Served(url, gateway, c).stream_chat(owned_by(gateway, 1))
        events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
        assert events[0].encode() == whole.removeprefix(b"data: ").rstrip(b"\n")
        error = orjson.loads(events[1])["error"]
        assert error["message"] == "lost the stream of the worker leading this call", error
        assert error["code"] == LeaderLost(LOST).code  # (the Redis path's)
        assert fake.count() == 0  # (nothing asked of the upstream here: frames were relayed)
    finally:
        await door.aclose()
        peers.remove(directory)


async def test_a_keyed_request_its_owner_took_but_did_not_answer_is_never_run_here_too(fake):
    """Sent to the owner of its record, which took it and said nothing in time: it may be
    running there, so it is a 503 to retry (answered from that record while the owner lives), not
    a second run."""
    directory = meeting_place(2)
    config = Config(
        upstreams=[fake.url],
        coalesce={"join_timeout_ms": 50},
        limits={"upstream_timeout": 0.2},
    )
    door, held = PeerServer(), asyncio.Event()

    async def takes_and_holds(scope, receive, send):
        held.set()
        await asyncio.Event().wait()  # (until the door closes)

    try:
        slot, owner = claim(directory, 2), claim(directory, 2)
        assert slot is not None and owner is not None
        await door.start(takes_and_holds, owner.socket_path(1), 1, 75)
        gateway = build_gateway(config, peers=Peers(slot, config))
        assert gateway.peers is not None
        key = idempotency_key_owned_by(gateway, 1)
        async with serve_app(create_app(gateway)) as url, httpx.AsyncClient(base_url=url) as c:
            response = await Served(url, gateway, c).chat(
                "Charge my card", headers={"idempotency-key": key}
            )
        assert held.is_set() and response.status_code == 503
        assert response.headers["retry-after"] == "1" and fake.count() == 0
        # This worker's own refusal, counted here (it was counted by no worker for a while).
        counts = gateway.snapshot()
        assert (counts["requests"], counts["rejected"], counts["latency_ms"]) == (1, 1, {})
    finally:
        await door.aclose()
        peers.remove(directory)


def out_of_descriptors_once(worker: Peers, owner: int, kind: str = "") -> None:
    """``worker``'s next connection to ``owner``'s socket fails as it does in a process with no
    file descriptor left (``carpool serve --workers 2`` under a low ``nofile`` limit): aiohttp's
    ``ClientConnectorError`` of ``EMFILE``, the socket never opened, ``owner`` alive. The
    connection after it opens. ``kind``: of its pools, the one (``ASKS``: a flight's asks;
    ``OWN``: the workers' own calls)."""
    connector = worker._session(owner, kind).connector
    assert connector is not None
    connect = connector.connect

    async def short(request: Any, traces: Any, timeout: Any) -> Any:
        connector.connect = connect  # type: ignore[method-assign]
        shortage = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        raise aiohttp.ClientConnectorError(request.connection_key, shortage)

    connector.connect = short  # type: ignore[method-assign]


async def test_a_keyed_request_on_a_worker_out_of_descriptors_is_a_503_and_runs_once_on_its_owner(
    fake,
):
    """A worker with no descriptor left cannot open its socket to the live owner of a keyed
    request's record: taken for a dead owner, the request was waited on, run here (its record
    here), the owner held for gone; the retry, reaching the owner, found no record there and the
    generation ran twice under one Idempotency-Key. It is the gateway's own want, as for an
    upstream call: a 503 ``gateway_overloaded`` with ``Retry-After``, nothing run, the owner not
    blamed; the retry runs once on the owner, and the next is replayed from its record."""
    async with two_workers(fake.url) as pair:
        a = pair.a.gateway
        assert a.peers is not None
        key = {"idempotency-key": idempotency_key_owned_by(a, 1)}
        out_of_descriptors_once(a.peers, 1)
        refused = await pair.a.chat("Charge my card", headers=key)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "gateway_overloaded"
        assert refused.headers["retry-after"] == "1"
        assert fake.count() == 0 and 1 not in a.peers._gone
        counts = a.snapshot()
        assert (counts["overloaded"], counts["peers"]["unreachable"]) == (1, 0)
        assert counts["rejected"] == 1  # (this worker's own refusal, as for an owner it lacks)
        ran = await pair.a.chat("Charge my card", headers=key)
        assert ran.status_code == 200 and fake.count() == 1
        replayed = await pair.b.chat("Charge my card", headers=key)
        assert replayed.json() == ran.json() and fake.count() == 1
        assert pair.b.gateway.snapshot()["peers"]["served"] == 1


async def test_a_call_asked_of_the_owner_by_a_worker_out_of_descriptors_is_a_503_not_a_call_here(
    fake,
):
    """A flight's call asked of its key's live owner by a worker with no descriptor left: taken
    for an owner that did not answer, it was called here (a second upstream call for the key)
    and the owner counted ``unreachable``. The gateway's own want: a 503 ``gateway_overloaded``
    with ``Retry-After``, no upstream call; asked again, the owner makes the one call."""
    async with two_workers(fake.url) as pair:
        a = pair.a.gateway
        assert a.peers is not None
        question = owned_by(a, 1)
        out_of_descriptors_once(a.peers, 1, ASKS)
        refused = await pair.a.chat(question)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "gateway_overloaded"
        assert refused.headers["retry-after"] == "1"
        assert fake.count() == 0
        counts = a.snapshot()
        assert (counts["overloaded"], counts["peers"]["unreachable"]) == (1, 0)
        assert counts["upstream_errors"] == 0
        answered = await pair.a.chat(question)
        assert answered.status_code == 200 and answered.headers["x-carpool"] == "miss"
        assert fake.count() == 1 and pair.b.gateway.snapshot()["upstream_calls"] == 1


async def test_joiners_timing_out_on_a_worker_asking_the_owner_share_one_fresh_call_there(fake):
    """The owner's call stalls (here led by this worker's own request, asked of it): this
    worker's joiners that time out run one fresh call among them at the join timeout, as
    joiners do in one process, not a wait on the stalled call (docs/scaling.md: one such call
    per worker, as one per instance with Redis)."""
    async with two_workers(fake.url, coalesce={"join_timeout_ms": 100}) as pair:
        question = owned_by(pair.a.gateway, 1)
        gate = fake.gate = asyncio.Event()
        asked_of_owner = asyncio.create_task(pair.a.chat(question))
        await fake.wait_for_calls(1)
        fake.gate = None  # (the calls after it answer at once)
        joiners = await asyncio.gather(pair.a.chat(question), pair.a.chat(question))
        said = {joiner.json()["choices"][0]["message"]["content"] for joiner in joiners}
        assert said == {f"answer 2 to {question}"} and not asked_of_owner.done()
        assert fake.count() == 2
        gate.set()
        assert (await asked_of_owner).json()["choices"][0]["message"]["content"] == (
            f"answer 1 to {question}"
        )


def scope_of_key(gateway: Gateway, idempotency_key: str) -> str:
    """The record scope of ``idempotency_key`` for an anonymous chat request (``scope_of``)."""
    from carpool.idempotency.once import scope_of

    body = httpx.Request("POST", "/", json=_chat("Charge my card")).content
    request = parse(ClientRequest("/v1/chat/completions", body, {}), 1 << 20)
    key = fingerprint(request, gateway.config, gateway.accepted)
    return scope_of(key, idempotency_key, request, gateway.config)


async def test_the_workers_own_calls_never_wait_for_keyed_requests_passed_on(fake):
    # An invalidation, and the scrape of another worker's /stats, took the connections of the
    # keyed requests passed on whole: with those held by calls still running, an operator's
    # invalidation waited for the calls to end (23 s in a review), a scrape left the worker
    # out. The workers' own calls have connections of their own.
    admin = {"authorization": "Bearer adm"}
    limits = {"upstream_max_connections": 1}
    async with two_workers(fake.url, admin_token="adm", limits=limits) as pair:
        fake.gate = asyncio.Event()
        key = idempotency_key_owned_by(pair.a.gateway, 1)
        keyed = asyncio.create_task(pair.a.chat("Charge my card", headers={"idempotency-key": key}))
        await fake.wait_for_calls(1)  # (its call held: a's one connection to b held with it)
        try:
            dropped = await asyncio.wait_for(
                pair.a.client.post("/admin/invalidate", json={"all": True}, headers=admin),
                WAIT_S,
            )
            assert dropped.status_code == 200, dropped.text
            stats = (await pair.a.client.get("/stats", headers=admin)).json()
            assert stats["run"]["workers"] == 2  # (b's read through its door)
        finally:
            fake.gate.set()
        assert (await keyed).status_code == 200 and fake.count() == 1


async def test_an_invalidation_is_not_undone_by_the_worker_that_takes_it_last(fake):
    """Three workers: the key's owner (2) takes an invalidation last; meanwhile worker 1, which
    took it, asks the owner and keeps its old answer as a hit. The invalidation passes every
    worker twice: once it has returned, no worker serves the old answer."""
    gate = asyncio.Event()

    def slow(i: int, worker: Peers) -> None:
        if i != 2:
            return
        listen = worker.listen

        async def gated_listen(app: Any) -> None:
            async def gated(scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "http" and scope["path"] == "/admin/invalidate":
                    await gate.wait()
                await app(scope, receive, send)

            await listen(gated)

        worker.listen = gated_listen  # type: ignore[method-assign]

    admin = {"authorization": "Bearer adm"}
    async with workers(3, fake.url, wrap=slow, admin_token="adm") as (w0, w1, w2):
        question = owned_by(w1.gateway, 2)
        assert (await w2.chat(question)).headers["x-carpool"] == "miss"
        invalidating = asyncio.create_task(
            w0.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        )
        await eventually(lambda: w1.gateway.flights.epoch == 1, what="worker 1 took it")
        assert w2.gateway.flights.epoch == 0
        kept = await w1.chat(question)  # asked of the owner, which has not taken it yet
        assert kept.headers["x-carpool"] == "hit" and "answer 1" in kept.text
        gate.set()
        assert (await invalidating).status_code == 200
        for served in (w1, w2, w0):
            again = await served.chat(question)
            assert again.headers["x-carpool"] != "hit" or "answer 2" in again.text
            assert "answer 1" not in again.text
        assert fake.count() == 2


async def test_an_invalidation_this_worker_could_not_send_for_want_of_descriptors_is_a_503(fake):
    """A worker with no descriptor left cannot open its socket to a live worker: taken for a
    worker that is down (holding nothing), the invalidation said 200, and the other worker
    served what it dropped nowhere. It says 503 with ``Retry-After``, as for a worker that did
    not take it."""
    admin = {"authorization": "Bearer adm"}
    async with workers(2, fake.url, admin_token="adm") as (w0, w1):
        question = owned_by(w0.gateway, 1)
        assert (await w1.chat(question)).headers["x-carpool"] == "miss"
        assert w0.gateway.peers is not None
        out_of_descriptors_once(w0.gateway.peers, 1, OWN)
        refused = await w0.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert (await w1.chat(question)).headers["x-carpool"] == "hit"  # (what it kept)
        again = await w0.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        assert again.status_code == 200
        assert (await w1.chat(question)).headers["x-carpool"] == "miss"


async def test_an_invalidation_a_live_worker_did_not_take_is_a_503_to_retry_not_a_200(fake):
    """A worker that answers its door but not with the invalidation done (an error, here its
    door's 500) keeps its answers: the admin call said 200 all the same, as if every answer
    were gone. It says 503 with ``Retry-After``, as with Redis (an invalidation may be
    repeated); a worker that is down holds nothing and stays no reason to."""

    def failing(i: int, worker: Peers) -> None:
        if i != 1:
            return
        listen = worker.listen

        async def failing_listen(app: Any) -> None:
            async def refuse(scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "http" and scope["path"] == "/admin/invalidate":
                    await send({"type": "http.response.start", "status": 500, "headers": []})
                    await send({"type": "http.response.body", "body": b"{}"})
                    return
                await app(scope, receive, send)

            await listen(refuse)

        worker.listen = failing_listen  # type: ignore[method-assign]

    admin = {"authorization": "Bearer adm"}
    async with workers(2, fake.url, wrap=failing, admin_token="adm") as (w0, w1):
        question = owned_by(w0.gateway, 1)
        assert (await w1.chat(question)).headers["x-carpool"] == "miss"
        refused = await w0.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "worker peer-1 did not take" in refused.json()["error"]["message"]
        assert (await w1.chat(question)).headers["x-carpool"] == "hit"  # (what it kept)


async def test_a_request_asked_of_the_owner_reaches_it_with_the_clients_own_bytes(fake, tmp_path):
    """A header value that is not ASCII (a client key written in UTF-8, here accepted by the
    gateway's own keys) and a query as the client wrote it reach the owner byte for byte: the
    owner accepts the key, and the upstream sees what it sees when the owner is asked directly.
    (The peer hop's HTTP client would send the value as UTF-8 of its latin-1 reading, and
    normalize the query: the owner refused the key with a 401.) A client's own
    ``x-carpool-peer-raw`` is never passed on. The upstream gets the client's bytes too,
    through the owner or directly (both wrote them as UTF-8 of their latin-1 reading)."""
    key = "sk-clé-1"
    keys = tmp_path / "keys"
    keys.write_text(key + "\n", encoding="utf-8")
    sent = key.encode()  # (the client's bytes; the server reads header bytes as latin-1)
    headers = {"authorization": "Bearer " + sent.decode("latin-1"), "x-carpool-peer-raw": "x"}
    query = "tag=%7Eone"

    def owned(gateway: Gateway, prefix: str) -> str:
        assert gateway.peers is not None
        for i in range(1000):
            question = f"{prefix} {i}?"
            body = httpx.Request("POST", "/", json=_chat(question)).content
            client = ClientRequest("/v1/chat/completions", body, headers, query.encode())
            found = fingerprint(parse(client, 1 << 20), gateway.config, gateway.accepted).key
            if found is not None and gateway.peers.owner_of(found) == 1:
                return question
        raise AssertionError("no such question")

    async with two_workers(fake.url, auth={"client_keys_file": str(keys)}) as pair:

        async def upstream_saw(served: Served, question: str) -> tuple[str, str]:
            response = await served.client.post(
                f"/v1/chat/completions?{query}",
                content=httpx.Request("POST", "/", json=_chat(question)).content,
                headers={
                    "content-type": "application/json",
                    **{k: v.encode("latin-1") for k, v in headers.items()},
                },
            )
            assert response.status_code == 200, response.text
            call = fake.calls[-1]
            assert "x-carpool-peer-raw" not in call.headers
            return call.headers["authorization"], call.query

        through = await upstream_saw(pair.a, owned(pair.a.gateway, "through"))
        direct = await upstream_saw(pair.b, owned(pair.a.gateway, "direct"))
        assert fake.count() == 2 and pair.a.gateway.snapshot()["peer_calls"] == 1
        assert through == direct and through[1] == query
        # (and reach the upstream so: the owner's call writes them back as the client's bytes)
        assert through[0] == headers["authorization"]


async def test_a_name_sent_as_utf8_is_the_same_name_on_the_owner_it_is_asked_of(fake):
    """A namespace and a tag sent as UTF-8 are read as that text by the worker the client
    reached, and by the owner it asks: the owner keeps the answer under the same namespace and
    tag (a hit for the client asking it directly), not under their bytes read as latin-1, nor
    refuses them (``carpool.request.header_text``)."""
    named = {"x-carpool-namespace": "café", "x-carpool-tags": "prix-été"}
    sent = {name: value.encode() for name, value in named.items()}
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1, headers=named)

        async def asked(served: Served) -> httpx.Response:
            return await served.client.post(
                "/v1/chat/completions", json=_chat(question), headers=sent
            )

        through = await asked(pair.a)
        assert through.status_code == 200, through.text
        assert through.headers["x-carpool"] == "miss"
        assert pair.a.gateway.snapshot()["peer_calls"] == 1  # (asked of the owner)
        assert (await asked(pair.b)).headers["x-carpool"] == "hit"
        assert fake.count() == 1


@pytest.mark.parametrize(
    "control",
    [
        ("x-carpool-freshness", "v2"),
        ("x-carpool-namespace", "private"),
        ("cache-control", "no-cache"),
    ],
    ids=lambda control: control[0],
)
async def test_a_control_the_client_lists_in_connection_reaches_the_owner_it_is_asked_of(
    fake, control
):
    """A client may list a header in ``Connection`` (RFC 9110 7.6.1: for the first recipient
    only), carpool's controls too: the worker it reached read it, but the hop to the owner
    dropped it, so the owner served the request the answer of another freshness token, another
    namespace, or its cache despite ``no-cache``."""
    name, value = control
    headers = {name: value, "connection": f"keep-alive, {name}"}
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1, headers=headers)
        # (Asked of b, which holds it whichever worker owns the plain request's key.)
        assert (await pair.b.chat(question)).headers["x-carpool"] == "miss"
        controlled = await pair.a.chat(question, headers=headers)
        assert controlled.headers["x-carpool"] == "miss" and fake.count() == 2
        assert pair.a.gateway.snapshot()["peer_calls"] == 1  # (asked of the owner)
        assert name not in fake.calls[-1].headers  # (still this hop's only)


async def test_an_idempotency_key_the_client_lists_in_connection_reaches_its_records_owner(fake):
    """Sent whole to its record's owner without its key, the request ran there unrecorded: its
    retry ran the generation again."""
    async with two_workers(fake.url) as pair:
        key = idempotency_key_owned_by(pair.a.gateway, 1)
        headers = {"idempotency-key": key, "connection": "keep-alive, idempotency-key"}
        first = await pair.a.chat("Roll a die", headers=headers, temperature=1)
        retry = await pair.a.chat("Roll a die", headers=headers, temperature=1)
        assert first.status_code == retry.status_code == 200
        assert retry.headers.get("idempotent-replayed") == "true" and fake.count() == 1
        assert retry.content == first.content


async def test_a_clients_own_peer_raw_header_is_never_honoured_by_the_owner(fake):
    """``x-carpool-peer-raw`` names the headers the asking worker percent-encoded; one a client
    sends is dropped before the hop, so the owner decodes nothing of the client's choosing (its
    ``x-custom: a%41`` reaches the upstream as sent, not as ``aA``)."""
    headers = {"x-carpool-peer-raw": "x-custom", "x-custom": "a%41"}
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1, headers=headers)
        response = await pair.a.chat(question, headers=headers)
        assert response.status_code == 200 and pair.a.gateway.snapshot()["peer_calls"] == 1
        assert fake.calls[-1].headers["x-custom"] == "a%41"


async def test_a_request_within_the_header_limit_is_within_it_on_its_owner_too(fake):
    """The hop to the owner adds headers of its own (``accept-encoding: identity``, aiohttp's
    ``Accept``, its ``Host``): counted again on the owner against ``limits.max_header_bytes``, a
    client's request just within the limit got a 431 there when keyed, and was done where it
    landed (a second upstream call per key) when asked. A peer's request is not measured again:
    its worker measured the client's own headers."""
    limit = 2048
    async with (
        two_workers(fake.url, limits={"max_header_bytes": limit}) as pair,
        httpx.AsyncClient(base_url=pair.a.url) as client,
    ):
        for name in ("accept", "accept-encoding", "connection", "user-agent"):
            del client.headers[name]  # (only what a terse client sends)

        def at_the_limit(question: str, extra: dict[str, str], over: int = 0) -> httpx.Request:
            body = httpx.Request("POST", "/", json=_chat(question)).content
            headers = {"content-type": "application/json", **extra, "x-filler": ""}
            request = client.build_request("POST", "/v1/chat/completions", content=body)
            request.headers.update(headers)
            size = sum(len(name) + len(value) for name, value in request.headers.raw)
            request.headers["x-filler"] = "f" * (limit - size + over)
            assert sum(len(n) + len(v) for n, v in request.headers.raw) == limit + over
            return request

        keyed = next(
            f"order-{i}"
            for i in range(1000)
            if pair.a.gateway.peers is not None
            and pair.a.gateway.peers.owner_of(scope_of_key(pair.a.gateway, f"order-{i}")) == 1
        )
        response = await client.send(at_the_limit("Charge my card", {"idempotency-key": keyed}))
        assert response.status_code == 200, response.text
        # (A question owned by worker 1 with the headers it is sent with: ``x-filler`` is in
        # its key, as any header the gateway does not know.)
        asked = await client.send(
            next(
                request
                for i in range(1000)
                if (request := at_the_limit(f"Which worker leads me, {i}?", {}))
                and pair.a.gateway.peers is not None
                and pair.a.gateway.peers.owner_of(
                    key_of(pair.a.gateway, f"Which worker leads me, {i}?", dict(request.headers))
                )
                == 1
            )
        )
        assert asked.status_code == 200 and asked.headers["x-carpool"] == "miss"
        # Both were run by the owner, once each; nothing was done here instead.
        a, b = pair.a.gateway.snapshot(), pair.b.gateway.snapshot()
        assert (a["upstream_calls"], a["peers"]["unreachable"], a["peer_calls"]) == (0, 0, 2)
        assert b["upstream_calls"] == 2 and fake.count() == 2
        # The client's own limit still holds.
        over = await client.send(at_the_limit(owned_by(pair.a.gateway, 1, "Over"), {}, over=1))
        assert over.status_code == 431 and fake.count() == 2


async def test_a_keyed_request_whose_owner_died_holding_it_says_a_retry_may_run_it_again(fake):
    """The owner of its record took the request and died before answering: a 503 to retry, which
    says what becomes of the retry. The record lived in the dead worker's memory only, so the
    retry, on the worker that takes its slot, runs the request (it said "not run twice")."""
    directory = meeting_place(2)
    config = Config(upstreams=[fake.url])
    taken = asyncio.Event()

    async def takes_and_dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        taken.set()
        writer.transport.abort()  # (as the kernel does for a worker killed with SIGKILL)

    try:
        slot, owner = claim(directory, 2), claim(directory, 2)
        assert slot is not None and owner is not None
        dying = await asyncio.start_unix_server(takes_and_dies, path=str(owner.socket_path(1)))
        gateway = build_gateway(config, peers=Peers(slot, config))
        assert gateway.peers is not None
        key = idempotency_key_owned_by(gateway, 1)
        headers = {"idempotency-key": key}
        async with serve_app(create_app(gateway)) as url, httpx.AsyncClient(base_url=url) as c:
            served = Served(url, gateway, c)
            response = await served.chat("Charge my card", headers=headers)
            assert taken.is_set() and response.status_code == 503
            assert response.headers["retry-after"] == "1" and fake.count() == 0
            detail = response.json()["detail"]
            assert "not run twice" not in detail and "may run the request again" in detail
            # The worker that takes the dead one's slot holds no record of it.
            dying.close()
            await dying.wait_closed()
            os.close(owner.lock_fd)  # (the kernel frees a dead worker's lock)
            successor = claim(directory, 2)
            assert successor is not None and successor.index == 1
            replacement = build_gateway(config, peers=Peers(successor, config))
            async with serve_app(create_app(replacement)):
                retry = await served.chat("Charge my card", headers=headers)
            assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
            # (The call made by its key's owner, which the record's asks: either of the two.)
            calls = sum(g.snapshot()["upstream_calls"] for g in (gateway, replacement))
            assert fake.count() == 1 and calls == 1
    finally:
        peers.remove(directory)


async def test_a_worker_without_a_slot_asks_the_owners_until_one_frees_then_owns_it(fake):
    """Every slot held as it starts (uvicorn's SIGHUP starts the new worker before it stops the
    old one; SIGTTIN adds one beyond N): the worker owns nothing and asks the owners (it shared
    nothing, for good: a key's call, an Idempotency-Key's run once per worker). Invalidations
    reach it on its spare socket; a keyed request whose owner is down is not run there; once a
    slot frees, it takes it and owns its keys."""
    directory = meeting_place(2)
    config = Config(upstreams=[fake.url], admin_token="adm")
    admin = {"authorization": "Bearer adm"}
    try:
        first, second = claim(directory, 2), claim(directory, 2)
        assert first is not None and second is not None and claim(directory, 2) is None
        owner0 = build_gateway(config, peers=Peers(first, config))
        owner1 = build_gateway(config, peers=Peers(second, config))
        newcomer = build_gateway(config, peers=Peers(peers.meeting(directory, 2), config))
        assert newcomer.peers is not None and newcomer.peers.index is None
        async with contextlib.AsyncExitStack() as stack:
            served = []
            for gateway in (owner0, newcomer):
                url = await stack.enter_async_context(serve_app(create_app(gateway)))
                client = await stack.enter_async_context(httpx.AsyncClient(base_url=url))
                served.append(Served(url, gateway, client))
            w0, new = served
            # Worker 1 is down (it holds its slot): a keyed request it owns is not run here.
            key = next(
                f"order-{i}"
                for i in range(1000)
                if newcomer.peers.owner_of(scope_of_key(newcomer, f"order-{i}")) == 1
            )
            refused = await new.chat("Charge my card", headers={"idempotency-key": key})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert fake.count() == 0
            async with serve_app(create_app(owner1)) as url1:
                # Owned by 0: asked of it, kept here as well.
                question = owned_by(newcomer, 0)
                assert (await new.chat(question)).headers["x-carpool"] == "miss"
                assert (await w0.chat(question)).headers["x-carpool"] == "hit"
                assert (await new.chat(question)).headers["x-carpool"] == "hit"
                assert owner0.snapshot()["upstream_calls"] == 1
                assert newcomer.snapshot()["upstream_calls"] == 0
                # Keyed: run once, by its record's owner, wherever the retries land.
                for where in (new, w0, new):
                    again = await where.chat("Charge my card", headers={"idempotency-key": key})
                    assert again.status_code == 200
                # (Its call made by the key's owner: asked by the record's, which leads it.)
                calls = sum(g.snapshot()["upstream_calls"] for g in (owner0, owner1))
                assert fake.count() == 2 and calls == 2
                # An invalidation on an owner reaches the newcomer, and one there reaches both.
                async with httpx.AsyncClient(base_url=url1) as c1:
                    dropped = await c1.post("/admin/invalidate", json={"all": True}, headers=admin)
                assert dropped.status_code == 200
                assert (await new.chat(question)).headers["x-carpool"] == "miss"
                assert (await w0.chat(question)).headers["x-carpool"] == "hit"
                dropped = await new.client.post(
                    "/admin/invalidate", json={"all": True}, headers=admin
                )
                assert dropped.status_code == 200 and dropped.json()["invalidated"] >= 2
                assert (await w0.chat(question)).headers["x-carpool"] == "miss"
                assert newcomer.snapshot()["peers"]["worker"] is None
            os.close(second.lock_fd)  # (worker 1 stopped: the kernel frees its lock)
            await eventually(
                lambda: newcomer.peers.index == 1 and not list(directory.glob("spare-*.sock")),
                what="the newcomer took slot 1 and closed its spare socket",
            )
            assert newcomer.snapshot()["peers"]["worker"] == 1
            # It owns slot 1's keys now: worker 0 asks it.
            question = owned_by(owner0, 1, "Led by the newcomer")
            assert (await w0.chat(question)).headers["x-carpool"] == "miss"
            assert newcomer.snapshot()["peers"]["served"] == 1
            assert newcomer.snapshot()["upstream_calls"] == 1
    finally:
        peers.remove(directory)


async def test_a_stream_the_upstream_breaks_counts_one_upstream_error_where_it_was_called(fake):
    # The asking worker relayed the owner's broken stream and counted an upstream error of its
    # own, with no upstream call: one engine failure, two errors over the workers.
    async with two_workers(fake.url) as pair:
        question = owned_by(pair.a.gateway, 1)
        fake.cut_after = 2
        await pair.a.stream_chat(question)
        a, b = pair.a.gateway.snapshot(), pair.b.gateway.snapshot()
        assert (a["upstream_calls"], a["upstream_errors"]) == (0, 0)
        assert (b["upstream_calls"], b["upstream_errors"]) == (1, 1) and fake.count() == 1


def _summed(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def test_a_deleted_response_is_dropped_on_every_worker(fake):
    """A client deletes a stored response through one worker: every worker's answers that are
    it go, with no admin token (the invalidation passed on through the peers' door). Before,
    the worker that kept it (the key's owner) handed it out again to any worker asking."""
    fake.keeps_responses = True
    async with two_workers(fake.url) as pair:
        a = pair.a.gateway
        assert a.peers is not None
        for i in range(1000):  # a request whose key worker 1 owns, as worker 0 sees it
            body = {"model": "m", "input": f"Which worker keeps me, {i}?", "temperature": 0}
            raw = httpx.Request("POST", "/", json=body).content
            request = parse(ClientRequest("/v1/responses", raw, {}), 1 << 20)
            key = fingerprint(request, a.config, a.accepted).key
            if key is not None and a.peers.owner_of(key) == 1:
                break
        made = await pair.a.client.post("/v1/responses", json=body)  # B calls, both keep it
        rid = made.json()["id"]
        assert (await pair.b.client.post("/v1/responses", json=body)).headers["x-carpool"] == "hit"
        epochs = [served.gateway.flights.epoch for served in (pair.a, pair.b)]
        deleted = await pair.a.client.delete(f"/v1/responses/{rid}")
        assert deleted.status_code == 200, deleted.text
        calls = fake.count()
        again = await pair.a.client.post("/v1/responses", json=body)
        assert again.status_code == 200 and again.json()["id"] != rid
        assert fake.count() == calls + 1
        # By key ({"state": tag} through the peers' door): no invalidation of every layer.
        assert [served.gateway.flights.epoch for served in (pair.a, pair.b)] == epochs


async def test_a_deleted_stored_chat_completion_is_dropped_on_every_worker(fake):
    """As a stored response: a chat completion kept upstream (``store: true``), deleted
    through one worker, is served by no worker again (the owner of its key kept it too)."""
    fake.keeps_completions = True
    async with two_workers(fake.url) as pair:
        a = pair.a.gateway
        assert a.peers is not None
        for i in range(1000):  # a request whose key worker 1 owns, as worker 0 sees it
            body = {**_chat(f"Which worker keeps me, {i}?"), "store": True}
            raw = httpx.Request("POST", "/", json=body).content
            request = parse(ClientRequest("/v1/chat/completions", raw, {}), 1 << 20)
            key = fingerprint(request, a.config, a.accepted).key
            if key is not None and a.peers.owner_of(key) == 1:
                break
        cid = (await pair.a.client.post("/v1/chat/completions", json=body)).json()["id"]
        hit = await pair.b.client.post("/v1/chat/completions", json=body)
        assert hit.headers["x-carpool"] == "hit" and hit.json()["id"] == cid
        deleted = await pair.a.client.delete(f"/v1/chat/completions/{cid}")
        assert deleted.status_code == 200, deleted.text
        for served in (pair.a, pair.b):
            again = await served.client.post("/v1/chat/completions", json=body)
            assert again.status_code == 200 and again.json()["id"] != cid


async def test_only_a_worker_may_pass_a_deleted_responses_tag_or_a_refusal_on(fake):
    """``{"state": tag}`` (a worker's DELETE passed on) and ``{"refused": tenant}`` come
    through the peers' door only: on
    the public port, even with the admin token, it is no selector."""
    async with two_workers(fake.url, admin_token="t") as pair:
        response = await pair.a.client.post(
            "/admin/invalidate",
            json={"state": state_tag("anonymous", "resp_1")},
            headers={"Authorization": "Bearer t"},
        )
        assert response.status_code == 400
        unauthorized = await pair.a.client.post(
            "/admin/invalidate", json={"state": state_tag("anonymous", "resp_1")}
        )
        assert unauthorized.status_code == 401
        # Nor a refusal passed on ({"refused": tenant}): no client takes another's key back.
        refused = await pair.a.client.post(
            "/admin/invalidate",
            json={"refused": "anonymous"},
            headers={"Authorization": "Bearer t"},
        )
        assert refused.status_code == 400


async def test_a_scrape_on_any_worker_counts_the_whole_run_once(fake):
    """The workers share one port: each scrape landed on one worker, whose counters alone went
    down from the last scrape's (a reset to Prometheus). Any worker now answers the run's sum,
    and a request passed on to its key's owner is counted once, where its client sent it
    (before: in the outcomes of both)."""
    async with two_workers(fake.url, admin_token="t") as pair:
        admin = {"Authorization": "Bearer t"}
        passed_on = owned_by(pair.a.gateway, 1)
        await pair.a.chat(passed_on)  # asked of B, the owner: B calls upstream
        await pair.a.chat(passed_on)  # a hit on A
        await pair.b.chat(owned_by(pair.b.gateway, 1, prefix="B's own"))  # a miss on B
        assert fake.count() == 2
        scrapes = [
            (await served.client.get("/metrics", headers=admin)).text for served in (pair.a, pair.b)
        ]
        for text in scrapes:
            assert _summed(text, "carpool_requests_total") == 3
            assert _summed(text, "carpool_upstream_calls_total") == 2
            assert _summed(text, "carpool_request_duration_seconds_count") == 3
        assert pair.b.gateway.snapshot()["peers"]["served"] == 1
        # Through the door, a worker answers for itself alone.
        own = pair.b.gateway.metrics.render().decode()
        assert _summed(own, "carpool_requests_total") == 1


async def test_a_keyed_request_passed_on_whole_is_counted_once_where_it_runs(fake):
    """A keyed request runs whole on its record's owner, which alone sees what it saved (a hit
    there) or refused (a reused key: 422): it counts it, the worker its client sent it to does
    not. (Before, the owner's saving was counted nowhere, and a refusal twice: as the owner's
    rejection and as the asking worker's bypass.)"""
    async with two_workers(fake.url) as pair:
        a, b = pair.a.gateway, pair.b.gateway
        owned = [
            f"order-{i}"
            for i in range(1000)
            if a.peers.owner_of(scope_of_key(a, f"order-{i}")) == 1
        ]
        first = await pair.a.chat("Charge my card", headers={"idempotency-key": owned[0]})
        second = await pair.a.chat("Charge my card", headers={"idempotency-key": owned[1]})
        assert second.headers["x-carpool"] == "hit" and fake.count() == 1
        reused = await pair.a.chat("Charge my card twice", headers={"idempotency-key": owned[0]})
        assert reused.status_code == 422
        runs, asks = b.snapshot(), a.snapshot()
        assert (runs["misses"], runs["hits"], runs["rejected"]) == (1, 1, 1)
        assert runs["tokens_saved"] == first.json()["usage"]["total_tokens"] > 0
        assert (asks["requests"], asks["tokens_saved"]) == (0, 0)
        assert runs["requests"] + asks["requests"] == 3
        assert sum(f["count"] for f in runs["latency_ms"].values()) == 2  # (the refusal: untimed)
        assert asks["latency_ms"] == {}


async def test_stats_on_any_worker_carries_the_runs_totals(fake):
    """The dashboard keeps one connection, so one worker answered every poll and its charts
    showed that worker's traffic alone: ``/stats`` is still the answering worker's document,
    with ``run``, the workers' figures summed."""
    async with two_workers(fake.url, admin_token="t") as pair:
        admin = {"Authorization": "Bearer t"}
        await pair.a.chat(owned_by(pair.a.gateway, 0, prefix="A's own"))  # a miss on A
        mine = owned_by(pair.b.gateway, 1, prefix="B's own")
        await pair.b.chat(mine)  # a miss on B
        await pair.b.chat(mine)  # a hit on B
        doc = (await pair.a.client.get("/stats", headers=admin)).json()
        assert (doc["requests"], doc["pid"]) == (1, os.getpid())
        run = doc["run"]
        assert (run["workers"], run["requests"], run["misses"], run["hits"]) == (2, 3, 2, 1)
        assert run["pids"] == [os.getpid()] * 2  # (both workers in this process)
        assert run["saved_fraction"] == round(1 / 3, 6) and run["upstream_calls"] == 2
        assert run["layers"]["exact"]["entries"] == 2
        assert run["latency_ms"]["miss"]["count"] == 2
        assert "run" not in pair.b.gateway.snapshot()  # (a worker's own, through its door)


async def test_sim_stats_on_any_worker_carries_every_workers_simulated_replicas():
    """Each worker runs its own embedded simulated engine: ``/sim/stats`` is the answering
    worker's replicas, with ``run``, every worker's, so whichever worker a reader lands on (the
    bench's engine counts, before and after a run) it counts the whole engine's calls. Before,
    one worker's: a bench against `serve --workers 2` reported 21 engine calls of 49."""
    async with two_workers(None) as pair:
        await pair.a.chat(owned_by(pair.a.gateway, 0, prefix="A's own"))  # A's engine
        await pair.b.chat(owned_by(pair.b.gateway, 1, prefix="B's own"))  # B's engine

        def calls(replicas: list[dict[str, Any]]) -> int:
            return sum(replica["calls"].get("chat/completions", 0) for replica in replicas)

        for served in (pair.a, pair.b):
            doc = (await served.client.get("/sim/stats")).json()
            assert calls(doc["replicas"]) == 1
            assert doc["run"]["workers"] == 2 and calls(doc["run"]["replicas"]) == 2


async def test_the_runs_idempotency_records_are_summed_over_its_workers(fake):
    """Each worker holds the records of the keys it owns, in its own memory: the run's
    ``/metrics`` and ``/stats`` ``run`` count every worker's, whichever worker answers."""
    async with two_workers(fake.url, admin_token="t") as pair:
        admin = {"Authorization": "Bearer t"}
        a = pair.a.gateway
        owned = {a.peers.owner_of(scope_of_key(a, f"order-{i}")): f"order-{i}" for i in range(50)}
        for key in (owned[None], owned[1]):  # one kept by each worker
            reply = await pair.a.chat("Charge my card", headers={"idempotency-key": key})
            assert reply.status_code == 200
        assert a.snapshot()["idempotency"]["records"] == 1
        for served in (pair.a, pair.b):
            text = (await served.client.get("/metrics", headers=admin)).text
            assert _summed(text, "carpool_idempotency_records") == 2
            run = (await served.client.get("/stats", headers=admin)).json()["run"]
            assert run["idempotency"]["records"] == 2
            assert run["idempotency"]["bytes"] == sum(
                g.snapshot()["idempotency"]["bytes"] for g in (a, pair.b.gateway)
            )


def test_the_runs_totals_sum_each_replicas_errors_take_its_worst_state_and_skip_odd_shapes():
    # The run's replica showed one worker's errors and health beside the run's calls; a worker
    # whose document had an odd part (a None where an object goes) made /stats a 500.
    from carpool.peers.metrics import run_totals

    a = {
        "pid": 11,
        "requests": 2,
        "replicas": {"r0": {"state": "healthy", "calls": 5, "errors": 0}},
    }
    b = {
        "pid": 4,
        "requests": 3,
        "replicas": {"r0": {"state": "down", "calls": 7, "errors": 7}, "r1": None},
        "layers": {"exact": None},
        "latency_ms": {"miss": None, "hit": {"p50": 1.5, "count": 2}},
    }
    run = run_totals([a, b, {"replicas": [1, 2], "latency_ms": "x"}])
    assert (run["requests"], run["workers"], run["pids"]) == (5, 3, [4, 11])
    assert run["replicas"] == {
        "r0": {"state": "down", "calls": 12, "errors": 7, "in_flight": 0, "failures": 0}
    }
    assert run["layers"] == {} and run["latency_ms"]["hit"]["count"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_keyed_answer_run_by_its_owner_in_front_of_the_simulator_is_labelled_once(
    stream,
):
    """The owner labels its answer, and the worker relaying it labelled it again: twice."""
    directory = meeting_place(2)
    config = Config(upstreams=[])  # (the embedded simulated engine)
    try:
        a, b = (build_gateway(config, peers=Peers(claim(directory, 2), config)) for _ in range(2))
        async with contextlib.AsyncExitStack() as stack:
            url = await stack.enter_async_context(serve_app(create_app(a)))
            await stack.enter_async_context(serve_app(create_app(b)))
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
            body = {**_chat("Charge my card"), **({"stream": True} if stream else {})}
            key = {"Idempotency-Key": idempotency_key_owned_by(a, 1)}
            response = await client.post("/v1/chat/completions", json=body, headers=key)
            assert response.status_code == 200
            assert b.snapshot()["peers"]["served"] == 1
            assert response.headers.get_list("x-carpool-simulated") == ["true"]
    finally:
        peers.remove(directory)


async def test_a_tenant_accepted_on_one_worker_only_never_deadlocks_the_two_owners(fake):
    """In a shared namespace each worker keys a request by what the upstream accepted there: a
    tenant accepted on one worker only had two keys, whose owners could be each other. Sent to
    both at once, each led a flight asking the other, and each peer request joined the other's
    flight, waiting on it: both waited out the join timeout, then both called the upstream. The
    owner is chosen from the shared key, the same on every worker: one call, no wait."""
    shared = {"authorization": "Bearer sk-t1", "x-carpool-namespace": "pub"}
    async with two_workers(
        fake.url, tenant={"shared_namespaces": ["pub"]}, coalesce={"join_timeout_ms": 3000}
    ) as pair:
        a, b = pair.a.gateway, pair.b.gateway
        assert a.peers is not None and b.peers is not None

        def owner_key(gateway: Gateway, question: str) -> str:
            body = httpx.Request("POST", "/", json=_chat(question)).content
            request = parse(ClientRequest("/v1/chat/completions", body, shared), 1 << 20)
            key = fingerprint(request, gateway.config, gateway.accepted)
            assert key.key is not None
            return key.shared_key or key.key

        # The tenant accepted by b only: a call b makes itself.
        warm = next(
            q
            for q in (f"warm {i}?" for i in range(1000))
            if b.peers.owner_of(owner_key(b, q)) is None
            and b.peers.owner_of(key_of(b, q, shared)) is None
        )
        assert (await pair.b.chat(warm, headers=shared)).headers["x-carpool"] == "miss"
        assert len(a.accepted) == 0 and len(b.accepted) == 1
        # A question whose two keys' owners were each other: a's (the tenant's own) b, b's
        # (the shared one) a.
        question = next(
            q
            for q in (f"split {i}?" for i in range(2000))
            if a.peers.owner_of(key_of(a, q, shared)) == 1
            and b.peers.owner_of(key_of(b, q, shared)) == 0
        )
        # Each worker asks its owner only once both have begun their flights (as when the two
        # arrive together).
        for worker in (a.peers, b.peers):
            ask = worker.ask

            async def once_both_fly(*args: Any, _ask: Any = ask, **kwargs: Any) -> Any:
                await eventually(lambda: a.flights.calls and b.flights.calls, what="two flights")
                return await _ask(*args, **kwargs)

            worker.ask = once_both_fly  # type: ignore[method-assign]
        fake.delay = 0.5  # (the call still running as the other worker's request comes)
        calls = fake.count()
        first, second = await asyncio.gather(
            pair.a.chat(question, headers=shared), pair.b.chat(question, headers=shared)
        )
        assert first.status_code == second.status_code == 200
        assert first.json() == second.json() and fake.count() == calls + 1


async def test_a_killed_spare_workers_socket_is_removed_not_tried_on_every_invalidation(fake):
    """A worker without a slot killed (SIGKILL) leaves its spare socket's file, refusing
    connections: the first invalidation that finds it so past ``STALE_SPARE_S`` removes it
    and lets its connections go; a spare socket made a moment ago is kept (it may be binding)."""
    admin = {"authorization": "Bearer adm"}
    async with two_workers(fake.url, admin_token="adm") as pair:
        peers_a = pair.a.gateway.peers
        assert peers_a is not None
        killed, binding = spare_path(peers_a.directory), spare_path(peers_a.directory)
        for path in (killed, binding):
            with socket.socket(socket.AF_UNIX) as made:
                made.bind(str(path))  # (never listening: as a killed worker's file)
        long_ago = time.time() - STALE_SPARE_S - 60
        os.utime(killed, (long_ago, long_ago))
        first = await pair.a.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        assert first.status_code == 200
        assert not killed.exists() and binding.exists()
        again = await pair.a.client.post("/admin/invalidate", json={"all": True}, headers=admin)
        assert again.status_code == 200
        held = {path for path, _ in peers_a._sessions}  # (a pool per socket and kind)
        assert killed not in held and binding in held
        assert binding.exists()


def _labelled(text: str) -> dict[str, float]:
    """carpool_semantic_audits_total per namespace labelled in an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.labels["namespace"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "carpool_semantic_audits_total"
    }


async def test_a_workers_runs_metrics_keep_the_semantic_series_no_namespace_labels(fake):
    """The namespaces' ranking of the merge (``peers.metrics.merge``) skipped every
    ``carpool_semantic_*`` sample without a namespace: a workers' run lost the judge's calls
    and the similarity histogram, which one process exports."""
    async with two_workers(fake.url, admin_token="t") as pair:

        def series(text: str) -> set[str]:
            return {s.name for f in text_string_to_metric_families(text) for s in f.samples}

        wanted = {"carpool_semantic_judge_calls_total", "carpool_semantic_similarity_count"}
        assert wanted <= series(pair.a.gateway.metrics.render().decode())  # (one worker's)
        scraped = await pair.a.client.get("/metrics", headers={"authorization": "Bearer t"})
        assert scraped.status_code == 200 and wanted <= series(scraped.text)


async def test_a_workers_run_labels_at_most_100_namespaces_ranked_over_the_runs_totals(fake):
    """Each worker held its own /metrics to METRIC_NAMESPACES, but a scrape of the run summed
    the workers' labelled sets (up to N x 100), and a namespace ranked out on one worker and
    in on another was labelled with that one's count alone (then jumped, or went down: a reset
    to Prometheus, when a worker's ranking moved). Now the run's sum is ranked again, by the
    same rule: not serving first, then the most audited in all the workers."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("usearch")
    from carpool.identity import ANONYMOUS_TENANT
    from carpool.metrics import METRIC_NAMESPACES
    from carpool.semantic.audit import MIN_AUDITS, Budget

    settings = {"semantic": {"enabled": True, "audit_rate": 1.0, "max_wrong_rate": 0.05}}
    async with two_workers(fake.url, admin_token="t", **settings) as pair:
        a, b = pair.a.gateway.layers.audits, pair.b.gateway.layers.audits
        assert a is not None and b is not None
        for audits, worker in ((a, "a"), (b, "b")):
            for i in range(METRIC_NAMESPACES + 50):
                for _ in range(3):
                    audits.record(Budget(ANONYMOUS_TENANT, f"{worker}-{i}"), False)
        # Ranked out on each worker (fewer audits than its 150), in over the run's (4 of 3s).
        for audits in (a, b):
            for _ in range(2):
                audits.record(Budget(ANONYMOUS_TENANT, "both"), False)
        # Not serving on b only (every audit wrong): first, whatever its count.
        for _ in range(MIN_AUDITS):
            b.record(Budget(ANONYMOUS_TENANT, "troubled"), True)
        admin = {"Authorization": "Bearer t"}
        own = _labelled(pair.a.gateway.metrics.render().decode())
        assert len(own) == METRIC_NAMESPACES and "both" not in own
        scrapes = [
            _labelled((await served.client.get("/metrics", headers=admin)).text)
            for served in (pair.a, pair.b)
        ]
        assert scrapes[0] == scrapes[1]  # whichever worker the scrape lands on
        run = scrapes[0]
        assert len(run) == METRIC_NAMESPACES
        assert run["both"] == 4 and run["troubled"] == MIN_AUDITS
        assert all(count == 3 for ns, count in run.items() if ns not in ("both", "troubled"))


async def test_a_peers_idle_connection_is_closed_by_its_client_before_its_server():
    # The peer server kept an idle connection uvicorn's 5 s while its client (aiohttp) kept it
    # 15 s: a request sent as the server closed it was never read, taken for one sent and not
    # answered (a keyed request's 503). The server keeps it ``limits.client_keepalive``, the
    # client half that.
    directory = meeting_place(2)
    door = PeerServer()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    try:
        slot = claim(directory, 2)
        assert slot is not None
        await door.start(app, slot.socket_path(1), 1, 0.2)  # (far below uvicorn's 5 s)
        reader, writer = await asyncio.open_unix_connection(str(slot.socket_path(1)))
        writer.write(b"GET / HTTP/1.1\r\nhost: worker\r\n\r\n")
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")
        # Closed by the server once idle (read to the end: within 4 s, not uvicorn's 5).
        await asyncio.wait_for(reader.read(), 4)
        writer.close()
        workers = Peers(slot, Config(limits={"client_keepalive": 8}))
        try:
            connector = workers._session(1).connector
            assert connector is not None
            assert connector._keepalive_timeout == 4  # (aiohttp has no public reader)
        finally:
            await workers.aclose()
    finally:
        await door.aclose()
        peers.remove(directory)


async def test_a_cancelled_close_of_a_worker_waiting_for_a_slot_stays_cancelled(fake):
    # Its close cancelled the task waiting for a slot and awaited it under
    # suppress(CancelledError): a cancellation of the close itself, arriving then, was
    # swallowed with it, and the close went on as if none had come.
    directory = meeting_place(1)
    config = Config(upstreams=[fake.url])
    try:
        held = claim(directory, 1)
        assert held is not None
        newcomer = build_gateway(config, peers=Peers(peers.meeting(directory, 1), config))
        assert newcomer.peers is not None
        async with serve_app(create_app(newcomer)):
            assert newcomer.peers.index is None  # (waiting for the slot held above)
            closing = asyncio.create_task(newcomer.peers.aclose())
            await asyncio.sleep(0)  # (it has cancelled the wait and awaits its end)
            closing.cancel()
            await asyncio.wait({closing})
            assert closing.cancelled()
    finally:
        peers.remove(directory)


async def test_a_worker_settling_its_calls_as_it_closes_still_answers_its_peers(fake):
    """A worker closing (``serve --workers``: a SIGHUP's reload, one worker restarted) settles
    the calls it leads before its layers close; meanwhile the other workers' requests for the
    keys it owns were refused with a 503 ``shutting_down``, which their clients got."""
    async with two_workers(fake.url) as pair:
        gate = fake.gate = asyncio.Event()
        leading = asyncio.create_task(pair.b.chat(owned_by(pair.a.gateway, 1, "Held by b")))
        await fake.wait_for_calls(1)
        fake.gate = None  # (the calls after this one are answered at once)
        pair.b.gateway.stop_by = time.monotonic() + 30  # (its grace: the held call may end)
        closing = asyncio.create_task(pair.b.gateway.aclose())
        await eventually(lambda: pair.b.gateway.closed, what="b closing")
        asked = await pair.a.chat(owned_by(pair.a.gateway, 1, "Asked of b"))
        assert asked.status_code == 200, asked.text
        assert fake.count() == 2  # (b, its owner, called the upstream for it)
        gate.set()  # (b's held call ends: b closes)
        await closing
        assert (await leading).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_call_its_owner_cancels_as_it_closes_is_made_by_the_worker_that_asked(fake, stream):
    """A worker closing (a SIGHUP's reload, a SIGTERM) cancels the calls it still leads once
    its grace period is over; another worker waiting on one for its own client relayed what the
    owner said of it, a 499 "every client of this request left" (a stream: that error event),
    which its client, still there, never retried. The owner now says it is shutting down, and
    the worker that asked makes the call itself: its client gets the answer."""
    async with two_workers(fake.url) as pair:
        gate = fake.gate = asyncio.Event()
        question = owned_by(pair.a.gateway, 1, "Cut as its owner closes")
        body = {**_chat(question), **({"stream": True} if stream else {})}
        asked = asyncio.create_task(pair.a.client.post("/v1/chat/completions", json=body))
        await fake.wait_for_calls(1)  # (b, the owner, calls the upstream for a's client)
        fake.gate = None  # (the next call is answered at once)
        pair.b.gateway.stop_by = time.monotonic()  # (no grace left: its call is cancelled)
        await pair.b.gateway.aclose()
        answer = await asked
        gate.set()
    assert answer.status_code == 200, answer.text
    if stream:
        assert answer.text.rstrip().endswith("data: [DONE]"), answer.text[-300:]
        assert '"error"' not in answer.text
    assert fake.count() == 2  # (b's, cancelled, and a's own)
