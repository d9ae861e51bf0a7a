"""The sections of the client-facing perimeter: who a tenant is, idempotency keys, request
limits and which other paths pass through.

Contract: every tunable of the perimeter lives here, with its unit and default in its description
(the config reference, docs/config.md, is generated from them); the code that enforces them reads
these fields. Durations are seconds; sizes are bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from .base import LONGEST_TTL, Section, header_name, header_value_name


class TenantConfig(Section):
    header: str = Field(
        "Authorization",
        min_length=1,
        description="The primary credential header (a header name, in any case). The tenant "
        "is a one-way digest (BLAKE2b, not keyed; never the raw value) of this header and every "
        "one in `credential_headers` that the client sends; it is written to no log line, "
        "response or metric.",
    )
    credential_headers: list[str] = Field(
        default_factory=lambda: [
            "Authorization",
            "api-key",
            "x-api-key",
            "OpenAI-Organization",
            "OpenAI-Project",
            "x-goog-api-key",
            "cf-aig-authorization",
            "cf-access-client-id",
            "cf-access-client-secret",
        ],
        description="Every request header that carries a credential or selects the account an "
        "upstream bills (OpenAI's `Authorization`, Azure's `api-key`, Anthropic-style "
        "`x-api-key`, OpenAI's organization and project, Google's `x-goog-api-key`, "
        "Cloudflare AI Gateway's and Cloudflare Access's tokens): all of them, with `header`, "
        "make the tenant. Remove one only if the upstream never reads it. Header names, in any "
        "case.",
    )
    shared_namespaces: list[str] = Field(
        default_factory=list,
        description="Namespaces whose "
        "answers are shared across tenants, but only with a "
        "tenant the upstream has accepted within "
        "`accepted_ttl`; others are scoped to themselves. Each as a client names it in "
        "`x-carpool-namespace`: 1-256 printable characters, no white space around them (the "
        "default namespace, none given, is never shared).",
    )
    accepted_ttl: float = Field(
        600,
        gt=0,
        description="Seconds a tenant counts as accepted by "
        "the upstream after its last 2xx answer on a cached endpoint "
        "(what lets it read a shared namespace); a 2xx of a call sent before the tenant's "
        "last refusal (401, 403) accepts nothing.",
    )
    accepted_max_entries: int = Field(
        100_000,
        ge=1,
        description="Most accepted tenants "
        "remembered (oldest out: a forgotten one is scoped to "
        "itself until its next 2xx).",
    )

    @field_validator("header")
    @classmethod
    def _a_header_name(cls, value: str) -> str:
        header_name(value)  # (kept as written: the tenant's names are lower-cased where read)
        return value

    @field_validator("credential_headers")
    @classmethod
    def _header_names(cls, value: list[str]) -> list[str]:
        for name in value:
            header_name(name)
        return value

    @field_validator("shared_namespaces")
    @classmethod
    def _namespaces_a_client_can_name(cls, value: list[str]) -> list[str]:
        # A namespace no request can ask for (x-carpool-namespace is stripped, at most 256
        # printable characters; an empty one is the default namespace, never shared) would
        # silently share nothing.
        for namespace in value:
            header_value_name(namespace, "x-carpool-namespace", "namespace")
        return value


class IdempotencyConfig(Section):
    retention: float = Field(
        86400, gt=0, le=LONGEST_TTL, description="Seconds an idempotency record is kept."
    )
    on_conflict: Literal["reject", "wait"] = Field(
        "reject",
        description="Same key while the first is processing: 409 (reject), or wait for its "
        "answer (wait) up to coalesce.join_timeout_ms, then 409.",
    )
    max_records: int = Field(
        100_000,
        gt=0,
        description="In-process records kept (without `redis`, or its fallback): beyond it the "
        "oldest finished ones go before their retention (logged), and a retry of theirs runs "
        "again; but a tenant holding less than its share (max_records / tenants) keeps its "
        "records while another holds more: one tenant's flood of keys evicts its own. Records "
        "being processed are never evicted.",
    )
    max_bytes: int = Field(
        256 * 1024 * 1024,
        gt=0,
        description="Bytes the in-process idempotency records hold: each finished or released "
        "record's stored response and its key, fingerprint and bookkeeping (0.5-0.7 KB "
        "besides its key and answer); beyond it, as `max_records`. Records being processed are "
        "not counted (as many as requests in flight). What they hold: `/stats` `idempotency`, "
        "`carpool_idempotency_bytes`.",
    )
    lease: float = Field(
        6.0,
        gt=0,
        le=LONGEST_TTL,
        description="With `redis`: seconds a record being processed "
        "is held unless its instance renews it (every lease/3 while the request "
        "runs): a retry on another instance after this one died runs within "
        "about this long. Longer than a Redis pause you want to ride out.",
    )


class LimitsConfig(Section):
    max_body_bytes: int = Field(
        8 * 1024 * 1024,
        gt=0,
        description="Largest request body accepted; larger ones get 413. Pass-through uploads "
        "(`/v1/files`, `/v1/uploads`) too: raise it for the files your clients upload. A "
        "pass-through body past 1 MiB goes to the upstream as it comes, never held whole in "
        "memory; one past the limit is cut there, and the upstream never gets it whole.",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        gt=0,
        description="Largest total size of a request's "
        "header names and values (431 beyond it), and of its target, path and query (414; "
        "65,535 bytes at most whatever this says, the longest uvicorn's URL parser takes); "
        "a chunked body's trailer fields count as headers (and are dropped). Counted as they "
        "arrive; the connection is closed after the answer (the gateway forwards headers "
        "upstream, and uvicorn's HTTP parser sets no limit).",
    )
    upstream_timeout: float = Field(
        600,
        gt=0,
        description="Seconds to wait for the upstream's answer before 504. A whole answer, "
        "head and body, must come within it of the call being sent, however it trickles in; "
        "a stream's first event within it of the call, and each next event within it of the "
        "one before (SSE comments, such as keep-alive pings, are no event). The call's "
        "connection is then closed. Pass-through answers, relayed as they come, get it "
        "between two reads.",
    )
    upstream_connect_timeout: float = Field(
        10, gt=0, description="Seconds to wait for a connection to the upstream before 502."
    )
    upstream_keepalive: float = Field(
        4.0,
        gt=0,
        description="Seconds an idle connection to an upstream is kept for the next call. "
        "Keep it below the upstream server's own idle timeout (uvicorn's, hence vLLM's and "
        "SGLang's, and llama.cpp's server's: 5 s), so that the gateway closes an idle "
        "connection before the server does. A call whose kept connection the server has "
        "closed anyway goes on a new connection, and so, once, does one dropped before it "
        "was written whole; one the server may have read whole is never sent again.",
    )
    upstream_max_connections: int = Field(
        1000,
        gt=0,
        description="Pooled connections per replica; a request beyond waits for one, in turn "
        "(first come, first served): a cached endpoint's call for at most "
        "`upstream_queue_timeout`, a pass-through call without a time limit. Per pool: the "
        "cached endpoints' calls and pass-through calls have one each, and so has each worker "
        "process (serve --workers).",
    )
    upstream_queue_timeout: float = Field(
        10,
        gt=0,
        description="Seconds a cached endpoint's call may wait for a connection to its "
        "replica when all `upstream_max_connections` are in use (long streams hold theirs as "
        "long as they run; pass-through calls wait without this bound). Past it: 503 "
        "gateway_overloaded with Retry-After, nothing sent and the replica not counted as "
        "failing (busy, not down); a cached endpoint's call is tried once on another replica "
        "first, if there is one (not a call already failed over, nor one for the replica "
        "holding its stored response). Twice it (the failover's wait too) must stay under "
        "`coalesce.join_timeout_ms`, so that the flight's joiners get its 503 rather than "
        "each making a call of its own that waits as long again: a value given above that "
        "is refused, the default is held to a third of a shorter join timeout.",
    )
    body_read_timeout: float = Field(
        30,
        gt=0,
        description="Seconds a client may take to send "
        "a whole request body (cached endpoints, pass-through, "
        "admin); a body still trickling in after that gets 408 and "
        "nothing is sent upstream (a pass-through body past 1 MiB, which goes on as it comes, "
        "is cut there: the upstream never gets it whole). A large upload must come within it: "
        "the time the client takes counts, not the upstream's taking it. Also the time for a request line and its headers, from "
        "the connection (its first request) or the request's first byte: 408 and the "
        "connection closed (closed alone if nothing came). An idle connection between "
        "requests is closed after `client_keepalive`.",
    )
    client_keepalive: float = Field(
        75,
        gt=0,
        description="Seconds an idle client connection is kept open for its next request "
        "(nginx's `keepalive_timeout`). Longer than clients keep theirs (the OpenAI and "
        "Anthropic SDKs, httpx: 5 s), so that the client closes an idle connection first: at "
        "uvicorn's 5 s, a request sent on a connection as the gateway closed it failed "
        "(connection reset, no answer; the SDKs retry it). Also the workers' relay (`--workers`, "
        "its client keeping one half as long) and `carpool bench`'s gateway.",
    )
    send_timeout: float = Field(
        60,
        gt=0,
        description="Seconds a client may go without reading any of what it is sent while "
        "more waits for it (its socket's buffers full): its connection is then closed, as if "
        "it had left (a stream it followed goes on for its other clients). A slow reader is "
        "not cut while it reads some. 60 s, as nginx's `send_timeout`: a stalled client no "
        "longer holds what it was sent (a flight's frames, a slice of a long answer) for as "
        "long as it keeps its connection open. Kept by `carpool serve`'s HTTP protocol; the "
        "app under another server has that server's limits.",
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
    max_json_containers: int = Field(
        100_000,
        ge=1,
        description="Most arrays and objects a request body may hold, in all; more gets 400 "
        "(`too_many_containers`) before it is parsed. Bytes alone do not bound what a body "
        "costs: 8 MB of `[[...]]` is millions of lists, parsed, checked and copied on the "
        "event loop (5-9 s, every request waiting). A conversation of thousands of messages, "
        "2,048 token lists or a deep tool schema hold far fewer.",
    )


class PassthroughConfig(Section):
    """Which other `/v1/...` paths are forwarded to an upstream (never cached)."""

    allow: list[str] = Field(
        default_factory=lambda: ["/"],
        description="Path prefixes, relative to the upstream's "
        "/v1, that pass-through forwards, matched by whole segments (`/models` allows "
        "`/v1/models` and `/v1/models/x`, not `/v1/modelsx`); other paths get 403. `/` = "
        "everything under /v1; [] = pass-through off. Unset while the gateway holds the "
        "upstream's credential (`upstream.api_key` / `api_keys`, or a user and password in an "
        "upstream URL): `[/models]`, the account's stored state being every client's. Whatever the list, a path with a dot "
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


class AuthConfig(Section):
    """Who may use the gateway at all, with keys the gateway holds (instead of the upstream's)."""

    client_keys_file: str | None = Field(
        None,
        description="A UTF-8 file (a byte order mark at its start is skipped) of the client "
        "keys the gateway accepts, one per line: the key "
        "itself, or its SHA-256 in hex (64 hex digits, `sha256:` before them allowed: a key "
        "that is itself 64 hex digits is listed by its digest; a line starting with `#` is a "
        "comment). "
        "With it, a "
        "request to /v1/... without a listed key (`Authorization: Bearer`, `api-key` or "
        "`x-api-key`) gets 401 before anything is read, cached or shared; each key is its own "
        "tenant. Read at start-up, once for the run (with `--workers`, every worker, one "
        "started later too, admits the keys listed then; restart to change them). "
        "null: no check (the upstream judges the keys).",
    )

    @field_validator("client_keys_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not Path(value).is_file():
            raise ValueError(f"{value!r} is not a file")
        # Read now as ``serve`` reads it: check-config refuses what serve would fail on (a
        # traceback at start-up; with --workers, each worker's, restarted for ever).
        from ..auth import ClientKeys

        try:
            ClientKeys.load(value)
        except UnicodeDecodeError:
            raise ValueError(f"{value!r} is not UTF-8 text") from None
        except OSError as exc:
            raise ValueError(f"{value!r} cannot be read ({exc.strerror})") from None
        return value


class ShutdownConfig(Section):
    """What ``carpool serve`` does on SIGTERM (a rolling deploy, a scale-down)."""

    drain_s: float = Field(
        5.0,
        ge=0,
        description="Seconds between SIGTERM and closing the listening socket: /readyz answers "
        "503 meanwhile, so that load balancers stop sending, while requests are still served, each "
        "answer saying `Connection: close` (a proxy keeps no connection the end would close). "
        "(One worker. With `workers` > 1 the workers stop at once, while uvicorn's parent "
        "keeps the socket open until the run exits: a connection made meanwhile waits, then is "
        "reset; take the instance out of the load balancer before SIGTERM.)",
    )
    grace_s: float = Field(
        30.0,
        ge=0,
        description="Seconds the requests in progress then have to finish (flights and their "
        "waiters get their answers, streams end properly) before the process exits anyway: "
        "those still running then are cut, a reply not begun as a 503 with Retry-After in its "
        "API's error shape (pass-through's too, in OpenAI's), a stream under way with its API's "
        "error event and its end (a pass-through answer being relayed: its connection closed, "
        "never its body ended as if whole), each cut logged at INFO (uvicorn's count of them "
        "too), not as an error. Requests waiting in an embeddings batch are sent "
        "as the drain begins, whatever `batching.max_batch_delay_ms`. A second signal once "
        "stopping (Ctrl-C twice) changes nothing; a third ends the grace period at once, "
        "cutting those requests so (one worker; with `workers` > 1 a Ctrl-C after the first "
        "changes nothing, and a worker still running 15 s past the grace period is killed). "
        "Give the platform's stop timeout more than `drain_s` + `grace_s` (35 s by default; "
        "Kubernetes' terminationGracePeriodSeconds is 30 s by default, `docker stop` waits "
        "10 s): its SIGKILL cuts the requests with no 503 and leaves a Redis Idempotency-Key "
        "record in progress until its lease ends.",
    )
