"""The byte-identical fast path (repeat_memo.RepeatMemo): a repeat skips parsing, never the rules."""

from __future__ import annotations

import inspect
import re

import pytest

from carpool import request as request_module
from carpool.config import Config
from carpool.fingerprint import fingerprint
from carpool.lru import held
from carpool.repeat_memo import _ENTRY_OVERHEAD, MAX_MEMO_HEADERS, RepeatMemo
from carpool.request import CONTROL_HEADERS, ClientRequest, parse

CHAT = "/v1/chat/completions"
BODY = b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}'


def test_every_header_parse_controls_reads_is_a_control_header_of_the_memo():
    source = inspect.getsource(request_module.parse_controls)
    read = set(re.findall(r'headers\.get\("([a-z0-9-]+)"\)', source))
    assert read and read == set(CONTROL_HEADERS)


async def test_a_byte_identical_repeat_is_a_hit_through_the_memo(gw, fake):
    first = await gw.chat("hello")
    assert len(gw.gateway.repeats) == 1
    again = await gw.chat("hello")
    assert (first.headers["x-carpool"], again.headers["x-carpool"]) == ("miss", "hit")
    assert again.json() == first.json() and fake.count() == 1
    streamed, text = await gw.stream_chat("hello")  # other bytes: parsed, then a hit
    assert streamed.headers["x-carpool"] == "hit" and text.endswith("data: [DONE]\n\n")


async def test_a_repeat_with_another_control_header_or_tenant_is_not_the_same_request(gw, fake):
    await gw.chat("hello", headers={"x-carpool-namespace": "a"})
    other_namespace = await gw.chat("hello", headers={"x-carpool-namespace": "b"})
    other_tenant = await gw.chat(
        "hello", headers={"x-carpool-namespace": "a", "authorization": "Bearer someone-else"}
    )
    no_cache = await gw.chat(
        "hello", headers={"x-carpool-namespace": "a", "cache-control": "no-cache"}
    )
    assert [r.headers["x-carpool"] for r in (other_namespace, other_tenant, no_cache)] == [
        "miss",
        "miss",
        "miss",
    ]
    assert fake.count() == 4


@pytest.mark.parametrize("header", ["idempotency-key", "x-idempotency-key"])
async def test_a_repeat_carrying_an_idempotency_key_goes_through_its_record(gw, fake, header):
    await gw.chat("hello")
    keyed = await gw.chat("hello", headers={header: "k-1"})
    assert keyed.headers["x-carpool"] == "hit" and fake.count() == 1
    replay = await gw.chat("hello", headers={header: "k-1"})
    assert replay.headers.get("idempotent-replayed") == "true"


def test_the_memo_remembers_only_shareable_requests_that_may_read_and_stays_in_budget():
    config = Config()
    memo = RepeatMemo(("authorization",), max_bytes=2 * (_ENTRY_OVERHEAD + len(BODY) + 2) + 10)

    def remember(body: bytes, headers: dict[str, str]) -> None:
        client = ClientRequest(CHAT, body, headers)
        request = parse(client, 1 << 20)
        memo.remember(memo.key_of(client), request, fingerprint(request, config), None)

    remember(BODY.replace(b'"temperature":0', b'"temperature":0.7'), {})  # sampled
    remember(BODY, {"cache-control": "no-store"})
    remember(BODY, {"authorization": "Bearer " + "k" * MAX_MEMO_HEADERS})  # too large to keep
    assert len(memo) == 0
    assert memo.key_of(ClientRequest(CHAT, BODY, {"idempotency-key": "k"})) is None
    for i in range(5):
        remember(BODY.replace(b"hi", f"hi {i}".encode()), {})
    assert len(memo) == 2 and memo.bytes <= memo.max_bytes  # the oldest went first
    newest = ClientRequest(CHAT, BODY.replace(b"hi", b"hi 4"), {})
    assert memo.get(memo.key_of(newest)) is not None


def test_the_memo_counts_the_headers_it_keeps_as_the_objects_they_are():
    # Each forwarded header is a tuple of two strings (~170 bytes held), not its characters
    # (~15): counted so, 40 of them let the memo hold ~6x its budget.
    config = Config()
    memo = RepeatMemo(("authorization",), max_bytes=1 << 20)
    headers = {f"x-h{j}": f"value-{j}" for j in range(40)}
    client = ClientRequest(CHAT, BODY, headers)
    request = parse(client, 1 << 20)
    memo.remember(memo.key_of(client), request, fingerprint(request, config), None)
    kept = next(iter(memo._memo.mapping))
    assert memo.bytes >= _ENTRY_OVERHEAD + len(BODY) + held(
        kept[3], *(x for pair in kept[3] for x in (pair, *pair))
    )


def test_the_memos_entries_are_untracked_by_the_garbage_collector_once_it_has_seen_them():
    import gc

    config = Config()
    memo = RepeatMemo(("authorization",), max_bytes=1 << 20)
    for i in range(20):
        body = BODY.replace(b"hi", f"hi {i}".encode())
        client = ClientRequest(CHAT, body, {"authorization": "Bearer k", "x-other": "v"})
        request = parse(client, 1 << 20)
        memo.remember(memo.key_of(client), request, fingerprint(request, config), 60.0)
    for _ in range(3):  # (a tuple is untracked once those in it are: a level a pass)
        gc.collect()
    kept = memo._memo.mapping
    assert len(kept) == 20
    assert not any(gc.is_tracked(key) or gc.is_tracked(value) for key, value in kept.items())
    repeat = memo.get(next(iter(kept)))
    assert repeat is not None and repeat.max_age == 60.0 and not repeat.stream


def test_the_memo_key_leaves_out_the_configured_neutral_headers_as_the_key_does():
    memo = RepeatMemo(("authorization",), 1 << 20, neutral=frozenset({"x-edge-request"}))
    plain = RepeatMemo(("authorization",), 1 << 20)

    def memo_key(memo, **headers):
        return memo.key_of(ClientRequest(CHAT, BODY, {"authorization": "Bearer k", **headers}))

    assert memo_key(memo, **{"x-edge-request": "1"}) == memo_key(memo, **{"x-edge-request": "2"})
    assert memo_key(memo, **{"x-edge-request": "1"}) == memo_key(memo)
    assert memo_key(plain, **{"x-edge-request": "1"}) != memo_key(plain, **{"x-edge-request": "2"})
    # What hosting platforms add to every request is out of every memo key.
    assert memo_key(plain, **{"fly-request-id": "1"}) == memo_key(plain, **{"fly-request-id": "2"})


async def test_a_byte_identical_messages_request_with_an_origin_is_not_a_repeat_of_one_without(
    gw, fake
):
    """The scope keeps a Messages request with an ``Origin`` apart from one without (a browser's
    call Anthropic refuses without its opt-in header: ``canonical.scope``), but the memo key
    left ``Origin`` out with the neutral headers: a browser's byte-identical repeat of a
    server's request was served the server's answer (a hit), one spelled otherwise a miss."""
    body = (
        b'{"model":"c","max_tokens":8,"temperature":0,"messages":[{"role":"user","content":"hi"}]}'
    )
    plain = {"content-type": "application/json"}
    server = await gw.client.post("/v1/messages", content=body, headers=plain)
    browser = await gw.client.post(
        "/v1/messages", content=body, headers={**plain, "origin": "https://example.com"}
    )
    assert server.headers["x-carpool"] == "miss"
    assert browser.headers["x-carpool"] == "miss" and fake.count("/v1/messages") == 2
    config = Config()
    memo = RepeatMemo(("authorization",), 1 << 20)
    requests = [
        ClientRequest("/v1/messages", body, {}),
        ClientRequest("/v1/messages", body, {"origin": "https://example.com"}),
    ]
    keys = [fingerprint(parse(client, 1 << 20), config).key for client in requests]
    assert keys[0] != keys[1]
    assert memo.key_of(requests[0]) != memo.key_of(requests[1])
