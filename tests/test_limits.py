"""Bad input and limits over HTTP (issue #8, part 2): every bad request gets a well-formed 4xx,
nothing of it is stored or sent upstream, and the gateway keeps serving.

Limits that the gateway enforces (CONTRACT.md "Errors from the gateway itself", "Idempotency",
"Cache controls on a request"; ``request.py``, ``idempotency.py``):
- the body: ``limits.max_body_bytes`` -> 413 (declared or streamed without a length);
- ``Idempotency-Key``: 1 to 255 printable ASCII characters (a structured-field string, or bare)
  -> else 400 problem+json;
- ``x-carpool-namespace``, ``-type``, ``-freshness`` and each tag: at most 256 printable
  characters, sent as UTF-8; at most 32 distinct tags -> else 400 ``invalid_header``;
- the body: a JSON object with ``model`` (a string) and the endpoint's input of the right type
  -> else 400 in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib

import orjson
import pytest

from carpool.idempotency import MAX_KEY_LENGTH
from carpool.request import MAX_HEADER_TOKEN, MAX_TAGS
from fakes.errors import assert_openai_error as assert_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
JSON = {"content-type": "application/json"}
MESSAGES = [{"role": "user", "content": "What is carpool?"}]


def assert_openai_error(response, status: int, code: str | None = None) -> dict:
    return assert_error(response, status, code, "invalid_request_error")


def assert_problem(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert {"type", "title", "status", "detail"} <= set(problem)
    assert problem["status"] == status and problem["detail"]
    return problem


class RawResponse:
    """Enough of an ``httpx.Response`` for the assertions here."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content
        self.text = content.decode("utf-8", "replace")

    def json(self):
        return orjson.loads(self.content)


async def raw_post(
    url: str, path: str, headers: dict[str, str | bytes], body: bytes
) -> RawResponse:
    """A POST written byte for byte: header values httpx refuses to send (blank, DEL, tab...)
    still reach the server as they are."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    lines = [
        f"POST {path} HTTP/1.1".encode(),
        f"host: {host}".encode(),
        b"content-type: application/json",
        f"content-length: {len(body)}".encode(),
        b"connection: close",
    ]
    lines += [
        name.encode() + b": " + (v if isinstance(v, bytes) else v.encode("latin-1"))
        for name, v in headers.items()
    ]
    writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, content = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in header_lines)
    return RawResponse(
        int(status_line.split()[1]), {k.lower(): v for k, v in fields.items()}, content
    )


async def assert_still_serving_and_nothing_stored(gw, fake, calls_before: int = 0) -> None:
    """The gateway is up, and the valid twin of what was refused is a miss: nothing was kept."""
    assert (await gw.client.get("/healthz")).status_code == 200
    assert fake.count() == calls_before
    response = await gw.chat()
    assert response.status_code == 200 and response.headers["x-carpool"] == "miss"
    assert fake.count() == calls_before + 1


# --- the body --------------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_413_in_openai_shape_and_the_gateway_stays_up(
    fake, gateway_with
):
    async with gateway_with(limits={"max_body_bytes": 1000}) as gw:
        declared = await gw.chat("x" * 2000)  # Content-Length: over it
        assert_openai_error(declared, 413, "body_too_large")
        assert declared.headers["x-carpool"] == "bypass"

        async def chunks():  # no length: counted as read
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(50):
                yield b"y" * 100
            yield b'"}], "temperature": 0}'

        streamed = await gw.client.post(CHAT, content=chunks(), headers=JSON)
        assert "content-length" not in streamed.request.headers
        assert_openai_error(streamed, 413, "body_too_large")
        assert gw.gateway.stats.rejected == 2
        await assert_still_serving_and_nothing_stored(gw, fake)


@pytest.mark.parametrize("path", [CHAT, "/v1/files"], ids=["cached", "pass-through"])
async def test_a_body_over_the_limit_is_413_and_the_connection_closes(fake, gateway_with, path):
    """The rest of the body is not read: the connection closes after the 413 (it stayed open,
    reading the rest of the body with no deadline)."""
    async with gateway_with(limits={"max_body_bytes": 1000}) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                "content-length: 1000000000000\r\n\r\n{".encode()
            )
            raw = await asyncio.wait_for(reader.read(), 5)  # the answer, then the end
        finally:
            writer.close()
    head, _, content = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
    response = RawResponse(int(status_line.split()[1]), headers, content)
    assert_openai_error(response, 413, "body_too_large")
    assert headers["connection"] == "close" and fake.count() == 0


async def test_a_body_exactly_at_the_limit_is_accepted(fake, gateway_with):
    async with gateway_with(limits={"max_body_bytes": 1000}) as gw:
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": ""}]}
        body["messages"][0]["content"] = "z" * (1000 - len(orjson.dumps(body)))
        raw = orjson.dumps(body)
        assert len(raw) == 1000
        assert (await gw.client.post(CHAT, content=raw, headers=JSON)).status_code == 200
        assert_openai_error(await gw.client.post(CHAT, content=raw + b" ", headers=JSON), 413)


async def test_large_and_many_headers_never_take_the_gateway_down(gw, fake):
    large = "a" * 20_000  # within limits.max_header_bytes (64 KiB)
    assert (await gw.chat()).headers["x-carpool"] == "miss"
    # A large credential is only hashed for the tenant (and forwarded, as every header is).
    answer = await gw.chat(headers={"authorization": f"Bearer {large}"})
    assert answer.status_code == 200 and answer.headers["x-carpool"] == "miss"
    # Large cache-control headers are refused, without echoing them back.
    for name in ("x-carpool-tags", "x-carpool-namespace", "x-carpool-freshness", "x-carpool-type"):
        refused = await gw.chat(headers={name: large})
        error = assert_openai_error(refused, 400, "invalid_header")
        assert len(refused.content) < 500 and name in error["message"]
    assert_problem(await gw.chat(headers={"idempotency-key": large}))
    error = assert_openai_error(await gw.chat(headers={"cache-control": "max-age=" + large}), 400)
    assert len(error["message"]) < 200
    extra = {f"x-extra-{i}": "v" * 40 for i in range(500)}
    many = await gw.chat(headers=extra)
    # Headers forwarded upstream are in the key (they may change the answer): a new request.
    assert many.status_code == 200 and many.headers["x-carpool"] == "miss"
    assert (await gw.chat(headers=extra)).headers["x-carpool"] == "hit"
    assert (await gw.client.get("/healthz")).status_code == 200
    assert fake.count() == 3


async def test_headers_over_the_limit_are_431_in_openai_shape_and_never_forwarded(gw, fake):
    limit = gw.gateway.config.limits.max_header_bytes
    for headers in (
        {"authorization": "Bearer " + "a" * limit},
        {f"x-extra-{i}": "v" * 100 for i in range(1000)},
    ):
        refused = await gw.chat(headers=headers)
        assert_openai_error(refused, 431, "headers_too_large")
        assert refused.headers["x-carpool"] == "bypass"
        passthrough = await gw.client.get("/v1/models", headers=headers)
        assert_openai_error(passthrough, 431, "headers_too_large")
    assert fake.count() == 0  # nothing reached the upstream
    assert (await gw.client.get("/stats")).json()["rejected"] == 2
    assert (await gw.chat()).status_code == 200


async def test_a_max_age_too_large_to_represent_counts_as_2_to_the_31_not_a_crash(gw, fake):
    """RFC 9111 1.2.2; it used to be an OverflowError (500) from float(10**400)."""
    assert (await gw.chat()).headers["x-carpool"] == "miss"
    again = await gw.chat(headers={"cache-control": "max-age=" + "9" * 400})
    assert again.status_code == 200 and again.headers["x-carpool"] == "hit"
    assert fake.count() == 1


async def test_a_malformed_cache_control_max_age_is_400(gw, fake):
    for value in ("max-age=abc", "max-age=-1", "max-age=", "max-age=1.5", "max-age=1e3"):
        assert_openai_error(await gw.chat(headers={"cache-control": value}), 400, "invalid_header")
    await assert_still_serving_and_nothing_stored(gw, fake)


# --- content codings -------------------------------------------------------------------------

CHAT_BODY = orjson.dumps({"model": "m", "temperature": 0, "messages": MESSAGES})
MESSAGES_BODY = orjson.dumps(
    {"model": "m", "temperature": 0, "max_tokens": 10, "messages": MESSAGES}
)
# (The bytes need not be what they say: the coding alone is refused, before the body is read.)
CODED = [
    ("gzip", gzip.compress(CHAT_BODY)),
    ("deflate", zlib.compress(CHAT_BODY)),
    ("br", b"\x8b\x02\x80" + CHAT_BODY),
    ("GZIP", gzip.compress(CHAT_BODY)),
    ("identity, gzip", gzip.compress(CHAT_BODY)),
    ("gzip", CHAT_BODY),  # (a plain body labelled gzip: a byte-identical repeat of the first)
]


async def test_a_content_coding_other_than_identity_on_a_cached_endpoint_is_415_naming_it(gw, fake):
    """The body was read as JSON whatever its coding: a compressed one got a 400 blaming the
    JSON ("surrogates not allowed"), and a plain one labelled gzip was served, forwarded to the
    upstream still labelled gzip."""
    stored = await gw.client.post(CHAT, content=CHAT_BODY, headers=JSON)
    assert stored.headers["x-carpool"] == "miss"
    for coding, body in CODED:
        refused = await gw.client.post(
            CHAT, content=body, headers={**JSON, "content-encoding": coding}
        )
        error = assert_openai_error(refused, 415, "unsupported_content_encoding")
        assert "Content-Encoding" in error["message"], coding
        assert refused.headers["x-carpool"] == "bypass", coding
        assert refused.headers["accept-encoding"] == "identity", coding  # (RFC 9110 15.5.16)
    # Anthropic's error shape on /v1/messages, as for its other refusals.
    refused = await gw.client.post(
        "/v1/messages", content=MESSAGES_BODY, headers={**JSON, "content-encoding": "gzip"}
    )
    assert refused.status_code == 415 and refused.headers["x-carpool"] == "bypass"
    anthropic = refused.json()
    assert anthropic["type"] == "error" and anthropic["error"]["type"] == "invalid_request_error"
    assert "Content-Encoding" in anthropic["error"]["message"]
    assert gw.gateway.stats.rejected == len(CODED) + 1
    assert fake.count() == 1  # (the first request's call alone)


async def test_a_cached_endpoints_call_never_carries_the_clients_content_encoding(gw, fake):
    """Its body is re-serialized JSON: ``identity`` is served, and not forwarded. Pass-through
    forwards the body as it came, and its coding with it."""
    served = await gw.client.post(
        CHAT, content=CHAT_BODY, headers={**JSON, "content-encoding": "Identity"}
    )
    assert served.status_code == 200 and served.headers["x-carpool"] == "miss"
    assert "content-encoding" not in fake.calls[-1].headers
    packed = gzip.compress(b'{"purpose": "batch"}')
    await gw.client.post("/v1/files", content=packed, headers={**JSON, "content-encoding": "gzip"})
    passed = fake.calls[-1]
    assert passed.path == "/v1/files" and passed.raw_body == packed
    assert passed.headers["content-encoding"] == "gzip"


# --- idempotency keys ------------------------------------------------------------------------

INVALID_KEYS = {
    "empty": "",
    "empty-quoted": '""',
    "blank": "   ",
    "blank-quoted": '"   "',
    "256-chars": "k" * (MAX_KEY_LENGTH + 1),
    "256-chars-quoted": '"' + "k" * (MAX_KEY_LENGTH + 1) + '"',
    "10000-chars": "k" * 10_000,
    "non-ascii-utf8": "clé-ключ-鍵".encode(),
    "non-ascii-latin1": b"caf\xe9",
    "tab": "a\tb",
    "delete": "a\x7fb",
    "unterminated-quote": '"unterminated',
    "bad-escape": '"bad\\escape"',
    "text-after-the-string": '"a" trailing',
}


async def test_an_invalid_idempotency_key_is_400_problem_json_and_nothing_is_stored(gw, fake):
    """Empty, blank, over 255 characters, not printable ASCII, or a malformed quoted string."""
    body = {"model": "m", "messages": MESSAGES, "temperature": 0}
    for case, value in INVALID_KEYS.items():
        for header in ("Idempotency-Key", "X-Idempotency-Key"):
            response = await raw_post(gw.url, CHAT, {header: value}, orjson.dumps(body))
            if response.headers["content-type"] == "application/json":
                # The HTTP parser refused the header line (DEL): the request never got here.
                assert_openai_error(response, 400, "invalid_http")
            else:
                problem = assert_problem(response)
                assert problem["title"] and response.headers["x-carpool"] == "bypass", case
            # The library API takes any str: the gateway's own check answers the same.
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            reply = await gw.gateway.request(CHAT, body, {header: text})
            assert reply.status == 400, case
            assert dict(reply.headers)[b"content-type"] == b"application/problem+json", case
    assert fake.count() == 0 and gw.gateway.store.entries == 0
    # The same request with a valid key runs (no record was begun by the refused ones).
    ok = await gw.chat(headers={"Idempotency-Key": "valid"})
    assert ok.status_code == 200 and "idempotent-replayed" not in ok.headers
    assert fake.count() == 1


async def test_an_idempotency_key_of_1_to_255_printable_ascii_characters_is_accepted(gw, fake):
    valid = [
        "k" * MAX_KEY_LENGTH,
        '"' + "q" * MAX_KEY_LENGTH + '"',
        "a b",
        '"with \\"quotes\\""',
        "*?[]{}:",
        "-",
        "~",
    ]
    for i, value in enumerate(valid):
        first = await gw.chat(f"question {i}", headers={"Idempotency-Key": value})
        assert first.status_code == 200, value
        again = await gw.chat(f"question {i}", headers={"Idempotency-Key": value})
        assert again.headers.get("idempotent-replayed") == "true", value
        assert again.content == first.content
    assert fake.count() == len(valid)


# --- tags, namespaces and the other cache-control headers ----------------------------------

CONTROL_HEADERS = ("x-carpool-namespace", "x-carpool-type", "x-carpool-freshness", "x-carpool-tags")


async def test_a_cache_control_header_value_is_at_most_256_characters(gw, fake):
    for name in CONTROL_HEADERS:
        ok = await gw.chat(name, headers={name: "n" * MAX_HEADER_TOKEN})
        assert ok.status_code == 200, name
        error = assert_openai_error(
            await gw.chat(f"other {name}", headers={name: "n" * (MAX_HEADER_TOKEN + 1)}),
            400,
            "invalid_header",
        )
        assert str(MAX_HEADER_TOKEN) in error["message"]
    assert fake.count() == len(CONTROL_HEADERS)


async def test_at_most_32_distinct_tags(gw, fake):
    tags = [f"t{i}" for i in range(MAX_TAGS)]
    assert (await gw.chat(headers={"x-carpool-tags": ",".join(tags)})).status_code == 200
    # Repeats and empty items do not count.
    repeated = ",".join(tags * 3) + ",,, ,"
    assert (await gw.chat(headers={"x-carpool-tags": repeated})).status_code == 200
    error = assert_openai_error(
        await gw.chat("other", headers={"x-carpool-tags": ",".join([*tags, "one-more"])}),
        400,
        "invalid_header",
    )
    assert "32" in error["message"]
    assert fake.count() == 1


async def test_control_characters_in_a_namespace_or_tag_are_400(gw, fake):
    """HTTP/1.1 cannot carry most of them; the library API (``Gateway.request``) can."""
    body = {"model": "m", "temperature": 0, "messages": MESSAGES}
    for name in CONTROL_HEADERS:
        for value in ("a\nb", "a\rb", "a\tb", "a\x00b", "a\x1bb", "a\x7fb", "a\u2028b", "a\x85b"):
            reply = await gw.gateway.request(CHAT, body, {name: value})
            assert reply.status == 400, (name, value)
            assert reply.json()["error"]["code"] == "invalid_header"
            assert dict(reply.headers)[b"x-carpool"] == b"bypass"
    assert fake.count() == 0


async def test_a_control_header_whose_bytes_are_no_printable_text_is_a_400_in_the_apis_shape(
    gw, fake
):
    """Its text is what the operator names again (``/admin/invalidate``, ``cache.types``): bytes
    that spell no printable text, in UTF-8 or latin-1 (a C1 control byte), name nothing."""
    chat = orjson.dumps({"model": "m", "temperature": 0, "messages": MESSAGES})
    messages = orjson.dumps({"model": "m", "max_tokens": 5, "messages": MESSAGES})
    for name in CONTROL_HEADERS:
        for value in (b"a\x80b", b"a\xc2\x80b"):
            refused = await raw_post(gw.url, CHAT, {name: value}, chat)
            error = assert_openai_error(refused, 400, "invalid_header")
            assert name in error["message"] and "printable" in error["message"], error
            assert refused.headers["x-carpool"] == "bypass"
        anthropic = await raw_post(gw.url, "/v1/messages", {name: b"a\x80b"}, messages)
        assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
        assert "printable" in anthropic.json()["error"]["message"]
    await assert_still_serving_and_nothing_stored(gw, fake)


async def test_glob_and_key_syntax_characters_are_plain_text_in_tags_and_namespaces(gw, fake):
    """Tags and namespaces are only ever digested into store keys; these are ordinary text."""
    headers = {"x-carpool-namespace": "ns:*?[a-z]{x}\\", "x-carpool-tags": "t:*,t?,[t],{t}"}
    assert (await gw.chat(headers=headers)).headers["x-carpool"] == "miss"
    assert (await gw.chat(headers=headers)).headers["x-carpool"] == "hit"
    assert (await gw.chat(headers={**headers, "x-carpool-namespace": "ns:x"})).headers[
        "x-carpool"
    ] == "miss"


async def test_x_carpool_share_only_takes_sampled(gw, fake):
    assert_openai_error(await gw.chat(headers={"x-carpool-share": "all"}), 400, "invalid_header")
    await assert_still_serving_and_nothing_stored(gw, fake)


# --- malformed bodies ------------------------------------------------------------------------


def chat_body(**fields):
    return orjson.dumps({"model": "m", "temperature": 0, "messages": MESSAGES, **fields})


def without(name: str) -> bytes:
    body = {"model": "m", "temperature": 0, "messages": MESSAGES}
    del body[name]
    return orjson.dumps(body)


MALFORMED = [
    pytest.param(CHAT, b"", "invalid_json", id="empty"),
    pytest.param(CHAT, b"{not json", "invalid_json", id="not-json"),
    pytest.param(CHAT, b'{"model": "m",', "invalid_json", id="truncated"),
    pytest.param(CHAT, b'{"model": "m", "messages": [], }', "invalid_json", id="trailing-comma"),
    pytest.param(CHAT, b'{"model": "\xff\xfe"}', "invalid_json", id="invalid-utf8"),
    pytest.param(CHAT, b'{"model": "\\ud800"}', "invalid_json", id="lone-surrogate"),
    pytest.param(CHAT, chat_body()[:-1] + b', "temperature": NaN}', "invalid_json", id="nan"),
    pytest.param(CHAT, chat_body()[:-1] + b', "top_p": 1e400}', "invalid_json", id="infinity"),
    pytest.param(CHAT, b"[" * 5000 + b"]" * 5000, "invalid_json", id="deeply-nested"),
    pytest.param(CHAT, b"\xef\xbb\xbf" + chat_body(), "invalid_json", id="utf8-bom"),
    pytest.param(CHAT, b"[1, 2]", "invalid_body", id="array"),
    pytest.param(CHAT, b'"text"', "invalid_body", id="string"),
    pytest.param(CHAT, b"42", "invalid_body", id="number"),
    pytest.param(CHAT, b"null", "invalid_body", id="null"),
    pytest.param(CHAT, without("model"), "invalid_request", id="model-missing"),
    pytest.param(CHAT, chat_body(model=None), "invalid_request", id="model-null"),
    pytest.param(CHAT, chat_body(model=5), "invalid_request", id="model-number"),
    pytest.param(CHAT, chat_body(model=["m"]), "invalid_request", id="model-list"),
    pytest.param(CHAT, without("messages"), "invalid_request", id="messages-missing"),
    pytest.param(CHAT, chat_body(messages="hi"), "invalid_request", id="messages-string"),
    pytest.param(
        CHAT, chat_body(messages={"role": "user"}), "invalid_request", id="messages-object"
    ),
    pytest.param(CHAT, chat_body(messages=[]), "invalid_request", id="messages-empty"),
    pytest.param(CHAT, chat_body(messages=["hi"]), "invalid_request", id="message-string"),
    pytest.param(
        CHAT, chat_body(messages=[MESSAGES[0], None]), "invalid_request", id="message-null"
    ),
    pytest.param(CHAT, chat_body(temperature="0"), "invalid_request", id="temperature-string"),
    pytest.param(CHAT, chat_body(temperature=True), "invalid_request", id="temperature-bool"),
    pytest.param(CHAT, chat_body(temperature=[0]), "invalid_request", id="temperature-list"),
    pytest.param(CHAT, chat_body(top_p="1"), "invalid_request", id="top_p-string"),
    pytest.param(CHAT, chat_body(seed="1"), "invalid_request", id="seed-string"),
    pytest.param(CHAT, chat_body(seed=1.5), "invalid_request", id="seed-fraction"),
    pytest.param(CHAT, chat_body(top_k=True), "invalid_request", id="top_k-bool"),
    pytest.param(CHAT, chat_body(n="2"), "invalid_request", id="n-string"),
    pytest.param(CHAT, chat_body(stream="yes"), "invalid_request", id="stream-string"),
    pytest.param(CHAT, chat_body(stream=1), "invalid_request", id="stream-number"),
    pytest.param(
        COMPLETIONS, b'{"model": "m", "temperature": 0}', "invalid_request", id="prompt-missing"
    ),
    pytest.param(
        COMPLETIONS,
        b'{"model": "m", "temperature": 0, "prompt": 5}',
        "invalid_request",
        id="prompt-number",
    ),
    pytest.param(
        COMPLETIONS,
        b'{"model": "m", "temperature": 0, "prompt": []}',
        "invalid_request",
        id="prompt-empty-list",
    ),
    pytest.param(
        COMPLETIONS,
        b'{"model": "m", "temperature": 0, "prompt": [1, "a"]}',
        "invalid_request",
        id="prompt-mixed-list",
    ),
    pytest.param(
        COMPLETIONS,
        b'{"temperature": 0, "prompt": "hi"}',
        "invalid_request",
        id="completion-model-missing",
    ),
    pytest.param(EMBEDDINGS, b'{"model": "e"}', "invalid_request", id="input-missing"),
    pytest.param(
        EMBEDDINGS, b'{"model": "e", "input": {"text": "hi"}}', "invalid_request", id="input-object"
    ),
    pytest.param(
        EMBEDDINGS, b'{"model": "e", "input": [[1], "a"]}', "invalid_request", id="input-mixed-list"
    ),
    pytest.param(EMBEDDINGS, b'{"input": "hi"}', "invalid_request", id="embedding-model-missing"),
    # ``true`` is no token id (Python's bool is an int: ``[true]`` met ``[1]``'s answer).
    pytest.param(
        EMBEDDINGS, b'{"model": "e", "input": [true, false]}', "invalid_request", id="input-bools"
    ),
    pytest.param(
        EMBEDDINGS,
        b'{"model": "e", "input": [[1], [true]]}',
        "invalid_request",
        id="input-bool-ids",
    ),
    pytest.param(
        COMPLETIONS,
        b'{"model": "m", "temperature": 0, "prompt": [true]}',
        "invalid_request",
        id="prompt-bools",
    ),
]


async def test_a_malformed_body_is_400_in_openai_shape_and_nothing_is_stored(gw, fake):
    for case in MALFORMED:
        path, raw, code = case.values
        response = await gw.client.post(path, content=raw, headers=JSON)
        try:
            error = assert_openai_error(response, 400, code)
        except AssertionError as failure:
            raise AssertionError(f"case {case.id}: {failure}") from None
        assert response.headers["x-carpool"] == "bypass", case.id
        assert len(error["message"]) < 300, case.id
    assert gw.gateway.stats.rejected == len(MALFORMED)
    assert gw.gateway.store.entries == 0
    await assert_still_serving_and_nothing_stored(gw, fake)


async def test_a_malformed_body_with_an_idempotency_key_leaves_the_key_unused(gw, fake):
    """Validation comes first: the key of a refused request is free for its corrected retry."""
    refused = await gw.client.post(
        CHAT, content=without("model"), headers={**JSON, "Idempotency-Key": "k1"}
    )
    assert_openai_error(refused, 400)
    ok = await gw.chat(headers={"Idempotency-Key": "k1"})
    assert ok.status_code == 200 and "idempotent-replayed" not in ok.headers
    assert fake.count() == 1


async def test_a_storm_of_bad_requests_leaves_the_gateway_serving(gw, fake):
    bad = [raw for path, raw, _ in (p.values for p in MALFORMED) if path == CHAT]
    responses = await asyncio.gather(
        *(gw.client.post(CHAT, content=raw, headers=JSON) for raw in bad * 2)
    )
    assert {r.status_code for r in responses} == {400}
    assert gw.gateway.stats.rejected == len(bad) * 2
    await assert_still_serving_and_nothing_stored(gw, fake)
