"""The sections of what is shared and for how long: fingerprinting, the exact cache, coalescing
and the semantic cache.

Contract: every tunable of these layers lives here, with its unit and default in its
description (the config reference, docs/config.md, is generated from them); the layers are built
from these fields. Durations are seconds unless the name ends in ``_ms``; sizes are bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from ..identity import names_a_secret
from ..semantic.audit import MAX_WINDOW, MIN_AUDITS, smallest_window, wilson
from .base import LONGEST_TTL, Section, header_name, header_value_name
from .upstream import held_key
from .urls import checked_url

#: ``semantic.embed_timeout_ms`` left null with ``embedder: upstream``: a healthy embeddings call
#: takes milliseconds, an LLM's answer far longer, so the bound is seldom felt but by a hung one.
UPSTREAM_EMBED_TIMEOUT_S = 1.0


class FingerprintConfig(Section):
    normalize_whitespace: bool = Field(
        False,
        description="Opt-in: trim text and collapse runs of white space before hashing "
        "(never inside ``` fenced code, for requests of type `code`, or for embeddings inputs). "
        "Off, text is exact after Unicode NFC: white space is meaning (indentation, counted "
        "spaces, tabs, Markdown hard breaks); embeddings inputs are exact, without NFC. On, "
        "an invalidation by prompt prefix matches the prefix as given and collapsed.",
    )
    repeat_memo_bytes: int = Field(
        16 * 1024 * 1024,
        ge=0,
        description="Budget (bytes: request bodies, their header values and ~400 bytes an "
        "entry) of the memo that lets a byte-identical repeat reach the exact cache without "
        "being parsed again, per process (each worker its own); 0 = off. /stats `repeat_memo` "
        "and /metrics `carpool_repeat_memo_bytes` say what it holds.",
    )
    neutral_headers: list[str] = Field(
        default_factory=list,
        description="Request headers (names, in any case) left out of the key, beside the "
        "transport, tracing and hosting platforms' headers carpool knows: two requests that "
        "differ only in them share an answer (and a batched embeddings call). For what your own "
        "proxies add to every request (a request id, a timestamp, the client's address). Never "
        "name a header that may change the answer (a deployment, model or feature selector) or "
        "that the upstream authorizes by: the tenant is made of the credential headers only. "
        "A name that says it carries a secret (key, token, secret, session...) is refused.",
    )

    @field_validator("neutral_headers")
    @classmethod
    def _neutral_headers_are_header_names(cls, value: list[str]) -> list[str]:
        names: list[str] = []
        for name in value:
            lowered = header_name(name)
            if names_a_secret(lowered):
                raise ValueError(
                    f"{name!r} says it carries a credential: never neutral (a header the "
                    "upstream authorizes by belongs in tenant.credential_headers)"
                )
            if lowered not in names:
                names.append(lowered)
        return names


class TypePolicy(Section):
    ttl: float = Field(
        ...,
        ge=0,
        le=LONGEST_TTL,
        description="Seconds an answer of this type stays in the cache, and the oldest this "
        "instance serves, whoever stored it; 0 = never stored nor served from a cache (still "
        "coalesced while in flight and within the window).",
    )


DEFAULT_TYPES = {
    "translation": {"ttl": 86400},
    "faq": {"ttl": 3600},
    "code": {"ttl": 1800},
    "realtime": {"ttl": 300},
    "factual": {"ttl": 0},
}


class CacheConfig(Section):
    default_ttl: float = Field(
        3600,
        ge=0,
        le=LONGEST_TTL,
        description="Seconds an answer stays cached when its "
        "request has no `x-carpool-type` (or an unknown one), and the oldest such answer this "
        "instance serves, whoever stored it.",
    )
    max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Budget of the in-process exact "
        "cache in bytes; beyond it, answers are evicted in the order they were stored, sparing "
        "once each one hit since (second-chance LRU). 0: nothing is stored (identical "
        "requests still share a call in flight and its coalescing window).",
    )
    types: dict[str, TypePolicy] = Field(
        default_factory=lambda: {k: TypePolicy(**v) for k, v in DEFAULT_TYPES.items()},
        description="TTL policy per request type (`x-carpool-type`, read in any case). Keys given "
        "in the file are merged over the defaults, in any case (`Realtime` is `realtime`).",
    )

    @field_validator("types", mode="before")
    @classmethod
    def _merge_default_types(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        # A request's type is read lower-cased: a key spelled otherwise would never apply; nor
        # would one no request can name in x-carpool-type (stripped, 1-256 printable
        # characters): silently, a `ttl: 0` meant to keep answers out kept them default_ttl.
        given: dict[Any, Any] = {}
        for name, policy in value.items():
            if isinstance(name, str):
                # As a client may send it: "İ" is the one letter lower() lengthens ("i" and a
                # dot above), and a name read again (Config.load validates twice) is lowered.
                header_value_name(name.replace("i\u0307", "\u0130"), "x-carpool-type", "type")
            lowered = name.lower() if isinstance(name, str) else name
            if lowered in given:
                raise ValueError(f"{name!r}: two keys differ only in case")
            given[lowered] = policy
        return {**DEFAULT_TYPES, **given}


class CoalesceConfig(Section):
    window_ms: float = Field(
        1000,
        ge=0,
        description="Milliseconds a finished answer stays joinable "
        "by identical requests, even with ttl 0; 0: no window, adaptive or not (no finished "
        "answer lingers). With adaptive, at most max_window_ms.",
    )
    adaptive: bool = Field(
        True,
        description="Adapt the window per key to how often it is "
        "asked: sqrt(T^2 + adaptive_tradeoff x gap) - T for a call of T "
        "seconds and a mean gap between arrivals of gap seconds, within [min_window_ms, "
        "max_window_ms]; window_ms until the key has repeated 3 times (rule and "
        "derivation in carpool/window.py). Off with window_ms 0.",
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
    min_window_ms: float = Field(
        50, ge=0, description="Shortest adaptive window (ms); at most max_window_ms."
    )
    max_window_ms: float = Field(
        3000,
        ge=0,
        le=LONGEST_TTL * 1000,
        description="Longest adaptive window (ms), window_ms included: the "
        "staleness bound, no lingering answer is shared older than this (without adaptive, "
        "the window is window_ms).",
    )
    join_timeout_ms: float = Field(
        30000,
        gt=0,
        description="Milliseconds a joiner waits for "
        "the flight's first output (its first streamed chunk, or its "
        "whole answer) before it runs its own upstream call; the time the flight's call "
        "waits for a connection to its replica (limits.upstream_max_connections) counts too "
        "(twice limits.upstream_queue_timeout must stay under it). "
        "Also the longest a retry with an "
        "Idempotency-Key waits for the first request's answer (idempotency.on_conflict: wait) "
        "before its 409.",
    )
    finish_abandoned: bool = Field(
        False,
        description="Finish an upstream call whose clients all "
        "left, to fill the cache, instead of cancelling it; and a request with an "
        "Idempotency-Key whose client left, its answer kept for a retry. Every shared "
        "call is finished so, a no-store request's too, which fills nothing (a request that "
        "comes meanwhile may still join it); a sampled or pass-through one is cancelled. "
        "Stopping, the process waits for such a call within `shutdown.grace_s` even when "
        "nobody is left to read its answer (without Redis it dies with the process).",
    )

    @model_validator(mode="after")
    def _within_the_staleness_bound(self) -> CoalesceConfig:
        """With ``adaptive``, ``max_window_ms`` bounds every window, ``window_ms`` (a key's
        first) included: a config that says otherwise is refused, not quietly clamped. A
        default it would contradict (``max_window_ms: 500`` alone) is held to the bound
        (``window.AdaptiveWindow``): that config was accepted before the check came."""
        if not self.adaptive:
            return self
        given = self.model_fields_set
        if "window_ms" in given and self.window_ms > self.max_window_ms:
            raise ValueError(
                f"coalesce.window_ms ({self.window_ms:g}) is above coalesce.max_window_ms "
                f"({self.max_window_ms:g}), the staleness bound of the adaptive window: "
                "raise max_window_ms, lower window_ms, or set adaptive: false"
            )
        if "min_window_ms" in given and self.min_window_ms > self.max_window_ms:
            raise ValueError(
                f"coalesce.min_window_ms ({self.min_window_ms:g}) is above "
                f"coalesce.max_window_ms ({self.max_window_ms:g})"
            )
        return self


class JudgeConfig(Section):
    """``semantic.judge``: an LLM asked, for candidates in the uncertain band, whether two requests
    have the same answer (off until ``model`` is set)."""

    model: str | None = Field(
        None,
        description="The judge's model name; setting it turns the judge on (null: no judge).",
    )
    url: str | None = Field(
        None,
        description="OpenAI-compatible base URL of the judge (e.g. http://host:8000/v1); null: "
        "the gateway's own upstreams.",
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _from_the_environment(cls, value: Any) -> Any:
        return held_key(value)

    @field_validator("url")
    @classmethod
    def _url_is_a_url(cls, value: str | None) -> str | None:
        return None if value is None else checked_url(value.rstrip("/"), ("http", "https"))

    api_key: SecretStr | None = Field(
        None,
        description="Bearer key sent to the judge (a value, or `${ENV_VAR}` read at start-up; "
        "null: none). With `url` null the judge's calls go through the upstreams carrying this "
        "key, or `upstream.api_key` when the gateway holds one (it replaces this one there), "
        "never a client's; with neither, a warning at start-up: an upstream that wants a key "
        "refuses every judge call. Never logged nor shown.",
    )
    band: tuple[float, float] = Field(
        (0.75, 0.97),
        description="[low, high] cosine similarity of the candidates the judge decides (after "
        "the exact rules); outside it the verifier decides.",
    )
    verifier_band: tuple[float, float] = Field(
        (0.0, 1.0),
        description="[low, high] verifier score of the candidates the judge is asked about: "
        "outside it the verifier is sure enough and its verdict stands (fewer judge calls; "
        "[0.02, 0.99] halves them at about the same recall on the held-out pairs). A candidate "
        "only a rule in `overrules` refused is always asked.",
    )
    overrules: list[
        Literal[
            "quoted",
            "number",
            "operator",
            "identifier",
            "entity",
            "order",
            "polarity",
            "substitution",
            "relation",
            "qualifier",
            "tone",
        ]
    ] = Field(
        default_factory=list,
        description="Exact rules whose refusals the judge may overrule in the band (the "
        "verifier never may): e.g. [entity, identifier, number] when the judge reads names "
        "and numbers reliably. Empty: every rule's refusal stands.",
    )
    timeout_ms: float = Field(
        2000,
        gt=0,
        description="Longest wait for the judge's verdicts, one deadline for a whole lookup (its "
        "nearest candidate, then the others); a timeout is a miss. A reply body over 64 KiB is "
        "no verdict either.",
    )
    max_tokens: int = Field(4, ge=1, description="Tokens the judge may answer with.")
    cache_entries: int = Field(10_000, ge=1, description="Verdicts remembered, per pair.")

    @field_validator("band", "verifier_band")
    @classmethod
    def _band_is_ordered(cls, band: tuple[float, float]) -> tuple[float, float]:
        low, high = band
        if not 0 <= low <= high <= 1:
            raise ValueError("band must be [low, high] with 0 <= low <= high <= 1")
        return band


class SemanticConfig(Section):
    enabled: bool = Field(
        False,
        description="Serve near-duplicate prompts from the semantic cache "
        "(needs the semantic extra: pip install '.[semantic]' in carpool's checkout, or the "
        "wheel carpool came from with `[semantic]` after its path).",
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
        "most Chinese characters to one unknown token). Within them, while `english_only`, only "
        "a text that reads as English is compared by meaning: widening this alone (with a "
        "multilingual `embedder: upstream`) compares no other language. Narrowed to the "
        "scripts the verifier's verifier.json names (`scripts`; Latin where it names none, as "
        "the packaged one's: it scored Cyrillic, Greek and kana negations the same as their "
        "affirmations, 0.99).",
    )
    english_only: bool = Field(
        True,
        description="Compare by meaning only a prompt (and earlier turns) that reads as English: "
        "its plain words are words of the packaged verifier's vocabulary and each sentence has "
        "an English function word. Any other text is matched exactly. The exact rules' word "
        "lists and the packaged verifier are English whatever the embedder: with false, a "
        "reviewer's non-English traps in Latin script (a German negation, a Portuguese refusal, "
        "French on/off) were served 29.5 % of the time, against ~1.5 % for English. Turn off "
        "only behind a guard of your own that reads those languages.",
    )
    max_text_chars: int = Field(
        16_384,
        ge=1,
        description="The longest prompt (and earlier turns, each) compared by meaning, in "
        "characters; a longer one gets no semantic view: matched exactly, never stored in or "
        "looked up by the semantic cache. Its checks (`english_only`, the scripts) read every "
        "character on the event loop, ~1 µs each: an 8 MB prompt held every other request of "
        "the process ~7 s. The guard serves a text past 4,096 characters only when identical "
        "anyway; the default keeps earlier turns (few-shot examples) of up to ~4K tokens.",
    )
    threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Cosine similarity at or above "
        "which a candidate is considered; null = the calibrated "
        "default, 0.40 (docs/semantic.md).",
    )
    verifier_dir: str | None = Field(
        None,
        description="A folder holding the verifier (model.onnx, tokenizer.json, "
        "verifier.json with their SHA-256 digests: what scripts/train_verifier.py writes); null: "
        "the one packaged with carpool.",
    )

    @field_validator("model_dir", "verifier_dir")
    @classmethod
    def _a_folder_with_its_files(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Checked when the config loads: check-config refuses what serve would fail on. Only
        # that each file is there and readable: their digests are checked when the model loads.
        if value is None:
            return None
        folder = Path(value)
        if not folder.is_dir():
            raise ValueError(f"{value!r} is not a folder")
        # (Imported here: light, but the embed package imports numpy when it is installed.)
        if info.field_name == "model_dir":
            from ..semantic.embed.weights import MODEL_SHA256

            what, files = "model", tuple(MODEL_SHA256)
        else:
            from ..semantic.verifier import FILES

            what, files = "verifier", FILES
        for name in files:
            path = folder / name
            if not (path.is_file() and os.access(path, os.R_OK)):
                raise ValueError(f"no {what} in {value}: it holds no readable {name}")
        if what == "verifier":
            from ..semantic.view import verifier_scripts

            # (The scripts it names, if any, named as a list; read now, not as cached.)
            verifier_scripts.__wrapped__(value)
        return value

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
        "/v1/embeddings with `embedding_model`, sent through the replicas as the gateway's own "
        "calls are (health, back-off, one failover; counted in `upstream_calls`; a 5xx answer "
        "is about the text, no verdict on the replica).",
    )
    embedding_model: str = Field(
        "text-embedding-3-small",
        description="Model asked of the upstream when `embedder: upstream`.",
    )
    embedding_dim: int = Field(
        1536,
        ge=1,
        description="Length of the upstream's embedding vectors when `embedder: upstream`. "
        "A model answering another length fails every embedding: said once, as an error "
        "naming both lengths, and in /stats (`layers.semantic.embed_problem`).",
    )
    embedder_api_key: SecretStr | None = Field(
        None,
        description="`embedder: upstream`: the Bearer key its /v1/embeddings calls carry (a "
        "value, or `${ENV_VAR}` read at start-up; never logged nor shown). Every tenant's "
        "prompts are embedded under it, batched together: never a client's key. A credential "
        "the gateway holds (`upstream.api_key` / `api_keys`, or a user and password in a "
        "replica's URL) replaces any other on its replicas, this one too: set, this key is "
        "sent only where the gateway holds none. null: the held credential, else none (a "
        "keyless upstream; start-up logs a warning: one that wants a key refuses every "
        "embedding, and the semantic cache never hits).",
    )

    @field_validator("embedder_api_key", mode="before")
    @classmethod
    def _embedder_key_from_the_environment(cls, value: Any) -> Any:
        return held_key(value)

    embed_timeout_ms: float | None = Field(
        None,
        gt=0,
        description="Longest wait for an embedding (a lookup's, an entry's), its upstream call "
        "included: a timeout is an embedder failure, a miss (`embed_failures`), and no entry is "
        "made for that prompt; a miss's reply waits for its prompt's embedding (to insert its "
        "entry first) no longer than this after its upstream call began. null: 1000 with "
        "`embedder: upstream` (a network call that may hang), none with local (the model in "
        "process cannot hang; a bound would only turn slow embeddings under load into misses).",
    )
    max_pending: int = Field(
        32,
        ge=1,
        description="Most lookups (identical requests share one) and embeddings of new "
        "entries in progress; past it a request is not looked up (a miss at once, no entry "
        "made for its prompt: /stats `layers.semantic.lookups_shed`), and a miss's prompt is "
        "not embedded (no entry, its reply never waits for one: `entries_shed`). Lookups "
        "queue for the verifier, one pair at a time (~3-4 ms a pair, up to `candidates` pairs "
        "a lookup), embeddings for the embedder: without a bound, work arriving faster than "
        "they do made every request wait seconds (docs/semantic.md).",
    )
    max_entries: int = Field(
        100_000, ge=1, description="Most entries kept; least recently used evicted first."
    )
    max_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Budget of the semantic entries in bytes (least recently used evicted "
        "first), apart from `cache.max_bytes`: each entry holds its own answer (counted whole, "
        "even while the exact cache keeps a copy), its texts, its vector in the index (twice "
        "its raw size) and its bookkeeping; each scope (tenant, namespace, parameters, system "
        "prompt...) counts its index, 56 KB. An entry larger than the whole budget is not kept.",
    )
    candidates: int = Field(
        8,
        ge=1,
        description="Nearest entries examined per lookup; the most similar the guard passes is "
        "served (1: only the nearest: fewer answers of another prompt, fewer hits; "
        "docs/semantic.md).",
    )
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
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    audit_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Fraction of semantic hits also sent upstream in the background, after the "
        "client got its answer, to compare the answers (the namespace's wrong-hit estimate).",
    )
    audit_window: int = Field(
        500,
        ge=10,
        le=MAX_WINDOW,
        description="Audits per error budget (a tenant's in a namespace) the estimate is made "
        "of (the latest). With max_wrong_rate, at least the window that can show the budget "
        "met: one whose 95% upper bound, with no audit wrong, is under it (the config is "
        "refused otherwise, naming it).",
    )
    max_wrong_rate: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Error budget, per tenant and namespace (a shared namespace's tenants "
        "share one): when the 95% interval's lower bound of its wrong-hit rate exceeds it, "
        f"over at least {MIN_AUDITS} audits, the namespace backs off for that tenant (near repeats only; "
        "mark-only if their rate exceeds it too) and comes back once audits put the upper "
        "bound under it (null: no budget).",
    )

    @model_validator(mode="after")
    def _a_budget_the_window_can_show_met(self) -> SemanticConfig:
        """A budget the window cannot resolve is refused: even with none of its audits wrong,
        the 95% upper bound of a full window (z^2 / (n + z^2): 0.0076 at 500) would stay over
        it, and a namespace that backed off would never come back."""
        budget, window = self.max_wrong_rate, self.audit_window
        if budget is None or window >= (needed := smallest_window(budget)):
            return self
        if window < MIN_AUDITS:
            why = f"a window moves an error budget only once it holds {MIN_AUDITS} audits"
        elif needed > MAX_WINDOW:
            raise ValueError(
                f"semantic.max_wrong_rate ({budget:g}) is smaller than any audit window (at "
                f"most {MAX_WINDOW}) can show met; give a larger max_wrong_rate"
            )
        else:
            why = (
                f"with no audit of the window wrong, its 95% upper bound is "
                f"{wilson(0, window)[2]:.4f}, not under the budget: a namespace that backed "
                "off would never serve again"
            )
        raise ValueError(
            f"semantic.max_wrong_rate ({budget:g}) needs a longer semantic.audit_window than "
            f"{window}: {why}; give audit_window >= {needed}, or a larger max_wrong_rate"
        )

    def embed_timeout_s(self) -> float | None:
        """``embed_timeout_ms`` in seconds, its null resolved for the embedder (None: none)."""
        if self.embed_timeout_ms is not None:
            return self.embed_timeout_ms / 1000
        return UPSTREAM_EMBED_TIMEOUT_S if self.embedder == "upstream" else None
