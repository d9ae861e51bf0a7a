"""The whole configuration: the top-level keys and one section per layer.

Contract: ``Config()`` is all defaults and reads nothing; ``Config.load`` merges the sources
(carpool.config.loader) and validates. Nested sections are the models of caching, perimeter,
upstream and distributed; ``ttl_for`` is the one rule that reads the cache's TTL policy, and
``holds_upstream_credentials`` the one that says whether the gateway holds the credential its
replicas are called with (a key, ``upstream.api_key``/``api_keys``, or a user and password in
an upstream URL): then pass-through reaches only /v1/models unless ``passthrough.allow`` is set.
``with_secrets`` is what a child process rebuilds exactly this config from (``from_secrets``): the
keys given (a validator may tell them from defaults), secrets included, each held key resolved. The top-level keys that could never
work are refused: an empty ``host`` (every interface, unsaid) or one no socket could take
(``urls.checked_host``), an ``admin_token`` that is empty or that no header could carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from .base import OnOff, Section
from .caching import CacheConfig, CoalesceConfig, FingerprintConfig, SemanticConfig
from .distributed import DistributedConfig
from .perimeter import (
    AuthConfig,
    IdempotencyConfig,
    LimitsConfig,
    PassthroughConfig,
    ShutdownConfig,
    TenantConfig,
)
from .upstream import BatchingConfig, RoutingConfig, SimConfig, UpstreamConfig, keys_resolved
from .urls import any_credentials, checked_host, checked_url


class Config(Section):
    """The whole configuration. Build it with ``Config.load``; a plain ``Config()`` is all defaults."""

    upstreams: list[str] = Field(
        default_factory=list,
        description="Base URLs of OpenAI-compatible replicas, ending in /v1 (the path the API's "
        "paths, `/chat/completions`..., are appended to); empty = the embedded simulated engine. "
        "One whose path ends otherwise (a provider's `/v1beta/openai`) is used as given, and "
        "start-up logs a warning naming it (without its user and password), in case /v1 was "
        "left out. A query in one (Azure's `?api-version=`) is sent with every call to it, "
        "cached and passed through, before the client's own. A user and password in one "
        "(`https://user:pass@host/v1`) are a credential the gateway holds, as `upstream.api_key` "
        "is: sent as `Authorization: Basic` in place of the client's credentials, with the same "
        "protections (pass-through reaches only /v1/models unless `passthrough.allow` is set); "
        "never shown.",
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
    admin_token: str | None = Field(
        None,
        json_schema_extra={"secret": True},  # (an empty variable is refused: carpool.config.loader)
        description="The token that enables /admin/* and guards /stats, /metrics and /dashboard: "
        "`Authorization: Bearer <token>` (the scheme in any case), or, for /stats, /metrics and /dashboard (a browser asks for it), the password of Basic. "
        "Printable, without white space around it (a header value cannot carry that). An empty "
        "one, `''` in the file or `CARPOOL_ADMIN_TOKEN=`, is refused (a secret that was not "
        "mounted): give one, or null for none. null: /admin/* does not exist and the others are "
        "open to whoever reaches the port (start-up warns when that is beyond loopback).",
    )
    sampling: Literal["strict", "same-params"] = Field(
        "strict",
        description="strict: sampled "
        "requests bypass unless they opt in; "
        "same-params: they share with identical "
        "parameters.",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address the gateway listens on: an IP address (IPv6 with or without "
        "brackets) or a host name (no scheme or port). Every interface: `0.0.0.0` or `::` (or "
        "IPv4's short form `0`); an empty host, which would mean every interface too, is refused.",
    )
    allowed_hosts: list[str] | None = Field(
        None,
        description="Host names a request may name in its `Host` header; any other name gets "
        "403 `host_not_allowed` (an IP address, or no `Host`, is always accepted; `*`: any "
        "name). null: any name, but under `carpool serve` listening on loopback, where it is "
        "`[localhost]`: a web page the operator opens cannot reach the gateway by a name of "
        "its own made to resolve to 127.0.0.1 (DNS rebinding). A proxy on this machine that "
        "passes its clients' `Host` on (nginx's `proxy_set_header Host $host`) needs its "
        "names here.",
    )
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="Gateway processes serving one port. With `redis` they share "
        "through it; without, through each other: each key's upstream calls are made by the "
        "worker that owns it, every worker keeping the answers it served (docs/scaling.md).",
    )
    port: int = Field(8080, ge=0, le=65535, description="Port the gateway listens on.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: `time level logger [request id] message`; json: one object per line "
        "(time, level, logger, request_id, message) for log shippers.",
    )
    tracing: OnOff = Field(
        "auto",
        description="OpenTelemetry spans per "
        "layer (extra otel). auto: when a tracer "
        "provider is installed (e.g. by "
        "opentelemetry-instrument); on: always (without the otel extra, serve and "
        "check-config exit 2 saying so).",
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
    auth: AuthConfig = Field(default_factory=AuthConfig)
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    sim: SimConfig = Field(default_factory=SimConfig)

    @field_validator("upstreams")
    @classmethod
    def _upstreams_are_urls(cls, value: list[str]) -> list[str]:
        return [checked_url(url.rstrip("/"), ("http", "https")) for url in value]

    @field_validator("host")
    @classmethod
    def _an_address(cls, value: str) -> str:
        return checked_host(value)

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, value: list[str] | None) -> list[str] | None:
        # As a ``Host`` header is compared (``server.host_named``): lower case, no final dot.
        if value is None:
            return None
        names = [name.strip().lower().rstrip(".") for name in value]
        if not all(names) or any(":" in n or "/" in n or " " in n for n in names):
            raise ValueError("give host names (or *), without a scheme or a port")
        return names

    @field_validator("admin_token")
    @classmethod
    def _a_token_a_client_can_present(cls, value: str | None) -> str | None:
        # As a held key (``upstream.held_key``): an empty token would silently mean "none", the
        # admin surfaces open. One with white space around it or a control character could
        # never be sent in a header (its value is stripped), a lone surrogate never encoded.
        if value is None:
            return None
        if not value.strip():
            raise ValueError("the token is empty: give one, or null for none")
        if value != value.strip() or not value.isprintable():
            raise ValueError(
                "the token must be printable, without white space around it (a header value "
                "cannot carry that)"
            )
        return value

    @field_validator("redis")
    @classmethod
    def _redis_is_a_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        checked_url(value, ("redis", "rediss", "unix"))
        from ..redis.connection import url_problem  # (the one package that imports redis-py)

        problem = url_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

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

    @model_validator(mode="after")
    def _one_key_per_upstream(self) -> Config:
        keys = len(self.upstream.api_keys)
        if keys and keys != len(self.upstreams):
            raise ValueError(
                f"upstream.api_keys: give one key per upstream ({len(self.upstreams)}), or none"
            )
        if self.holds_upstream_credentials() and "allow" not in self.passthrough.model_fields_set:
            # With one credential for every client, the upstream account's stored state (stored
            # chat completions, responses, files, batches) would be every client's:
            # pass-through reaches only the model list unless the operator lists more.
            self.passthrough = PassthroughConfig(allow=["/models"])
        return self

    @model_validator(mode="after")
    def _a_flights_queue_wait_ends_before_its_joiners_leave(self) -> Config:
        """A flight's call waits ``limits.upstream_queue_timeout`` at most for a connection to
        its replica, and as long again on another one (``ReplicaSet.send``'s one failover).
        Its joiners wait ``coalesce.join_timeout_ms`` for it, then each makes its own call,
        which would queue as long again: a queue timeout given that twice would reach the join
        timeout is refused. The default alone is held to a third of a join timeout that short
        (as ``coalesce.max_window_ms`` alone holds the window): such a config was accepted
        before the check."""
        join_s = self.coalesce.join_timeout_ms / 1000
        queue_s = self.limits.upstream_queue_timeout
        if 2 * queue_s < join_s:
            return self
        if "upstream_queue_timeout" in self.limits.model_fields_set:
            raise ValueError(
                f"limits.upstream_queue_timeout ({queue_s:g} s) may be waited twice by one call "
                f"(once more on another replica), which reaches coalesce.join_timeout_ms "
                f"({self.coalesce.join_timeout_ms:g}): its joiners would each make a call of "
                "their own; give a queue timeout under half the join timeout"
            )
        self.limits.upstream_queue_timeout = join_s / 3
        return self

    def holds_upstream_credentials(self) -> bool:
        """Whether the gateway holds a credential for its upstreams, sent in place of the
        client's: a key (``upstream.api_key`` / ``api_keys``; one the simulated engine ignores)
        or a user and password in any replica's URL (``urls.any_credentials``). Each replica's
        own is decided so by ``upstream.http`` (``HttpUpstream._held``: its key, its URL)."""
        return (
            self.upstream.api_key is not None
            or bool(self.upstream.api_keys)
            or any_credentials(tuple(self.upstreams))
        )

    def with_secrets(self) -> dict[str, Any]:
        """The config as JSON-able data from which a child process rebuilds exactly this one
        (``Config.model_validate``, or ``Config.load`` of it written as a file: a 0600 one),
        its secrets included: never for a log or a page. Only the keys that were given (or
        assigned since) are written, as given: a default is left to be the default again, so
        that a validator that tells a given value from a default (``coalesce``'s bound, the
        held key's ``passthrough.allow``) decides in the child as it did here."""
        return _given(self)

    @classmethod
    def from_secrets(cls, data: Mapping[str, Any]) -> Config:
        """The config ``data`` (``with_secrets``, perhaps changed) describes: its held keys are
        values already, taken as they are (``upstream.keys_resolved``), even one that looks like
        ``${NAME}``."""
        with keys_resolved():
            return cls.model_validate(data)

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
        """Merge the file, the environment (``os.environ`` unless ``env`` is given) and explicit
        overrides over the defaults, then validate; ``ConfigError`` names any bad value."""
        # Imported here: the loader builds its settings class from this one.
        from .loader import load

        return load(path, env, overrides)


def _given(section: BaseModel) -> dict[str, Any]:
    """``section``'s fields that were given or assigned (``model_fields_set``), as JSON-able
    data, each secret (``SecretStr``) as its value."""
    data: dict[str, Any] = section.model_dump(mode="json", exclude_unset=True)
    for name in section.model_fields_set:
        value = getattr(section, name)
        if isinstance(value, SecretStr):
            data[name] = value.get_secret_value()
        elif isinstance(value, list) and any(isinstance(item, SecretStr) for item in value):
            data[name] = [
                item.get_secret_value() if isinstance(item, SecretStr) else item for item in value
            ]
        elif isinstance(value, BaseModel):
            data[name] = _given(value)
    return data
