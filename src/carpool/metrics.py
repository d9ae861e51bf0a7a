"""Counters for /stats and /metrics.

Contract:
- The hot path only increments plain integers on ``Stats`` (no locks, no label lookups); the
  Prometheus collector reads them at scrape time, so /stats and /metrics can never disagree.
- Metric names follow Prometheus conventions: ``carpool_`` prefix, ``_total`` for counters, base
  units (seconds, bytes) in the name.
- ``latency_ms`` in /stats: p50/p95/p99 per outcome over the last ``RECENT`` requests of that
  outcome (a ring per outcome: the dashboard wants "now", not the histogram's whole history).
  Only requests counted under an outcome are timed (``Gateway.observe``), and each of those
  is (``Counted``: one whose reply never came back, its client gone as its idempotency record
  was being kept, to its end): the gateway's own refusals are counted in ``rejected`` only, a
  client that left before any outcome in ``abandoned`` only, so
  ``carpool_request_duration_seconds``'s count per outcome is ``carpool_requests_total``'s
  (but for a keyed list, whose items are counted each, timed once).
- ``tokens_saved`` counts only the tokens the upstream reported (``usage``) for the answers that
  hits and joiners got (not a semantic hit whose audit asks the engine again), prompt +
  completion (``Api.usage_tokens``: a message's prompt-cache tokens, which Anthropic counts
  apart from ``input_tokens``, included);
  ``saved_without_usage`` counts those answers it reported none for, so ``tokens_saved`` is a
  lower bound whenever that is not 0.
- ``upstream_calls`` counts every attempt sent to a replica (``ReplicaSet.attempts``): a
  failover's two, a judge's, an audit's or an ``embedder: upstream`` embedding's call through
  the replicas, pass-through calls, the embeddings list probe's (``OwnCalls``) and the
  readiness probe's (``ReplicaSet.ready``) too (what the engines were
  asked, as ``upstream_errors`` counts failed attempts), not calls asked of a peer worker.
- ``requests`` and the counters that add up to it are the cached endpoints' requests: a
  pass-through request is in none of them, answered or refused by the gateway
  (``server.GatewayApp``).
- Among the workers (``carpool.peers``) a request is counted by one worker only
  (``COUNTED_ELSEWHERE``: outcome, tokens saved, latency), so that the workers' counts add up
  to the run's: a flight's call asked of its key's owner by the worker its client sent it to,
  where the client is (the owner counts it in ``peers.served``); a keyed request passed on
  whole, where it runs (the owner: only it sees what it saved or refused).
- A counter never goes down: ``carpool_semantic_audits_total`` and ``_wrong_total`` are a
  namespace's audits in all (``Audits.totals``), which ``POST /admin/semantic/audit/reset``
  leaves; what a reset empties (the estimate, the state) are gauges. At most
  ``METRIC_NAMESPACES`` namespaces are labelled (``labelled``): one ranked out loses its series
  (a gap, not a reset: ranked in again, it is back with its count in all, never lower). Among
  the workers each renders
  every namespace for the merge, which ranks the run's sums by the same rule
  (``peers.metrics.merge``).
- The gauges (flights, caches, idempotency records, Redis errors...) are ``admin.gauges``', as
  it says:
  ``carpool_redis_errors_total{component}`` counts each Redis layer's own failed calls, none
  twice; with Redis the exact cache's entries and bytes are the whole shared cache's, at most
  a stats interval old; a call led by another instance (or worker) is a flight here too while
  requests here follow it.
- ``saved_fraction`` is the share of *eligible* requests (not bypassed, not rejected) that did not
  reach upstream: (hits + semantic hits + coalesced) / (hits + semantic hits + coalesced + misses).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .outcome import Outcome, list_outcome

RECENT = 1024


class Counted:
    """How the request whose task this is was counted (``Stats.count``): one per request
    (``server.GatewayApp.serve`` makes it), shared with the tasks its parts run in (a keyed
    list's items, counted each), which see it through their copy of the context.

    ``done``: counted under an outcome, here or by another worker: a client that leaves it is
    not ``abandoned`` too. ``outcomes``: those counted here, for the request whose reply never
    came back to be timed (the cancel of its client leaving, or of the shutdown, landed while
    its idempotency record was being kept): timed under ``outcome`` all the same."""

    __slots__ = ("done", "outcomes")

    def __init__(self) -> None:
        self.done = False
        self.outcomes: list[Outcome] = []

    @property
    def outcome(self) -> Outcome | None:
        """What the request was, as its reply says it (a keyed list: as its items were)."""
        if len(self.outcomes) > 1:
            return list_outcome(set(self.outcomes))
        return self.outcomes[0] if self.outcomes else None


# The request whose task this is (``Counted``); None outside a served request (the library's).
COUNTED: ContextVar[Counted | None] = ContextVar("carpool_counted", default=None)
# Whether the request whose task this is is counted by another worker (``carpool.peers``; the
# module's contract): its outcome, tokens saved and latency are not counted here.
COUNTED_ELSEWHERE: ContextVar[bool] = ContextVar("carpool_counted_elsewhere", default=False)
# The most namespaces the semantic audit series are labelled with (``labelled``).
METRIC_NAMESPACES = 100
SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0, float("inf"))
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, float("inf"))
# From 10 us: an exact hit takes tens of microseconds held by the HTTP protocol, hundreds on the
# ASGI path; with 0.5 ms for the lowest bound nearly every hit shared one bucket.
DURATION_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    float("inf"),
)


def counted_elsewhere() -> None:
    """The request whose task this is is counted by another worker (``COUNTED_ELSEWHERE``)."""
    COUNTED_ELSEWHERE.set(True)
    counted = COUNTED.get()
    if counted is not None:
        counted.done = True


class Stats:
    def __init__(
        self,
        attempts: Callable[[], int] = lambda: 0,
        overloaded: Callable[[], int] = lambda: 0,
    ) -> None:
        self.attempts = attempts  # upstream calls: read from the replicas, never counted twice
        # calls this machine could not open a connection for (``GatewayOverloaded``), to a
        # replica or to a key's owner among the workers: likewise
        self.overloaded = overloaded
        self.outcomes: Counter[Outcome] = Counter()
        self.routes: Counter[tuple[str, str]] = Counter()  # (route, outcome or "error")
        self.rejected = 0  # 4xx from the gateway itself
        self.abandoned = 0  # clients that left before their answer (no outcome: none was given)
        self.upstream_errors = 0
        self.upstream_status: Counter[tuple[str, str]] = Counter()  # (replica, status code)
        self.tokens_saved = 0
        self.saved_without_usage = 0  # answers saved whose usage the upstream never reported
        self.routing: Counter[str] = Counter()  # routing decision -> calls
        self.recent: dict[Outcome, deque[float]] = {o: deque(maxlen=RECENT) for o in Outcome}

    @property
    def upstream_calls(self) -> int:
        return self.attempts()

    def count(self, route: str, outcome: Outcome) -> None:
        counted = COUNTED.get()
        if COUNTED_ELSEWHERE.get():  # (by another worker: the module's contract)
            counted_elsewhere()
            return
        self.outcomes[outcome] += 1
        self.routes[(route, outcome)] += 1  # a StrEnum: its own label value
        if counted is not None:
            counted.done = True
            counted.outcomes.append(outcome)

    def count_decision(self, decision: Any) -> None:
        """A request's routing decision (its last attempt's), answered or failed."""
        self.routing[decision.value] += 1

    def observe_attempt(self, replica: Any, status: int, decision: Any) -> None:
        """Every attempt on a replica (failed-over ones too), for /stats and /metrics."""
        self.upstream_status[(replica.name, str(status))] += 1
        # (A redirect, a 1xx taken as final, a status past 599 failed too: the client's 502.
        # A 304 is a pass-through conditional GET's answer.)
        if not (200 <= status < 300 or status == 304):
            self.upstream_errors += 1

    def snapshot(self) -> dict[str, Any]:
        o = self.outcomes
        saved = o[Outcome.HIT] + o[Outcome.SEMANTIC_HIT] + o[Outcome.COALESCED]
        eligible = saved + o[Outcome.MISS]
        return {
            "requests": sum(o.values()) + self.rejected + self.abandoned,
            "hits": o[Outcome.HIT],
            "semantic_hits": o[Outcome.SEMANTIC_HIT],
            "coalesced": o[Outcome.COALESCED],
            "misses": o[Outcome.MISS],
            "bypass": o[Outcome.BYPASS],
            "rejected": self.rejected,
            "abandoned": self.abandoned,
            "upstream_calls": self.upstream_calls,
            "upstream_errors": self.upstream_errors,
            "overloaded": self.overloaded(),
            "tokens_saved": self.tokens_saved,
            "saved_without_usage": self.saved_without_usage,
            "saved_fraction": round(saved / eligible, 6) if eligible else 0.0,
            "latency_ms": {o.value: _percentiles(ring) for o, ring in self.recent.items() if ring},
        }


Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)


def _by(family: Family, counts: Iterable[tuple[str, float]]) -> Family:
    """``family`` (of one label) with a sample for each (label value, count) of ``counts``."""
    for value, n in counts:
        family.add_metric([value], n)
    return family


def _percentiles(seconds: deque[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    last = len(ordered) - 1

    def at(q: float) -> float:
        return round(ordered[round(q * last)] * 1000, 3)

    return {"p50": at(0.50), "p95": at(0.95), "p99": at(0.99), "count": len(ordered)}


class _StatsCollector(Collector):
    def __init__(self, stats: Stats, gauges: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats
        self.gauges = gauges
        self.every_namespace = False  # (``Metrics.render``)

    def collect(self) -> Iterator[Any]:
        s = self.stats
        requests = CounterMetricFamily(
            "carpool_requests", "Requests by route and outcome.", labels=["route", "outcome"]
        )
        for (route, outcome), n in sorted(s.routes.items()):
            requests.add_metric([route, outcome], n)
        yield requests
        upstream = CounterMetricFamily(
            "carpool_upstream_requests",
            "Upstream attempts by replica and HTTP status: the engine's, or 502 for one that got "
            "no answer and 504 for one that timed out (the gateway's own codes, as its clients "
            "got them); one that waited past limits.upstream_queue_timeout for a connection, or "
            "that this machine could not open one for, is in carpool_gateway_overloaded_total "
            "instead.",
            labels=["replica", "status"],
        )
        for (replica, status), n in sorted(s.upstream_status.items()):
            upstream.add_metric([replica, status], n)
        yield upstream
        yield CounterMetricFamily(
            "carpool_requests_rejected",
            "Requests the gateway refused itself (400, 413, 431, idempotency 409/422/503): "
            "with carpool_requests_total, every request /stats counts.",
            value=s.rejected,
        )
        yield CounterMetricFamily(
            "carpool_requests_abandoned",
            "Requests whose client left before they were counted under an outcome.",
            value=s.abandoned,
        )
        yield CounterMetricFamily(
            "carpool_upstream_calls",
            "Attempts sent to the upstream's replicas: failovers', judges', audits', the "
            "upstream embedder's, probes' and "
            "pass-through calls too, and those that waited for a connection.",
            value=s.upstream_calls,
        )
        yield CounterMetricFamily(
            "carpool_upstream_errors",
            "Upstream attempts that got no 2xx answer: the engine's own 4xx refusals (a client's "
            "mistake) included; carpool_upstream_requests_total's status tells them apart.",
            value=s.upstream_errors,
        )
        yield CounterMetricFamily(
            "carpool_gateway_overloaded",
            "Upstream calls this machine could not open a connection for (no file descriptor, "
            "no local port; or every connection to the replica busy past "
            "limits.upstream_queue_timeout): a 503 gateway_overloaded unless another replica "
            "took the call. Among workers, also the calls and keyed requests this worker could "
            "not open a connection to their key's owner for.",
            value=s.overloaded(),
        )
        yield _by(
            CounterMetricFamily(
                "carpool_routing_decisions",
                "Calls routed to the upstream's replicas (a request's, a judge's, an audit's, the "
                "upstream embedder's), each "
                "once, by the decision of its last attempt (prefix_match, least_loaded, "
                "failover...); pass-through calls and probes are not routed so.",
                labels=["decision"],
            ),
            sorted(s.routing.items()),
        )
        yield CounterMetricFamily(
            "carpool_tokens_saved",
            "Prompt + completion tokens not recomputed thanks to hits and coalescing.",
            value=s.tokens_saved,
        )
        yield CounterMetricFamily(
            "carpool_saved_without_usage",
            "Requests saved whose usage the upstream never reported (tokens_saved is a lower "
            "bound while this is not 0).",
            value=s.saved_without_usage,
        )
        g = self.gauges()
        yield _by(
            CounterMetricFamily(
                "carpool_redis_errors",
                "Redis calls that failed, by the layer that made them (store, flights, "
                "invalidations, semantic, idempotency), each counted once; those Redis refused "
                "(maxclients, a busy pool, full, a slot moving, a key of another type) are "
                "counted apart.",
                labels=["component"],
            ),
            g["redis_errors"].items(),
        )
        yield CounterMetricFamily(
            "carpool_redis_pool_exhausted",
            "Redis calls that found every "
            "pooled connection busy for distributed.pool_timeout (a miss, "
            "nothing kept locally; Redis not marked down).",
            value=g["redis_pool_exhausted"],
        )
        yield CounterMetricFamily(
            "carpool_redis_max_clients",
            "Redis calls whose connection Redis refused because it served its maxclients "
            "already (a miss, nothing kept locally; Redis not marked down).",
            value=g["redis_max_clients"],
        )
        yield CounterMetricFamily(
            "carpool_redis_full",
            "Writes Redis refused because it was full (maxmemory under noeviction): answers "
            "served, not shared; Redis not marked down.",
            value=g["redis_full"],
        )
        yield CounterMetricFamily(
            "carpool_redis_slot_moving",
            "Redis Cluster calls refused while their slot was being migrated (a reshard): run "
            "without sharing; Redis not marked down.",
            value=g["redis_slot_moving"],
        )
        yield CounterMetricFamily(
            "carpool_redis_wrong_type",
            "Redis calls refused because a key held another type than carpool writes there "
            "(WRONGTYPE: something else wrote it): run without sharing; Redis not marked down.",
            value=g["redis_wrong_type"],
        )
        if (refusals := g["redis_refusals"]) is not None:
            yield CounterMetricFamily(
                "carpool_redis_refusals_received",
                "Keys another instance saw the upstream refuse (401/403), taken back here.",
                value=refusals["received"],
            )
            yield CounterMetricFamily(  # (10,000: ``redis.invalidation.MAX_TELLING``, not imported
                # here: the redis extra)
                "carpool_redis_refusals_unsent",
                "Keys the upstream refused here never told to the other instances (more than "
                "10,000 waiting, or Redis out of reach for tenant.accepted_ttl): where accepted "
                "before, they read the shared namespaces until tenant.accepted_ttl.",
                value=refusals["unsent"],
            )
            yield GaugeMetricFamily(
                "carpool_redis_refusals_pending",
                "Keys the upstream refused here, waiting to be told to the other instances.",
                value=refusals["pending"],
            )
        yield GaugeMetricFamily(
            "carpool_flights",
            "Upstream calls in flight (and lingering in the coalescing window); with Redis or "
            "--workers, a call led elsewhere that requests here follow too.",
            value=g["flights"],
        )
        yield GaugeMetricFamily(
            "carpool_flight_waiters", "Requests attached to a flight.", value=g["waiters"]
        )
        entries = GaugeMetricFamily(
            "carpool_cache_entries",
            "Cached answers by layer (with Redis, exact: the whole shared cache, at most 1 s old).",
            labels=["layer"],
        )
        size = GaugeMetricFamily(
            "carpool_cache_bytes", "Bytes held by cached answers, by layer.", labels=["layer"]
        )
        for layer, info in g["layers"].items():
            entries.add_metric([layer], info["entries"])
            size.add_metric([layer], info["bytes"])
        yield entries
        yield size
        if (semantic := g["layers"].get("semantic")) is not None:
            shed = CounterMetricFamily(
                "carpool_semantic_shed",
                "Semantic work not done, semantic.max_pending being in progress: lookups not "
                "made (a miss), entries not made (their prompt not embedded).",
                labels=["work"],
            )
            shed.add_metric(["lookup"], semantic["lookups_shed"])
            shed.add_metric(["entry"], semantic["entries_shed"])
            yield shed
            yield _by(
                CounterMetricFamily(
                    "carpool_semantic_refusals",
                    "Semantic candidates refused, by the guard's reason: a rule's, the verifier's "
                    "(meaning, context), the judge's, an audit's...",
                    labels=["reason"],
                ),
                semantic["refused"].items(),
            )
            yield CounterMetricFamily(
                "carpool_semantic_lookups_joined",
                "Semantic lookups that joined an identical request's lookup in progress.",
                value=semantic["lookups_joined"],
            )
        memo = g["repeat_memo"]
        yield GaugeMetricFamily(
            "carpool_repeat_memo_entries",
            "Request bodies held by the memo of byte-identical repeats (not answers).",
            value=memo["entries"],
        )
        yield GaugeMetricFamily(
            "carpool_repeat_memo_bytes",
            "Bytes held by the memo of byte-identical repeats (fingerprint.repeat_memo_bytes).",
            value=memo["bytes"],
        )
        records = g["idempotency"]  # (None: a library caller's own records, not known here)
        for name, field, help_text in _IDEMPOTENCY:
            yield GaugeMetricFamily(
                name, help_text, value=records[field] if records is not None else None
            )
        yield _by(
            GaugeMetricFamily(
                "carpool_upstream_in_flight", "Calls in flight per replica.", labels=["replica"]
            ),
            g["replicas"].items(),
        )
        yield from _semantic_audit(g, None if self.every_namespace else METRIC_NAMESPACES)


# The fields of ``/stats`` ``idempotency`` (``admin.idempotency_records``), for the workers' sum
# (``peers.metrics.run_totals``) and the OpenAPI document.
IDEMPOTENCY_FIGURES = ("records", "processing", "bytes", "max_bytes")
# The idempotency records' gauges: (name, field of ``admin.idempotency_records``, help).
_IDEMPOTENCY = (
    (
        "carpool_idempotency_records",
        "records",
        "Finished idempotency records this process holds for retries (with Redis: its copies "
        "of the answers it finished there; the shared records are not counted).",
    ),
    (
        "carpool_idempotency_processing",
        "processing",
        "Idempotency records being processed in this process.",
    ),
    (
        "carpool_idempotency_bytes",
        "bytes",
        "Bytes the idempotency records hold in this process (idempotency.max_bytes; with "
        "Redis, its copies; the shared records' size is not counted).",
    ),
)


def _semantic_audit(g: dict[str, Any], limit: int | None) -> Iterator[Any]:
    """The judge's calls, and per namespace the audits of semantic hits and the estimate."""
    yield CounterMetricFamily(
        "carpool_semantic_judge_calls",
        "Questions asked of the semantic judge (semantic.judge); never upstream calls saved.",
        value=g["judge_calls"],
    )
    audited = CounterMetricFamily(
        "carpool_semantic_audits",
        "Semantic hits audited against a fresh answer (and reported wrong), by namespace.",
        labels=["namespace"],
    )
    wrong = CounterMetricFamily(
        "carpool_semantic_audits_wrong",
        "Audited or reported semantic hits found wrong, by namespace.",
        labels=["namespace"],
    )
    estimate = GaugeMetricFamily(
        "carpool_semantic_wrong_rate",
        "Estimated wrong-hit rate over the latest audits, with its 95% Wilson bounds.",
        labels=["namespace", "bound"],
    )
    backed_off = GaugeMetricFamily(
        "carpool_semantic_backoff",
        "A namespace's error-budget state, the furthest from serving of its tenants' budgets: "
        "0 serving, 1 backed-off, 2 mark.",
        labels=["namespace"],
    )
    windows = g["semantic_audit"]
    for namespace, (in_all, wrong_in_all) in labelled(g["semantic_audit_totals"], windows, limit):
        # The counters from the totals, never reset; the rest from the windows, which an
        # admin's reset empties (a namespace reset and not audited since: no estimate yet).
        audited.add_metric([namespace], in_all)
        wrong.add_metric([namespace], wrong_in_all)
        audit = windows.get(namespace)
        if audit is not None:
            for bound in ("estimate", "low", "high"):
                estimate.add_metric([namespace, bound], audit[bound])
        state = audit["state"] if audit is not None else "serving"
        backed_off.add_metric([namespace], _STATES.index(state))
    yield from (audited, wrong, estimate, backed_off)


_STATES = ("serving", "backed-off", "mark")


def labelled(
    totals: dict[str, tuple[int, int]],
    audits: dict[str, dict[str, Any]],
    limit: int | None = METRIC_NAMESPACES,
) -> list[tuple[str, tuple[int, int]]]:
    """The namespaces ``/metrics`` labels its series with, and their ``totals``: at most
    ``limit``, those not serving first (what an alert is for), then the most audited in all
    (``peers.metrics.merge`` ranks a workers' run by the same rule; ``/stats`` lists these,
    ``admin.audited_namespaces``). Namespaces are the clients' to name: a series set each would
    grow with every one audited (``GET /admin/semantic/audit`` lists them all). ``limit`` None:
    every one, for the merge."""

    def serving(namespace: str) -> bool:
        audit = audits.get(namespace)
        return audit is None or audit["state"] == "serving"

    ranked = sorted(totals.items(), key=lambda item: (serving(item[0]), -item[1][0]))
    return ranked if limit is None else ranked[:limit]


class Buckets:
    """A histogram of plain numbers: ``observe`` is a bisect and two additions, no lock.

    (prometheus_client's Histogram takes a lock per bucket; the gateway runs on one event loop,
    so nothing races, and the request path should not pay for it.)
    """

    __slots__ = ("name", "help", "bounds", "counts", "sum")

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name, self.help = name, help_text
        self.bounds = tuple(b for b in bounds if b != float("inf"))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


class _BucketsCollector(Collector):
    def __init__(
        self,
        unlabelled: list[Buckets],
        by_outcome: dict[Outcome, Buckets],
        name: str,
        help_text: str,
    ) -> None:
        self.unlabelled, self.by_outcome = unlabelled, by_outcome
        self.name, self.help = name, help_text

    def collect(self) -> Iterator[Any]:
        for buckets in self.unlabelled:
            family = HistogramMetricFamily(buckets.name, buckets.help)
            family.add_metric([], buckets.cumulative(), buckets.sum)
            yield family
        family = HistogramMetricFamily(self.name, self.help, labels=["outcome"])
        for outcome, buckets in self.by_outcome.items():
            if any(buckets.counts):
                family.add_metric([outcome.value], buckets.cumulative(), buckets.sum)
        yield family


class Metrics:
    """The gateway's Prometheus registry (one per gateway, so several can live in one process)."""

    def __init__(self, stats: Stats, gauges: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._stats = _StatsCollector(stats, gauges)
        self.registry.register(self._stats)
        self.duration = {
            o: Buckets("carpool_request_duration_seconds", "", DURATION_BUCKETS) for o in Outcome
        }
        self._recent = stats.recent
        self.similarity = Buckets(
            "carpool_semantic_similarity",
            "Cosine similarity of the semantic cache's served hits.",
            SIMILARITY_BUCKETS,
        )
        self.batch_size = Buckets(
            "carpool_batch_size",
            "Items per upstream call of the embeddings batcher (1: an item sent alone).",
            BATCH_SIZE_BUCKETS,
        )
        self.batch_wait = Buckets(
            "carpool_batch_wait_seconds",
            "Time an embeddings request waited in the batch buffer.",
            DURATION_BUCKETS,
        )
        self.registry.register(
            _BucketsCollector(
                [self.similarity, self.batch_size, self.batch_wait],
                self.duration,
                "carpool_request_duration_seconds",
                "Time from request to the last byte of the answer, by outcome.",
            )
        )

    def observe(self, outcome: Outcome, seconds: float) -> None:
        self.duration[outcome].observe(seconds)
        self._recent[outcome].append(seconds)

    def render(self, every_namespace: bool = False) -> bytes:
        """The exposition; ``every_namespace``: each namespace audited here labelled, for
        ``peers.metrics.merge`` to rank over the run's totals (a worker's own top
        ``METRIC_NAMESPACES`` would leave out what it saw of a namespace in the run's)."""
        self._stats.every_namespace = every_namespace
        try:
            return generate_latest(self.registry)
        finally:
            self._stats.every_namespace = False
