"""What ``carpool bench`` replays: a ``Workload``, and what one holds (``traits``).

Contract:
- A ``Workload`` is an ordered list of ``BenchRequest`` (arrival offset ``t`` in seconds from the
  start of the run, endpoint path, JSON body, headers to send, tenant label) with its name, source
  (``"synthetic"`` or the recorded file's path) and the parameters it was made with. Requests are
  sorted by ``t``; a request may carry the text of the answer it must get (``expected``). Where
  they come from: ``synthetic.py`` (the built-in presets, text from
  ``catalog.py``) and ``recorded.py`` (a JSONL file).
- ``ENDPOINTS``: what a workload may send: the OpenAI classics (streams ending with
  ``data: [DONE]``) and the Responses and Messages APIs (``TYPED_ENDPOINTS``: typed streams ending
  with their last event).
- ``WorkloadError``: a workload cannot be built or read; its message says where and why.
- ``traits(workload, config, arrivals)`` measures what a workload holds (shares, tenants by their
  credentials, duplicates by the gateway's own fingerprint) and the rates it was replayed at,
  for the report and the tests.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..config import Config
from ..fingerprint import names_of
from ..identity import tenant_of

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
MODEL = "carpool-bench"
LABELS = ("new", "repeat", "trending", "paraphrase", "sampled", "trap")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", RESPONSES, MESSAGES)
TYPED_ENDPOINTS = (RESPONSES, MESSAGES)


class WorkloadError(ValueError):
    """A workload cannot be built or read; the message says where and why."""


@dataclass(slots=True)
class BenchRequest:
    t: float  # arrival offset (s) from the start of the run
    endpoint: str  # one of the gateway's cached endpoints
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    tenant: str | None = None
    label: str = ""  # synthetic: new | repeat | ... ; recorded: ""
    expected: str | None = None  # the answer's text when the workload knows it (``audit``)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def payload(self) -> bytes:
        return orjson.dumps(self.body)


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[BenchRequest]
    source: str = "synthetic"  # "synthetic" or the recorded file's path
    params: dict[str, Any] = field(default_factory=dict)
    timed: bool = True  # the requests carry meaningful timestamps

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span(self) -> float:
        return self.requests[-1].t if self.requests else 0.0


def tenant_header_value(header: str, tenant: str) -> str:
    """What a tenant sends in the tenant header (a Bearer token when it is Authorization)."""
    return f"Bearer {tenant}" if header.lower() == "authorization" else tenant


def traits(
    workload: Workload,
    config: Config | None = None,
    arrivals: list[float] | None = None,
    *,
    closed_loop: bool = False,
) -> dict[str, Any]:
    """What the workload holds: shares, tenants (as the gateway tells them apart: by the
    credentials in their headers), and duplicates by the gateway's fingerprint. Its rates
    (``span_s``, ``mean_rate_rps``, ``peak_rate_rps_1s``) are those of ``arrivals``, the send
    offsets replayed (``--rate`` rescales a recording's), by default its own timestamps; a
    ``closed_loop`` run has no schedule, and no rates."""
    from .oracle import request_key

    config = config or Config()
    n = len(workload)
    names = names_of(config.tenant)
    tenants = {
        tenant_of({k.lower(): v for k, v in r.headers.items()}, names) for r in workload.requests
    }
    seen: set[str] = set()
    shareable = duplicates = 0
    for request in workload.requests:
        key = request_key(request, config)
        if key is None:
            continue
        shareable += 1
        if key in seen:
            duplicates += 1
        seen.add(key)
    labels = Counter(r.label for r in workload.requests if r.label)
    timed = arrivals is not None or workload.timed
    times = arrivals if arrivals is not None else [r.t for r in workload.requests]
    span = max(times, default=0.0)
    per_second = Counter(int(t) for t in times)
    return {
        "requests": n,
        "tenants": len(tenants),
        "stream_share": _share(sum(r.stream for r in workload.requests), n),
        "endpoints": dict(Counter(r.endpoint for r in workload.requests)),
        "shareable_share": _share(shareable, n),
        "duplicate_share": _share(duplicates, shareable),  # of shareable requests
        "distinct_fingerprints": len(seen),
        "labels": {label: labels[label] for label in LABELS if labels[label]},
        "span_s": None if closed_loop else round(span, 3),
        "mean_rate_rps": round(n / span, 3) if span > 0 and timed and not closed_loop else None,
        "peak_rate_rps_1s": max(per_second.values())
        if timed and per_second and not closed_loop
        else None,
    }


def _share(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0
