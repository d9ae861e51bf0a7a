"""One typed configuration for the whole gateway.

Contract:
- Every tunable lives here, with its unit and default in its description; no layer hides a literal.
- Sources, strongest first: explicit overrides (CLI flags) > ``CARPOOL_*`` environment variables >
  the YAML file > the defaults below. Nested keys in the environment use ``__``:
  ``CARPOOL_CACHE__MAX_BYTES=1000``; values are read as YAML scalars (``true``, ``1.5``, ``[a, b]``).
- Unknown keys are errors (a typo must not silently keep a default). ``load`` raises ``ConfigError``
  naming the field and what is allowed; the CLI turns it into exit status 2.
- Durations are seconds unless the name ends in ``_ms``; sizes are bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_PREFIX = "CARPOOL_"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FingerprintConfig(_Section):
    normalize_whitespace: bool = Field(
        False,
        description="Opt-in: trim text and collapse runs of white space before hashing "
        "(never inside ``` fenced code, for requests of type `code`, or for embeddings inputs). "
        "Off, text is exact after Unicode NFC: white space is meaning (indentation, counted "
        "spaces, tabs, Markdown hard breaks).",
    )
    repeat_memo_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="Budget (bytes of request bodies) of the memo that "
        "lets a byte-identical repeat reach the exact cache without being parsed again; 0 = off.",
    )


class TypePolicy(_Section):
    ttl: float = Field(
        ...,
        ge=0,
        description="Seconds an answer of this type stays in the cache; "
        "0 = never stored (still coalesced while in flight and within the window).",
    )


DEFAULT_TYPES = {
    "translation": {"ttl": 86400},
    "faq": {"ttl": 3600},
    "code": {"ttl": 1800},
    "realtime": {"ttl": 300},
    "factual": {"ttl": 0},
}


class CacheConfig(_Section):
    default_ttl: float = Field(
        3600,
        ge=0,
        description="Seconds an answer stays cached when its "
        "request has no `x-carpool-type` (or an unknown one).",
    )
    max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Budget of the in-process exact "
        "cache in bytes; least recently used answers are evicted beyond it.",
    )
    types: dict[str, TypePolicy] = Field(
        default_factory=lambda: {k: TypePolicy(**v) for k, v in DEFAULT_TYPES.items()},
        description="TTL policy per request type (`x-carpool-type`). Keys given in the file are "
        "merged over the defaults.",
    )

    @field_validator("types", mode="before")
    @classmethod
    def _merge_default_types(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {**DEFAULT_TYPES, **value}
        return value


class CoalesceConfig(_Section):
    window_ms: float = Field(
        1000,
        ge=0,
        description="Milliseconds a finished answer stays joinable "
        "by identical requests, even with ttl 0.",
    )
    adaptive: bool = Field(
        True,
        description="Adapt the window per key to how often it is "
        "asked: sqrt(T^2 + adaptive_tradeoff x gap) - T for a call of T "
        "seconds and a mean gap between arrivals of gap seconds, within "
        "[min_window_ms, max_window_ms]; window_ms until the key has repeated "
        "3 times (rule and derivation in carpool/window.py).",
    )
    adaptive_tradeoff: float = Field(
        8.0,
        gt=0,
        description="Seconds; how much answer age the "
        "adaptive window accepts to save an upstream call (larger: "
        "more sharing, older answers).",
    )
    adaptive_keys: int = Field(
        100_000,
        ge=1,
        description="Keys whose arrival gaps the adaptive "
        "window remembers (least recently seen forgotten first).",
    )
    min_window_ms: float = Field(50, ge=0, description="Shortest adaptive window (ms).")
    max_window_ms: float = Field(
        3000,
        ge=0,
        description="Longest adaptive window (ms): the "
        "staleness bound, no lingering answer is shared older than this.",
    )
    join_timeout_ms: float = Field(
        30000,
        gt=0,
        description="Milliseconds a joiner waits for "
        "the flight's first output (its first streamed chunk, or its "
        "whole answer) before it runs its own upstream call.",
    )
    finish_abandoned: bool = Field(
        False,
        description="Finish an upstream call whose clients all "
        "left, to fill the cache, instead of cancelling it.",
    )


class SemanticConfig(_Section):
    enabled: bool = Field(
        False,
        description="Serve near-duplicate prompts from the semantic cache "
        "(needs the [semantic] extra: pip install 'carpool[semantic]').",
    )
    mode: Literal["serve", "mark"] = Field(
        "serve",
        description="serve: answer from a passing "
        "candidate; mark: never serve, only annotate the "
        "response with an opaque id of the nearest entry (never "
        "its text), its score and the guard's verdict (to "
        "measure before trusting).",
    )
    model_dir: str | None = Field(
        None,
        description="embedder local: a directory holding all-MiniLM-L6-v2's "
        "model.safetensors and tokenizer.json (checked against their SHA-256 digests). null: "
        "the Hugging Face cache at the pinned revision, filled by `carpool fetch-model` (the only "
        "thing that ever downloads it).",
    )
    scripts: list[str] = Field(
        default_factory=lambda: ["Latin"],
        description="The writing systems the embedding model and the guard read (Unicode script "
        "names: Latin, Greek, Cyrillic, Han, Hiragana, Katakana, Hangul, Arabic, Hebrew, "
        "Devanagari, Thai...; `*`: any). A prompt with a letter of another script gets no "
        "semantic view: exact matching only, never a guess (the packaged English model maps "
        "most Chinese characters to one unknown token). Widen it with a multilingual model "
        "(`embedder: upstream`).",
    )
    threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Cosine similarity at or above "
        "which a candidate is considered; null = the calibrated "
        "default (README, Semantic cache).",
    )
    verifier_dir: str | None = Field(
        None,
        description="A folder holding the verifier (model.onnx, tokenizer.json, "
        "verifier.json with their SHA-256 digests: what scripts/train_verifier.py writes); null: "
        "the one packaged with carpool.",
    )
    verifier_threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="The verifier's score at or above which a candidate that "
        "passed the exact rules is served; null: the one calibrated with the model "
        "(verifier.json). Higher: fewer wrong hits and fewer hits.",
    )
    embedder_precision: Literal["int8", "fp32"] = Field(
        "int8",
        description="embedder local: int8 weights (2.5x faster on a short prompt; the "
        "same hits and misses measured on the development pairs) or fp32 (the reference "
        "model's numbers). Instances sharing Redis must use the same: vectors of the other "
        "precision are ignored.",
    )
    embedder: Literal["local", "upstream"] = Field(
        "local",
        description="local: the packaged "
        "sentence model; upstream: the upstream's "
        "/v1/embeddings with `embedding_model`.",
    )
    embedding_model: str = Field(
        "text-embedding-3-small",
        description="Model asked of the upstream when `embedder: upstream`.",
    )
    embedding_dim: int = Field(
        1536,
        ge=1,
        description="Length of the upstream's embedding vectors when `embedder: upstream`.",
    )
    max_entries: int = Field(
        100_000, ge=1, description="Most entries kept; least recently used evicted first."
    )
    candidates: int = Field(8, ge=1, description="Nearest entries examined per lookup.")
    batch_size: int = Field(32, ge=1, description="Most texts embedded in one model call.")
    batch_delay_ms: float = Field(
        0,
        ge=0,
        description="Longest wait to fill an embedding batch "
        "(0: the next turn of the event loop; batches still form "
        "while the model is busy).",
    )
    index_connectivity: int = Field(16, ge=2, description="HNSW links per node (memory vs recall).")
    index_expansion_add: int = Field(64, ge=1, description="HNSW candidate list when adding.")
    index_expansion_search: int = Field(32, ge=1, description="HNSW candidate list when searching.")


class TenantConfig(_Section):
    header: str = Field(
        "Authorization",
        min_length=1,
        description="The primary credential "
        "header. The tenant is a keyed digest (never the raw value) of this "
        "header and every one in `credential_headers` that the client sends.",
    )
    credential_headers: list[str] = Field(
        default_factory=lambda: [
            "Authorization",
            "api-key",
            "x-api-key",
            "OpenAI-Organization",
            "OpenAI-Project",
        ],
        description="Every request header that carries a credential or selects the account an "
        "upstream bills (OpenAI's `Authorization`, Azure's `api-key`, Anthropic-style "
        "`x-api-key`, OpenAI's organization and project): all of them, with `header`, make the "
        "tenant. Remove one only if the upstream never reads it.",
    )
    shared_namespaces: list[str] = Field(
        default_factory=list,
        description="Namespaces whose "
        "answers are shared across tenants, but only with a "
        "tenant the upstream has accepted within "
        "`accepted_ttl`; others are scoped to themselves.",
    )
    accepted_ttl: float = Field(
        600,
        gt=0,
        description="Seconds a tenant counts as accepted by "
        "the upstream after its last 2xx answer on a cached endpoint "
        "(what lets it read a shared namespace).",
    )
    accepted_max_entries: int = Field(
        100_000,
        ge=1,
        description="Most accepted tenants "
        "remembered (oldest out: a forgotten one is scoped to "
        "itself until its next 2xx).",
    )


class IdempotencyConfig(_Section):
    retention: float = Field(86400, gt=0, description="Seconds an idempotency record is kept.")
    on_conflict: Literal["reject", "wait"] = Field(
        "reject", description="Same key while the first is processing: 409 (reject) or wait for it."
    )
    lease: float = Field(
        6.0,
        gt=0,
        description="With `redis`: seconds a record being processed "
        "is held unless its instance renews it (every lease/3 while the request "
        "runs): a retry on another instance after this one died runs within "
        "about this long. Longer than a Redis pause you want to ride out.",
    )


class RoutingConfig(_Section):
    """Routing of misses across replicas and replica health (carpool.routing)."""

    policy: Literal["cache-aware", "round-robin", "least-loaded"] = Field(
        "cache-aware",
        description="How a miss picks an upstream replica when there are several: "
        "cache-aware (the replica that already holds the prompt's prefix in its KV cache, unless "
        "load is imbalanced), round-robin, least-loaded (fewest calls in flight).",
    )
    cache_threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description="cache-aware: the least match rate (prefix characters already sent to a "
        "replica / prompt characters) that routes by affinity; below it the request goes to the "
        "least-loaded replica. Lower: more affinity, also for weak matches, at the cost of "
        "balance; higher: only long shared prefixes (system prompts, documents) pin a replica. "
        "0.5: a shared prefix must be at least half the prompt to be worth a busier replica.",
    )
    balance_abs_threshold: int = Field(
        32,
        ge=0,
        description="cache-aware: load is imbalanced (affinity overruled, least-loaded used) only "
        "when the busiest replica has more than this many requests in flight more than the "
        "least busy one (and balance_rel_threshold holds too). Lower: tighter balance, more "
        "prefix recomputation; higher: more cache hits, longer queues on hot replicas. 32: about "
        "one engine batch of headroom, as in SGLang's router.",
    )
    balance_rel_threshold: float = Field(
        1.5,
        ge=1,
        description="cache-aware: ... and when the busiest replica's in-flight count is above this "
        "multiple of the least busy one's. Guards against reacting to absolute gaps that are "
        "small relative to a high overall load. 1.5: SGLang's router default.",
    )
    tree_budget_chars: int = Field(
        2_000_000,
        gt=0,
        description="cache-aware: prompt characters remembered per replica; the least recently "
        "sent prefixes are evicted beyond it. Should approximate the engine's KV-cache capacity "
        "(~4 characters a token): too high and the router believes in prefixes the engine has "
        "already evicted; too low and it forgets ones the engine still holds. Memory: about 100 "
        "bytes per block_chars characters. 2,000,000: ~500k tokens, one large engine's KV cache.",
    )
    block_chars: int = Field(
        64,
        ge=1,
        description="cache-aware: prefix granularity; prompts are matched in whole blocks of this "
        "many characters (a partial last block never matches). Smaller: finer matches, more "
        "memory and hashing; larger: cheaper, coarser. 64: ~16 tokens, vLLM's KV block size.",
    )
    backoff_s: float = Field(
        5.0,
        gt=0,
        description="Seconds a replica is left out after a connection failure, timeout or 5xx; "
        "doubled on each further consecutive failure up to backoff_max_s. Shorter: a recovered "
        "replica rejoins sooner, a dead one costs more failed probes (each retried once on "
        "another replica, so only latency).",
    )
    backoff_max_s: float = Field(
        60.0,
        gt=0,
        description="The longest back-off after repeated failures: how long a replica that keeps "
        "failing waits between probes. 60: a dead replica costs at most one probe a minute.",
    )
    log_interval: float = Field(
        30.0,
        gt=0,
        description="Seconds between two warnings about one replica's failures (unreachable, "
        "timed out, 5xx); the next warning counts the failures not logged in between. The "
        "first failure after a quiet period is always logged.",
    )


class BatchingConfig(_Section):
    max_batch_size: int = Field(
        32,
        ge=1,
        description="Most distinct items merged into one "
        "upstream /v1/embeddings call (identical items take one slot).",
    )
    max_batch_delay_ms: float = Field(5, ge=0, description="Longest wait for a batch to fill.")
    max_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one batch (approximated as characters / 4)."
    )
    embeddings: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Whether concurrent single-input /v1/embeddings requests are merged "
        "into one list-input call. Merging must not change an answer, and some engines answer "
        "a list wrongly (llama-cpp-python's server: every item but the first). auto: merged "
        "only once a probe has shown that every replica answers a list item by item as it "
        "answers single inputs (per model and parameters: a 2-item list and its two items alone, "
        "vectors compared, sent at the first batch; until then, and for good if a replica "
        "fails it, each request is sent alone); on: always merged (an engine known to be "
        "right); off: never merged.",
    )
    embeddings_probe_retry: float = Field(
        30,
        ge=0,
        description="Seconds before the embeddings list probe (`embeddings: auto`) "
        "is tried again on a replica when it could not decide (the replica failed, refused the "
        "credentials or timed out); requests are sent alone meanwhile.",
    )


class LimitsConfig(_Section):
    max_body_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest request body accepted; larger ones get 413."
    )
    max_header_bytes: int = Field(
        64 * 1024,
        gt=0,
        description="Largest total size of a request's "
        "header names and values; larger ones get 431 (the gateway "
        "forwards headers upstream, and the HTTP server sets no limit).",
    )
    upstream_timeout: float = Field(
        600,
        gt=0,
        description="Seconds to wait for the upstream's "
        "answer (for streams: between two chunks) before 504.",
    )
    upstream_connect_timeout: float = Field(
        10, gt=0, description="Seconds to wait for a connection to the upstream before 502."
    )
    upstream_max_connections: int = Field(1000, gt=0, description="Pooled connections per replica.")
    body_read_timeout: float = Field(
        30,
        gt=0,
        description="Seconds a client may take to send "
        "a whole request body (cached endpoints, pass-through, "
        "admin); a body still trickling in after that gets 408 and "
        "nothing is sent upstream.",
    )
    max_json_depth: int = Field(
        64,
        ge=2,
        le=200,
        description="Deepest nesting of arrays and "
        "objects accepted in a request body; deeper gets 400 "
        "(`too_deep`). At most 200: the body is re-serialised for the "
        "upstream, and a JSON encoder stops at 255 levels.",
    )


class DistributedConfig(_Section):
    """How instances share Redis/Valkey (used when `redis` is set)."""

    key_prefix: str = Field(
        "carpool:",
        min_length=1,
        description="Prefix of every key carpool "
        "writes (no `{` or `}`: they are Redis Cluster hash tags).",
    )
    timeout: float = Field(
        0.5,
        gt=0,
        description="Seconds a Redis call may take before the "
        "instance treats Redis as unavailable.",
    )
    connect_timeout: float = Field(0.25, gt=0, description="Seconds to connect to Redis.")
    cluster: bool = Field(
        False,
        description="`redis` is a node of a Redis Cluster / Valkey "
        "cluster: use a cluster client (it learns the other nodes from this "
        "one). `carpool serve` turns it on by itself when the server says it "
        "runs in cluster mode.",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="Connections to Redis this instance may "
        "open (per node on a cluster; Valkey's default maxclients is "
        "10,000: size it for all instances). A call that finds them "
        "all busy waits for one (on a cluster it does not wait).",
    )
    pool_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds a Redis call may wait for a free "
        "connection; past it the call runs without Redis (counted as "
        "`pool_exhausted`, logged) but Redis is not marked down.",
    )
    retry_interval: float = Field(
        1.0,
        gt=0,
        description="While Redis is unavailable, seconds between two attempts to use it again.",
    )
    log_interval: float = Field(
        30.0, gt=0, description="Seconds between two log lines about Redis being unavailable."
    )
    shared_flights: bool = Field(
        True,
        description="Coalesce identical requests across instances: "
        "one instance makes the upstream call, the others follow it "
        "through Redis (false: each instance coalesces only its own "
        "requests).",
    )
    lease_ms: float = Field(
        5000,
        ge=30,
        description="Milliseconds the lock of a cross-instance "
        "flight's leader lives unless renewed (it is renewed every "
        "lease_ms/3 while the call runs): an instance that dies mid-call is "
        "taken over by a waiting instance within about this long.",
    )
    stream_maxlen: int = Field(
        10000,
        ge=1,
        description="Most entries (streamed chunks) kept in a "
        "cross-instance flight's Redis stream (XADD MAXLEN ~); an instance "
        "that joins after older chunks were trimmed gets the answer whole "
        "once it is complete.",
    )


class UpstreamConfig(_Section):
    stream_usage: bool = Field(
        True,
        description="Ask a streaming upstream for a final usage chunk "
        "(`stream_options.include_usage`) so tokens saved can be counted; "
        "clients that did not ask for it never see it.",
    )
    stream_flights: bool = Field(
        False,
        description="Ask the upstream to stream every chat or "
        "completions call the gateway shares, even when the client "
        "leading it did not ask to: streaming clients that join it get "
        "its tokens live, non-streaming ones the assembled answer (an "
        "unfinished one is then a 502, not served). Not for completions "
        "with `best_of` or `echo`. Off: the call streams only when its "
        "leader asked to.",
    )


class PassthroughConfig(_Section):
    """Which other `/v1/...` paths are forwarded to an upstream (never cached)."""

    allow: list[str] = Field(
        default_factory=lambda: ["/"],
        description="Path prefixes, relative to the upstream's "
        "/v1, that pass-through forwards, matched by whole segments (`/models` allows "
        "`/v1/models` and `/v1/models/x`, not `/v1/modelsx`); other paths get 403. `/` = "
        "everything under /v1; [] = pass-through off. Whatever the list, a path with a dot "
        "segment, an encoded `/` or `\\`, a backslash, a control character or an empty segment "
        "is refused (400), and nothing outside the upstream's /v1 is ever reached.",
    )

    @field_validator("allow")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        out = []
        for prefix in value:
            inner = prefix[1:].removesuffix("/")
            segments = inner.split("/") if inner else []
            if not prefix.startswith("/") or any(
                s in ("", ".", "..") or not s.isprintable() or set(s) & set("%\\?#")
                for s in segments
            ):
                raise ValueError(
                    f"{prefix!r} must be a path like /models: starting with /, "
                    "without dot or empty segments, %, \\, ? or #"
                )
            out.append("/" + "/".join(segments))
        return out


class SimConfig(_Section):
    """The embedded simulated engine: a cost model that behaves like a real one where it matters."""

    replicas: int = Field(1, ge=1, description="Simulated replicas when no --upstream is given.")
    max_concurrency: int = Field(
        32, ge=1, description="Sequences decoded at once per replica; more queue."
    )
    prefill_ms_per_token: float = Field(
        0.05,
        ge=0,
        description="Prefill cost per prompt token not found in the replica's prefix cache (ms).",
    )
    decode_ms_per_token: float = Field(
        5.0,
        ge=0,
        description="Decode cost per output token (ms); "
        "streams emit one chunk per token at this pace.",
    )
    default_max_tokens: int = Field(
        48, ge=1, description="Answer length cap when the request sets none."
    )
    prefix_cache_tokens: int = Field(
        200_000,
        ge=0,
        description="Prompt tokens each replica keeps "
        "in its simulated KV (prefix) cache, LRU by block.",
    )
    block_tokens: int = Field(16, ge=1, description="Prefix-cache block size in tokens.")
    embedding_dim: int = Field(64, ge=1, description="Length of the simulated embedding vectors.")
    embedding_call_ms: float = Field(
        2.0,
        ge=0,
        description="Fixed cost of one embeddings "
        "forward pass (ms); its items are computed together, "
        "padded to the longest, at prefill_ms_per_token.",
    )
    embedding_concurrency: int = Field(
        1, ge=1, description="Embeddings forward passes run at once per replica; more calls queue."
    )


class Config(_Section):
    """The whole configuration. Build it with ``Config.load``; a plain ``Config()`` is all defaults."""

    upstreams: list[str] = Field(
        default_factory=list,
        description="Base URLs ending in /v1 of "
        "OpenAI-compatible replicas; empty = the embedded simulated engine.",
    )
    upstream_names: list[str] = Field(
        default_factory=list,
        description="Names of the `upstreams`, in the same order (as "
        "many): how /stats, /metrics, /healthz, the logs and error messages call each replica. "
        "Empty = operators see the URL without its user, password, query and fragment (made "
        "unique with `#2`, `#3`...), and /healthz and error bodies, which clients can read, "
        "say `replica-0`, `replica-1`... Each name: 1-64 printable characters, all distinct.",
    )
    redis: str | None = Field(
        None,
        description="Redis/Valkey URL (redis://host:port/db) of the "
        "store shared by every instance; null = in-process only.",
    )
    admin_token: str | None = Field(None, description="Bearer token that enables /admin/*.")
    sampling: Literal["strict", "same-params"] = Field(
        "strict",
        description="strict: sampled "
        "requests bypass unless they opt in; "
        "same-params: they share with identical "
        "parameters.",
    )
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="Gateway processes serving one port. Each "
        "has its own caches and flights unless `redis` is set, which they then "
        "share.",
    )
    port: int = Field(8080, ge=0, le=65535, description="Port the gateway listens on.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    tracing: Literal["auto", "on", "off"] = Field(
        "auto",
        description="OpenTelemetry spans per "
        "layer (extra otel). auto: when a tracer "
        "provider is installed (e.g. by "
        "opentelemetry-instrument).",
    )
    fingerprint: FingerprintConfig = Field(default_factory=FingerprintConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    coalesce: CoalesceConfig = Field(default_factory=CoalesceConfig)
    semantic: SemanticConfig = Field(default_factory=SemanticConfig)
    tenant: TenantConfig = Field(default_factory=TenantConfig)
    idempotency: IdempotencyConfig = Field(default_factory=IdempotencyConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    passthrough: PassthroughConfig = Field(default_factory=PassthroughConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    sim: SimConfig = Field(default_factory=SimConfig)

    @field_validator("upstreams")
    @classmethod
    def _upstreams_are_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL ending in /v1")
        return [url.rstrip("/") for url in value]

    @field_validator("upstream_names")
    @classmethod
    def _one_name_per_upstream(cls, value: list[str], info: Any) -> list[str]:
        upstreams = info.data.get("upstreams")
        if value and upstreams is not None and len(value) != len(upstreams):
            raise ValueError(f"give one name per upstream ({len(upstreams)}), or none")
        for name in value:
            if not 1 <= len(name) <= 64 or not name.isprintable():
                raise ValueError(f"{name!r} must be 1-64 printable characters")
        if len(set(value)) != len(value):
            raise ValueError("the names must be distinct")
        return value

    def ttl_for(self, request_type: str | None) -> float:
        """Seconds an answer of ``request_type`` may be stored (0 = never)."""
        if request_type is not None:
            policy = self.cache.types.get(request_type)
            if policy is not None:
                return policy.ttl
        return self.cache.default_ttl

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> Config:
        """Merge the file, the environment and explicit overrides over the defaults, then validate."""
        merged: dict[str, Any] = {}
        if path is not None:
            try:
                loaded = yaml.safe_load(Path(path).read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ConfigError(f"config file {path}: {exc}") from exc
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {path}: the top level must be a mapping")
            _deep_merge(merged, loaded)
        _deep_merge(merged, _from_env(os.environ if env is None else env))
        _deep_merge(merged, dict(overrides or {}))
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from exc


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == "CARPOOL_CONFIG":
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        # pydantic's messages already say what is allowed ("Input should be 'a' or 'b'").
        message = err["msg"] if err["type"] != "extra_forbidden" else "unknown key"
        lines.append(f"{field}: {message}; got {err.get('input')!r}")
    return "invalid config: " + "; ".join(lines)


def reference_markdown() -> str:
    """The config reference (docs/config.md), generated from the model so it cannot drift."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `carpool.config.Config` by `carpool config-reference`; do not edit.",
        "Sources, strongest first: CLI flags, `CARPOOL_*` environment variables (nested keys "
        "joined with `__`, e.g. `CARPOOL_CACHE__MAX_BYTES`), the YAML file (`--config`), "
        "these defaults. Durations are seconds unless the key ends in `_ms`; sizes are "
        "bytes.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, dict):
                default = {
                    k: (v.model_dump() if isinstance(v, BaseModel) else v)
                    for k, v in default.items()
                }
            shown = yaml.safe_dump(default, default_flow_style=True, width=1000).strip()
            shown = shown.removesuffix("\n...").removesuffix("...").strip()
            if get_origin(annotation) is Literal:
                kind = "one of " + ", ".join(f"`{a}`" for a in get_args(annotation))
            else:
                kind = str(annotation).replace("typing.", "").replace("<class '", "")
                kind = kind.replace("'>", "").replace("|", "\\|")
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{prefix}{name}` | {kind} | `{shown}` | {meaning} |")

    walk(Config, "")
    return "\n".join(lines) + "\n"
