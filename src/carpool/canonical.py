"""The canonical form of a request, which its keys digest: its body and its scope.

Contract (the fingerprint's, :mod:`carpool.fingerprint`: what is in a key, how it is spelled):
- Included: endpoint, model, the full input and every field that can change the output; unknown
  fields too (a field we do not know might matter). Excluded: ``user``, ``stream``,
  ``stream_options.include_usage`` (but beside ``continuous_usage_stats``), ``metadata``,
  request ids, and all transport headers. Every other stream option is in (vLLM's
  ``continuous_usage_stats`` puts a usage in every chunk beside ``include_usage``, OpenAI's
  ``include_obfuscation`` pads them: frames a client that did not ask was replayed).
  Without ``"stream": true`` the stream options are in whole (the engines refuse them there;
  null or ``{}`` out).
  Per API (``EXCLUDED_BY_KIND``): Responses keeps ``user``, ``metadata``, ``safety_identifier``
  and ``prompt_cache_key`` in (its answer echoes them); Messages leaves out only ``stream`` and
  a ``metadata`` of at most a ``user_id`` (Anthropic refuses any field it does not know, so
  every other one is in: a request refused alone is never served another's answer).
- Canonical: key order and number spelling (``0`` vs ``0.0``, ``1e0``) never change a key: a
  number is keyed by its value, an integer past 64 bits too (read as its digits by
  ``exact_json``, never as the float it rounds to: two such integers, or one and that float, are
  two requests). Nor does the Unicode composition (NFC) of the input text: a message's content
  (a string, its text parts, the text and content nested in them), a prompt, a Responses
  ``input`` (its items' text and content: ``INPUT_TEXT``), a Messages ``system``. Every other
  string is exact: a stop sequence, a guided choice, a regex or a grammar is matched against the
  tokens the engine writes, an image or file URL fetched by its bytes, a tool call's arguments
  rendered as sent; two spellings there are two requests. Text is otherwise exact: white space
  is meaning (Python indentation, counted spaces, tabs, Markdown hard breaks, non-ASCII spaces,
  control characters). Only with the opt-in ``fingerprint.normalize_whitespace`` is the input
  text (message contents, prompt) trimmed and are runs of white space collapsed to one space,
  except inside ``` fenced code, in requests of type ``code`` and in embeddings inputs (a vector
  of different text is a different vector).
- A prompt the answer repeats is keyed exactly as sent, neither NFC nor collapsed: with
  ``echo``, vLLM's ``prompt_logprobs``, ``return_token_ids`` or Responses
  ``enable_response_messages`` (``apis.openai.echoes_prompt``), the input text is exact; a
  Responses ``instructions``, which every Responses answer repeats, always is. Folded, one
  spelling was served the other's text back, word for word, as its own. One with ``echo`` has
  ``stream`` in its key too: engines repeat the prompt in a whole answer and not always in a
  stream (llama-cpp-python's server), so a stream's answer is no JSON client's; so has one
  with ``prompt_logprobs`` (vLLM refuses it streamed, and sends it only in a whole answer).
- Two exceptions, where what looks the same is not to the engine: the fields that carry a JSON
  schema, a tool's definition or a chat template's arguments (``ORDERED_FIELDS``), and the
  ``input`` of a Messages ``tool_use`` block, keep their key order, their strings exact and
  their numbers as written,
  an int apart from a float (OpenAI's structured outputs write an object's keys in the schema's
  order, and an ``enum`` value as written; chat templates render tools and tool calls as given,
  ``"minimum": 1`` apart from ``"minimum": 1.0``), and embeddings inputs are
  exact, not NFC (an embedding is of the code points as sent: the Ohm sign and Omega, ``e`` +
  U+0301 and ``é``, tokenize apart). An ordered value is in the key as its JSON text (a number
  as the double or integer parsed: ``1.0`` and ``1e0`` one, ``1`` another, an integer past 64
  bits its digits), which nests no deeper than the body: any depth ``limits.max_json_depth``
  lets in.
- The scope (``scope``) is everything besides the body that decides which answer a request may
  get: the key version, a label (one per kind of key: ``answer``, ``request``, ``semantic``), the
  tenant, the namespace, the freshness token, the request type, the tags (but for ``request``:
  what an answer is invalidated by), the query string, the endpoint
  and the forwarded headers that might change the answer (``varying_headers``: all but the
  credentials, the controls, the idempotency key, those the request's ``Connection`` names, the
  ``NEUTRAL_HEADERS``/``NEUTRAL_PREFIXES`` of transport, tracing, client telemetry and what
  hosting platforms, CDNs and load balancers add to every request (a request id, a queue time,
  the client's address and geography: Heroku, Fly.io, Render, Vercel, CloudFront, Azure, App
  Engine...), and those the operator names in ``fingerprint.neutral_headers``; of a ``Cookie``,
  the cookies infrastructure sets: ``identity.user_cookies``). A neutral header
  only does not split the cache: the tenant is made of the credential headers whatever it says,
  so no header that may carry a credential, or pick a deployment, model or feature, is neutral.
  ``grant_of``, the repeat memo and the embeddings batcher's groups leave out the same ones.
  Last, what the instance's config changes in the answer or in who may get it, each only when
  set (the keys of a config with none stay): that the gateway holds the upstream's credential
  (``Config.holds_upstream_credentials``: that one is held, not which, so rotating it keeps
  every key), that it collapses this request's white space (``collapses``), and the
  names of ``fingerprint.neutral_headers``. Instances sharing one Redis whose configs differ in
  them (a rolling change) share none of those keys, answers, calls, semantic scopes nor
  idempotency records (a retry there is a 422 until the change is done): otherwise a client
  of one got another's answer its own request would not have (the held key's to a client the
  upstream refuses; "hi  there"'s to "hi there"; one made with a header left out to a
  request without it).
  ``digest`` is the 32-hex-digit BLAKE2b digest of a scope and a canonical body: the one form
  every key takes.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from typing import Any

import orjson

from .apis.openai import echoes_prompt
from .config import Config, FingerprintConfig, TenantConfig
from .exact_json import INT_END, INT_MIN, big_int
from .idempotency import HEADER, HEADER_ALIAS
from .identity import credential_headers, tenant_of, user_cookies
from .request import CONTROL_HEADERS, Request
from .unicode_forms import normal_form
from .upstream.base import NOT_FORWARDED, connection_listed

# (``safety_identifier`` and ``prompt_cache_key`` are OpenAI's successors of ``user`` for abuse
# tracking and its prompt cache's routing, ``prompt_cache_retention`` how long that cache keeps
# the prompt: none changes the answer, and a chat or completion does not echo them.)
EXCLUDED_FIELDS = frozenset(
    {
        "user",
        "stream",
        "stream_options",
        "metadata",
        "request_id",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)
# ``metadata`` is in the key of a request that asks the upstream to store its answer
# (``store: true``): the stored object keeps it, and listing stored objects filters by it.
# OpenAI's Responses API echoes ``metadata``, ``user``, ``safety_identifier`` and
# ``prompt_cache_key`` in its answer: there they are part of what is served, so part of the key.
# Anthropic's Messages API refuses every field it does not know (400, "Extra inputs are not
# permitted"): OpenAI's ``user``, ``safety_identifier``, ``stream_options``... are in its key, so
# that a request refused on its own is never served the answer to one without them. Its
# ``metadata`` is out only as Anthropic takes it, its ``user_id`` alone (``_neutral_metadata``).
EXCLUDED_BY_KIND = {
    "responses": frozenset({"stream", "stream_options"}),
    "messages": frozenset({"stream"}),
}
# Request headers that reach the upstream but never change its answer: transport, tracing and
# client telemetry (the SDKs' ``x-stainless-*``), the ids and attempt numbers other SDKs give
# each try of a request (Azure's, AWS's): a retry under an Idempotency-Key is the same request;
# and what hosting platforms, CDNs and load balancers add to every request they forward (a
# request id, a queue time, the client's address and port, its geography), which would make
# every request behind them a new key. Only headers the platform documents as such are named;
# never one that may carry a credential or pick a deployment, model or feature. Any other
# forwarded header is in the key, unless the operator names it in
# ``fingerprint.neutral_headers`` (its own proxy's: ``neutral_of``).
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
        "x-ms-client-request-id",
        "amz-sdk-invocation-id",
        "amz-sdk-request",
        "x-amz-sdk-invocation-id",
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
        # Tracing that other agents add, a new value each attempt (Sentry, Jaeger, New Relic,
        # SkyWalking, Zipkin's single header, Elastic APM, gRPC, Envoy's request id).
        "sentry-trace",
        "uber-trace-id",
        "newrelic",
        "sw8",
        "sw8-correlation",
        "sw8-x",
        "b3",
        "elastic-apm-traceparent",
        "grpc-trace-bin",
        "x-ot-span-context",
        "x-client-trace-id",
        # Cloudflare's tracing and geography, by name: its ``cf-`` headers are not all neutral
        # (``cf-aig-authorization``, ``cf-access-client-secret`` are credentials).
        "cf-ray",
        "cf-connecting-ip",
        "cf-connecting-ipv6",
        "cf-ipcountry",
        "cf-visitor",
        "cf-worker",
        "cf-ew-via",
        "cf-ipcity",
        "cf-ipcontinent",
        "cf-iplatitude",
        "cf-iplongitude",
        "cf-region",
        "cf-region-code",
        "cf-metro-code",
        "cf-postal-code",
        "cf-timezone",
        # The time a request reached the front of the platform (Heroku's router, nginx set up
        # for New Relic's queue time, in microseconds or milliseconds: new every request), and
        # Heroku's routers' own timing, queue and request id headers.
        "x-request-start",
        "x-queue-start",
        "connect-time",
        "total-route-time",
        "x-heroku-queue-wait-time",
        "x-heroku-queue-depth",
        "x-heroku-dynos-in-use",
        "heroku-request-id",
        # Proxies' and platforms' client address, port and scheme headers, beside
        # X-Forwarded-For (Azure App Service's X-Client-IP and X-Client-Port, Rackspace's, the
        # address ingress-nginx found before its own X-Forwarded-For, Apache's and Traefik's
        # proxy host name: one per proxy replica).
        "x-client-ip",
        "x-client-port",
        "x-cluster-client-ip",
        "x-original-forwarded-for",
        "x-forwarded-server",
        "x-forwarded-ssl",
        "x-forwarded-scheme",
        "x-scheme",
        # Fly.io's proxy: its request id, the client's address and port, the edge region.
        "fly-request-id",
        "fly-client-ip",
        "fly-forwarded-port",
        "fly-region",
        # Render's request id; Railway's and its edge; Netlify's, the client's address and its
        # geography; DigitalOcean App Platform's client address.
        "rndr-id",
        "x-railway-request-id",
        "x-railway-edge",
        "x-nf-request-id",
        "x-nf-client-connection-ip",
        "x-nf-geo",
        "do-connecting-ip",
        # Vercel's request id (the regions it went through) and client address; its geography
        # is ``x-vercel-ip-*`` (NEUTRAL_PREFIXES). Not ``x-vercel-`` as a family: it has the
        # deployment's URL, an OIDC token and a proxy signature.
        "x-vercel-id",
        "x-vercel-forwarded-for",
        # CloudFront's request id, scheme and device type (from the User-Agent); the viewer's
        # address, geography and TLS are ``cloudfront-viewer-*`` (NEUTRAL_PREFIXES).
        "x-amz-cf-id",
        "cloudfront-forwarded-proto",
        "cloudfront-is-desktop-viewer",
        "cloudfront-is-mobile-viewer",
        "cloudfront-is-tablet-viewer",
        "cloudfront-is-smarttv-viewer",
        "cloudfront-is-ios-viewer",
        "cloudfront-is-android-viewer",
        # Azure: Front Door's request reference, client and socket addresses and loop count
        # (not X-Azure-FDID, which an origin checks to accept only its own Front Door),
        # Application Gateway's trace id, App Service's (ARR) log id (not X-ARR-ClientCert,
        # the client's certificate).
        "x-azure-ref",
        "x-azure-clientip",
        "x-azure-socketip",
        "x-azure-requestchain",
        "x-appgw-trace-id",
        "x-arr-log-id",
        # Google App Engine's geography, client address, scheme and request ids (not
        # ``x-appengine-`` as a family: its user, cron, task and inbound-app headers are who
        # is calling, its API ticket a credential).
        "x-appengine-country",
        "x-appengine-region",
        "x-appengine-city",
        "x-appengine-citylatlong",
        "x-appengine-user-ip",
        "x-appengine-https",
        "x-appengine-request-log-id",
        "x-appengine-request-id-hash",
        # Fastly's client address and the chain of its nodes a request went through (loop
        # detection, as CDN-Loop: one per node); Akamai's hop count and EdgeScape geography.
        "fastly-client-ip",
        "fastly-ff",
        "akamai-origin-hop",
        "x-akamai-edgescape",
        # Not X-Forwarded-Client-Cert (Envoy, Istio): the identity of the client's certificate,
        # the same for every request of one client (so it splits the cache per client, never
        # per request), and an upstream or a filter behind carpool may authorize by it, while
        # the tenant is made of the credential headers only: neutral, it would let a client
        # the upstream refuses read what one it accepts was answered. Nor the request's target
        # before a rewrite (X-Original-URI, X-Original-URL): the same for the same request,
        # and its query may hold a key. An operator whose upstream reads neither may name them
        # in ``fingerprint.neutral_headers``.
    }
)
# Prefixes of header families that are telemetry only; a family that may also carry a
# credential is never named here by its prefix. (CloudFront's ``cloudfront-viewer-*``: the
# viewer's address, geography, TLS and header order; Vercel's ``x-vercel-ip-*``: geography.)
NEUTRAL_PREFIXES = (
    "x-stainless-",
    "x-carpool-",
    "sec-",
    "x-b3-",
    "x-datadog-",
    "x-envoy-",
    "cloudfront-viewer-",
    "x-vercel-ip-",
)
# (Not moved on when ``ORDERED_FIELDS``, exact embeddings inputs, exact strings outside the
# input text and integral floats kept in ordered fields came: an ordered field's objects are
# written in a form no key had before (but as a string value of that field: hence
# ``ORDERED_VERSION``, below), and a string in NFC, or an ordered field with no
# integral float, keeps the key it had, whose answer, if a canonically equivalent request's,
# goes with its TTL: but not while older instances keep writing it, in a rolling upgrade, hence
# ``ANSWER_EPOCH``. Every other key stays, and with it the cache. Nor when integers past 64
# bits came to be keyed by their digits: only a request holding one, or an integral float past
# 64 bits, has a new key; every other keeps its own.)
KEY_VERSION = 2
# A request that holds an ordered field (``ORDERED_FIELDS``) is keyed under version 3: an
# ordered value is in the key as its JSON text, a string, and before a field was ordered a
# string value of it was in the key as that string; an older instance's key for the string
# (``"tools": "[...]"``) was a newer one's for the object, on one Redis the answer to the
# other request. Every other request keeps its key.
ORDERED_VERSION = 3
# The answer and semantic keys (every key but an idempotency record's request digest) carry an
# epoch too, moved by a release that keys apart requests an earlier release keyed together:
# during a rolling upgrade the older instances keep writing the merged key, whose answer a
# newer one would serve to the request it keys apart (a Messages request without an Origin
# was served the 401 a browser's got; an answer repeating its prompt, one spelling's, the
# other's; a stored completion, another's metadata). So a release of another epoch shares no
# answer, call or semantic entry with this one; the request digests keep their version, so
# an Idempotency-Key's retry is replayed across it (a 422 only for a request keyed otherwise
# now). Epoch 1: Messages' Origin, exact strings beside NFC input text, ``store`` keyed with
# its ``metadata``. Epoch 2: vLLM's ``return_prompt_text`` and SGLang's
# ``return_prompt_token_ids`` keyed by the prompt as sent, ``prompt_logprobs`` with ``stream``,
# stream options without a stream, ``include_usage`` beside ``continuous_usage_stats``.
ANSWER_EPOCH = 2
# Body fields that carry a JSON schema or a tool's definition (OpenAI's response_format and
# tools, the legacy functions, the Responses API's text.format, vLLM's guided_json and
# structured_outputs, llama.cpp's and SGLang's json_schema, Ollama's format, TGI's grammar,
# Anthropic's output_format and output_config), and the values a chat template renders into the
# prompt as given (vLLM's, SGLang's and llama.cpp's chat_template_kwargs, vLLM's documents: a
# thinking budget of 512 and of 512.0 are two prompts): the answer follows their key order
# (structured outputs write the keys of an object in the schema's order; chat templates render
# tools as given), so two orders are two requests.
ORDERED_FIELDS = frozenset(
    {
        "response_format",
        "tools",
        "functions",
        "text",
        "guided_json",
        "structured_outputs",
        "json_schema",
        "format",
        "grammar",
        "output_format",
        "output_config",
        "chat_template_kwargs",
        "documents",
    }
)
# The fields of the input text besides ``messages``, ``prompt`` and ``input`` (per API), and the
# members of an input item or a content part that hold its text (``_input_text``): NFC there,
# exact everywhere else. Not a Responses request's ``instructions``: every Responses answer
# repeats them, so they are keyed exactly as sent (``canonical_body``).
_INSTRUCTION_FIELDS = {"messages": "system"}
INPUT_TEXT = frozenset({"text", "content"})
# The Messages content blocks whose ``input`` is a tool call's arguments as an object (chat and
# Responses send them as a string, compared exactly): rendered by the template as given.
_TOOL_CALL_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
# A request carrying one must be checked against its record first (idempotency.parse_key).
IDEMPOTENCY_HEADERS = frozenset({HEADER, HEADER_ALIAS})
_FENCE = "```"
_WHITESPACE_RUN = re.compile(r"\s+")


@functools.lru_cache(maxsize=16)
def _names(header: str, others: tuple[str, ...]) -> tuple[str, ...]:
    return credential_headers(header, others)


# Per set of credential names and of configured neutral names: header names seen that never
# vary the key (grows to a bound).
_STEADY: dict[tuple[tuple[str, ...], frozenset[str]], set[str]] = {}


@functools.lru_cache(maxsize=16)
def _neutral(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(name.lower() for name in names)


def neutral_of(fingerprint: FingerprintConfig) -> frozenset[str]:
    """The lower-case names of ``fingerprint.neutral_headers``: the operator's own neutral
    headers, left out of every key beside ``NEUTRAL_HEADERS`` (``varying_headers``)."""
    return _neutral(tuple(fingerprint.neutral_headers))


def _varies(name: str, names: tuple[str, ...], neutral: frozenset[str]) -> bool:
    return not (
        name in NEUTRAL_HEADERS
        or name in NOT_FORWARDED
        or name in names
        or name in CONTROL_HEADERS
        or name in IDEMPOTENCY_HEADERS
        or name in neutral
        or name.startswith(NEUTRAL_PREFIXES)
    )


def varying_headers(
    headers: Mapping[str, str], names: tuple[str, ...], neutral: frozenset[str]
) -> tuple[Any, ...]:
    """The forwarded headers that might change the answer, besides the credentials (``names``,
    the tenant), the controls and the neutral ones (``NEUTRAL_HEADERS``, ``NEUTRAL_PREFIXES``
    and ``neutral``, the configured ``neutral_of``): name and value, in a canonical order."""
    steady = _STEADY.get((names, neutral))
    if steady is None:
        steady = _STEADY.setdefault((names, neutral), set())
    rest = headers.keys() - steady  # one C-speed set difference in the common case
    if not rest:
        return ()
    # Named by this request's ``Connection``: not forwarded, so the upstream's answer cannot
    # depend on them; hop-by-hop for this request only, so not ``steady`` either.
    listed = connection_listed(headers)
    found = []
    for name in rest:
        if name in listed:
            continue
        if _varies(name, names, neutral):
            value = headers[name]
            if name == "cookie":
                # Infrastructure's cookies are neutral: a load balancer's affinity (AWS ALB
                # re-issues its own on every response: a client with a cookie jar would never
                # meet its own answers, nor its retry its first try), analytics.
                value = user_cookies(value)
                if not value:
                    continue
            found.append((name, value))
        elif len(steady) < 4096:  # names are few; a flood of made-up ones is not
            steady.add(name)
    if len(found) > 1:
        found.sort()
    return tuple(found)


def grant_of(
    request: Request, names: tuple[str, ...], neutral: frozenset[str]
) -> tuple[str, Any, str, tuple[Any, ...]]:
    """What an upstream may allow one key and refuse another: the endpoint, the model, the
    query string and the forwarded headers that may change the answer (a deployment, a beta
    feature) (``identity.AcceptedCredentials``). ``names``: the credential headers;
    ``neutral``: the configured neutral ones (``neutral_of``)."""
    return (
        request.kind,
        request.body.get("model"),
        request.query,
        varying_headers(request.headers, names, neutral),
    )


def names_of(tenant: TenantConfig) -> tuple[str, ...]:
    """The lower-case credential header names that make the tenant under this config."""
    return _names(tenant.header, tuple(tenant.credential_headers))


def requester(headers: Mapping[str, str], config: Config) -> str:
    """The tenant of whoever sent ``headers`` (identity.tenant_of over the configured names)."""
    return tenant_of(headers, names_of(config.tenant))


def digest(
    request: Request,
    config: Config,
    label: str,
    tenant: str,
    namespace: str,
    canonical: dict[str, Any],
) -> str:
    """The key (32 hex digits) of ``canonical``, a canonical body, in the request's scope."""
    material = orjson.dumps(
        [*scope(request, config, label, tenant, namespace), canonical],
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.blake2b(material, digest_size=16).hexdigest()


def scope(request: Request, config: Config, label: str, tenant: str, namespace: str) -> list[Any]:
    """Everything besides the body that decides which answer a request may get."""
    controls = request.controls
    version = KEY_VERSION if ORDERED_FIELDS.isdisjoint(request.body) else ORDERED_VERSION
    scoped: list[Any] = [
        version if label == "request" else (version, ANSWER_EPOCH),
        label,
        tenant,
        namespace,
        controls.freshness,
        controls.request_type or "",
        request.query,
        request.kind,
        varying_headers(request.headers, names_of(config.tenant), neutral_of(config.fingerprint)),
    ]
    if request.kind == "messages" and "origin" in request.headers:
        # Anthropic refuses a request carrying Origin (a browser's) without its opt-in header
        # (``anthropic-dangerous-direct-browser-access``, keyed) with a 401: one with an Origin
        # is not one without. Its presence, not its value (a neutral header elsewhere).
        scoped.append("origin")
    if controls.tags and label != "request":
        # An answer is stored with its request's tags, to be dropped by invalidating any of
        # them: a request tagged otherwise reading it (or joining its call) would keep serving
        # it past an invalidation of its own tags. (Appended only when there are tags: the keys
        # of untagged requests stay; an idempotency record is the request's, whatever its tags.)
        scoped.append(sorted(controls.tags))
    configured = _configured(request, config)
    if configured:
        # Appended only when some setting is on (a dict: never taken for the tags' list), so
        # that the keys of a config with none of them stay what they were.
        scoped.append(configured)
    return scoped


def _configured(request: Request, config: Config) -> dict[str, Any]:
    """What this instance's config changes in the answer a request gets, or in whether its
    client may get it: instances sharing one Redis whose configs differ in it (a rolling
    change) share none of those keys, each answering only as its own config would."""
    configured: dict[str, Any] = {}
    if config.holds_upstream_credentials():
        # Called with the gateway's credential, a request is answered whatever its client
        # presents; passed through, only if the upstream accepts the client's own. Only that
        # one is held is marked, not which key (no digest of it): rotating the held key must
        # not empty the cache.
        configured["held"] = True
    if collapses(request, config):
        # "hi  there" went upstream as sent, keyed as "hi there": for an instance that keeps
        # white space that answer is another prompt's.
        configured["collapsed"] = True
    neutral = neutral_of(config.fingerprint)
    if neutral:
        # Left out of this key, these headers may have changed the answer: an instance keying
        # them must not take it for the answer to a request without them.
        configured["neutral"] = _sorted(neutral)
    return configured


@functools.lru_cache(maxsize=16)
def _sorted(names: frozenset[str]) -> tuple[str, ...]:
    return tuple(sorted(names))


def collapses(request: Request, config: Config) -> bool:
    """Whether white space is collapsed: an opt-in, never for code or embeddings inputs."""
    return (
        config.fingerprint.normalize_whitespace
        and request.kind != "embedding"
        and request.controls.request_type != "code"
    )


def canonical_body(kind: str, body: Mapping[str, Any], collapse: bool) -> dict[str, Any]:
    """The body with excluded fields dropped, numbers and text in canonical form."""
    out: dict[str, Any] = {}
    excluded = EXCLUDED_BY_KIND.get(kind, EXCLUDED_FIELDS)
    # An answer that carries its prompt (echo, the prompt's tokens or logprobs, vLLM's
    # Responses ``input_messages``) is keyed by the prompt exactly as sent: folded (NFC, white
    # space), one spelling was served the other's text back as its own.
    exact = echoes_prompt(body) or body.get("enable_response_messages") not in (None, False)
    for name, value in body.items():
        if name == "stream_options" and "stream_options" in excluded:
            if body.get("stream") is not True:
                # Without a stream, the engines refuse stream options (vLLM and OpenAI: a
                # 400): that request is keyed with them, never served a plain request's stored
                # 200. (Null or {}, vLLM takes: out.) Marked unstreamed: a stream's options,
                # keyed otherwise, may come out the same (a review: a stream was served a JSON
                # request's answer).
                if value:
                    out[name] = _canonical(value)
                    out["stream"] = False
            elif isinstance(value, dict):
                # (include_usage decides only whether the client is sent the usage chunk, which
                # the gateway asks for anyway and hides from those that did not: outside the
                # key)
                options = {k: v for k, v in value.items() if k != "include_usage"}
                if options.get("continuous_usage_stats") not in (None, False):
                    # (Beside it, include_usage puts a usage in every chunk, which the gateway
                    # does not hide: in the key. A review: the first client's shape was served
                    # the next.)
                    options["include_usage"] = value.get("include_usage") is True
                if options:
                    out[name] = _canonical(options)
            continue
        if (name in excluded and not (name == "metadata" and body.get("store") is True)) or (
            name == "metadata" and kind == "messages" and _neutral_metadata(value)
        ):
            # (A chat stored upstream, ``store: true``, keeps its metadata there: the stored
            # objects are listed and filtered by it, so it is what the request makes.)
            continue
        if exact and name in ("messages", "prompt", "input", "system", "instructions"):
            out[name] = _canonical(value)  # (strings exact, numbers canonical)
        elif name == "messages" and isinstance(value, list):
            out[name] = [_canonical_message(m, collapse) for m in value]
        elif name == "input" and kind == "embedding":
            out[name] = _exact_input(value)
        elif name in ("prompt", "input"):
            out[name] = _canonical_text_field(value, collapse)
        elif name == _INSTRUCTION_FIELDS.get(kind):
            out[name] = _input_text(value)
        elif name in ORDERED_FIELDS:
            out[name] = _ordered(value)
        else:
            out[name] = _canonical(value)
    if (
        body.get("echo") not in (None, False) or body.get("prompt_logprobs") is not None
    ) and "stream" in excluded:
        # Engines repeat the prompt in a whole answer and not always in a stream
        # (llama-cpp-python's server: ``echo`` only in the whole one): the answer assembled
        # from a stream was served to, and joined by, the request's JSON clients without its
        # prompt. vLLM refuses ``prompt_logprobs`` with a stream (but 0), and only its whole
        # answer carries them: a stream was served the JSON answer's hit, or refused on a miss.
        # (vLLM's ``return_token_ids`` streams the prompt's ids in its first chunk: one answer.)
        out["stream"] = body.get("stream") is True
    return out


def _neutral_metadata(value: Any) -> bool:
    """A Messages ``metadata`` as Anthropic takes it: at most its ``user_id`` (text or null),
    which tags the request for abuse tracking and never changes the answer. Any other field is
    one Anthropic refuses: in the key."""
    return (
        isinstance(value, dict)
        and value.keys() <= {"user_id"}
        and (value.get("user_id") is None or isinstance(value["user_id"], str))
    )


def _exact_input(value: Any) -> Any:
    """An embeddings input: its text exactly as sent (an embedding is of the code points sent:
    no NFC, which folds distinct characters, the Ohm sign into Omega), numbers canonical."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [v if isinstance(v, str) else _canonical(v) for v in value]
    return _canonical(value)


def _ordered(value: Any) -> str:
    """An ``ORDERED_FIELDS`` value in the key: its JSON text, every object's keys in their
    order (the digest sorts keys only of what is not text), strings exact, numbers as parsed:
    an int apart from a float (a schema or a tool is rendered as text, ``tojson`` writes
    ``1.0`` for a float and ``1`` for an int: two prompts), a float in its one shortest
    spelling (``1.0`` and ``1e0`` are one). (Each object written as a list of its pairs
    instead nested three levels for one and failed the digest past ~85 levels: a 500.)"""
    return orjson.dumps(value).decode()


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
    if isinstance(part, dict) and part.get("type") in _TOOL_CALL_BLOCKS and "input" in part:
        return {**_canonical(part), "input": _ordered(part["input"])}
    return _input_text(part)


def _canonical_text_field(value: Any, collapse: bool) -> Any:
    if isinstance(value, str):
        return normalize_text(value, collapse)
    if isinstance(value, list):
        return [
            normalize_text(v, collapse) if isinstance(v, str) else _input_text(v) for v in value
        ]
    return _input_text(value)


def _input_text(value: Any) -> Any:
    """Input text in its structure (a content part, a Responses input item, a Messages system
    prompt's blocks): the strings that are its text (``INPUT_TEXT`` members, at any depth: a
    tool result's content) in NFC, every other string exact (a URL, a tool call's arguments,
    an id), numbers canonical."""
    if isinstance(value, str):
        return _nfc(value)
    if isinstance(value, dict):
        return {
            k: _nfc(v) if k in INPUT_TEXT and isinstance(v, str) else _input_text_inner(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_input_text_inner(v) for v in value]
    return _canonical(value)


def _input_text_inner(value: Any) -> Any:
    # Below the top, a bare string is no text (an id, a URL, a token list's...): only the
    # members named text or content are.
    return _canonical(value) if isinstance(value, str) else _input_text(value)


def _nfc(text: str) -> str:
    # (A text whose normalization would be quadratic is keyed as sent: ``normal_form``.)
    composed = normal_form("NFC", text)
    return text if composed is None else composed


def normalize_text(text: str, collapse: bool) -> str:
    """NFC, and (with ``collapse``) trimmed with white-space runs as one space outside ``` fences."""
    text = _nfc(text)
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
    """A value outside the input text: numbers by value, strings exact (no NFC: a stop
    sequence, a guided choice or a URL is matched or fetched by its code points)."""
    if isinstance(value, float):
        # 0 and 0.0 (and 1e0) are the same number: an integral float is keyed as the integer
        # it is, so 2**60 and 1152921504606846976.0 are one; past the 64 bits orjson writes
        # as ints, as the big integer ``exact_json`` reads such an integer as (its digits), so
        # 2**70 and 1180591620717411303424.0 are one too, and an integer and the float it
        # rounds to are two.
        if not value.is_integer():
            return value
        return int(value) if INT_MIN <= value < INT_END else big_int(int(value))
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value
