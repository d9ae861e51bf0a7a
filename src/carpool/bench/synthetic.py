"""The built-in synthetic workloads of ``carpool bench``: presets of traits, drawn from a seed.

Contract:
- ``synthetic(name, requests, rate, seed, ...)`` is deterministic: the same arguments give the same
  bodies, headers and timestamps in any process (one ``random.Random(seed)``, no wall clock, no
  ``hash()``). Its traits, per ``Spec`` (each a probability per request, so a workload of a few
  hundred requests already shows them):
  * Zipf-popular questions from a catalog of support questions (``catalog.py``);
    ``duplicate_rate`` of the shareable requests repeat an earlier request of the same tenant
    exactly (same fingerprint), picked by Zipf popularity, or (``trending_share`` of repeats) one
    of the tenant's 3 newest questions, so that repeats also arrive while the first call is in
    flight (coalescing);
  * several tenants (``tenants``, Zipf-weighted), each with its own tenant header value: answers
    never cross tenants, so the same question asked by two tenants is two fingerprints;
  * shared prefixes: every chat request starts with one of its tenant's long system prompts
    (``system_prompt_words`` words); ``completions_share`` go to ``/v1/completions`` with the
    system prompt as the head of the prompt;
  * a streaming mix: ``stream_share`` of requests stream (with ``stream_options.include_usage``);
    the stream flag is drawn per request, so streaming and non-streaming copies share;
  * other APIs: ``apis_share`` of new chat questions go, half and half, to ``/v1/responses``
    (``instructions`` = the system prompt, ``input`` = the question, ``max_output_tokens``) and
    ``/v1/messages`` (``system``, one user message, ``max_tokens``); both sample by default, so
    their shareable requests say ``temperature: 0`` (they have no ``seed``: a seeded question is
    asked at temperature 0 there). Their streams send ``stream: true`` alone (no
    ``stream_options``). 0 except in the ``apis`` preset, so the other presets are unchanged;
  * sampling: ``sampled_share`` are sampled without a seed (``temperature`` 0.8, unshareable:
    ``bypass``), ``seeded_share`` of new questions are sampled with a seed (shareable);
  * paraphrases: ``paraphrase_rate`` of the shareable requests reword an earlier question of the
    tenant in a form not asked before (a new fingerprint, a near duplicate for the semantic
    layer); ``whitespace_noise`` of exact repeats add white space (0 by default: white space is
    meaning, so such a repeat is a new request unless ``fingerprint.normalize_whitespace``);
  * bursty open-loop arrivals at mean ``rate`` req/s: a two-state Markov-modulated Poisson process
    (``burst_factor`` times the calm rate for ``burst_fraction`` of the time); 1 = plain Poisson.
  Each request carries a ``label``: new | repeat | trending | paraphrase | sampled.
- ``PRESETS`` name the built-in workloads (``mixed`` is the default; ``apis`` sets
  ``apis_share``); ``Spec`` fields can be overridden on top of a preset.
- ``Zipf(rng, size, s)`` draws ranks 0..size-1 with weight ``1 / (rank + 1) ** s``, one
  ``rng.random()`` per draw (the benchmarks' traces use it too).
"""

from __future__ import annotations

import bisect
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from .catalog import PARAPHRASES, completion_prompt, question, system_prompt
from .workloads import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    MODEL,
    RESPONSES,
    TYPED_ENDPOINTS,
    BenchRequest,
    Workload,
    WorkloadError,
    tenant_header_value,
)


@dataclass(frozen=True, slots=True)
class Spec:
    """The traits of a synthetic workload (module docstring)."""

    tenants: int = 4
    duplicate_rate: float = 0.6
    trending_share: float = 0.3
    paraphrase_rate: float = 0.06
    whitespace_noise: float = 0.0
    sampled_share: float = 0.04
    seeded_share: float = 0.05
    stream_share: float = 0.3
    completions_share: float = 0.1
    apis_share: float = 0.0
    zipf_s: float = 1.1
    system_prompt_words: int = 300
    system_prompts_per_tenant: int = 2
    max_tokens: int = 64
    burst_factor: float = 4.0
    burst_fraction: float = 0.2
    burst_mean_s: float = 1.0

    def check(self) -> None:
        for name in (
            "duplicate_rate",
            "trending_share",
            "paraphrase_rate",
            "whitespace_noise",
            "sampled_share",
            "seeded_share",
            "stream_share",
            "completions_share",
            "apis_share",
            "burst_fraction",
        ):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise WorkloadError(f"{name} must be between 0 and 1, got {value}")
        if self.duplicate_rate + self.paraphrase_rate > 1:
            raise WorkloadError("duplicate_rate + paraphrase_rate must not exceed 1")
        if self.tenants < 1 or self.system_prompts_per_tenant < 1 or self.max_tokens < 1:
            raise WorkloadError("tenants, system_prompts_per_tenant and max_tokens must be >= 1")
        if self.tenants > MOST_TENANTS:
            # (Each tenant's system prompts are written before the first request: 10**8 of
            # them grew the run past 16 GB, deaf to SIGTERM, for a one-request workload.)
            raise WorkloadError(f"tenants must be at most {MOST_TENANTS:,}, got {self.tenants:,}")
        if self.burst_factor < 1 or self.burst_mean_s <= 0 or self.zipf_s < 0:
            raise WorkloadError("burst_factor must be >= 1, burst_mean_s > 0, zipf_s >= 0")


# The most tenants a synthetic workload has (``--tenants``): each one's system prompts are
# made up front.
MOST_TENANTS = 10_000

PRESETS: dict[str, dict[str, Any]] = {
    # Every trait at once, semantic-layer traffic included (it is off by default: paraphrases are
    # then new fingerprints). The default.
    "mixed": {},
    # One tenant's FAQ bot: Zipf questions and their repeats, steady Poisson arrivals, no streams.
    "faq": {
        "tenants": 1,
        "duplicate_rate": 0.7,
        "paraphrase_rate": 0.0,
        "sampled_share": 0.0,
        "seeded_share": 0.0,
        "stream_share": 0.0,
        "completions_share": 0.0,
        "burst_factor": 1.0,
        "system_prompt_words": 60,
    },
    # Flash crowds: strong bursts, repeats mostly of the newest questions (coalescing).
    "bursty": {"burst_factor": 8.0, "burst_fraction": 0.15, "trending_share": 0.7},
    # Many tenants asking the same catalog: isolation keeps their answers apart.
    "tenants": {"tenants": 16, "duplicate_rate": 0.5},
    # Mostly streaming clients: time to first byte of shared streams.
    "streaming": {"stream_share": 0.9, "completions_share": 0.0},
    # Long shared system prompts and no repeats at all: nothing to deduplicate (oracle = requests),
    # only the engine's prefix cache helps.
    "prefix": {
        "duplicate_rate": 0.0,
        "paraphrase_rate": 0.0,
        "system_prompt_words": 800,
        "system_prompts_per_tenant": 1,
        "sampled_share": 0.0,
    },
    # Reworded questions, for the semantic layer (turn it on with --config).
    "paraphrase": {"duplicate_rate": 0.3, "paraphrase_rate": 0.4, "sampled_share": 0.0},
    # Three APIs at once: chat, OpenAI's Responses API and Anthropic's Messages API (about a
    # third each of new questions; no completions), every trait of ``mixed`` otherwise.
    "apis": {"apis_share": 2 / 3, "completions_share": 0.0},
}


class Zipf:
    """Draws ranks by Zipf weight; ``draw_new`` one that is not in a given set."""

    def __init__(self, rng: random.Random, size: int, s: float) -> None:
        self.rng, self.size = rng, size
        weights = [1.0 / (rank**s) for rank in range(1, size + 1)]
        self.cumulative = list(_accumulate(weights))
        self.weights = weights

    def draw(self) -> int:
        return bisect.bisect_left(self.cumulative, self.rng.random() * self.cumulative[-1])

    def draw_new(self, issued: set[int]) -> int:
        for _ in range(64):
            rank = self.draw()
            if rank not in issued:
                return rank
        return next(r for r in range(self.size) if r not in issued)


def _accumulate(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


@dataclass(slots=True)
class _Item:
    """A shareable request a tenant has made: what an exact repeat copies."""

    rank: int
    endpoint: str
    body: dict[str, Any]
    text: str  # the question as asked


@dataclass(slots=True)
class _Tenant:
    name: str
    systems: list[str]
    items: list[_Item] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)  # Zipf weights of items, summed
    issued: set[int] = field(default_factory=set)
    phrasings: set[tuple[int, int]] = field(default_factory=set)  # (rank, paraphrase) asked


def arrivals(rng: random.Random, n: int, rate: float, spec: Spec) -> list[float]:
    """``n`` arrival offsets: a two-state Markov-modulated Poisson process of mean ``rate``."""
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    if spec.burst_factor == 1 or spec.burst_fraction in (0, 1):
        calm = burst = rate
    else:
        calm = rate / (1 - spec.burst_fraction + spec.burst_fraction * spec.burst_factor)
        burst = calm * spec.burst_factor
    burst_mean = spec.burst_mean_s
    calm_mean = burst_mean * (1 - spec.burst_fraction) / max(spec.burst_fraction, 1e-9)
    t, in_burst = 0.0, False
    state_end = rng.expovariate(1 / calm_mean)
    out: list[float] = []
    while len(out) < n:
        step = rng.expovariate(burst if in_burst else calm)
        if t + step > state_end:  # memoryless: restart the draw in the next state
            t = state_end
            in_burst = not in_burst
            state_end = t + rng.expovariate(1 / (burst_mean if in_burst else calm_mean))
            continue
        t += step
        out.append(t)
    # A short run sees few calm/burst cycles, so its mean rate would wander: rescale it to the
    # mean asked for (the last request arrives at n / rate), which keeps the bursts' shape.
    scale = (n / rate) / out[-1] if out and out[-1] > 0 else 1.0
    return [round(x * scale, 6) for x in out]


def synthetic(
    name: str = "mixed",
    requests: int = 3000,
    rate: float = 40.0,
    seed: int = 0,
    tenant_header: str = "Authorization",
    **overrides: Any,
) -> Workload:
    """The built-in workload ``name`` (``PRESETS``) with ``overrides`` of ``Spec`` fields."""
    if name not in PRESETS:
        raise WorkloadError(f"unknown workload {name!r}; built-in: {', '.join(PRESETS)}, audit")
    if requests < 1:
        raise WorkloadError(f"requests must be >= 1, got {requests}")
    try:
        spec = Spec(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})
    except TypeError as error:
        raise WorkloadError(str(error)) from None
    spec.check()
    rng = random.Random(f"carpool-bench/{name}/{seed}")
    tenants = [
        _Tenant(
            f"bench-tenant-{k + 1}",
            [
                system_prompt(rng, k, v, spec.system_prompt_words)
                for v in range(spec.system_prompts_per_tenant)
            ],
        )
        for k in range(spec.tenants)
    ]
    tenant_weights = list(_accumulate([1.0 / (k + 1) ** 0.7 for k in range(spec.tenants)]))
    catalog = Zipf(rng, max(2 * requests, 1000), spec.zipf_s)
    times = arrivals(rng, requests, rate, spec)
    out: list[BenchRequest] = []
    for t in times:
        tenant = tenants[bisect.bisect_left(tenant_weights, rng.random() * tenant_weights[-1])]
        stream = rng.random() < spec.stream_share
        if rng.random() < spec.sampled_share:
            label, endpoint, body = (
                "sampled",
                *_fresh_body(rng, spec, tenant, catalog.draw(), sampled=True),
            )
        else:
            label, endpoint, body = _shareable(rng, spec, tenant, catalog)
        body = dict(body)
        if stream:
            body["stream"] = True
            if endpoint not in TYPED_ENDPOINTS:
                body["stream_options"] = {"include_usage": True}
        headers = {tenant_header: tenant_header_value(tenant_header, tenant.name)}
        out.append(BenchRequest(t, endpoint, body, headers, tenant.name, label))
    params = {
        "preset": name,
        "requests": requests,
        "rate": rate,
        "seed": seed,
        "spec": dataclasses.asdict(spec),
        "tenant_header": tenant_header,
    }
    return Workload(name, out, "synthetic", params, timed=True)


def _shareable(
    rng: random.Random, spec: Spec, tenant: _Tenant, catalog: Zipf
) -> tuple[str, str, dict[str, Any]]:
    draw = rng.random()
    if draw < spec.duplicate_rate and tenant.items:
        if rng.random() < spec.trending_share:
            item, label = rng.choice(tenant.items[-3:]), "trending"
        else:
            index = bisect.bisect_left(tenant.cumulative, rng.random() * tenant.cumulative[-1])
            item, label = tenant.items[min(index, len(tenant.items) - 1)], "repeat"
        body = item.body
        if rng.random() < spec.whitespace_noise:
            body = _with_text(
                item.endpoint, body, tenant, "  " + item.text.replace(" ", "  ", 1) + " \n"
            )
        return label, item.endpoint, body
    if draw < spec.duplicate_rate + spec.paraphrase_rate and tenant.items:
        for _ in range(8):
            item = rng.choice(tenant.items)
            variant = rng.randrange(len(PARAPHRASES))
            if (item.rank, variant) not in tenant.phrasings:
                tenant.phrasings.add((item.rank, variant))
                text = PARAPHRASES[variant].format(q=question(item.rank)[1])
                body = _with_text(item.endpoint, item.body, tenant, text)
                _remember(tenant, item.rank, item.endpoint, body, text, catalog)
                return "paraphrase", item.endpoint, body
    rank = catalog.draw_new(tenant.issued)
    tenant.issued.add(rank)
    endpoint, body = _fresh_body(rng, spec, tenant, rank, sampled=False)
    tenant.phrasings.add((rank, -1))
    _remember(tenant, rank, endpoint, body, question(rank)[0], catalog)
    return "new", endpoint, body


def _remember(
    tenant: _Tenant, rank: int, endpoint: str, body: dict[str, Any], text: str, catalog: Zipf
) -> None:
    tenant.items.append(_Item(rank, endpoint, body, text))
    last = tenant.cumulative[-1] if tenant.cumulative else 0.0
    tenant.cumulative.append(last + catalog.weights[rank])


def _fresh_body(
    rng: random.Random, spec: Spec, tenant: _Tenant, rank: int, sampled: bool
) -> tuple[str, dict[str, Any]]:
    system = rng.choice(tenant.systems)
    text = question(rank)[0]
    params: dict[str, Any] = {"model": MODEL, "max_tokens": spec.max_tokens}
    if sampled:
        params["temperature"] = 0.8
    elif rng.random() < spec.seeded_share:
        params.update(temperature=0.8, seed=rng.randrange(1, 1000))
    else:
        params["temperature"] = 0
    if rng.random() < spec.completions_share:
        return COMPLETIONS, {**params, "prompt": completion_prompt(system, text)}
    if spec.apis_share and rng.random() < spec.apis_share:
        # No seed in these APIs: a seeded question is asked greedily (temperature 0).
        params.pop("seed", None)
        params["temperature"] = 0.8 if sampled else 0
        if rng.random() < 0.5:
            return RESPONSES, {
                "model": MODEL,
                "instructions": system,
                "input": text,
                "max_output_tokens": spec.max_tokens,
                "temperature": params["temperature"],
            }
        return MESSAGES, {
            **params,
            "system": system,
            "messages": [{"role": "user", "content": text}],
        }
    return CHAT, {
        **params,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
    }


def _with_text(endpoint: str, body: dict[str, Any], tenant: _Tenant, text: str) -> dict[str, Any]:
    """``body`` asking ``text`` instead (same system prompt and parameters)."""
    if endpoint == CHAT:
        return {**body, "messages": [body["messages"][0], {"role": "user", "content": text}]}
    if endpoint == RESPONSES:
        return {**body, "input": text}
    if endpoint == MESSAGES:
        return {**body, "messages": [{"role": "user", "content": text}]}
    system = body["prompt"].split("\n\nQuestion: ", 1)[0]
    return {**body, "prompt": completion_prompt(system, text)}
