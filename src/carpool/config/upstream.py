"""The sections of the upstream side: routing misses across replicas, batching embeddings,
what is asked of a streaming upstream, and the embedded simulated engine.

Contract: every tunable of these layers lives here, with its unit and default in its description
(the config reference, docs/config.md, is generated from them); the layers are built from these
fields. Durations are seconds unless the name ends in ``_ms``. A held key's ``${NAME}`` is read
from the environment once, where the config is first loaded (``held_key``); a child process
rebuilding that config takes each key as it was resolved (``keys_resolved``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from .base import OnOff, Section


class RoutingConfig(Section):
    """Routing of misses across replicas and replica health (carpool.routing)."""

    policy: Literal["cache-aware", "round-robin", "least-loaded"] = Field(
        "cache-aware",
        description="How a miss picks an upstream replica when there are several: "
        "cache-aware (the replica that already holds the prompt's prefix in its KV cache, unless "
        "load is imbalanced; a prefix sent by the same tenant, or in the same shared namespace, "
        "for the same model and cache_salt: another tenant's never steers a request), "
        "round-robin, least-loaded (fewest calls in flight).",
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
        "already evicted; too low and it forgets ones the engine still holds. Memory: about 400 "
        "bytes per block_chars characters remembered (measured: its key, its place in the "
        "replica's record and in the shared index), ~12.5 MB per replica at the defaults. "
        "2,000,000: ~500k tokens, one large engine's KV cache.",
    )
    block_chars: int = Field(
        64,
        ge=1,
        description="cache-aware: prefix granularity; prompts are matched in whole blocks of this "
        "many characters (a partial last block never matches). Smaller: finer matches, more "
        "memory and hashing; larger: cheaper, coarser. 64: ~16 tokens, vLLM's KV block size.",
    )
    state_entries: int = Field(
        100_000,
        ge=1,
        description="Stored responses (Responses API) and chat completions (store: true) whose "
        "replica is remembered, whatever the policy, so that GET /v1/responses/{id} (and the "
        "other /v1/responses/{id}/... calls), a request with previous_response_id and the calls "
        "on /v1/chat/completions/{id} go to the replica that made it, the only one that holds "
        "it (vLLM and SGLang each keep their own responses); so do the files uploaded and the "
        "batches made through the gateway (/v1/files/{id}, /v1/batches/{id}, a POST "
        "/v1/batches of such a file: SGLang keeps them per process). Beyond it the least recently "
        "made or named are forgotten, and their follow-ups routed by the policy; shared fairly "
        "between tenants: a tenant holding less than its share (this bound over the tenants "
        "holding some) loses none while another holds more, so one tenant's load forgets its "
        "own, never another's. ~260 bytes an "
        "entry (~740 where each is its own tenant's): 100,000 (~26 MB) cover the last ~15 "
        "minutes at 100 responses a second.",
    )
    backoff_s: float = Field(
        5.0,
        gt=0,
        description="Seconds a replica is left out after a connection failure, timeout or 5xx "
        "(or a 401 to its own key, `upstream.api_keys`); "
        "doubled each time a call sent to it once it was left out (a probe) fails, up to "
        "backoff_max_s (the calls already in flight that fail with the first failure add "
        "nothing, nor does a failed /readyz probe). Shorter: a recovered "
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
        "timed out, 5xx, a pass-through answer cut part-way), whether it recovered in between "
        "or not; the next line counts the "
        "failures and recoveries not logged in between. The first failure after a quiet period "
        "is always logged, and the recovery from a logged failure. Also between two lines "
        "about calls this machine could not open a connection for (gateway_overloaded).",
    )
    ready_timeout_s: float = Field(
        0.8,
        gt=0,
        description="Seconds /readyz waits for a replica's answer to its probe (GET /models, "
        "asked of the replicas at once, the first answer deciding) when no replica answered "
        "in the last 5 s; one that does not answer in time is left out as a failed one. Keep "
        "it under the balancer's probe timeout (Kubernetes' default: 1 s). 0.8: an engine's "
        "/models answers in milliseconds, and /readyz answers within 1 s.",
    )

    @model_validator(mode="after")
    def _backoff_within_its_maximum(self) -> RoutingConfig:
        """A ``backoff_s`` given above ``backoff_max_s`` is refused, not quietly clamped (every
        back-off would be the maximum, the first included). A ``backoff_max_s`` alone below
        the default ``backoff_s`` is held to (every back-off is that maximum), as
        ``coalesce.max_window_ms`` alone is: such a config was accepted before the check."""
        if "backoff_s" in self.model_fields_set and self.backoff_s > self.backoff_max_s:
            raise ValueError(
                f"routing.backoff_s ({self.backoff_s:g}) is above routing.backoff_max_s "
                f"({self.backoff_max_s:g}), the longest back-off: raise backoff_max_s or "
                "lower backoff_s"
            )
        return self


class BatchingConfig(Section):
    max_batch_size: int = Field(
        32,
        ge=1,
        description="Most distinct items merged into one "
        "upstream /v1/embeddings call (identical requests take one slot).",
    )
    max_batch_delay_ms: float = Field(
        5,
        ge=0,
        description="Longest wait for a batch to fill (none once shutdown begins: the batches "
        "waiting are sent then).",
    )
    max_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one batch (approximated as characters / 4)."
    )
    embeddings: OnOff = Field(
        "auto",
        description="Whether concurrent single-input /v1/embeddings requests are merged "
        "into one list-input call. Merging must not change an answer, and some engines answer "
        "a list wrongly (llama-cpp-python's server: every item but the first). auto: merged "
        "only once a probe has shown that every replica answers a list item by item as it "
        "answers single inputs (per model, parameters, kind of input, texts or token lists, "
        "credentials and forwarded headers that may change the answer: one probe per tenant, "
        "as a router in front may send each key or header to another engine; "
        "a 2-item list and its two items alone, vectors compared, sent at the first batch; "
        "until then, and for good if a replica fails it, each request is sent alone); on: "
        "always merged (an engine known to be right); off: never merged. Texts and token "
        "lists are never merged into one list (engines refuse a mixed one). The semantic "
        "cache's upstream embedder (`semantic.embedder: upstream`) asks the same check, for "
        "its own key and model: its texts go one by one until lists are known right.",
    )
    embeddings_probe_retry: float = Field(
        30,
        ge=0,
        description="Seconds before the embeddings list probe (`embeddings: auto`) "
        "is tried again on a replica when it could not decide (the replica failed, refused the "
        "credentials or timed out); requests are sent alone meanwhile.",
    )


class UpstreamConfig(Section):
    api_key: SecretStr | None = Field(
        None,
        description="A key the gateway holds for its upstreams, sent as `Authorization: Bearer "
        "...` in place of the client's credentials (which then never go upstream): a value, or "
        "`${ENV_VAR}` to read it from the environment at start-up. Never logged nor shown. "
        "A key with white space around it or a control character (a secret file's trailing "
        "newline) is refused, naming the key and its variable, never trimmed: no header can "
        "carry it, and a key silently changed is another key (so every held key). "
        "With it, pass-through reaches only /v1/models unless `passthrough.allow` is set (the "
        "account's stored state would be every client's). null: the client's credentials go "
        "upstream as they came (unless a user and password in an upstream's URL are sent in "
        "their place: a credential the gateway holds too, see `upstreams`).",
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="One key per upstream replica, in the order of `upstreams` (each a value or "
        "`${ENV_VAR}`), when the replicas need different keys; overrides `api_key`. When they "
        "differ, a replica that refuses its key (401: revoked, mistyped) is left out like "
        "a failing one (`routing.backoff_s`) and the call is tried once on another replica "
        "(a 403, what the key may do, stays the call's); with one key for every replica a "
        "refusal is the call's (a 502, no replica left out). "
        "Empty: `api_key` for every replica.",
    )
    proxy: Literal["env", "none"] = Field(
        "env",
        description="How the upstreams (and `semantic.judge.url`) are reached: `env` through "
        "the HTTP proxy the environment names, as curl and the openai SDK read it "
        "(`HTTPS_PROXY` for an https upstream, `HTTP_PROXY` for an http one, `ALL_PROXY` for "
        "either, any case; not for a host `NO_PROXY` names; never for a loopback host); `none` "
        "directly whatever the environment says. Only an `http://` proxy is used (a CONNECT "
        "tunnel for https), with the user and password of its URL if any; another kind is "
        "warned of at start-up and not used. Redis and calls between workers never go through "
        "a proxy.",
    )
    engine: Literal["generic", "tgi", "ollama"] = Field(
        "generic",
        description="The engine behind the upstreams, where it samples past the sampling rule "
        "(`temperature` 0, `top_k` 1: greedy, as vLLM, SGLang and llama.cpp read them). "
        "`tgi`: its OpenAI routes drop `top_k` (`top_k: 1` samples) and `typical_p`, and it "
        "samples whenever `top_p` is under 1, temperature 0 or not, unless a `seed` is sent. "
        "`ollama`: its OpenAI routes drop `top_k`. Those requests are then not shared (each "
        '"regenerate" would be served the first sample). generic: the rule as written.',
    )
    stream_usage: bool = Field(
        True,
        description="Ask a streaming upstream for a final usage chunk "
        "(`stream_options.include_usage`) so tokens saved can be counted; "
        "clients that did not ask for it never see it. A non-streaming leader of a "
        "`stream_flights` call asks for it whatever this says (its whole answer has one). "
        "false: a streaming chat or completions request that does not ask for it is sent "
        "without it; its answer lacks the usage a non-streaming client or a stream asking for "
        "it gets, so its call is shared only with requests like it (others make their own) "
        "and its answer is never stored.",
    )
    stream_flights: bool = Field(
        False,
        description="Ask the upstream to stream every call the gateway shares (chat, "
        "completions, Responses, Messages), even when the client "
        "leading it did not ask to: streaming clients that join it get "
        "its tokens live, non-streaming ones the assembled answer (an "
        "unfinished one is then a 502, not served). Not for completions "
        "with `best_of` or `echo`, nor for vLLM's `prompt_logprobs` (chat and completions; "
        "refused on a stream), nor for a request with `stream_options` and no stream (the "
        "engines refuse it): those go whole. Off: the call streams only when its "
        "leader asked to.",
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _from_the_environment(cls, value: Any) -> Any:
        return held_key(value)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _each_from_the_environment(cls, value: Any) -> Any:
        return [held_key(v) for v in value] if isinstance(value, list) else value

    def key_of(self, replica: int) -> str | None:
        """The key the gateway holds for replica number ``replica`` (None: pass-through)."""
        key = self.api_keys[replica] if self.api_keys else self.api_key
        return key.get_secret_value() if key is not None else None


class SimConfig(Section):
    """The embedded simulated engine: a cost model that behaves like a real one where it matters."""

    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Simulated replicas when no --upstream is given (at most 1024: each is "
        "probed and weighed per call, and 200,000 held every embeddings request for good).",
    )
    max_concurrency: int = Field(
        32,
        ge=1,
        description="Requests served at once per replica; more queue. A request's n choices, "
        "or a completions list of prompts, decode together in its one slot, as a batch does "
        "(a real engine's limit, vLLM's max_num_seqs, counts sequences).",
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
    embedding_dim: int = Field(
        64,
        ge=1,
        le=4096,  # (``sim.replica.MAX_DIMENSIONS``: what a request's ``dimensions`` may ask)
        description="Length of the simulated embedding vectors (at most 4096, as a request's "
        "`dimensions`).",
    )
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


# Whether a held key's ``${NAME}`` names a variable: not while a child process rebuilds the
# config its parent resolved (``keys_resolved``).
_EXPANDING: ContextVar[bool] = ContextVar("carpool_expanding_held_keys", default=True)


@contextmanager
def keys_resolved() -> Iterator[None]:
    """For the block, a held key is taken as it is written, never read from the environment:
    for the config a parent resolved, rebuilt in a child (a ``carpool serve`` worker, the bench's
    embedded gateway). Its keys are values already; one that looks like ``${OTHER}`` (a
    variable's value may) would be expanded a second time, or refused as a variable not set."""
    token = _EXPANDING.set(False)
    try:
        yield
    finally:
        _EXPANDING.reset(token)


def held_key(value: Any) -> Any:
    """A key the gateway holds: ``${NAME}`` is the environment variable's value (unless the
    config is being rebuilt from resolved values: ``keys_resolved``). An error when
    it is not set, or when the key is empty: an empty key would silently mean "no key held",
    and the clients' own credentials would then go upstream (a secret that was not mounted).
    An error too when the key has white space around it or a control character (a secret file's
    trailing newline): no header can carry it, so every call would fail (as ``admin_token``).
    The message names the variable, never the value."""
    variable = ""
    named = isinstance(value, str) and value.startswith("${") and value.endswith("}")
    if named and _EXPANDING.get():
        name = value[2:-1]
        variable = f"the environment variable {name} (named by ${{{name}}})"
        if name not in os.environ:
            raise ValueError(f"{variable} is not set")
        value = os.environ[name]
        if not value.strip():
            raise ValueError(f"{variable} is empty")
    if isinstance(value, str) and not value.strip():
        raise ValueError("the key is empty: give one, or null for none")
    if isinstance(value, str) and (value != value.strip() or not value.isprintable()):
        # Refused, not trimmed, not even of the one newline a file ends with: a key the gateway
        # changed silently would be another key, and the fix (printf '%s', or the file written
        # without it) belongs where the secret is made.
        where = variable or "the key"
        raise ValueError(
            f"{where} has white space around it or a control character (a trailing newline, "
            "as a secret file or `echo` leaves?): a header cannot carry it; remove it"
        )
    return value
