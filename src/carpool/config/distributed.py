"""The section of how instances share Redis/Valkey (used when ``redis`` is set).

Contract: every tunable of the shared store lives here, with its unit and default in its
description (the config reference, docs/config.md, is generated from them); carpool.redis reads
these fields. Durations are seconds unless the name ends in ``_ms``.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from .base import LONGEST_TTL, Section


class DistributedConfig(Section):
    """How instances share Redis/Valkey (used when `redis` is set)."""

    key_prefix: str = Field(
        "carpool:",
        min_length=1,
        description="Prefix of every key carpool "
        "writes (no `{` or `}`: they are Redis Cluster hash tags). Two fleets sharing one "
        "Redis (staging and production) must each have their own: the upstreams are not in "
        "the keys, so fleets with one prefix serve each other's answers.",
    )

    @field_validator("key_prefix")
    @classmethod
    def _no_hash_tag(cls, value: str) -> str:
        # (Checked again where the keys are made; here so that check-config refuses it too.)
        if "{" in value or "}" in value:
            raise ValueError("must not contain '{' or '}' (Redis Cluster hash tags)")
        return value

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
        "all busy waits for one (on a cluster only idempotency records wait). "
        "A connection Redis refuses past its maxclients is counted as "
        "`max_clients` and handled as a busy pool: Redis is not marked down.",
    )
    pool_timeout: float = Field(
        5.0,
        gt=0,
        description="Seconds a Redis call may wait for a free "
        "connection; past it the call runs without Redis (counted as "
        "`pool_exhausted`, logged) but Redis is not marked down. A request "
        "with an Idempotency-Key is then refused (503, Retry-After) rather "
        "than run without its shared record.",
    )
    retry_interval: float = Field(
        1.0,
        gt=0,
        description="While Redis is unavailable, seconds between two attempts to use it again.",
    )
    log_interval: float = Field(
        30.0,
        gt=0,
        description="Seconds between two log lines about Redis being unavailable (the first "
        "line of each degraded period is always logged).",
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
        le=LONGEST_TTL * 1000,
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
        "once it is complete. It bounds the shared semantic stream too (one "
        "record per stored answer, read by every instance): an instance "
        "whose reader falls that far behind forgets its semantic entries, and "
        "a follower that falls that far behind a stream (an upstream faster than "
        "it reads, an answer of more chunks) ends its streaming clients' answer "
        "with an error event.",
    )
