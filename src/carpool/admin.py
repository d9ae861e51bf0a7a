"""What the admin surfaces read of the layers, and the invalidation they order.

Contract:
- ``gauges(layers)``: the live figures ``/metrics`` scrapes (flights: the upstream calls in
  flight, those an invalidation forgot included, and the answers lingering in the window,
  ``FlightGroup.live``; with ``redis``, a call led by another instance that clients here follow
  is a flight here too, so the instances' sum counts it once per instance; waiters, each cache
  layer's entries and bytes, calls in flight per replica, Redis errors per component, Redis
  calls that found the pool exhausted; with ``redis``, the keys the upstream refused told by
  and to the other instances, None without); read at scrape time, never kept. The exact cache takes
  a step of reaping first (``Store.reap``), so that its figures come to count live entries
  only.
- ``idempotency`` (in the gauges and ``/stats``): what the idempotency records hold in this
  process's memory (``Layers.local_idempotency``), not answers of a cache layer (an
  invalidation leaves them): ``records`` finished or released (expired ones until swept),
  ``processing``, ``bytes`` as ``max_bytes`` bounds them (``idempotency.memory``). With
  ``redis``, this instance's fallback: its copies of the answers it finished in Redis, and the
  records begun here while Redis could not be read; the shared records in Redis are not
  counted (their number and size are Redis's, not read).
- ``refresh(layers)``, awaited by the reports (``/stats``, ``/metrics``) before they read the
  gauges: with ``redis``, the exact cache's figures are Redis's counts of the whole shared cache
  (every instance's entries, those expired reaped), read again when older than the store's
  stats interval (1 s; ``SharedStore.fresh_counts``). A read Redis does not answer (within the
  client's timeouts) leaves the last figures read: the report is answered all the same.
  Degraded, the figures are this instance's own memory's, and Redis is not asked.
- Redis errors per component: each layer's own failed calls, counted once, by the layer that
  made them: ``store`` (the exact cache), ``flights``, ``invalidations`` (the subscriber's
  reconnections too; without a semantic cache, its ``invalidate`` records), ``semantic``, ``idempotency``; a component without its layer is left out
  (``store`` is always there, 0 without ``redis``). ``redis_health``'s ``errors`` is every
  layer's together, as the one health they all tell counts them (which counts a full pool or a
  full Redis apart: ``pool_exhausted``, ``max_clients``, ``full``).
- ``snapshot(layers)``: the ``/stats`` document (the counters, the gauges, the replicas, the
  routing decisions, the batcher's figures, Redis's health; with ``--workers N`` and no
  ``redis``, ``peer_calls`` and this worker's ``peers`` figures). Its ``semantic_audit`` lists
  at most ``METRIC_NAMESPACES`` namespaces, ranked as ``/metrics`` ranks those it labels
  (``metrics.labelled``: not serving first, then the most audited in all) among the namespaces
  with live audits (one reset has none here; ``/metrics`` keeps its totals), and
  ``semantic_audit_more`` counts the others: namespaces are the clients' to name, and a list of
  every one (up to 20,000) made each poll of the dashboard megabytes. ``GET
  /admin/semantic/audit`` lists them all (``Audits.snapshot``).
- ``redis_health(layers)``: ``{"state": "off" | "up" | "degraded", ...}`` for ``/stats``, with
  each shared layer's counts; ``"off"`` without ``redis``. ``redis_state(layers)``: for the
  open ``/healthz``, only whether Redis is up (``state``, ``errors``, ``down_since``): no
  traffic counter (flights led or followed, invalidations, semantic records, writes a full
  Redis refused), which would tell anyone when someone's request was a miss.
- ``invalidate(layers, spec)``: drops the answers matching ``{"tag"|"namespace"|"prefix": str}``
  or ``{"all": true}`` from every layer, flights included (here and, with ``redis``, on every
  instance); anything else is a ``RequestError``. Returns how many answers were dropped, one
  per copy a layer held: an entry of the exact cache, one of the semantic cache, and an
  answer lingering in this instance's coalescing window that no cache keeps (ttl 0, say: the
  window's copy of a stored answer is that answer, counted in the cache). Lingering answers
  keep their labels (``Broadcast.labels``): only those the selector names are dropped. Every
  call running here is forgotten, named or not, and its answer not stored (it may predate
  what was dropped); none is counted. What the other instances drop (their windows, through
  ``InvalidationChannel``, which names nothing: all of them; the shared flights' lingering
  locks, which name nothing either: all of them) is not counted either. A prefix also stops
  the semantic entries of other prompts, made before it, being served to prompts that start
  with it (``SemanticCache``); those are not dropped, nor counted. A layer that could not
  reach Redis (the exact store's invalidation, the semantic stream's ``invalidate`` record)
  raises ``StoreUnavailable`` once every layer has been done here: the endpoint answers 503
  "retry", never a success some instance did not get. An instance without a semantic cache
  publishes that record too (``SemanticInvalidations``; its failures counted with the
  ``invalidations`` component's): in a fleet mid-change the others may hold semantic entries
  with their answers, which the pub/sub message (``InvalidationChannel``: flights only) and the
  exact store's invalidation do not reach.
- Every layer is read through its type (``Layers``): a Redis-backed layer's figures through
  ``layers.shared_store`` / ``layers.shared_semantic``, which are ``None`` without ``redis``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .canonical import normalize_text
from .errors import RequestError
from .metrics import METRIC_NAMESPACES, labelled
from .store.base import Selector, StoreUnavailable, prompt_text

if TYPE_CHECKING:
    from .layers import Layers


def gauges(layers: Layers) -> dict[str, Any]:
    """The live figures of ``/metrics`` (and part of ``/stats``)."""
    semantic, shared_store = layers.semantic, layers.shared_store
    layers.store.reap()  # (the live entries counted: expired ones reaped, a bounded step)
    return {
        # (Calls an invalidation forgot too: upstream calls in flight all the same.)
        "flights": layers.flights.live(),
        "waiters": layers.flights.waiters,
        "layers": {
            "exact": {"entries": layers.store.entries, "bytes": layers.store.bytes},
            **(
                {
                    "semantic": {
                        "entries": semantic.entries,
                        "bytes": semantic.bytes,
                        "embed_failures": semantic.embed_failures,
                        # (identical requests' lookups made once: ``SemanticCache.probe``)
                        "lookups_joined": semantic.lookups_joined,
                        # (``semantic.max_pending`` in progress: not looked up, not made)
                        "lookups_shed": semantic.lookups_shed,
                        "entries_shed": semantic.entries_shed,
                        # (a setting to correct, said once in the log: ``embed_problem``)
                        "embed_problem": semantic.embed_problem,
                        # (candidates refused, by the guard's reason: a rule's, the
                        # verifier's "meaning", the judge's "judge", an audit's "audit"...)
                        "refused": dict(sorted(semantic.rejections.items())),
                    }
                }
                if semantic
                else {}
            ),
        },
        # Not answers (``layers``): request bodies, for byte-identical repeats; held per
        # process, up to ``fingerprint.repeat_memo_bytes`` (RSS grows with it).
        "repeat_memo": {
            "entries": len(layers.repeats),
            "bytes": layers.repeats.bytes,
            "max_bytes": layers.repeats.max_bytes,
        },
        "idempotency": idempotency_records(layers),
        "replicas": {name: r["in_flight"] for name, r in layers.replicas.snapshot().items()},
        "redis_errors": redis_errors(layers),
        "redis_pool_exhausted": shared_store.pool_exhausted if shared_store is not None else 0,
        "redis_max_clients": shared_store.max_clients if shared_store is not None else 0,
        "redis_full": shared_store.full if shared_store is not None else 0,
        "redis_slot_moving": shared_store.slot_moving if shared_store is not None else 0,
        "redis_wrong_type": shared_store.wrong_type if shared_store is not None else 0,
        # (Keys the upstream refused, told to the other instances: None without Redis.)
        "redis_refusals": (
            {event: channel[f"refusals_{event}"] for event in ("received", "unsent", "pending")}
            if layers.invalidations is not None and (channel := layers.invalidations.snapshot())
            else None
        ),
        "judge_calls": layers.judge.calls if layers.judge is not None else 0,
        "semantic_audit": layers.audits.snapshot() if layers.audits is not None else {},
        "semantic_audit_totals": layers.audits.totals() if layers.audits is not None else {},
    }


def idempotency_records(layers: Layers) -> dict[str, int] | None:
    """What the idempotency records hold in this process (the module's contract); None when
    the records are not of this process's memory (a library caller's own)."""
    records = layers.local_idempotency
    if records is None:
        return None
    return {
        "records": records.kept,
        "processing": records.processing,
        "bytes": records.bytes,
        "max_bytes": records.max_bytes,
    }


async def refresh(layers: Layers) -> None:
    """Bring the figures the reports read from Redis up to date (the module's contract)."""
    if layers.shared_store is not None:
        await layers.shared_store.fresh_counts()


def redis_errors(layers: Layers) -> dict[str, int]:
    """Each Redis layer's own failed calls, by component (the module's contract)."""
    errors = {"store": layers.shared_store.store_errors if layers.shared_store is not None else 0}
    if layers.shared_flights is not None:
        errors["flights"] = layers.shared_flights.counts["errors"]
    if layers.invalidations is not None:
        errors["invalidations"] = layers.invalidations.counts["errors"]
        if layers.semantic_invalidations is not None:  # (its records: invalidations too)
            errors["invalidations"] += layers.semantic_invalidations.counts["errors"]
    if layers.shared_semantic is not None:
        errors["semantic"] = layers.shared_semantic.counts["errors"]
    if layers.shared_idempotency is not None:
        errors["idempotency"] = layers.shared_idempotency.errors
    return errors


def snapshot(layers: Layers) -> dict[str, Any]:
    """The /stats document."""
    g = gauges(layers)
    return {
        **layers.stats.snapshot(),
        "pid": os.getpid(),
        "flights": g["flights"],
        "waiters": g["waiters"],
        "layers": g["layers"],
        "repeat_memo": g["repeat_memo"],
        **({"idempotency": g["idempotency"]} if g["idempotency"] is not None else {}),
        "replicas": layers.replicas.snapshot(),
        "routing": dict(layers.stats.routing),
        "batching": layers.batcher.stats(),
        "redis": redis_health(layers),
        # Requests asked of another worker (``carpool.peers``): not upstream calls (the worker
        # asked counts its own), so the workers' upstream_calls add up to the engine's.
        "peer_calls": layers.peers.calls if layers.peers is not None else 0,
        **({"peers": layers.peers.snapshot()} if layers.peers is not None else {}),
        "judge_calls": g["judge_calls"],
        **({"judge": layers.judge.snapshot()} if layers.judge is not None else {}),
        **audited_namespaces(g["semantic_audit"], g["semantic_audit_totals"]),
        **(
            {"audit_calls": layers.audits.calls, "audit_failed": layers.audits.failed}
            if layers.audits is not None
            else {}
        ),
    }


def audited_namespaces(
    windows: dict[str, dict[str, Any]], totals: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """``/stats``' ``semantic_audit`` and ``semantic_audit_more`` (the module's contract)."""
    # A namespace whose totals were pushed out (MAX_BUDGETS) while a budget of it is held
    # ranks by its windows' audits.
    ranked = labelled(
        {
            name: totals.get(name, (audit["audited"], audit["wrong"]))
            for name, audit in windows.items()
        },
        windows,
        METRIC_NAMESPACES,
    )
    return {
        "semantic_audit": {name: windows[name] for name, _ in ranked},
        "semantic_audit_more": len(windows) - len(ranked),
    }


def redis_state(layers: Layers) -> dict[str, Any]:
    """``{"state": "off" | "up" | "degraded", "errors", "down_since"}`` for /healthz."""
    if layers.shared_store is None:
        return {"state": "off"}
    health = layers.shared_store.health()
    return {name: health[name] for name in ("state", "errors", "down_since")}


def redis_health(layers: Layers) -> dict[str, Any]:
    """``{"state": "off" | "up" | "degraded", ...}`` for /stats, every counter in."""
    report = layers.shared_store.health() if layers.shared_store is not None else {"state": "off"}
    if layers.shared_flights is not None:
        report = {**report, "flights": layers.shared_flights.snapshot()}
    if layers.invalidations is not None:
        report = {**report, "invalidations": layers.invalidations.snapshot()}
    if layers.shared_semantic is not None:
        report = {**report, "semantic": layers.shared_semantic.snapshot()}
    return report


async def invalidate(layers: Layers, spec: Any) -> int:
    """Drop the answers matching ``{"tag"|"namespace"|"prefix": str}`` or ``{"all": true}``."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise RequestError('give exactly one of "tag", "namespace", "prefix" or "all"')
    ((name, value),) = spec.items()
    selector: Selector | None = None
    also: list[Selector] = []
    if name == "all" and value is True:
        selector = Selector(everything=True)
    elif name == "tag" and isinstance(value, str) and value:
        selector = Selector(tag=value)
    elif name == "namespace" and isinstance(value, str):
        selector = Selector(namespace=value)  # ("": the default namespace)
    elif name == "prefix" and isinstance(value, str) and value:
        selector = Selector(prefix=prompt_text(value))
        if layers.config.fingerprint.normalize_whitespace:
            # Collapsed prompts keep their collapsed start (``lead``): the prefix is matched
            # as given (code, embeddings: kept as sent) and collapsed too.
            collapsed = prompt_text(normalize_text(value, True))
            if collapsed and collapsed != selector.prefix:
                also.append(Selector(prefix=collapsed))
    if selector is not None:
        # Flights are a layer too, running ones included: no request joins a call begun
        # before the invalidation, and that call's answer is not stored (its labels are known
        # once it has one: all go, at worst one extra upstream call per key). A lingering
        # answer goes if the selector names it, counted if the window held it alone.
        selectors = (selector, *also)
        lingering = layers.flights.invalidate(
            lambda labels: any(each.picks_labels(labels) for each in selectors)
        )
        missed: StoreUnavailable | None = None
        dropped = sum(not kept for _, kept in lingering)
        for each in selectors:
            try:
                dropped += await layers.store.invalidate(each)
            except StoreUnavailable as error:  # (dropped here; the shared answers stay)
                missed = error
            try:
                if layers.semantic is not None:
                    dropped += await layers.semantic.invalidate(each)
                elif layers.semantic_invalidations is not None:
                    # No semantic cache here, but the other instances' may hold entries with
                    # their answers, which only this record drops (a fleet mid-change).
                    await layers.semantic_invalidations.invalidate(each)
            except StoreUnavailable as error:  # (dropped here; the other instances' stay)
                missed = error
        if layers.shared_flights is not None:
            # Every instance's, after the store's invalidation has moved Redis's count of them
            # (``RedisStore.invalidate``, first): a call that claims its lock after these marks
            # read the count after it moved (``lead.py`` reads it once claimed), its answer
            # is fresh; one claimed before is marked (not stored, nor replayed). Marked first,
            # a call claimed between the marks and the count was missed: its answer, taken
            # back from the store by the count, still lingered in its lock for every instance.
            await layers.shared_flights.forget_all()
        if layers.invalidations is not None:  # last: the other instances' windows
            await layers.invalidations.publish()
        if missed is not None:
            # Not a success: the answers in Redis (or the other instances' semantic entries)
            # were not dropped, and they are still served. The caller retries (an
            # invalidation may be repeated).
            raise StoreUnavailable(
                "the invalidation did not reach Redis: its answers there stay; retry it"
            ) from missed
        return dropped
    raise RequestError(
        f'invalid selector {name!r}: use "tag" or "prefix" (a non-empty string), "namespace" '
        '(a string; "" is the default namespace) or "all": true'
    )
