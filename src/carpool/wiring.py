"""Each layer of the gateway built from the one config: ``build_layers`` assembles them into
``Layers``, ``build_gateway`` runs requests through them (``Gateway``).

Contract: every function here only constructs (no I/O, nothing started: ``Layers.start`` does);
a layer whose config is off is ``None``; optional layers import their dependencies (the
``semantic`` and ``redis`` extras) only when they are on. A layer given to ``build_layers`` or
``build_gateway`` (upstreams, store, semantic cache, flights, idempotency records, a worker's
peers) is used as it is, instead of the one the config would build. ``embedder: upstream``
with no credentials of the gateway's for its /v1/embeddings (``semantic.embedder_api_key``, a
held key or a URL's user) is warned about as it is built: an upstream that wants a key refuses
every embedding; so is a judge sent through the replicas with none
(``semantic.judge.api_key``). The embedder's texts are merged into one list call only where the
list check of the gateway's own /v1/embeddings batching (``batcher.lists``,
``batching.embeddings``) says lists are answered item by item, for its key and model
(``semantic.embed.upstream``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from typing_extensions import Unpack

from . import admin
from .answer import Answer
from .batching import EmbeddingBatcher, ListCheck
from .clock import SYSTEM_CLOCK, Clock
from .config import CoalesceConfig, Config
from .exchange import send
from .fingerprint import RepeatMemo, names_of, neutral_of
from .flight import FlightGroup
from .idempotency import (
    FallbackRecords,
    IdempotencyRecords,
    MemoryIdempotencyRecords,
)
from .identity import AcceptedCredentials
from .layers import Layers
from .metrics import Metrics, Stats
from .pipeline import Gateway
from .routing.state import StateHolders
from .semantic.audit import Audits, label_key
from .state_index import StateIndex
from .store import MemoryStore, Store
from .tracing import Tracer
from .upstream.base import Upstream, UpstreamRequest, UpstreamResponse
from .upstream.function import FunctionUpstream
from .window import AdaptiveWindow, FixedWindow, WindowPolicy

if TYPE_CHECKING:
    from .peers import Peers
    from .redis.flights import SharedFlights
    from .redis.idempotency import RedisIdempotencyRecords
    from .redis.invalidation import InvalidationChannel
    from .redis.semantic import SemanticInvalidations, SharedSemanticCache
    from .redis.store import RedisStore
    from .routing.replicas import ReplicaSet
    from .semantic.cache import SemanticCache
    from .semantic.guard import Guard
    from .semantic.judge import Judge
    from .store.shared import SharedStore

log = logging.getLogger("carpool.semantic")


class Given(TypedDict, total=False):
    """The layers ``build_gateway``/``build_layers`` take as given instead of building them."""

    upstreams: Sequence[Upstream]
    store: Store | None
    semantic: SemanticCache | None
    flights: FlightGroup | None
    idempotency: IdempotencyRecords | None
    peers: Peers | None
    clock: Clock


def build_gateway(config: Config | None = None, **given: Unpack[Given]) -> Gateway:
    """A gateway on the layers ``config`` makes (``build_layers``, which takes the same
    ``given`` layers; the default config without one). Close it with ``aclose``."""
    return Gateway(build_layers(config, **given))


def build_layers(
    config: Config | None = None,
    *,
    upstreams: Sequence[Upstream] = (),
    store: Store | None = None,
    semantic: SemanticCache | None = None,
    flights: FlightGroup | None = None,
    idempotency: IdempotencyRecords | None = None,
    peers: Peers | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> Layers:
    """Every layer of one gateway; those given are used as they are (no upstreams given: the
    config's, or the simulated engine's). ``clock``: the time every in-process layer reads
    (stores, flights, records, accepted credentials, answers' ages); tests move a manual one."""
    config = config or Config()
    if not upstreams:
        from .upstream import build_upstreams

        upstreams = build_upstreams(config)
    upstreams = list(upstreams)
    for upstream in upstreams:
        if isinstance(upstream, FunctionUpstream) and upstream.timeout is None:
            upstream.timeout = config.limits.upstream_timeout  # (an HTTP upstream's bound too)
    store = store if store is not None else build_store(config, clock)
    shared_flights = build_shared_flights(config, store)
    coalesce = config.coalesce
    if flights is None:
        flights = FlightGroup(
            window=window_policy(coalesce), finish_abandoned=coalesce.finish_abandoned, clock=clock
        )
    # With redis: an invalidation anywhere forgets the flights on every instance, running
    # ones included (their answers are no longer stored).
    invalidations = build_invalidations(config, store, flights.forget_all)
    # The tenants the upstream answered recently: only they read a shared namespace.
    tenant = config.tenant
    accepted = AcceptedCredentials(tenant.accepted_ttl, tenant.accepted_max_entries, clock=clock)
    # (Calls this machine could not open a connection for: to a replica, or to the worker that
    # owns a key, ``carpool.peers``.)
    stats = Stats(
        attempts=lambda: replicas.attempts(),
        overloaded=lambda: replicas.overloaded + (peers.overloaded if peers is not None else 0),
    )
    tracer = Tracer(config.tracing)
    repeats = RepeatMemo(
        names_of(config.tenant),
        config.fingerprint.repeat_memo_bytes,
        min(64 * 1024, config.limits.max_body_bytes),
        neutral_of(config.fingerprint),
    )
    # The gauges and the batcher's calls read the layers once they are all built (below).
    metrics = Metrics(stats, lambda: admin.gauges(layers))
    replicas = build_replicas(config, upstreams, stats.observe_attempt, stats.count_decision)
    # Single embeddings are merged into list calls (identical ones were coalesced before),
    # but only where every replica is known to answer a list as it answers each item alone
    # (batching.embeddings; ``ListCheck``): merging must not change an answer.
    batching = config.batching
    from .routing.replicas import OwnCalls

    batcher = EmbeddingBatcher(
        lambda upstream_request: send(layers, upstream_request, ""),
        max_batch_size=batching.max_batch_size,
        max_batch_delay_s=batching.max_batch_delay_ms / 1000,
        max_batch_tokens=batching.max_batch_tokens,
        observe_wait=metrics.batch_wait.observe,
        observe_size=metrics.batch_size.observe,
        key_headers=names_of(config.tenant),
        neutral_headers=neutral_of(config.fingerprint),
        lists=ListCheck(
            batching.embeddings,
            [OwnCalls(replicas, i) for i in range(len(upstreams))],
            retry_s=batching.embeddings_probe_retry,
        ),
    )

    async def via_replicas(request: UpstreamRequest) -> UpstreamResponse:
        return await _via_replicas(layers, request)  # (``layers``: built below)

    judge = build_judge(config, via_replicas)
    if semantic is None:
        # (``batcher.lists``: the embedder's lists are merged only where the gateway's would be)
        semantic = build_semantic(config, via_replicas, store, judge, clock, batcher.lists)
    if semantic is not None and config.semantic.max_wrong_rate and not config.semantic.audit_rate:
        log.warning(
            "semantic.max_wrong_rate: with semantic.audit_rate 0 no hit is audited, so only "
            "feedback (POST /admin/semantic/feedback) moves the error budget; set "
            "semantic.audit_rate to audit a share of the hits"
        )
    audits = (
        Audits(
            config.semantic.audit_rate,
            config.semantic.audit_window,
            config.semantic.max_wrong_rate,
            label_key=label_key(config.admin_token),
        )
        if semantic is not None
        else None
    )
    if idempotency is None:
        idempotency = build_idempotency(config, store, clock)
    layers = Layers(
        config=config,
        upstreams=upstreams,
        replicas=replicas,
        store=store,
        flights=flights,
        idempotency=idempotency,
        accepted=accepted,
        repeats=repeats,
        batcher=batcher,
        stats=stats,
        metrics=metrics,
        tracer=tracer,
        semantic=semantic,
        judge=judge,
        audits=audits,
        shared_flights=shared_flights,
        invalidations=invalidations,
        shared_store=_redis_backed_store(config, store),
        shared_semantic=_redis_backed_semantic(config, semantic),
        semantic_invalidations=build_semantic_invalidations(config, store, semantic),
        shared_idempotency=_redis_backed_idempotency(config, idempotency),
        local_idempotency=_in_process_idempotency(idempotency),
        peers=peers,
        clock=clock,
        holders=StateHolders(config.routing.state_entries),
        states=StateIndex(config.routing.state_entries),
    )
    return layers


def _redis_backed_store(config: Config, store: Store) -> SharedStore | None:
    """``store`` as the Redis-backed store it is, with ``redis`` (what admin reads of Redis)."""
    if not config.redis:
        return None
    from .store.shared import SharedStore

    return store if isinstance(store, SharedStore) else None


def _redis_backed_semantic(
    config: Config, semantic: SemanticCache | None
) -> SharedSemanticCache | None:
    """``semantic`` as the semantic cache shared through Redis it is, with ``redis``."""
    if not config.redis or semantic is None:
        return None
    from .redis.semantic import SharedSemanticCache

    return semantic if isinstance(semantic, SharedSemanticCache) else None


def _redis_backed_idempotency(
    config: Config, idempotency: IdempotencyRecords
) -> RedisIdempotencyRecords | None:
    """The records in Redis that ``idempotency`` falls back from, with ``redis``."""
    if not config.redis or not isinstance(idempotency, FallbackRecords):
        return None
    from .redis.idempotency import RedisIdempotencyRecords

    shared = idempotency.shared
    return shared if isinstance(shared, RedisIdempotencyRecords) else None


def _in_process_idempotency(idempotency: IdempotencyRecords) -> MemoryIdempotencyRecords | None:
    """The records ``idempotency`` keeps in this process's memory: itself, or its fallback."""
    if isinstance(idempotency, FallbackRecords):
        return idempotency.local
    return idempotency if isinstance(idempotency, MemoryIdempotencyRecords) else None


def window_policy(coalesce: CoalesceConfig) -> WindowPolicy:
    if coalesce.adaptive:
        return AdaptiveWindow(
            coalesce.window_ms / 1000,
            coalesce.min_window_ms / 1000,
            coalesce.max_window_ms / 1000,
            coalesce.adaptive_tradeoff,
            coalesce.adaptive_keys,
        )
    return FixedWindow(coalesce.window_ms / 1000)


def build_store(config: Config, clock: Clock = SYSTEM_CLOCK) -> Store:
    """The in-process exact cache, or (with ``redis``) the shared one that degrades to it."""
    local = MemoryStore(config.cache.max_bytes, clock=clock)
    if not config.redis:
        return local
    from .store.shared import SharedStore

    d = config.distributed
    return SharedStore(
        _redis_store(config, clock),
        local,
        retry_interval=d.retry_interval,
        log_interval=d.log_interval,
    )


def _redis_store(config: Config, clock: Clock = SYSTEM_CLOCK) -> RedisStore:
    from .redis.store import RedisStore

    assert config.redis is not None
    d = config.distributed
    return RedisStore(
        config.redis,
        prefix=d.key_prefix,
        socket_timeout=d.timeout,
        connect_timeout=d.connect_timeout,
        max_connections=d.max_connections,
        pool_timeout=d.pool_timeout,
        cluster=d.cluster,
        clock=clock,
    )


def _shared_redis(
    config: Config, store: Store | None
) -> tuple[RedisStore, SharedStore | None, bool]:
    """The Redis connection a layer should use: the shared store's, with its health (so every
    layer sees one degraded mode), or, without a shared store, a new one the layer owns."""
    from .store.shared import SharedStore

    if isinstance(store, SharedStore):
        return store.redis, store, False
    return _redis_store(config), None, True


def build_shared_flights(config: Config, store: Store) -> SharedFlights | None:
    """Cross-instance flights (with ``redis``), on the shared store's client when there is one."""
    d = config.distributed
    if not config.redis or not d.shared_flights:
        return None
    from .redis.flights import SharedFlights

    redis, health, owned = _shared_redis(config, store)
    return SharedFlights(
        redis.client,
        prefix=d.key_prefix,
        lease_ms=d.lease_ms,
        stream_maxlen=d.stream_maxlen,
        join_timeout=config.coalesce.join_timeout_ms / 1000,
        linger_ms=config.coalesce.window_ms,
        socket_timeout=d.timeout,
        health=health,
        owns_client=owned,
    )


def build_invalidations(
    config: Config, store: Store, forget: Callable[[], int]
) -> InvalidationChannel | None:
    """With ``redis``: the channel that makes an invalidation on any instance ``forget`` (the
    finished flights lingering in the coalescing window) on every other one."""
    if not config.redis:
        return None
    from .redis.invalidation import InvalidationChannel

    d = config.distributed
    redis, health, owned = _shared_redis(config, store)
    return InvalidationChannel(
        redis.client,
        forget,
        prefix=d.key_prefix,
        socket_timeout=d.timeout,
        retry_interval=d.retry_interval,
        health=health,
        owns_client=owned,
        refusal_retry_s=config.tenant.accepted_ttl,
    )


def build_semantic_invalidations(
    config: Config, store: Store, semantic: SemanticCache | None
) -> SemanticInvalidations | None:
    """With ``redis`` and no semantic cache: what publishes this instance's invalidations to the
    semantic caches of the others, which a fleet mid-change may have (their entries held with
    their answers are dropped by nothing else)."""
    if not config.redis or semantic is not None:
        return None
    from .redis.semantic import SemanticInvalidations

    d = config.distributed
    redis, health, owned = _shared_redis(config, store)
    return SemanticInvalidations(
        redis.client,
        prefix=d.key_prefix,
        maxlen=d.stream_maxlen,
        health=health,
        owns_client=owned,
    )


def build_idempotency(
    config: Config, store: Store | None = None, clock: Clock = SYSTEM_CLOCK
) -> IdempotencyRecords:
    """Idempotency records: in process, or shared through Redis with an in-process fallback."""
    processing_ttl = config.limits.upstream_timeout + 60
    idempotency = config.idempotency
    local = MemoryIdempotencyRecords(
        idempotency.retention,
        processing_ttl,
        max_records=idempotency.max_records,
        max_bytes=idempotency.max_bytes,
        clock=clock,
        behind_redis=bool(config.redis),
    )
    if not config.redis:
        return local
    from .redis.idempotency import RedisIdempotencyRecords

    # On the shared store's connection pool and health, as every Redis layer (one degraded
    # state, one count of failures and of full pools). Shared records are leased for seconds
    # and renewed while the request runs, so a dead instance's key is free again soon; the
    # in-process ones die with their process.
    redis, health, owned = _shared_redis(config, store)
    return FallbackRecords(
        RedisIdempotencyRecords(
            redis.client,
            retention=config.idempotency.retention,
            lease=config.idempotency.lease,
            prefix=config.distributed.key_prefix,
            owns_client=owned,
            health=health,
            pool_timeout=config.distributed.pool_timeout,
            clock=clock,
        ),
        local,
    )


async def _via_replicas(layers: Layers, request: UpstreamRequest) -> UpstreamResponse:
    # (Not an upstream call saved; its 5xx is about a client's text, not the replica: ``own``.)
    response, _, _ = await layers.replicas.send(request, "", own=True)
    return response


def build_judge(
    config: Config,
    via_replicas: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]],
) -> Judge | None:
    """The judge (``semantic.judge.model`` set, semantic on): at ``semantic.judge.url``, else
    through the gateway's replicas."""
    settings = config.semantic.judge
    if not config.semantic.enabled or settings.model is None:
        return None
    from .semantic.judge import Judge, asking

    send, closing = via_replicas, None
    # Through the replicas, the judge's calls carry judge.api_key, or the key the gateway holds
    # (which replaces it there): never a client's. (The simulated engine wants no key.)
    if (
        settings.url is None
        and settings.api_key is None
        and config.upstreams
        and not config.holds_upstream_credentials()
    ):
        log.warning(
            "semantic.judge: its calls through the upstreams carry no credentials "
            "(semantic.judge.api_key and upstream.api_key unset, no user in an upstream URL): "
            "right for a keyless upstream; one that wants a key refuses every judge call and "
            "the judge never serves (set semantic.judge.api_key)"
        )
    if settings.url is not None:
        from .upstream.http import HttpUpstream
        from .upstream.proxy import usable_proxy

        proxy = usable_proxy(settings.url, config.upstream.proxy)
        server = HttpUpstream(settings.url, config.limits, name="judge", proxy=proxy)
        send, closing = server.send, server.aclose
    return Judge(
        asking(send, None if settings.api_key is None else settings.api_key.get_secret_value()),
        model=settings.model,
        timeout=settings.timeout_ms / 1000,
        max_tokens=settings.max_tokens,
        cache_entries=settings.cache_entries,
        closing=closing,
    )


def build_semantic(
    config: Config,
    via_replicas: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]] | None = None,
    store: Store | None = None,
    judge: Judge | None = None,
    clock: Clock = SYSTEM_CLOCK,
    lists: ListCheck | None = None,
) -> SemanticCache | None:
    """The semantic cache when ``semantic.enabled`` (its dependencies are the [semantic] extra);
    with ``redis`` (and ``store``, the exact store that resolves other instances' entries), one
    shared with every instance (``redis/semantic.py``). ``via_replicas``: a call through the
    gateway's replicas (their health, back-off and failover), which ``embedder: upstream``
    needs, with ``lists``: whether its texts may be merged into one list call (the gateway's
    ``batcher.lists``; None: no probe, merged only with ``batching.embeddings: on``).
    ``clock``: what the entries' expiry is read on (the answers' ``created``)."""
    if not config.semantic.enabled:
        return None
    from .semantic.guard import RulesThenVerifier
    from .semantic.verifier import shared_cross_encoder

    embedder = _embedder(config, via_replicas, lists)
    guard: Guard = RulesThenVerifier(
        shared_cross_encoder(config.semantic.verifier_dir),
        threshold=config.semantic.verifier_threshold,
    )
    if judge is not None:
        from .semantic.judge import JudgedGuard

        settings = config.semantic.judge
        guard = JudgedGuard(guard, judge, settings.band, settings.overrules, settings.verifier_band)
    if not config.redis or store is None:
        from .semantic.cache import SemanticCache

        return SemanticCache(config.semantic, embedder, guard, clock=clock)
    from .redis.semantic import SharedSemanticCache

    d = config.distributed
    redis, health, owned = _shared_redis(config, store)
    shared_store = store

    async def resolve(key: str) -> Answer | None:
        entry = await shared_store.get(key)
        if entry is None and health is not None and health.degraded:  # (Redis not asked)
            from .store.base import StoreUnavailable

            raise StoreUnavailable("redis degraded: another instance's answer is unknown")
        return entry.answer if entry is not None else None

    return SharedSemanticCache(
        config.semantic,
        embedder,
        guard,
        resolve,
        redis.client,
        prefix=d.key_prefix,
        maxlen=d.stream_maxlen,
        socket_timeout=d.timeout,
        retry_interval=d.retry_interval,
        health=health,
        owns_client=owned,
        clock=clock,
    )


def _embedder(
    config: Config,
    via_replicas: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]] | None,
    lists: ListCheck | None = None,
) -> Any:
    from .semantic.embed import LocalEmbedder, UpstreamEmbedder
    from .semantic.embed.upstream import embeddings_through

    s = config.semantic
    if s.embedder == "local":
        return LocalEmbedder(
            s.model_dir,
            max_batch=s.batch_size,
            max_delay_s=s.batch_delay_ms / 1000,
            precision=s.embedder_precision,
            timeout_s=s.embed_timeout_s(),
        )
    if via_replicas is None:
        raise ValueError("semantic.embedder: upstream embeds through the gateway's replicas")
    # Every tenant's prompts, batched together: under the embedder's key, never a client's (a
    # key the gateway holds replaces it on its replicas: ``upstream.http``).
    key = s.embedder_api_key.get_secret_value() if s.embedder_api_key is not None else None
    headers = {"authorization": f"Bearer {key}"} if key else {}
    # (The simulated engine wants no key.)
    if key is None and config.upstreams and not config.holds_upstream_credentials():
        log.warning(
            "semantic.embedder: upstream: its /v1/embeddings calls carry no credentials "
            "(semantic.embedder_api_key and upstream.api_key unset, no user in an upstream "
            "URL): right for a keyless "
            "upstream; one that wants a key refuses every embedding and the semantic cache "
            "never hits (set semantic.embedder_api_key)"
        )

    if lists is None:  # (built alone, no replicas to probe: merged only with ``on``)
        lists = ListCheck(config.batching.embeddings, [])
    return UpstreamEmbedder(
        # Through the replicas: a downed one is left out (its back-off), a failed call retried
        # once on another, and each attempt counted in ``upstream_calls`` (as the judge's).
        # A micro-batch is merged into one list call only where lists are known to be
        # answered item by item (``lists``): merging must not change a vector.
        embeddings_through(via_replicas, s.embedding_model, headers, lists),
        s.embedding_dim,
        name=f"upstream:{s.embedding_model}",
        max_batch=s.batch_size,
        max_delay_s=s.batch_delay_ms / 1000,
        timeout_s=s.embed_timeout_s(),
    )


def build_replicas(
    config: Config, upstreams: Sequence[Upstream], observe: Any, decided: Any = None
) -> ReplicaSet:
    """The replicas with their routing policy (cache-aware by default with several) and health.
    With keys that differ from replica to replica (``upstream.api_keys``), a refusal of one's
    key is that replica's failure (``own_keys``); with one key for all, the call's."""
    from .routing import build_policy
    from .routing.replicas import ReplicaSet

    routing = config.routing
    policy = build_policy(
        routing.policy if len(upstreams) > 1 else "round-robin", **routing.model_dump()
    )
    return ReplicaSet(
        upstreams,
        policy,
        backoff_s=routing.backoff_s,
        backoff_max_s=routing.backoff_max_s,
        observe=observe,
        decided=decided,
        log_interval=routing.log_interval,
        own_keys=len({key.get_secret_value() for key in config.upstream.api_keys}) > 1,
    )
