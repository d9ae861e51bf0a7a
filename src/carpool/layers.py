"""The layers of one gateway, built together from one config (``wiring.build_layers``), started
and closed together: ``Layers``.

Contract:
- ``Layers`` holds every layer the request's path reads (``Gateway``, ``pipeline.py``) and the
  admin surfaces report (``admin.py``); a layer whose config is off is ``None``.
- ``shared_store``, ``shared_semantic`` and ``shared_idempotency`` are the Redis-backed layers
  as what they are (the same objects as ``store`` and ``semantic``, and the shared side of
  ``idempotency``; ``None`` without ``redis``): what ``/stats``, ``/metrics`` and ``/healthz``
  read of Redis (errors, pool exhaustion, health, stream counts).
- ``local_idempotency``: the idempotency records in this process's memory (``idempotency``
  itself, or with ``redis`` its fallback, which also keeps a copy of each answer this instance
  finished in Redis), whose figures ``/stats`` and ``/metrics`` report; ``None`` for records of
  another kind a library caller gave (what they hold is not known here).
- ``semantic_invalidations``: with ``redis`` and no semantic cache, what publishes this
  instance's invalidations to the other instances' semantic caches (``SemanticInvalidations``);
  ``None`` otherwise (a shared semantic cache publishes its own).
- ``holders``: which replica keeps each stored response, file or batch this process saw
  (``routing.state``), for the follow-ups that only that replica can answer.
- ``states``: the keys and semantic entries this process stored under each stored response's
  tag (``state_index``), which a ``DELETE`` of it drops, and the responses deleted lately.
- ``start()`` starts the background work that needs the event loop (the server calls it at
  startup; the layers also start lazily on first use), a first read of the shared cache's
  counts among it; safe to call again.
- ``peers`` is this worker's place among the workers of ``carpool serve --workers N`` without
  ``redis`` (``carpool.peers``): who owns a key, and asking the owner; ``None`` otherwise.
- ``aclose()`` closes what the layers hold, each once, users before what they use (the peers'
  door first, its requests in progress finished on the upstreams; the batcher's probes before
  the upstreams; the shared layers before the store whose connection they share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .clock import SYSTEM_CLOCK, Clock
from .routing.state import StateHolders
from .state_index import StateIndex

if TYPE_CHECKING:
    from .batching import EmbeddingBatcher
    from .config import Config
    from .fingerprint import RepeatMemo
    from .flight import FlightGroup
    from .idempotency import IdempotencyRecords, MemoryIdempotencyRecords
    from .identity import AcceptedCredentials
    from .metrics import Metrics, Stats
    from .peers import Peers
    from .redis.flights import SharedFlights
    from .redis.idempotency import RedisIdempotencyRecords
    from .redis.invalidation import InvalidationChannel
    from .redis.semantic import SemanticInvalidations, SharedSemanticCache
    from .routing.replicas import ReplicaSet
    from .semantic.audit import Audits
    from .semantic.cache import SemanticCache
    from .semantic.judge import Judge
    from .store import Store
    from .store.shared import SharedStore
    from .tracing import Tracer
    from .upstream.base import Upstream


@dataclass(eq=False)
class Layers:
    """Every layer of one gateway (see the module's contract)."""

    config: Config
    upstreams: list[Upstream]
    replicas: ReplicaSet
    store: Store
    flights: FlightGroup
    idempotency: IdempotencyRecords
    accepted: AcceptedCredentials  # the tenants the upstream answered recently
    repeats: RepeatMemo
    batcher: EmbeddingBatcher
    stats: Stats
    metrics: Metrics
    tracer: Tracer
    semantic: SemanticCache | None = None
    judge: Judge | None = None  # semantic.judge
    audits: Audits | None = None  # with the semantic cache: audits, feedback, the budget
    shared_flights: SharedFlights | None = None
    invalidations: InvalidationChannel | None = None
    shared_store: SharedStore | None = None
    shared_semantic: SharedSemanticCache | None = None
    semantic_invalidations: SemanticInvalidations | None = None  # (redis, no semantic cache)
    shared_idempotency: RedisIdempotencyRecords | None = None
    local_idempotency: MemoryIdempotencyRecords | None = None  # (what this process holds)
    peers: Peers | None = None  # the other workers of this run, without redis
    clock: Clock = SYSTEM_CLOCK  # what the in-process layers and answers' ages read
    # which replica made each stored response (``routing.state``)
    holders: StateHolders = field(default_factory=StateHolders)
    # what each stored response's DELETE drops here, and the responses deleted (``state_index``)
    states: StateIndex = field(default_factory=StateIndex)

    def start(self) -> None:
        """Start background work that needs the event loop (the server calls it at startup;
        it also starts lazily on first use)."""
        self.tracer.refresh()
        if self.shared_store is not None:
            # (The figures of the whole shared cache, before this instance serves anything.)
            self.shared_store.refresh_soon()
        if self.shared_semantic is not None:
            self.shared_semantic.start()
        if self.invalidations is not None:
            self.invalidations.start()

    async def aclose(self) -> None:
        if self.peers is not None:
            await self.peers.aclose()
        await self.batcher.aclose()  # its probes use the upstreams closed below
        if self.invalidations is not None:
            await self.invalidations.aclose()
        if self.semantic is not None:
            await self.semantic.aclose()
        if self.semantic_invalidations is not None:
            await self.semantic_invalidations.aclose()
        if self.judge is not None:
            await self.judge.aclose()
        if self.shared_flights is not None:
            await self.shared_flights.aclose()
        for upstream in self.upstreams:
            await upstream.aclose()
        await self.store.aclose()
        await self.idempotency.aclose()
