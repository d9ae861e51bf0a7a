"""The report of a ``carpool bench`` run: ``report.json`` for machines, ``report.md`` for people.

Contract:
- ``build(...)`` returns one JSON-able dict. Top-level keys: ``requests`` (sent), ``upstream_calls``
  (the gateway's ``/stats`` delta over the run), ``oracle_calls`` (``oracle.py``),
  ``upstream_over_oracle``, ``within_5pct_of_oracle`` (null for a run with errors, with
  ``within_5pct_of_oracle_reason`` saying so: a failed request may or may not have cost an
  upstream call, so the comparison says nothing), ``errors``, ``saved_fraction`` (the requests
  filed ``hit``, ``semantic_hit`` or ``coalesced`` over *all* requests sent: answered without
  reaching upstream, failures and known-wrong answers left out; the gateway's own ``/stats``
  ``saved_fraction`` is over the eligible ones only, hits + coalesced + misses, which
  ``stats_delta`` holds),
  ``outcomes`` (counts by outcome as ``outcome_of`` files them: the ``x-carpool`` header, but
  ``error`` for every failed request whatever its header, and ``wrong_semantic_hit`` for a
  semantic hit known to be wrong, ``Result.wrong``: the audit workload),
  ``outcomes_by_label`` (synthetic workloads: per request label), ``latency_ms`` and
  ``ttfb_ms`` (streams only) per outcome and ``all`` (count, p50, p95, p99, mean, max), of the
  requests answered without error,
  ``tokens_saved`` (``/stats`` delta), ``gpu_seconds_saved`` (null when unknown, with
  ``gpu_seconds_saved_reason``) with its ``cost_model`` (its ``split``: how it was made),
  ``throughput_rps``, ``arrival_lag_ms`` (open loop), ``oracle`` (breakdown and assumptions),
  ``engine`` (the embedded simulator's own counters, delta), ``stats_delta`` (every numeric
  ``/stats`` counter), ``workload`` (name, source, parameters, measured traits), ``params`` (the
  run's parameters) and ``plots``.
- Percentiles: ``stats.percentile`` (linear interpolation between closest ranks); times are milliseconds, rounded to µs.
- The cost model: a saved request would have cost its prompt tokens x ``prefill_ms_per_token``
  plus its completion tokens x ``decode_ms_per_token`` (``config.sim``: the simulator's own cost
  model, or the values of ``--config`` for a real engine; ``cost_source`` says which) of engine
  time for one sequence. The ``/stats`` ``tokens_saved`` (prompt + completion) is split
  (``_split``) in the proportion of the prompt and completion tokens of the saved answers the
  client received that carried usage; when none did (streams without
  ``stream_options.include_usage``), of the tokens the embedded simulated engine counted for its
  calls; when there is no such engine either, ``gpu_seconds_saved`` is null and
  ``gpu_seconds_saved_reason`` says why: a guessed split (it was 50/50) priced decode, 100x
  prefill, on half of a prompt-heavy saving. ``cost_model.split`` records the source, the
  prompt share and how many saved answers it was based on. This counts sequence-seconds, as
  if the saved calls had run alone; an engine batching B sequences spends about 1/B of that in
  GPU time on decode, and a prefix cache may have spared part of the prefill: an upper bound.
- ``write(report, out_dir)`` writes ``report.json`` and ``report.md`` (the target as ``params``
  states it: the simulated engine, or the embedded gateway's configured upstreams by name, or the
  URL; the arrivals, a null ``rate`` included; no seed for a recorded workload, whose ``seed`` is
  null; with failures, how many requests succeeded rather than a rate "achieved"; a table per
  outcome, the headline numbers, and the plots linked, or how to get them when matplotlib is
  missing);
  ``write_results`` writes ``requests.jsonl``, one row per request (send time, outcome, status,
  latency, TTFB, tokens, error), for analyses of your own.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from ..config import Config
from . import stats
from .oracle import Oracle
from .replay import Result, Run
from .workloads import Workload

OUTCOMES = ("hit", "semantic_hit", "coalesced", "miss", "bypass")  # the x-carpool header's
WRONG_HIT = "wrong_semantic_hit"
FILED = ("hit", "semantic_hit", WRONG_HIT, "coalesced", "miss", "bypass", "error")  # outcome_of's
SAVED = ("hit", "semantic_hit", "coalesced")
TOLERANCE = 0.05


def summary_ms(seconds: Sequence[float]) -> dict[str, Any]:
    if not seconds:
        return {"count": 0}
    return stats.summary_ms(seconds, (50, 95, 99), digits=3, count="count", suffix="")


def outcome_of(result: Result) -> str:
    """The outcome a result is filed under (one of ``FILED``): ``error`` for a failed request
    (whatever its ``x-carpool`` said: a 5xx may carry ``coalesced``) or one without the header,
    ``wrong_semantic_hit`` for a semantic hit known to have served another question's answer,
    else its ``x-carpool``."""
    if not result.ok or result.outcome not in OUTCOMES:
        return "error"
    if result.outcome == "semantic_hit" and result.wrong is True:
        return WRONG_HIT
    return result.outcome


def _per_outcome(results: Sequence[Result], attr: str) -> dict[str, Any]:
    groups: dict[str, list[float]] = {}
    for r in results:
        value = getattr(r, attr)
        if value is not None and r.ok:
            groups.setdefault(outcome_of(r), []).append(value)
            groups.setdefault("all", []).append(value)
    return {name: summary_ms(groups[name]) for name in (*FILED, "all") if name in groups}


def _by_label(workload: Workload, results: Sequence[Result]) -> dict[str, dict[str, int]] | None:
    """Synthetic workloads: outcomes per request label (a ``semantic_hit`` on a ``new`` question
    answered it with a different question's answer)."""
    if not any(r.label for r in workload.requests):
        return None
    table: dict[str, Counter[str]] = {}
    for request, result in zip(workload.requests, results, strict=True):
        table.setdefault(request.label, Counter())[outcome_of(result)] += 1
    return {label: dict(counts) for label, counts in table.items()}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` for every top-level numeric counter of /stats."""
    out = {}
    gauges = ("saved_fraction", "flights", "waiters")  # not counters: no delta
    for name, value in after.items():
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and isinstance(before.get(name), (int, float))
            and name not in gauges
        ):
            out[name] = value - before[name]
    return out


def engine_delta(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The simulated replicas' counters over the run, summed over replicas: every worker's
    under ``serve --workers`` (``run``: the two reads may land on different workers)."""
    before_replicas, after_replicas = _sim_replicas(before), _sim_replicas(after)
    if not before or not after_replicas:
        return None
    totals: Counter[str] = Counter()
    for sign, replicas in ((-1, before_replicas), (1, after_replicas)):
        for replica in replicas:
            # Every call it answered, as the gateway's ``upstream_calls`` counts them.
            totals["calls"] += sign * sum(replica["calls"].values())
            for name in (
                "prompt_tokens",
                "cached_prompt_tokens",
                "completion_tokens",
                "busy_seconds",
                "queue_wait_seconds",
                "errors",
            ):
                totals[name] += sign * replica[name]
    out: dict[str, Any] = {"simulated": True, "replicas": len(after_replicas)}
    out.update({k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()})
    return out


def _sim_replicas(snapshot: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A ``/sim/stats`` document's replicas: the run's (every worker's) where it has ``run``."""
    if not snapshot:
        return []
    run = snapshot.get("run")
    replicas = (run if isinstance(run, dict) else snapshot).get("replicas")
    return replicas if isinstance(replicas, list) else []


def cost_model(config: Config, source: str | None = None) -> dict[str, Any]:
    """The per-token costs and where they come from (``source``: default, the simulated engine's
    own; ``runner`` says when they price another engine)."""
    return {
        "prefill_ms_per_token": config.sim.prefill_ms_per_token,
        "decode_ms_per_token": config.sim.decode_ms_per_token,
        "source": source or "config.sim (the simulated engine's cost model)",
        "meaning": "engine time of one sequence: prompt tokens x prefill + completion tokens "
        "x decode; tokens_saved split by the prompt/completion mix of the saved "
        "answers received (or, when none carried usage, of the embedded engine's own "
        "token counts); an upper bound on GPU time (batching and prefix caching share "
        "part of it)",
    }


def _split(results: Sequence[Result], engine: dict[str, Any] | None) -> dict[str, Any]:
    """How ``tokens_saved`` splits into prompt and completion tokens, from what the run measured:
    the usage of the saved answers that carried it; else the simulated engine's own counts of
    the tokens it prefilled and decoded; else unknown (``prompt_share`` None). A stream without
    ``stream_options.include_usage`` carries none: the split must not be guessed, since decode
    costs 100x prefill per token in the default model."""
    saved = [r for r in results if outcome_of(r) in SAVED]
    told = [r for r in saved if r.prompt_tokens is not None or r.completion_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in told)
    completion = sum(r.completion_tokens or 0 for r in told)
    split: dict[str, Any] = {
        "source": None,
        "prompt_share": None,
        "saved_answers": len(saved),
        "saved_answers_with_usage": len(told),
        "engine_calls": engine.get("calls") if engine else None,
    }
    if prompt + completion:
        split.update(source="saved answers", prompt_share=round(prompt / (prompt + completion), 6))
    elif engine and engine.get("prompt_tokens", 0) + engine.get("completion_tokens", 0) > 0:
        total = engine["prompt_tokens"] + engine["completion_tokens"]
        split.update(source="engine", prompt_share=round(engine["prompt_tokens"] / total, 6))
    return split


def gpu_seconds_saved(
    tokens_saved: int, config: Config, split: dict[str, Any]
) -> tuple[float | None, str | None]:
    """The engine seconds the saved tokens would have cost, and why it is unknown (None) when
    it is: no split of the tokens was measured."""
    if tokens_saved <= 0:
        return 0.0, None
    share = split["prompt_share"]
    if share is None:
        return None, (
            f"none of the {split['saved_answers']:,} saved answers carried usage (a stream "
            "without stream_options.include_usage has none) and no engine counted its tokens: "
            "the prompt/completion split of tokens_saved is unknown"
        )
    ms = (
        tokens_saved * share * config.sim.prefill_ms_per_token
        + tokens_saved * (1 - share) * config.sim.decode_ms_per_token
    )
    return round(ms / 1000, 3), None


def build(
    *,
    workload: Workload,
    workload_traits: dict[str, Any],
    run: Run,
    oracle: Oracle,
    config: Config,
    params: dict[str, Any],
    cost_source: str | None = None,
) -> dict[str, Any]:
    """``cost_source``: where the per-token costs come from (``cost_model``)."""
    results = run.results
    delta = stats_delta(run.stats_before, run.stats_after)
    upstream = int(delta.get("upstream_calls", 0))
    errors = [r for r in results if not r.ok]
    outcomes = Counter(outcome_of(r) for r in results)
    tokens_saved = int(delta.get("tokens_saved", 0))
    lags = [r.lag for r in results]
    engine = engine_delta(run.sim_before, run.sim_after)
    split = _split(results, engine)
    engine_seconds, unknown = gpu_seconds_saved(tokens_saved, config, split)
    report: dict[str, Any] = {
        "requests": len(results),
        "upstream_calls": upstream,
        "oracle_calls": oracle.calls,
        "upstream_over_oracle": round(upstream / oracle.calls, 4) if oracle.calls else None,
        "within_5pct_of_oracle": (
            None
            if errors
            else abs(upstream - oracle.calls) <= TOLERANCE * oracle.calls
            if oracle.calls
            else upstream == 0
        ),
        "within_5pct_of_oracle_reason": (
            f"{len(errors):,} of {len(results):,} requests failed: a failed request may or may "
            "not have cost an upstream call, so the calls are not compared with the oracle's"
            if errors
            else None
        ),
        "errors": len(errors),
        "error_samples": dict(Counter(r.error for r in errors).most_common(5)),
        "outcomes": {name: outcomes[name] for name in FILED if outcomes[name]},
        "outcomes_by_label": _by_label(workload, results),
        "latency_ms": _per_outcome(results, "latency"),
        "ttfb_ms": _per_outcome([r for r in results if r.stream], "ttfb"),
        "tokens_saved": tokens_saved,
        "gpu_seconds_saved": engine_seconds,
        "gpu_seconds_saved_reason": unknown,
        "cost_model": {**cost_model(config, cost_source), "split": split},
        "saved_fraction": round(sum(outcomes[o] for o in SAVED) / len(results), 4)
        if results
        else 0.0,
        "duration_s": round(run.duration, 3),
        "throughput_rps": round(len(results) / run.duration, 2) if run.duration > 0 else None,
        "arrival_lag_ms": summary_ms(lags) if params.get("mode") == "open-loop" else None,
        "oracle": oracle.summary(),
        "engine": engine,
        "stats_delta": delta,
        "workload": {
            "name": workload.name,
            "source": workload.source,
            "params": workload.params,
            "traits": workload_traits,
        },
        "params": params,
        "plots": [],
    }
    return report


def _tenant_id(tenant: str | None) -> str | None:
    """A tenant as the rows name it: a digest (12 hex digits), the same for the same tenant. The
    tenant is sent as a bearer token: a workload file's may be a real key."""
    if tenant is None:
        return None
    return hashlib.blake2b(tenant.encode(), digest_size=6).hexdigest()


def write_results(workload: Workload, run: Run, out: Path) -> None:
    """``requests.jsonl``: one row per request, in workload order, for your own analysis (a
    tenant named by a digest: ``_tenant_id``)."""
    rows = []
    for request, r in zip(workload.requests, run.results, strict=True):
        rows.append(
            orjson.dumps(
                {
                    "i": r.index,
                    "t": request.t,
                    "sent": round(r.sent, 6),
                    "endpoint": request.endpoint,
                    "tenant": _tenant_id(request.tenant),
                    "label": request.label or None,
                    "stream": r.stream,
                    "status": r.status,
                    "outcome": r.outcome,
                    "latency_ms": None if r.latency is None else round(r.latency * 1000, 3),
                    "ttfb_ms": None if r.ttfb is None else round(r.ttfb * 1000, 3),
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                    "error": r.error,
                    "wrong": r.wrong,
                }
            )
        )
    (out / "requests.jsonl").write_bytes(b"\n".join(rows) + b"\n")


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_bytes(
        orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    (out / "report.md").write_text(markdown(report), encoding="utf-8")


def _ms(summary: dict[str, Any], key: str) -> str:
    value = summary.get(key)
    return "" if value is None else f"{value:,.1f}"


def markdown(report: dict[str, Any]) -> str:
    p = report["params"]
    traits = report["workload"]["traits"]
    upstreams = p.get("upstreams") or []
    if p["target"] != "embedded":
        target = f"`{p['gateway_url']}`"
    elif upstreams:  # (its config's: no simulated engine in this run)
        names = ", ".join(f"`{name}`" for name in upstreams)
        target = f"embedded gateway + {len(upstreams)} configured upstream" + (
            f"s ({names})" if len(upstreams) > 1 else f" ({names})"
        )
    else:
        target = "embedded gateway + simulated engine"
    rate = p.get("rate")
    if p["mode"] != "open-loop":
        arrival = f"closed loop, {p['concurrency']} clients"
    elif p.get("recorded_timestamps"):
        arrival = "open loop, recorded timestamps, " + (
            f"{rate:g} req/s mean" if rate is not None else "all at one instant"
        )
    else:
        arrival = "open loop" + (f", {rate:g} req/s mean" if rate is not None else "")
    ratio = report["upstream_over_oracle"]
    within = report["within_5pct_of_oracle"]
    verdict = (
        "not compared: requests failed"
        if within is None
        else "within 5%"
        if within
        else "NOT within 5%"
    )
    seed = "" if p.get("seed") is None else f"seed {p['seed']}; "  # (none: a recorded run)
    errors, sent = report["errors"], report["requests"]
    pace = (
        # A failed request was not served: no rate "achieved" counts it.
        f"{sent - errors:,} of {sent:,} requests succeeded"
        if errors
        else f"{report['throughput_rps'] or 0:.1f} req/s achieved"
    )
    seconds = report["gpu_seconds_saved"]
    lines = [
        f"# carpool bench: `{report['workload']['name']}`",
        "",
        f"{sent:,} requests against the {target}; {arrival}; {seed}"
        f"{report['duration_s']:.1f} s ({pace}).",
        "",
        "| | |",
        "|---|---|",
        f"| upstream calls (gateway `/stats`) | **{report['upstream_calls']:,}** |",
        f"| oracle: fewest calls any correct deduplicator could make | **{report['oracle_calls']:,}** |",
        f"| upstream / oracle | {ratio if ratio is not None else 'n/a'} ({verdict}) |",
        "| requests answered without reaching upstream (failed and known-wrong answers left "
        f"out) | {100 * report['saved_fraction']:.1f}% |",
        f"| tokens saved | {report['tokens_saved']:,} |",
        "| engine seconds saved (cost model below) | "
        + ("unknown" if seconds is None else f"{seconds:,.1f}")
        + " |",
        f"| errors | {report['errors']} |",
    ]
    if report.get("engine"):
        e = report["engine"]
        lines.append(f"| calls the simulated engine received | {e['calls']:,} |")
    lines += [
        "",
        "| outcome | requests | share | p50 ms | p95 ms | p99 ms | stream TTFB p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    latency, ttfb = report["latency_ms"], report["ttfb_ms"]
    n = report["requests"] or 1
    for name in (*FILED, "all"):
        count = report["requests"] if name == "all" else report["outcomes"].get(name, 0)
        if not count:
            continue
        lat = latency.get(name, {})
        lines.append(
            f"| {name} | {count:,} | {100 * count / n:.1f}% | {_ms(lat, 'p50')} | "
            f"{_ms(lat, 'p95')} | {_ms(lat, 'p99')} | {_ms(ttfb.get(name, {}), 'p50')} |"
        )
    if report["errors"]:
        # (``all`` counts every request sent; a failed one has no latency to time.)
        answered = report["requests"] - report["errors"]
        lines += [
            "",
            "Latencies are those of the requests answered without error "
            f"({answered:,} of {report['requests']:,}).",
        ]
    lines += [
        "",
        "## Workload",
        "",
        f"Source: {report['workload']['source']}. {traits['requests']:,} requests, "
        f"{traits['tenants']} tenant(s), {100 * traits['stream_share']:.0f}% streaming, "
        f"{100 * traits['shareable_share']:.0f}% shareable, of which "
        f"{100 * traits['duplicate_share']:.0f}% exact repeats; "
        f"{traits['distinct_fingerprints']:,} distinct fingerprints.",
    ]
    if traits.get("labels"):
        lines.append(
            "Labels: " + ", ".join(f"{k} {v:,}" for k, v in traits["labels"].items()) + "."
        )
    new = (report.get("outcomes_by_label") or {}).get("new", {})
    wrong = new.get("semantic_hit", 0) + new.get(WRONG_HIT, 0)
    if wrong:
        lines.append(
            f"**{wrong:,} new questions were served from the semantic cache**, i.e. with "
            "the answer to a different catalog question (see `outcomes_by_label`)."
        )
    if report.get("audit"):
        lines += ["", *_audit_lines(report["audit"])]
    lines += [
        "",
        "## Oracle",
        "",
        f"{report['oracle']['calls']:,} = {report['oracle']['distinct_fingerprints']:,} "
        f"distinct fingerprints + {report['oracle']['unshareable']:,} unshareable requests "
        f"+ {report['oracle']['refreshes']:,} refreshes after expiry. "
        f"Method: {report['oracle']['method']}.",
        "",
    ]
    lines += [f"- {note}" for note in report["oracle"]["assumptions"]]
    cm = report["cost_model"]
    lines += [
        "",
        "## Cost model",
        "",
        f"{cm['prefill_ms_per_token']} ms per prompt token, {cm['decode_ms_per_token']} ms "
        f"per completion token ({cm['source']}): {cm['meaning']}.",
        "",
        *_split_lines(report),
        "## Plots",
        "",
    ]
    if report["plots"]:
        lines += [f"![{name}]({name})" for name in report["plots"]]
    else:
        lines.append(report.get("plots_missing") or "No plots.")
    return "\n".join(lines) + "\n"


def _split_lines(report: dict[str, Any]) -> list[str]:
    """What the prompt/completion split of ``tokens_saved`` was based on, or why it is unknown."""
    split = report["cost_model"].get("split")
    if not split or not report["tokens_saved"]:
        return []
    of = f"{split['saved_answers_with_usage']:,} of the {split['saved_answers']:,} saved answers"
    if split["source"] == "saved answers":
        text = (
            f"The saved tokens are split {100 * split['prompt_share']:.1f}% prompt by the usage "
            f"of {of} (those that carried usage)."
        )
    elif split["source"] == "engine":
        text = (
            f"No saved answer carried usage ({of}): the saved tokens are split "
            f"{100 * split['prompt_share']:.1f}% prompt by the engine's own counts of the "
            f"tokens of its {split['engine_calls']:,} calls."
        )
    else:
        text = f"Engine seconds saved: unknown: {report['gpu_seconds_saved_reason']}."
    return [text, ""]


def _audit_lines(audit: dict[str, Any]) -> list[str]:
    """The audit workload's section: the truth next to the audits' estimate."""
    estimate = audit["audit"]
    lines = [
        "## Audits against the truth",
        "",
        f"{audit['semantic_hits']:,} semantic hits served, {audit['wrong_hits']:,} of them wrong "
        f"(true rate {audit['true_wrong_rate']:.3f}; {audit['true_wrong_rate_of_the_window']:.3f}"
        f" over the latest {audit['window']:,}, which the estimate is made of).",
    ]
    if estimate:
        lines.append(
            f"Audits: {estimate['audited']:,} audited, {estimate['wrong']:,} disagreed; estimate "
            f"{estimate['estimate']:.3f}, 95% interval [{estimate['low']:.3f}, "
            f"{estimate['high']:.3f}]: it {'holds' if audit['interval_holds_true_rate'] else 'does NOT hold'}"
            f" the true rate. State at the end: {estimate['state']}; judge calls "
            f"{audit['judge_calls']:,}."
        )
    changes = audit["state_changes"]
    if changes:
        lines.append(
            "State changes: "
            + ", ".join(f"{c['state']} at request {c['at_request']:,}" for c in changes)
            + "."
        )
    if estimate and estimate["state"] != "serving":
        lines.append(
            "The namespace is not serving at the end: its latest audits are of the hits it "
            "would have served, which the true rate above (of the hits it did serve) is not."
        )
    return lines
