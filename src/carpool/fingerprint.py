"""The request fingerprint: what makes two requests "identical", and whether they may share at all.

Contract (CONTRACT.md "Request fingerprint", "Sampling policy", "Tenants"):
- Included: endpoint, model, the full input and every field that can change the output; unknown
  fields too (a field we do not know might matter). Excluded: ``user``, ``stream``,
  ``stream_options``, ``metadata``, request ids, and all transport headers.
- Canonical: key order, number spelling (``0`` vs ``0.0``, ``1e0``) and Unicode composition (NFC)
  never change a key. Text is otherwise exact: white space is meaning (Python indentation, counted
  spaces, tabs, Markdown hard breaks, non-ASCII spaces, control characters). Only with the opt-in
  ``fingerprint.normalize_whitespace`` is the input text (message contents, prompt) trimmed and
  are runs of white space collapsed to one space, except inside ``` fenced code, in requests of
  type ``code`` and in embeddings inputs (a vector of different text is a different vector).
- Scoped: the tenant (``identity.tenant_of``: a digest of every credential header, never the raw
  value), the namespace, the freshness token, the request type (``x-carpool-type``: it picks
  what may be stored and for how long) and the query string (Azure's ``api-version``...) are part
  of the key, so no answer crosses them, cached or in flight. So is every other request header
  that reaches the upstream and might change its answer (``OpenAI-Beta``, a deployment
  selector...): all forwarded headers but the ``NEUTRAL_HEADERS`` of transport, tracing and
  client telemetry (``varying_headers``). A namespace listed in ``tenant.shared_namespaces``
  drops the tenant from the scope (``tenant`` is ``*``), but only for a tenant ``accepted`` for
  the request's grant (the upstream answered it recently for this endpoint, model and query
  string): any other is scoped to itself. ``owner`` is always the requester's tenant, which
  scopes what is never shared (idempotency records).
- Sampling: a request is shareable when its output is deterministic: ``temperature`` 0, ``top_k``
  1, or a ``seed`` (``Api.deterministic``). An absent temperature is the upstream's default, which
  samples (Anthropic's default is 1). A request whose API says it never shares
  (``Api.never_shared``: Responses' ``background`` and ``conversation``) bypasses whatever the
  controls say. Sampled requests
  get no key (``bypass``) unless the config says ``sampling: same-params`` or the request sends
  ``x-carpool-share: sampled``; then they share only with identical parameters, which the key
  already guarantees. Embeddings are always deterministic.
- The key is a 32-hex-digit BLAKE2b digest: no input can collide with another by construction of
  its text, or inject anything into a store key.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .apis.base import is_deterministic
from .config import Config, TenantConfig
from .idempotency import HEADER, HEADER_ALIAS
from .identity import ANONYMOUS_TENANT, credential_headers, tenant_of
from .request import CONTROL_HEADERS, ClientRequest, Request
from .semantic.verifier import render_context
from .upstream.base import NOT_FORWARDED

__all__ = [
    "ANONYMOUS_TENANT",
    "Fingerprint",
    "RepeatMemo",
    "SemanticView",
    "canonical_body",
    "fingerprint",
    "is_deterministic",
    "request_digest",
    "requester",
    "semantic_view",
]

EXCLUDED_FIELDS = frozenset({"user", "stream", "stream_options", "metadata", "request_id"})
# OpenAI's Responses API echoes ``metadata`` and ``user`` in its answer: there they are part of
# what is served, so part of the key.
EXCLUDED_BY_KIND = {"responses": frozenset({"stream", "stream_options"})}
# Request headers that reach the upstream but never change its answer: transport, tracing and
# client telemetry (the SDKs' ``x-stainless-*``). Any other forwarded header is in the key.
NEUTRAL_HEADERS = frozenset(
    {
        "user-agent",
        "accept",
        "traceparent",
        "tracestate",
        "baggage",
        "x-request-id",
        "request-id",
        "x-client-request-id",
        "x-correlation-id",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-forwarded-port",
        "x-real-ip",
        "forwarded",
        "via",
        "origin",
        "referer",
        "dnt",
        "pragma",
        "priority",
        "x-amzn-trace-id",
        "x-cloud-trace-context",
        "cdn-loop",
        "true-client-ip",
    }
)
NEUTRAL_PREFIXES = ("x-stainless-", "x-carpool-", "sec-", "x-b3-", "x-datadog-", "cf-")
KEY_VERSION = 2
# A request carrying one must be checked against its record first (idempotency.parse_key).
IDEMPOTENCY_HEADERS = frozenset({HEADER, HEADER_ALIAS})
_FENCE = "```"
_WHITESPACE_RUN = re.compile(r"\s+")
_INT_MIN, _INT_END = -(2**63), 2**64  # the integers orjson parses (and writes) as integers


@dataclass(slots=True, frozen=True)
class Fingerprint:
    """The sharing decision for one request: ``key`` is None when it must bypass."""

    key: str | None
    tenant: str  # the sharing scope: "*" in a shared namespace
    namespace: str
    bypass_reason: str | None = None
    owner: str = ""  # the requester's own tenant, even in a shared namespace
    # In a shared namespace, for a requester not (yet) accepted by the upstream: the key it
    # would have there. It reads nothing under it, but its answer, once the upstream accepted
    # it, is stored under it for the others.
    shared_key: str | None = None


@functools.lru_cache(maxsize=16)
def _names(header: str, others: tuple[str, ...]) -> tuple[str, ...]:
    return credential_headers(header, others)


# Per set of credential names: header names seen that never vary the key (grows to a bound).
_STEADY: dict[tuple[str, ...], set[str]] = {}


def _varies(name: str, names: tuple[str, ...]) -> bool:
    return not (
        name in NEUTRAL_HEADERS
        or name in NOT_FORWARDED
        or name in names
        or name in CONTROL_HEADERS
        or name in IDEMPOTENCY_HEADERS
        or name.startswith(NEUTRAL_PREFIXES)
    )


def varying_headers(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[Any, ...]:
    """The forwarded headers that might change the answer, besides the credentials (``names``,
    the tenant) and the controls: name and value, in a canonical order."""
    steady = _STEADY.get(names)
    if steady is None:
        steady = _STEADY.setdefault(names, set())
    rest = headers.keys() - steady  # one C-speed set difference in the common case
    if not rest:
        return ()
    found = []
    for name in rest:
        if _varies(name, names):
            found.append((name, headers[name]))
        elif len(steady) < 4096:  # names are few; a flood of made-up ones is not
            steady.add(name)
    if len(found) > 1:
        found.sort()
    return tuple(found)


def grant_of(request: Request, names: tuple[str, ...]) -> tuple[str, Any, str, tuple[Any, ...]]:
    """What an upstream may allow one key and refuse another: the endpoint, the model, the
    query string and the forwarded headers that may change the answer (a deployment, a beta
    feature) (``identity.AcceptedCredentials``). ``names``: the credential headers."""
    return (
        request.kind,
        request.body.get("model"),
        request.query,
        varying_headers(request.headers, names),
    )


def names_of(tenant: TenantConfig) -> tuple[str, ...]:
    """The lower-case credential header names that make the tenant under this config."""
    return _names(tenant.header, tuple(tenant.credential_headers))


def requester(headers: Mapping[str, str], config: Config) -> str:
    """The tenant of whoever sent ``headers`` (identity.tenant_of over the configured names)."""
    return tenant_of(headers, names_of(config.tenant))


def fingerprint(
    request: Request,
    config: Config,
    accepted: Container[tuple[str, tuple[str, Any, str, tuple[Any, ...]]]] | None = None,
) -> Fingerprint:
    """The request's key and scope. ``accepted``: the tenants the upstream has recently answered
    (``identity.AcceptedCredentials``); None trusts every tenant (offline tools: the bench
    oracle, eval-semantic), never the gateway."""
    controls = request.controls
    namespace = controls.namespace
    tenant = owner = requester(request.headers, config)
    api = request.api
    shared = (
        bool(namespace)
        and namespace in config.tenant.shared_namespaces
        and not api.tenant_bound(request.body)
    )
    if shared and (
        accepted is None or (owner, grant_of(request, names_of(config.tenant))) in accepted
    ):
        tenant, shared = "*", False
    never = api.never_shared(request.body)  # (Responses' background, conversation)
    if never is not None:
        return Fingerprint(None, tenant, namespace, never, owner)
    if not api.deterministic(request.body):
        if not (controls.share_sampled or config.sampling == "same-params"):
            return Fingerprint(None, tenant, namespace, "sampled", owner)
    canonical = canonical_body(request.kind, request.body, _collapse(request, config))
    return Fingerprint(
        _digest(request, config, tenant, namespace, canonical),
        tenant,
        namespace,
        owner=owner,
        shared_key=_digest(request, config, "*", namespace, canonical) if shared else None,
    )


def _digest(
    request: Request, config: Config, tenant: str, namespace: str, canonical: dict[str, Any]
) -> str:
    material = orjson.dumps(
        [*_scope(request, config, "answer", tenant, namespace), canonical],
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.blake2b(material, digest_size=16).hexdigest()


def _scope(request: Request, config: Config, label: str, tenant: str, namespace: str) -> list[Any]:
    """Everything besides the body that decides which answer a request may get."""
    controls = request.controls
    return [
        KEY_VERSION,
        label,
        tenant,
        namespace,
        controls.freshness,
        controls.request_type or "",
        request.query,
        request.kind,
        varying_headers(request.headers, names_of(config.tenant)),
    ]


def _collapse(request: Request, config: Config) -> bool:
    """Whether white space is collapsed: an opt-in, never for code or embeddings inputs."""
    return (
        config.fingerprint.normalize_whitespace
        and request.kind != "embedding"
        and request.controls.request_type != "code"
    )


@dataclass(slots=True, frozen=True)
class Repeat:
    """What a byte-identical repeat needs to be answered from the exact cache."""

    key: str
    stream: bool
    include_usage: bool
    max_age: float | None  # the reader's bound: Cache-Control max-age and its type's TTL
    # In a shared namespace: (requester, grant), checked against ``AcceptedCredentials`` again.
    shared_by: tuple[str, Any] | None = None


class RepeatMemo:
    """Byte-identical repeats skip parsing and the canonical form: raw request -> ``Repeat``.

    Contract:
    - The memo key is every input of ``fingerprint`` that is not configuration: the endpoint, the
      query string, the body's bytes themselves and the value of each header that
      ``parse_controls`` and ``requester`` read. Equal memo keys therefore mean equal
      fingerprints, exactly (no digest of the body, so no collision is possible), except for the
      one input that changes over time, whether the upstream accepts the requester: a repeat in
      a shared namespace carries its requester (``shared_by``) to be checked again.
    - Remembered only for a request that parsed, is shareable and may read the cache; a request
      carrying an ``Idempotency-Key`` has no memo key (its record must be consulted first).
    - Bounded by ``max_bytes``, counting each entry's body, header values and a fixed overhead
      (oldest out first); bodies over ``max_body`` bytes and header values over
      ``MAX_MEMO_HEADERS`` bytes in all are not remembered. A forgotten repeat costs one parse.
    """

    def __init__(
        self, tenant_headers: tuple[str, ...], max_bytes: int, max_body: int = 64 * 1024
    ) -> None:
        self.names = (*CONTROL_HEADERS, *tenant_headers)
        self.tenant_headers = tenant_headers
        self.max_bytes = max_bytes
        self.max_body = max_body
        self.bytes = 0
        self._memo: dict[tuple[Any, ...], Repeat] = {}

    def __len__(self) -> int:
        return len(self._memo)

    def key_of(self, client: ClientRequest) -> tuple[Any, ...] | None:
        headers = client.headers
        if (
            IDEMPOTENCY_HEADERS & headers.keys()
            or len(client.body) > self.max_body
            or not self.max_bytes
        ):
            return None
        return (
            client.path,
            client.body,
            client.query,
            varying_headers(headers, self.tenant_headers),
            *map(headers.get, self.names),
        )

    def get(self, memo_key: tuple[Any, ...]) -> Repeat | None:
        return self._memo.get(memo_key)

    def remember(
        self, memo_key: tuple[Any, ...], request: Request, key: Fingerprint, max_age: float | None
    ) -> None:
        """``max_age``: the oldest answer the request accepts (its max-age and its type's TTL)."""
        if (
            key.key is None
            or not request.controls.may_read
            or memo_key in self._memo
            or (max_age is not None and max_age <= 0)
            or key.shared_key is not None
        ):
            return  # (a requester not yet accepted: its key will change)
        # The body kept is a copy of exactly its length: one built by orjson.dumps (the library
        # API's ``Gateway.request``) has a 4 KB buffer whatever its length, which ``bytes``
        # (its len) would not count.
        memo_key = (memo_key[0], bytes(memoryview(memo_key[1])), *memo_key[2:])
        if _header_bytes(memo_key) > MAX_MEMO_HEADERS:
            return  # a large credential or cache-control: not worth its room
        self._memo[memo_key] = Repeat(
            key.key,
            request.stream,
            request.include_usage,
            max_age,
            (key.owner, grant_of(request, self.tenant_headers)) if key.tenant == "*" else None,
        )
        self.bytes += _size(memo_key)
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._memo))
            del self._memo[oldest]
            self.bytes -= _size(oldest)


MAX_MEMO_HEADERS = 4096
_ENTRY_OVERHEAD = 400  # the key tuple, the Repeat and the dict slot, roughly (bytes)


def _header_bytes(memo_key: tuple[Any, ...]) -> int:
    return sum(len(value) for value in memo_key[4:] if value) + sum(
        len(name) + len(value) for name, value in memo_key[3]
    )


def _size(memo_key: tuple[Any, ...]) -> int:
    return _ENTRY_OVERHEAD + len(memo_key[1]) + len(memo_key[2]) + _header_bytes(memo_key)


def request_digest(request: Request, key: Fingerprint, config: Config) -> str:
    """What identifies a request for its idempotency record: its canonical body in its scope.

    Unlike ``Fingerprint.key`` it exists for sampled requests too: a retry of a sampled request
    must not run twice either.
    """
    # The requester's own scope (``owner``), not the sharing scope: the same request must map
    # to the same record whether or not the upstream has accepted its key meanwhile.
    material = orjson.dumps(
        [
            *_scope(request, config, "request", key.owner, key.namespace),
            canonical_body(request.kind, request.body, _collapse(request, config)),
        ],
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.blake2b(material, digest_size=16).hexdigest()


@dataclass(slots=True, frozen=True)
class SemanticView:
    """What the semantic cache compares: ``text`` by meaning, everything else by ``scope``."""

    scope: str  # digest of tenant, namespace, freshness and the body minus text, context
    text: str  # the last user turn (chat) or the prompt (completions), normalised
    context: str = ""  # a conversation's earlier turns (``render_context``), compared by meaning


def semantic_view(request: Request, key: Fingerprint, config: Config) -> SemanticView | None:
    """Split a shareable request into its scope and the text compared by meaning, if it has one.

    The last user turn is compared by meaning (each API's ``semantic_split``: chat and
    Messages' last user message, a completion's prompt, Responses' last user input), and so are a
    conversation's earlier turns (``context``: :func:`conversation`), so a reworded context or
    small talk can still hit while "cancel it" in a chat about a gym never matches "cancel it" in
    a chat about a phone plan (the guard reads both). The model, every parameter and the system
    prompt (instructions) must be identical: they are in the scope. Embeddings requests,
    multimodal last turns and list prompts have no semantic view; nor has a text (or context)
    with a letter of a script the model does not read (``semantic.scripts``): it is matched
    exactly, never guessed at.
    """
    if key.key is None:
        return None
    split = request.api.semantic_split(request.body)
    if split is None:
        return None
    text, rest = split
    context, rest = conversation(rest)
    if not (readable(text, config.semantic.scripts) and readable(context, config.semantic.scripts)):
        return None
    collapse = _collapse(request, config)
    material = orjson.dumps(
        [
            *_scope(request, config, "semantic", key.tenant, key.namespace),
            canonical_body(request.kind, rest, collapse),
        ],
        option=orjson.OPT_SORT_KEYS,
    )
    return SemanticView(
        hashlib.blake2b(material, digest_size=16).hexdigest(),
        normalize_text(text, collapse),
        normalize_text(context, collapse),
    )


#: Roles whose messages are instructions, matched exactly (in the scope), never by meaning.
INSTRUCTION_ROLES = frozenset({"system", "developer"})


def conversation(rest: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A chat body's earlier turns as one text (``verifier.render_context``), and the body
    without them: its instructions and the last turn's other fields stay in the scope.

    Only plain turns move out of the scope: a role and a text content, nothing else. A turn with
    tool calls, a name or non-text content, or an instruction after the first turn, keeps the
    whole conversation exact ("", ``rest``): when unsure, don't share.
    """
    messages = rest.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return "", rest
    *earlier, last = messages
    lead = 0  # the instructions before the first turn
    while (
        lead < len(earlier)
        and isinstance(earlier[lead], dict)
        and earlier[lead].get("role") in INSTRUCTION_ROLES
    ):
        lead += 1
    instructions, turns = earlier[:lead], earlier[lead:]
    if not turns or not all(
        isinstance(m, dict)
        and set(m) <= {"role", "content"}
        and m.get("role") not in INSTRUCTION_ROLES
        and isinstance(m.get("content"), str)
        for m in turns
    ):
        return "", rest
    return render_context(turns), {**rest, "messages": [*instructions, last]}


def readable(text: str, scripts: list[str]) -> bool:
    """Whether every letter of ``text`` is of one of ``scripts`` (``*``: any)."""
    if text.isascii() or "*" in scripts:
        return True
    allowed = frozenset(name.upper() for name in scripts)
    return all(_script(ch) in allowed for ch in set(text) if ch.isalpha())


@functools.lru_cache(maxsize=4096)
def _script(ch: str) -> str:
    """A letter's script, from its Unicode name: "LATIN SMALL LETTER E WITH ACUTE" -> LATIN."""
    name = unicodedata.name(ch, "")
    if name.startswith(("CJK ", "KANGXI")):
        return "HAN"
    if name.startswith(("FULLWIDTH LATIN", "MODIFIER LETTER SMALL")):
        return "LATIN"
    return name.split(" ", 1)[0]


def canonical_body(kind: str, body: Mapping[str, Any], collapse: bool) -> dict[str, Any]:
    """The body with excluded fields dropped, numbers and text in canonical form."""
    out: dict[str, Any] = {}
    excluded = EXCLUDED_BY_KIND.get(kind, EXCLUDED_FIELDS)
    for name, value in body.items():
        if name in excluded:
            continue
        if name == "messages" and isinstance(value, list):
            out[name] = [_canonical_message(m, collapse) for m in value]
        elif name in ("prompt", "input"):
            out[name] = _canonical_text_field(value, collapse)
        else:
            out[name] = _canonical(value)
    return out


def _canonical_message(message: Any, collapse: bool) -> Any:
    if not isinstance(message, dict):
        return _canonical(message)
    out: dict[str, Any] = {}
    for name, value in message.items():
        if name == "content":
            if isinstance(value, str):
                out[name] = normalize_text(value, collapse)
            elif isinstance(value, list):
                out[name] = [_canonical_part(part, collapse) for part in value]
            else:
                out[name] = _canonical(value)
        else:
            out[name] = _canonical(value)
    return out


def _canonical_part(part: Any, collapse: bool) -> Any:
    # {"type": "text", "text": "..."}: the text is input text; images etc. are kept exactly.
    if isinstance(part, dict) and isinstance(part.get("text"), str):
        return {**_canonical(part), "text": normalize_text(part["text"], collapse)}
    return _canonical(part)


def _canonical_text_field(value: Any, collapse: bool) -> Any:
    if isinstance(value, str):
        return normalize_text(value, collapse)
    if isinstance(value, list):
        return [normalize_text(v, collapse) if isinstance(v, str) else _canonical(v) for v in value]
    return _canonical(value)


def normalize_text(text: str, collapse: bool) -> str:
    """NFC, and (with ``collapse``) trimmed with white-space runs as one space outside ``` fences."""
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    if not collapse:
        return text
    if _FENCE not in text:
        if text.isascii():
            text = text.strip()
            if not _needs_collapse(text):
                return text  # the common case: no inner runs to collapse
        return " ".join(text.split())
    # Even-numbered pieces are prose, odd-numbered ones are inside a fence and kept verbatim.
    pieces = text.split(_FENCE)
    return _FENCE.join(
        piece if i % 2 else _WHITESPACE_RUN.sub(" ", piece) for i, piece in enumerate(pieces)
    ).strip()


def _needs_collapse(text: str) -> bool:
    """For stripped ASCII text: is there any inner white space other than single spaces?"""
    # A handful of C-speed substring scans is ~4x faster than split/join on a 600-char prompt.
    return (
        "  " in text
        or "\n" in text
        or "\t" in text
        or "\r" in text
        or "\x0b" in text
        or "\x0c" in text
        or "\x1c" in text
        or "\x1d" in text
        or "\x1e" in text
        or "\x1f" in text
    )


def _canonical(value: Any) -> Any:
    if isinstance(value, str):
        return value if value.isascii() else unicodedata.normalize("NFC", value)
    if isinstance(value, float):
        # 0 and 0.0 (and 1e0) are the same number; keep integral floats as ints in the key,
        # over the whole range the parser reads as integers (i64 and u64; past it, every
        # spelling is parsed as the same double), so 2**60 and 1152921504606846976.0 are one.
        return int(value) if value.is_integer() and _INT_MIN <= value < _INT_END else value
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value
