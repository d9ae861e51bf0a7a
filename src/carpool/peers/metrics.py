"""The workers' ``/metrics`` as one: what a scrape of the run's one port gets.

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
  the sums are the run's. Gauges are summed too (flights, waiters, cache entries and bytes:
  each worker's own), but for those that are a state or a rate, not an amount
  (:data:`HIGHEST`: the highest of the workers', the conservative reading for an alert).
- A worker that does not answer in time adds nothing to that scrape (logged by ``Peers``): its
  counters are missing from the sum once, which Prometheus reads as a reset, as it reads a
  worker that restarted (its counters start again from 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["HIGHEST", "merge"]

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
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
