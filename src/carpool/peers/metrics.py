"""The workers' ``/metrics`` as one: what a scrape of the run's one port gets; and the run's
totals in ``/stats`` (``run``), which the dashboard draws.

Contract:
- The workers of ``carpool serve --workers N`` share one port, and the kernel gives each
  scrape to whichever accepts it: one worker's counters, then another's, went down between two
  scrapes, which Prometheus reads as a counter reset (``rate()`` and ``increase()`` wrong, the
  dashboard's charts cleared). So the worker a scrape lands on asks every other one for its
  own exposition (``Peers.metrics``, through the peers' door: answered for that worker alone)
  and answers their sum (:func:`merge`).
- Counters and histograms (buckets, sums, counts) are summed sample by sample, labels and all:
  each request is counted by one worker (``metrics.COUNTED_ELSEWHERE``: a flight's call asked
  of the key's owner where its client is, a keyed request passed on whole where it runs), so
  the sums are the run's. Gauges are summed too (flights, waiters, cache entries and bytes,
  idempotency records and bytes: each worker's own), but for those that are a state or a
  rate, not an amount (:data:`HIGHEST`: the highest of the workers', the conservative reading
  for an alert).
- The ``carpool_semantic_*`` series of the sum are labelled with at most ``METRIC_NAMESPACES``
  namespaces, as one worker's are, ranked by ``metrics.labelled``'s rule over the run's sums
  (:func:`_labelled_namespaces`); each worker renders every one of its own for the merge, else
  the sum held up to N x ``METRIC_NAMESPACES``, and a namespace ranked out on one worker was
  labelled with the others' part of its count, which went down (a reset) when their rankings
  moved. As in one process, a namespace ranked out loses its series, and is back with the
  run's count in all when ranked in again (never lower, but for a worker that did not answer
  or was replaced: below).
- A worker that does not answer in time adds nothing to that scrape (logged by ``Peers``): its
  counters are missing from the sum once, which Prometheus reads as a reset, as it reads a
  worker that restarted (its counters start again from 0): the whole sum after it counts as
  an increase, the other workers' totals too (a spike of ``rate()``; docs/scaling.md).
- ``/stats`` stays the answering worker's document (its ``pid``), with ``run``
  (:func:`run_totals`): the workers' counters summed (``saved_fraction`` of the sums), their
  flights, caches, idempotency records (and their budgets) and replicas' calls summed, and per
  outcome the latency figures of the worker whose are highest (percentiles do not add up),
  ``workers`` the documents summed and ``pids`` their processes (sorted). The dashboard draws
  ``run`` when there is one: it polls on one kept-alive connection, so one worker answered
  every poll, and its charts showed that worker's traffic alone. ``pids`` tells it a run whose
  worker was replaced (its counters from 0 again) from the same run answered by another worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ..metrics import IDEMPOTENCY_FIGURES, METRIC_NAMESPACES

__all__ = ["HIGHEST", "merge", "run_totals"]

# Gauges that are a state or a rate, not an amount: the highest worker's value, never a sum.
HIGHEST = frozenset({"carpool_semantic_wrong_rate", "carpool_semantic_backoff"})


def merge(expositions: Iterable[str]) -> bytes:
    """The sum of the workers' expositions (Prometheus text format), in that format."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            summed = values[family.name]
            highest = family.name in HIGHEST
            for sample in family.samples:
                at = (sample.name, tuple(sorted(sample.labels.items())))
                if at not in summed:
                    summed[at] = sample.value
                elif highest:
                    summed[at] = max(summed[at], sample.value)
                else:
                    summed[at] += sample.value
    kept = _labelled_namespaces(values)
    for name, family in families.items():
        ranked = name.startswith(_SEMANTIC)
        for (sample_name, labels), value in values[name].items():
            named = dict(labels)
            # (Only a sample labelled by namespace is ranked: the judge's calls and the
            # similarity histogram, in the same families' prefix, carry none.)
            namespace = named.get("namespace")
            if ranked and namespace is not None and namespace not in kept:
                continue
            family.add_sample(sample_name, named, value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


# The families labelled by namespace, which ``metrics.labelled`` bounds in one process.
_SEMANTIC = "carpool_semantic_"


def _labelled_namespaces(values: dict[str, dict[Any, float]]) -> set[str]:
    """The run's namespaces to label, ranked over the workers' sums by ``metrics.labelled``'s
    rule: not serving first (the backoff gauge: the highest worker's), then the most audited in
    all; at most ``METRIC_NAMESPACES``. Each worker renders every one of its own for this
    (``Metrics.render``), so a namespace's count here is the run's, never a part of it."""
    audited: dict[str, float] = {}
    serving: dict[str, bool] = {}
    for name, samples in values.items():
        if not name.startswith(_SEMANTIC):
            continue
        for (sample_name, labels), value in samples.items():
            namespace = dict(labels).get("namespace")
            if namespace is None:
                continue
            audited.setdefault(namespace, 0)
            serving.setdefault(namespace, True)
            if sample_name == "carpool_semantic_audits_total":
                audited[namespace] = value
            elif sample_name == "carpool_semantic_backoff" and value != 0:
                serving[namespace] = False
    ranked = sorted(audited, key=lambda ns: (serving[ns], -audited[ns], ns))
    return set(ranked[:METRIC_NAMESPACES])


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


# The counters of a ``/stats`` document, summed in ``run``.
SUMMED = (
    "requests",
    "hits",
    "semantic_hits",
    "coalesced",
    "misses",
    "bypass",
    "rejected",
    "abandoned",
    "upstream_calls",
    "upstream_errors",
    "overloaded",
    "tokens_saved",
    "saved_without_usage",
    "flights",
    "waiters",
)


def run_totals(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures from its workers' ``/stats`` documents (the module's contract). Each
    replica's calls, load, errors and failures summed, its state the worst a worker saw. What
    is not of the expected shape in a document counts nothing (never a 500 for the run's)."""
    run: dict[str, Any] = {key: sum(_number(doc.get(key)) for doc in docs) for key in SUMMED}
    saved = run["hits"] + run["semantic_hits"] + run["coalesced"]
    eligible = saved + run["misses"]
    run["saved_fraction"] = round(saved / eligible, 6) if eligible else 0.0
    layers: dict[str, dict[str, float]] = {}
    idempotency: dict[str, float] = dict.fromkeys(IDEMPOTENCY_FIGURES, 0)
    replicas: dict[str, dict[str, Any]] = {}
    latency: dict[str, dict[str, float]] = {}
    for doc in docs:
        for name, layer in _pairs(doc.get("layers")):
            into = layers.setdefault(name, {"entries": 0, "bytes": 0})
            for field in ("entries", "bytes"):
                into[field] += _number(layer.get(field))
        records = doc.get("idempotency")  # (each worker holds its own keys': summed)
        if isinstance(records, dict):
            for field in IDEMPOTENCY_FIGURES:
                idempotency[field] += _number(records.get(field))
        for name, replica in _pairs(doc.get("replicas")):
            into = replicas.setdefault(name, {**replica, **dict.fromkeys(_REPLICA_SUMMED, 0)})
            for field in _REPLICA_SUMMED:
                into[field] += _number(replica.get(field))
            if _WORSE.get(str(replica.get("state")), 0) > _WORSE.get(str(into.get("state")), 0):
                into["state"] = replica["state"]
        for outcome, figures in _pairs(doc.get("latency_ms")):
            into = latency.setdefault(outcome, {"p50": 0, "p95": 0, "p99": 0, "count": 0})
            for field in ("p50", "p95", "p99"):
                into[field] = max(into[field], _number(figures.get(field)))
            into["count"] += _number(figures.get("count"))
    return {
        **run,
        "layers": layers,
        "idempotency": idempotency,
        "replicas": replicas,
        "latency_ms": latency,
        "workers": len(docs),
        "pids": sorted(pid for doc in docs if isinstance(pid := doc.get("pid"), int)),
    }


# A replica's figures summed over the workers, and its states from the best to the worst.
_REPLICA_SUMMED = ("calls", "in_flight", "errors", "failures")
_WORSE = {"healthy": 0, "probing": 1, "down": 2}


def _pairs(value: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """The name, object pairs of a document's object of objects (nothing of another shape)."""
    if isinstance(value, dict):
        for name, inner in value.items():
            if isinstance(name, str) and isinstance(inner, dict):
                yield name, inner


def _number(value: Any) -> float:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else 0
