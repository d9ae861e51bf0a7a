"""Parse a client's HTTP request into one ``Request`` the layers below can trust.

Contract:
- ``parse`` accepts the cached endpoints (``carpool.apis``: chat, completions, embeddings,
  responses, messages). It raises ``RequestError`` (400) for malformed JSON, a body that is not a
  JSON object, a field of the wrong type where the layers depend on it (``messages``,
  ``prompt``, ``input``, ``model``, ``stream``, ``temperature``, ``top_k``, ``seed``, ``n``...:
  each API's ``validate``), a missing ``model`` where the API requires one, and
  ``BodyTooLarge`` (413) over the size limit. A body in a content coding (``Content-Encoding``
  other than ``identity``, in any case, anywhere in its list: gzip, deflate, br...) is
  ``ContentCodingRefused`` (415), before it is read: the gateway decodes none, and the JSON it
  sends upstream is its own serialization (so no ``Content-Encoding`` is forwarded with it:
  ``upstream.base.NOT_FORWARDED``). It does not re-implement the upstream's validation of everything else:
  unknown fields pass through (and are part of the fingerprint). A ``"stream": null`` is no
  ``stream`` (as OpenAI takes it): dropped from the body, the upstream is asked without it.
- The ids a client names its request by (``client_ids``: its ``x-request-id`` and
  ``request-id`` headers, its body's ``request_id`` on chat, completions and embeddings:
  ``Api.request_id_fields``) are for the gateway's log alone: the body's is taken out of the
  body, the headers are replaced on the upstream call (``upstream.http``). An engine names its
  answer after the id it is sent (vLLM), and the key leaves them out: sent, one client's id was
  served to others.
- ``Controls`` is what the request asks of the cache layers, read from its headers
  (``Cache-Control``, ``x-carpool-*``). Malformed header values are 400, never silently ignored.
- The control headers that carry names (``TEXT_HEADERS``: a namespace, tags, a type, a
  freshness token) are read as the UTF-8 text their bytes spell (``header_text``, by the
  transport): the name an operator types in ``/admin/invalidate`` or ``cache.types``, and the
  one a library caller passes as text. Bytes that are no UTF-8 are read as latin-1 (Python's
  ``requests`` and ``urllib`` write a text value so): that name too. Every other header is read a byte a character (latin-1).
- Nothing here touches a cache or the network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

from . import exact_json, http_syntax
from .apis import APIS, Api, api_of
from .errors import BodyTooLarge, ContentCodingRefused, RequestError
from .upstream.base import REQUEST_ID_HEADERS, unstreamed

# The cached endpoints: gateway path -> (kind, path relative to the upstream's /v1 base).
ENDPOINTS: dict[str, tuple[str, str]] = {
    api.path: (api.kind, api.upstream_path) for api in APIS.values()
}

MAX_TAGS = 32
MAX_HEADER_TOKEN = 256
MAX_AGE = 2**31
# Every request header ``parse_controls`` reads. A byte-identical repeat (fingerprint.RepeatMemo)
# must agree on each of them, so a new control header belongs here too (a test reads the source).
CONTROL_HEADERS = (
    "cache-control",
    "x-carpool-namespace",
    "x-carpool-type",
    "x-carpool-tags",
    "x-carpool-freshness",
    "x-carpool-share",
)

# The control headers whose values are names (``parse_controls``): sent as UTF-8 (curl, Go's
# net/http, a browser's fetch send a string so) or latin-1 (Python's requests, urllib), read as
# that text (``header_text``), so that "prix-été" is the tag an operator names in JSON, not
# "prix-Ã©tÃ©".
TEXT_HEADERS = (
    "x-carpool-namespace",
    "x-carpool-type",
    "x-carpool-tags",
    "x-carpool-freshness",
)


@dataclass(slots=True)
class ClientRequest:
    """What arrived from a client, independent of the transport (HTTP server or library call)."""

    path: str
    # The raw body: emptied once parsed (``Gateway.handle``), unless a worker may pass the
    # request on whole to another (a keyed one, among ``--workers``).
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names
    # The raw query string (Azure's ``api-version``, deployment parameters): forwarded to the
    # upstream, and part of the fingerprint, since the upstream may answer differently.
    query: bytes = b""
    # Called once the request must wait (on a flight or the upstream), so that a transport can
    # start watching for its client leaving only then: an immediate hit never pays for it.
    on_wait: Callable[[], None] | None = None
    # Keeps the request going should its client leave, until the function it returns is called
    # (``inbound.ClientWatch.keep``): a retry with its Idempotency-Key waits on its record.
    keep: Callable[[], Callable[[], None]] | None = None
    # Sent by another worker of this run (``carpool.peers``), which chose this one to lead it:
    # led here, never passed on. Only the peers' own door sets it (``peers.PeerApp``).
    peer: bool = False
    # Its repeat memo key (``RepeatMemo.key_of``), once made (``keyed``): the HTTP protocol
    # asks ``Gateway.repeat_now`` first, and the whole path does not make it again.
    memo_key: tuple[Any, ...] | None = field(default=None, init=False, repr=False)
    keyed: bool = field(default=False, init=False, repr=False)


@dataclass(slots=True)
class Controls:
    """The cache behaviour a request asks for (CONTRACT.md "Cache controls on a request")."""

    no_cache: bool = False  # do not answer from cache; may join a call in flight; store
    no_store: bool = False  # neither read nor write a cache; may still coalesce
    max_age: float | None = None  # accept a cached answer only if younger than this (seconds)
    namespace: str = ""
    request_type: str | None = None
    tags: tuple[str, ...] = ()
    freshness: str = ""
    share_sampled: bool = False

    @property
    def may_read(self) -> bool:
        return not (self.no_cache or self.no_store)


@dataclass(slots=True)
class Request:
    """A validated request to one of the cached endpoints."""

    kind: str  # "chat" | "completion" | "embedding" | "responses" | ...
    upstream_path: str  # e.g. "/chat/completions"
    body: dict[str, Any]
    headers: Mapping[str, str]
    controls: Controls
    stream: bool
    include_usage: bool  # the client asked for the final usage chunk
    query: str = ""  # the query string, forwarded as it came
    # An idempotency record keeps its answer for retries that may ask for the usage it did not
    # (``idempotency.once``): a bypassed stream then asks the upstream for it (``bypass``).
    recorded: bool = False
    # The ids the client named it by (its request id headers, its body's ``request_id``):
    # logged with the upstream calls made for it, never sent (module doc).
    client_ids: tuple[str, ...] = ()
    # The files its input names (``apis.base.named_files``), once asked: walked on a miss only
    # (``lead``), once however often asked (a bytes check on every request cost hits ~1 µs a KB).
    files: tuple[str, ...] | None = field(default=None, init=False, repr=False)

    @property
    def api(self) -> Api:
        """What the layers must know of this request's API (``carpool.apis``)."""
        return api_of(self.kind)


def parse(
    client: ClientRequest,
    max_body_bytes: int,
    max_json_depth: int = 64,
    max_json_containers: int = 100_000,
) -> Request:
    """Validate ``client`` for its endpoint; raise ``RequestError``/``BodyTooLarge`` when it is bad."""
    kind, upstream_path = ENDPOINTS[client.path]
    coding = client.headers.get("content-encoding")
    if coding is not None:
        check_content_coding(coding)
    if len(client.body) > max_body_bytes:
        raise BodyTooLarge(max_body_bytes)
    check_json_containers(client.body, max_json_containers)
    try:
        body = exact_json.loads(client.body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", "invalid_body")
    check_json_depth(client.body, body, max_json_depth)
    if "stream" in body and body["stream"] is None:
        # What the official SDKs send for ``stream=None``; OpenAI (and vLLM) take it as absent,
        # and so does the upstream here: it is asked without it (an engine that types
        # ``stream`` a plain boolean, as SGLang does, refuses null).
        del body["stream"]
    api = api_of(kind)
    api.validate(body)
    client_ids = [v for name in REQUEST_ID_HEADERS if (v := client.headers.get(name))]
    for name in api.request_id_fields & body.keys():
        named = body.pop(name)  # (never sent: the module doc)
        client_ids.append(named if isinstance(named, str) else orjson.dumps(named).decode())
    # An API without a stream form (embeddings) answers JSON whatever ``stream`` says.
    stream = api.streams and body.get("stream") is True
    include_usage = api.client_usage(body, stream)
    return Request(
        kind,
        upstream_path,
        body,
        client.headers,
        parse_controls(client.headers),
        stream,
        include_usage,
        check_query(client.query),
        client_ids=tuple(client_ids),
    )


def check_content_coding(value: str) -> None:
    """``ContentCodingRefused`` (415) for a ``Content-Encoding`` that lists any coding but
    ``identity`` (codings are case-insensitive, RFC 9110 8.4.1): compressed bytes read as JSON
    were a 400 blaming the JSON, and a plain body labelled gzip was served as JSON."""
    for coding in value.split(","):
        coding = coding.strip().lower()
        if coding and coding != "identity":
            raise ContentCodingRefused(value.strip())


def body_digest(body: dict[str, Any]) -> str:
    """A digest of ``body`` as it is sent upstream (re-serialized as parsed: ``10`` and
    ``10.0`` differ, as they may to the upstream). Not its objects' key order, which no
    upstream reads (JSON objects are unordered), and which differs from one client's JSON
    encoder to another's: two clients asking the same are one requester whatever their
    encoders (a failed call's words and its 4xx are both's). Where key order changes the
    answer (a tool's schema, rendered into the prompt in order), it is in the fingerprint."""
    return hashlib.blake2b(
        orjson.dumps(body, option=orjson.OPT_SORT_KEYS), digest_size=16
    ).hexdigest()


def requester_digest(body: dict[str, Any]) -> str:
    """A digest of ``body`` but for how it is delivered (``stream``, ``stream_options``): two
    requests with one digest asked the upstream the same, every field out of the key included
    (``user``, ``metadata``...), so an error the upstream answered one is the other's too (a
    client streaming what another asked whole asked the same)."""
    return body_digest(unstreamed(body))


def check_query(raw: bytes) -> str:
    """The query string ``raw`` as text; ``RequestError`` (400) for one a URL cannot hold."""
    try:
        query = raw.decode("ascii")
    except UnicodeDecodeError:
        raise RequestError(
            "the query string must be ASCII (percent-encode the rest)", "invalid_query"
        ) from None
    if not query.isprintable() or " " in query or "#" in query:
        raise RequestError("the query string holds characters a URL cannot", "invalid_query")
    return query


def check_json_depth(raw: bytes, value: Any, max_depth: int) -> None:
    """Raise ``RequestError`` (400, ``too_deep``) when ``value``, parsed from ``raw``, nests
    arrays and objects more than ``max_depth`` levels deep (``limits.max_json_depth``).

    A loop over an explicit stack, never recursion: its job is to refuse, before any recursive
    walker (the fingerprint, the JSON encoder of the upstream call) sees it, a body that would
    exhaust the interpreter's stack and turn bad input into a 500.
    """
    # No more brackets than the limit cannot nest deeper: nearly every body stops here, unwalked.
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                if depth >= max_depth:
                    raise RequestError(
                        f"the JSON body is nested deeper than {max_depth} levels", "too_deep"
                    )
                stack.append((child, depth + 1))


# A JSON string, escapes and all (unrolled: no alternation tried at each character), or what
# is left of the text from an opening quote that none closes: every match found, none tried
# again from each quote inside it (an unclosed run of \" pairs took quadratic time).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)


def check_json_containers(raw: bytes, most: int) -> None:
    """Raise ``RequestError`` (400, ``too_many_containers``) when the JSON text ``raw`` holds
    more than ``most`` arrays and objects (``limits.max_json_containers``), before it is
    parsed: the parse, the depth check and the key's copy cost by the container, and 8 MB of
    ``[[...]]`` (millions) held the event loop 5-9 s. Its brackets are counted, outside its
    strings where there are more than ``most`` in all; a body of under ``2 * most`` bytes
    cannot hold more (two a container), so nearly every body costs nothing here."""
    if len(raw) <= 2 * most or raw.count(b"[") + raw.count(b"{") <= most:
        return
    structure = _JSON_STRING.sub(b"", raw)
    if structure.count(b"[") + structure.count(b"{") > most:
        raise RequestError(
            f"the JSON body holds more than {most} arrays and objects", "too_many_containers"
        )


def parse_controls(headers: Mapping[str, str]) -> Controls:
    """Read ``Cache-Control`` and the ``x-carpool-*`` headers; 400 on a malformed value."""
    controls = Controls()
    cache_control = headers.get("cache-control")
    if cache_control:
        for name, value in http_syntax.cache_directives(cache_control):
            if name == "no-cache":
                controls.no_cache = True
            elif name == "no-store":
                controls.no_store = True
            elif name == "max-age":
                seconds = value.strip().strip('"')
                if not (seconds.isascii() and seconds.isdigit()):
                    # RFC 9111 1.2.2: delta-seconds are digits (int() read "1_0" and "+5").
                    raise RequestError(
                        f"Cache-Control max-age must be a non-negative integer, got {value[:64]!r}",
                        "invalid_header",
                    )
                # Too large to represent counts as 2**31 (1.2.2); of two, the stricter holds
                # (the looser one, later, served what the client had refused).
                age = float(min(int(seconds), MAX_AGE))
                controls.max_age = age if controls.max_age is None else min(age, controls.max_age)
    namespace = headers.get("x-carpool-namespace")
    if namespace is not None:
        controls.namespace = header_token(namespace, "x-carpool-namespace")
    request_type = headers.get("x-carpool-type")
    if request_type is not None:
        controls.request_type = header_token(request_type, "x-carpool-type").lower() or None
    tags = headers.get("x-carpool-tags")
    if tags:
        controls.tags = tuple(
            dict.fromkeys(header_token(t, "x-carpool-tags") for t in tags.split(",") if t.strip())
        )
        if len(controls.tags) > MAX_TAGS:
            raise RequestError(f"x-carpool-tags: at most {MAX_TAGS} tags", "invalid_header")
    freshness = headers.get("x-carpool-freshness")
    if freshness is not None:
        controls.freshness = header_token(freshness, "x-carpool-freshness")
    share = headers.get("x-carpool-share")
    if share is not None:
        if share.strip().lower() != "sampled":
            raise RequestError("x-carpool-share must be 'sampled'", "invalid_header")
        controls.share_sampled = True
    return controls


def header_token(value: str, header: str) -> str:
    """``value`` of the control ``header`` as a request's is read: stripped, at most
    ``MAX_HEADER_TOKEN`` printable characters, else a ``RequestError``."""
    value = value.strip()
    if len(value) > MAX_HEADER_TOKEN:
        raise RequestError(
            f"{header}: value longer than {MAX_HEADER_TOKEN} characters", "invalid_header"
        )
    if not value.isprintable():
        raise RequestError(f"{header}: value must be printable text", "invalid_header")
    return value


def header_text(value: str) -> str:
    """A ``TEXT_HEADERS`` value as a transport reads every header (its bytes, a character
    each: latin-1) made the UTF-8 text those bytes spell (curl, Go, browsers). Bytes that spell
    none are read as latin-1, as they came (Python's ``http.client``, ``urllib`` and
    ``requests`` write a text value so): the same name either way to ``/admin/invalidate``,
    whose JSON is text."""
    if value.isascii():  # (nearly every value: the same text either way)
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeDecodeError:
        return value


def header_bytes(name: str, value: str) -> bytes:
    """The bytes a client sent for header ``name``, read as ``value`` by the transport
    (``header_text`` for ``TEXT_HEADERS``, latin-1 for the others); a value no transport read
    (a library caller's text): its UTF-8. (A ``TEXT_HEADERS`` value a client sent as latin-1
    goes as the UTF-8 of the same text: the owner reads the same name.)"""
    if name not in TEXT_HEADERS:
        return http_syntax.value_bytes(value)
    return value.encode("utf-8", "surrogateescape")


def list_input(request: Request) -> tuple[str, list[Any]] | None:
    """The field that holds a list input and its items, or None when it is not a list of
    several: ``/v1/embeddings`` with a list ``input``, ``/v1/completions`` with a list ``prompt``
    (strings, or token arrays: a flat list of ints is *one* prompt)."""
    name = {"embedding": "input", "completion": "prompt"}.get(request.kind)
    value = request.body.get(name) if name else None
    if name is None or not isinstance(value, list) or len(value) < 2 or isinstance(value[0], int):
        return None
    return name, value


def list_items(request: Request) -> list[Request] | None:
    """A list input (``list_input``) split into one request per item, or None when it is not a
    list of several.

    The items of a stream are asked whole (``stream`` is not in an item's record, so a retry in
    either format finds the items done before); the caller streams the merged answer.
    """
    listed = list_input(request)
    if listed is None:
        return None
    name, value = listed
    whole = unstreamed(request.body) if request.stream else request.body
    return [
        dataclasses.replace(
            request,
            body={**whole, name: [item]},
            stream=False,
            include_usage=request.api.client_usage(whole, False),
        )
        for item in value
    ]


def merge_items(kind: str, bodies: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """The response to a list request, from the responses to its items, in order (``n``: the
    choices asked for each prompt, each item's answer holding all of them)."""
    first = bodies[0]
    # The items' usage summed, its details too (cached, reasoning tokens); none when an item has
    # none (its engine reported none: nothing made up, a part-sum is no list's figure).
    usages = [usage for body in bodies if isinstance(usage := body.get("usage"), dict)]
    merged: dict[str, Any] = {}
    if len(usages) == len(bodies):
        merged["usage"] = _summed(usages)
    elif any("usage" in body for body in bodies):
        merged["usage"] = None
    rest = {key: value for key, value in first.items() if key != "usage"}
    if kind == "embedding":
        data = [{**item, "index": i} for i, body in enumerate(bodies) for item in body["data"]]
        return {**rest, "data": data, **merged}
    # OpenAI numbers the choices of a list prompt prompt by prompt: index = prompt * n + choice.
    choices = []
    for i, body in enumerate(bodies):
        # (``n`` asked, not the choices counted: an item short of one would shift the next
        # prompt's answers onto this one's indexes; such an item is not final, never merged.)
        choices += [
            {**choice, "index": i * n + choice.get("index", 0)} for choice in body["choices"]
        ]
    return {**rest, "choices": choices, **merged}


def _summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Usage objects summed key by key: integers (not a boolean), and objects
    (``prompt_tokens_details``...) alike; a key some item lacks, or holds as null or as
    anything else, is null (a part-sum is no list's figure)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(name for usage in usages for name in usage):
        values = [usage.get(name) for usage in usages]
        if all(type(value) is int for value in values):
            out[name] = sum(values)
        elif all(isinstance(value, dict) for value in values):
            out[name] = _summed(cast(list[dict[str, Any]], values))
        else:
            out[name] = None
    return out
