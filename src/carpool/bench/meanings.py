"""The ``audit`` workload of ``carpool bench``: labeled paraphrases and traps, an upstream that
answers by meaning, and the true wrong-hit rate to hold the semantic cache's audits against.

Contract:
- ``audit_workload(requests, rate, seed, tenant_header)``: catalog questions (``catalog.py``) in
  pairs of near meanings (the same object and context, two different actions: "upgrade" /
  "downgrade my subscription"), each meaning asked in ``PER_MEANING`` of its wordings (the
  canonical question and ``PARAPHRASES``, never the same wording twice: no exact repeats), in a
  seeded random order at Poisson arrivals of mean ``rate``; non-streaming chat at temperature 0,
  one tenant. Labels: ``new`` (a meaning's first wording, no near meaning asked before),
  ``trap`` (a meaning's first wording when its near meaning was asked before: a semantic hit
  here is a wrong answer), ``paraphrase`` (a later wording of a meaning asked before). Every
  request carries ``expected``: the answer its meaning gets.
- ``MeaningAnswers(app)``: an ASGI app in front of the simulated engine's (the benchmark
  upstream's ``by_meaning`` option). A chat call whose last message is a catalog question in any
  wording is answered ``answer_for(its core phrase)``: the same answer for every wording of one
  meaning, different answers for different meanings (the catalog has no synonyms). A call for
  ``JUDGE_MODEL`` is a labeled judge: carpool's "same answer?" question is answered yes when both
  requests have one meaning, "do these answers agree?" when the two answers are the same text.
  Anything else goes to the engine.
- ``audit_config(config)``: the embedded gateway's config for the workload: the semantic cache
  on, every hit audited (``semantic.audit_rate`` 1.0) and the labeled judge comparing answers,
  each unless the user's config sets it; with the judge's band empty unless set, so that the
  judge only compares answers and the cache's own decisions are what is measured.
- ``audits_settled(url, upstream, admin_token)``: waits until the audits a run left running are
  done (the run's ``settle``).
- ``grade(workload, run, audit_window)``: the truth next to what the audits said: semantic hits
  served, the wrong ones (the answer is not the request's ``expected``), the true rate over all
  hits and over the latest ``audit_window`` hits (what the estimate is made of), the gateway's
  ``semantic_audit`` of the default namespace at the end, whether its 95% interval holds the true
  rate, the namespace's state changes (seconds into the run and requests sent by then, from the
  polled ``/stats``), judge calls, semantic hits per label, and the cumulative served and wrong
  hits over the requests in send order (``series``).
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import Config
from ..semantic.judge import SAME_ANSWER, question_of
from .catalog import ACTIONS, CONTEXTS, OBJECTS, WORDINGS, core_of, question
from .upstream import read_body, replaying
from .workloads import CHAT, MODEL, BenchRequest, Workload, WorkloadError, tenant_header_value

WORKLOAD = "audit"
JUDGE_MODEL = "carpool-bench-judge"
PER_MEANING = 3
TENANT = "tenant-1"


def answer_for(core: str) -> str:
    return f"To {core}: open Settings and follow the steps for it."


# ------------------------------------------------------------------------------- the workload


def audit_workload(requests: int, rate: float, seed: int, tenant_header: str) -> Workload:
    if requests < 1:
        raise WorkloadError(f"the audit workload needs at least one request, got {requests}")
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    bases = len(OBJECTS) * len(CONTEXTS)  # an (object, context): the pair's shared words
    per_round = len(ACTIONS) * bases
    pairs = math.ceil(requests / (2 * PER_MEANING))
    order = rng.sample(range(bases), bases)
    asked: list[tuple[str, str, int]] = []  # (wording, its core phrase, pair)
    for n in range(pairs):
        base, round_ = order[n % bases], n // bases
        for action in rng.sample(range(len(ACTIONS)), 2):
            core = _core(action + len(ACTIONS) * base + per_round * round_)
            for wording in rng.sample(WORDINGS, PER_MEANING):
                asked.append((wording.format(q=core), core, n))
    rng.shuffle(asked)
    header = {tenant_header: tenant_header_value(tenant_header, TENANT)}
    seen_meanings: set[str] = set()
    seen_pairs: set[int] = set()
    out, t = [], 0.0
    for text, core, pair in asked[:requests]:
        label = "paraphrase" if core in seen_meanings else "trap" if pair in seen_pairs else "new"
        seen_meanings.add(core)
        seen_pairs.add(pair)
        t += rng.expovariate(rate)
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0}
        out.append(
            BenchRequest(t, CHAT, body, dict(header), TENANT, label, expected=answer_for(core))
        )
    params = {"requests": requests, "rate": rate, "seed": seed, "per_meaning": PER_MEANING}
    return Workload(WORKLOAD, out, params=params)


def _core(index: int) -> str:
    return question(index)[1]


def audit_config(config: Config) -> dict[str, Any]:
    """The embedded gateway's config (as data) for the audit workload: see the contract."""
    semantic = config.semantic
    judge = semantic.judge
    data: dict[str, Any] = config.with_secrets()  # (the keys given: sections may be absent)
    given = data.setdefault("semantic", {})
    given["enabled"] = True
    if "audit_rate" not in semantic.model_fields_set:
        given["audit_rate"] = 1.0
    if "model" not in judge.model_fields_set:
        given.setdefault("judge", {})["model"] = JUDGE_MODEL
    if "band" not in judge.model_fields_set:
        given.setdefault("judge", {})["band"] = [1.0, 1.0]  # no candidate: it compares answers
    return data


# ------------------------------------------------------------------- the upstream, by meaning


class MeaningAnswers:
    """Chat answers by meaning and a labeled judge, in front of the engine (module contract)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        text = _answer(raw)
        if text is None:
            await self.app(scope, replaying(raw, receive), send)
            return
        body = orjson.loads(raw)
        stream = body.get("stream") is True
        payload = _chunks(body["model"], text) if stream else _completion(body["model"], text)
        kind = b"text/event-stream" if stream else b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]}
        )
        await send({"type": "http.response.body", "body": payload})


def _answer(raw: bytes) -> str | None:
    """What a chat call is answered by meaning; None: not a catalog question nor a judge's."""
    try:
        body = orjson.loads(raw)
        content = body["messages"][-1]["content"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(content, str):
        return None
    if body.get("model") == JUDGE_MODEL:
        return "yes" if _verdict(body) else "no"
    core = core_of(content)
    return answer_for(core) if core is not None else None


def _verdict(body: dict[str, Any]) -> bool:
    asked = question_of(body)
    if asked is None:
        return False
    question, a, b = asked
    if not (isinstance(a, str) and isinstance(b, str)):
        return False  # (the catalog's questions are single turns)
    if question is SAME_ANSWER:
        return (core := core_of(a)) is not None and core == core_of(b)
    return a == b


def _completion(model: str, text: str) -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-meaning",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24},
        }
    )


def _chunks(model: str, text: str) -> bytes:
    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        event = {
            "id": "chatcmpl-meaning",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(event) + b"\n\n"

    opening = chunk({"role": "assistant", "content": text}, None)
    return opening + chunk({}, "stop") + b"data: [DONE]\n\n"


# --------------------------------------------------------------------------------- the truth


async def audits_settled(
    url: str, upstream: Any, admin_token: str | None, timeout: float = 60.0
) -> None:
    """Wait (at most ``timeout`` s) until the audits the run started are done: the upstream has
    no call in flight and the gateway's audited count has not moved over three reads."""
    from .client import Address, Pool
    from .replay import get_json

    admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
    pool = Pool(Address.parse(url))
    loop = asyncio.get_running_loop()
    deadline, last, still = loop.time() + timeout, None, 0
    try:
        while still < 3 and loop.time() < deadline:
            stats = await get_json(pool, "/stats", admin)
            audited = (stats.get("semantic_audit") or {}).get("", {}).get("audited")
            idle = (await asyncio.to_thread(upstream.count))["in_flight"] == 0
            still = still + 1 if idle and audited == last else 0
            last = audited
            await asyncio.sleep(0.1)
    finally:
        pool.close()


def grade(workload: Workload, run: Any, audit_window: int) -> dict[str, Any]:
    """``run``: a ``replay.Run`` of ``workload`` (module contract)."""
    ordered = sorted(run.results, key=lambda result: result.sent)
    wrong = [
        r.wrong is True for r in ordered if r.outcome == "semantic_hit" and r.wrong is not None
    ]
    served_over, wrong_over, served, wrongs = [], [], 0, 0
    for result in ordered:
        if result.outcome == "semantic_hit":
            served += 1
            wrongs += result.wrong is True
        served_over.append(served)
        wrong_over.append(wrongs)
    recent = wrong[-audit_window:]
    true_recent = sum(recent) / len(recent) if recent else 0.0
    audit = (run.stats_after.get("semantic_audit") or {}).get("", {})
    states = [
        (t, stats["semantic_audit"][""]["state"])
        for t, stats in run.stats_series
        if "" in (stats.get("semantic_audit") or {})
    ]
    sent = [r.sent for r in ordered]
    changes, before = [], "serving"  # (every namespace starts serving)
    for t, state in states:
        if state != before:
            changes.append(
                {"at_s": round(t, 3), "at_request": bisect.bisect_right(sent, t), "state": state}
            )
        before = state
    return {
        "semantic_hits": len(wrong),
        "wrong_hits": sum(wrong),
        "true_wrong_rate": round(sum(wrong) / len(wrong), 4) if wrong else 0.0,
        "true_wrong_rate_of_the_window": round(true_recent, 4),
        "window": len(recent),
        "audit": audit,
        "interval_holds_true_rate": bool(audit) and audit["low"] <= true_recent <= audit["high"],
        "state_changes": changes,
        "judge_calls": run.stats_after.get("judge_calls", 0)
        - run.stats_before.get("judge_calls", 0),
        "by_label": {
            label: sum(
                1
                for request, result in zip(workload.requests, run.results, strict=True)
                if request.label == label and result.outcome == "semantic_hit"
            )
            for label in ("new", "trap", "paraphrase")
        },
        "series": {"served": served_over, "wrong": wrong_over},  # cumulative, send order
    }
