"""The oracle: the fewest upstream calls any correct deduplicator could make on a workload.

Contract:
- Computed from the workload (its requests and their arrival times) and, given it, which of
  its requests' answers are ones the gateway never stores (``never_stored``: read from each
  answer itself by its API, as the gateway judges it; ``replay.Result.storable``), never from
  what the gateway reported, so it can judge the gateway's ``upstream_calls``.
- "Identical" is the gateway's own definition, reused rather than re-implemented: each request is
  parsed with ``carpool.request.parse`` and keyed with ``carpool.fingerprint.fingerprint`` under
  the run's config (tenant header, namespaces, sampling policy, white-space normalisation). So the
  oracle measures how well carpool deduplicates, not whether its fingerprint is right (the
  fingerprint has its own tests).
- One call per distinct fingerprint among shareable requests while its answer lives, plus one per
  unshareable request (sampled without a seed, unless the policy shares those): the policy's
  lower bound. A request the gateway rejects (400/413/bad idempotency key) costs nothing; a
  request reusing an ``Idempotency-Key`` already seen for its tenant costs nothing (replay or
  refusal).
- Lifetimes, per fingerprint, from the call that produced the answer: stored answers live their
  type's TTL (``config.ttl_for``; 0 = never stored), readable unless the request says
  ``no-cache``/``no-store`` or its ``max-age`` is shorter; an answer in flight is joinable until
  it arrived: the call a request makes ends at its send time + ``call_durations[i]`` (the run's
  measured latency of that request, when it was a miss: its answer came from its own call), or
  + ``call_seconds`` where that is unknown (None; the report passes the run's median miss
  latency). Ending every call after the median had a request sent after a short call's answer
  arrived join it (a closed loop's next request): fewer calls than any deduplicator can make.
  It then lingers joinable for the longest coalescing window (``max_window_ms`` when adaptive,
  else ``window_ms``; none with ``window_ms`` 0), except after a ``no-store`` leader.
  A call whose answer is never stored (a Responses answer that ended ``incomplete`` or
  ``failed``, a message without a stop reason: docs/design.md, "What is stored") is joinable
  only while in flight: it is neither stored nor lingers, so the next request after it calls
  again. When the run is shorter than every TTL and every answer is stored, none of this
  matters: the oracle is distinct fingerprints + unshareable requests.
- Not modelled (stated in the report): cache evictions (``cache.max_bytes`` is assumed large
  enough), the semantic layer (it may go below this exact-match oracle: paraphrases count as new
  fingerprints here), and the embeddings batcher (it merges distinct embeddings into one call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import Config
from ..errors import RequestError
from ..fingerprint import fingerprint
from ..idempotency import IdempotencyError, parse_key
from ..request import ClientRequest, parse
from .workloads import BenchRequest, Workload


def _parsed(request: BenchRequest, config: Config) -> tuple[Any, Any, str | None] | None:
    """(Request, Fingerprint, idempotency key), or None when the gateway would reject it."""
    headers = {k.lower(): v for k, v in request.headers.items()}
    try:
        parsed = parse(
            ClientRequest(request.endpoint, request.payload(), headers),
            config.limits.max_body_bytes,
        )
        idempotency_key = parse_key(headers)
    except (RequestError, IdempotencyError):
        return None
    return parsed, fingerprint(parsed, config), idempotency_key


def request_key(request: BenchRequest, config: Config) -> str | None:
    """The request's fingerprint key; None when it is unshareable or rejected."""
    parsed = _parsed(request, config)
    return None if parsed is None else parsed[1].key


@dataclass(slots=True)
class _Life:
    flight_end: float = float("-inf")  # the last call's answer was ready then
    linger: bool = True
    cache_produced: float = float("-inf")
    cache_until: float = float("-inf")


@dataclass(slots=True)
class Oracle:
    calls: int = 0
    distinct: int = 0  # distinct fingerprints among shareable requests
    unshareable: int = 0  # one call each
    refreshes: int = 0  # further calls of a fingerprint whose answer had expired
    rejected: int = 0  # the gateway answers these itself: no call
    replays: int = 0  # a reused Idempotency-Key: no call
    never_stored: int = 0  # calls whose answer the gateway never stores (nor lingers)
    needs_call: list[bool] = field(default_factory=list)  # per request, in workload order
    assumptions: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "distinct_fingerprints": self.distinct,
            "unshareable": self.unshareable,
            "refreshes": self.refreshes,
            "rejected": self.rejected,
            "idempotent_replays": self.replays,
            "never_stored": self.never_stored,
            "method": "carpool.fingerprint.fingerprint under the run's config; one call per "
            "distinct fingerprint while its answer lives + one per unshareable "
            "request",
            "assumptions": self.assumptions,
        }


def oracle(
    workload: Workload,
    config: Config,
    times: Sequence[float] | None = None,
    call_seconds: float = 0.0,
    never_stored: Sequence[bool] | None = None,
    call_durations: Sequence[float | None] | None = None,
) -> Oracle:
    """The oracle for ``workload`` with requests arriving at ``times`` (default: their ``t``);
    ``never_stored``: per request, whether its answer is one the gateway never stores (default:
    every answer is stored); ``call_durations``: per request, how long the call it made took
    (None: unknown, ``call_seconds``)."""
    requests = workload.requests
    times = [r.t for r in requests] if times is None else list(times)
    unstored = [False] * len(requests) if never_stored is None else list(never_stored)
    durations = [None] * len(requests) if call_durations is None else list(call_durations)
    if len(times) != len(requests) or len(unstored) != len(requests):
        raise ValueError("one time and one never_stored per request")
    if len(durations) != len(requests):
        raise ValueError("one call duration (or None) per request")
    measured = 0  # calls ended at their measured answer, not after the assumed call_seconds
    coalesce = config.coalesce
    longest = coalesce.max_window_ms if coalesce.adaptive else coalesce.window_ms
    window = (longest if coalesce.window_ms > 0 else 0) / 1000  # (``window.py``: 0 is none)
    result = Oracle(needs_call=[False] * len(requests))
    lives: dict[str, _Life] = {}
    idempotency_seen: set[tuple[str, str]] = set()
    ttls_used: set[float] = set()
    for i in sorted(range(len(requests)), key=lambda i: (times[i], i)):
        t = times[i]
        parsed = _parsed(requests[i], config)
        if parsed is None:
            result.rejected += 1
            continue
        request, key, idempotency_key = parsed
        if idempotency_key is not None:
            scoped = (key.owner, idempotency_key)  # as the gateway: the requester's own
            if scoped in idempotency_seen:
                result.replays += 1
                continue
            idempotency_seen.add(scoped)
        if key.key is None:
            result.unshareable += 1
            result.calls += 1
            result.needs_call[i] = True
            continue
        controls = request.controls
        ttl = config.ttl_for(controls.request_type)
        ttls_used.add(ttl)
        life = lives.get(key.key)
        if life is None:
            result.distinct += 1
            life = lives[key.key] = _Life()
        elif _served(life, t, controls, window):
            continue
        else:
            result.refreshes += 1
        result.calls += 1
        result.needs_call[i] = True
        result.never_stored += unstored[i]
        # The call ends when its answer arrived, as measured; a closed loop's next request is
        # sent after that, so it cannot join it.
        duration = durations[i]
        measured += duration is not None
        life.flight_end = t + (call_seconds if duration is None else duration)
        # The answer this call makes is the one request i got (its engine answers a request
        # alike each time): one never stored does not linger either (docs/design.md).
        stored = not controls.no_store and not unstored[i]
        life.linger = stored
        if stored and ttl > 0:
            life.cache_produced = life.flight_end
            life.cache_until = life.cache_produced + ttl
    span = max(times) - min(times) if times else 0.0
    shortest = min(ttls_used) if ttls_used else None
    notes = [
        f"cache entries are never evicted (cache.max_bytes = {config.cache.max_bytes} is "
        "assumed large enough)",
        "exact matches only: semantic hits can bring upstream_calls below this oracle",
        "embeddings requests count one call per distinct input request; the gateway's "
        "batcher may merge several into one upstream call",
    ]
    notes.append(
        f"a call is joinable until its answer arrived: its request's send time + that "
        f"request's measured latency ({measured:,} of the {result.calls - result.unshareable:,} "
        f"calls of shareable requests), else + {call_seconds * 1000:.0f} ms (the run's median "
        f"miss latency, where the request was not a miss in the run)"
    )
    if shortest is not None and shortest < span:
        notes.append(
            f"some answers expire during the run (ttl {shortest:g} s < run {span:.1f} "
            f"s): each is refreshed by one call at its first request after expiry; "
            f"a finished answer stays joinable {window * 1000:.0f} ms (the longest "
            f"coalescing window)"
        )
    else:
        notes.append(
            f"every answer outlives the run (shortest ttl "
            f"{'n/a' if shortest is None else f'{shortest:g} s'} >= run "
            f"{span:.1f} s): no refreshes"
        )
    if result.never_stored:
        notes.append(
            f"{result.never_stored} calls made answers the gateway never stores (a Responses "
            "answer that ended incomplete or failed, a message without a stop reason, as the "
            "client received them): each is joinable only while in flight"
        )
    result.assumptions = notes
    return result


def _served(life: _Life, t: float, controls: Any, window: float) -> bool:
    """Could a request at ``t`` be answered without a call of its own?"""
    if t <= life.flight_end:  # joins the call in flight
        return True
    join_age = controls.max_age if controls.may_read else 0.0
    since = t - life.flight_end
    if life.linger and since <= window and (join_age is None or since < join_age):
        return True  # within the coalescing window
    return (
        controls.may_read
        and t < life.cache_until
        and (controls.max_age is None or t - life.cache_produced < controls.max_age)
    )
