"""The semantic cache's audits and error budget against the true wrong-hit rate.

The workload: catalog questions of ``carpool.bench.catalog`` (each core phrase a distinct
meaning, no synonyms) asked as themselves and reworded (``PARAPHRASES``), in a seeded random
order. The upstream answers by meaning: every wording of one core phrase gets the same answer,
two core phrases never do. So a semantic hit is right exactly when the entry's meaning is the
request's, which the benchmark knows (the true wrong-hit rate), while the gateway only knows what
its audits tell it. The cache is set loose (``semantic.verifier_threshold``, default 0.2), so it
does serve wrong hits: near catalog questions ("upgrade" / "downgrade my subscription", another
context) are this workload's traps.

Two runs of the same requests, in process (``build_gateway`` on a ``FunctionUpstream``: the
figures are the pipeline's decisions, not timings):
1. ``audit_rate`` 1.0, no budget: every served hit is audited; the judge that compares answers
   (``semantic.judge`` through the upstream) says whether the two answers agree. Reported: the
   audits' estimate and its 95% interval, the true rate, and whether the interval holds it.
2. The same with ``max_wrong_rate`` at half the true rate: the namespace backs off, then serves
   only marks; the wrong hits served stop growing. ``audit.png`` plots the wrong hits served
   over the requests for both runs.

    python benchmarks/bench_audit.py [--quick] [--json]
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import orjson

from carpool.bench import scenario
from carpool.bench.catalog import PARAPHRASES, question
from carpool.config import Config
from carpool.outcome import Outcome
from carpool.semantic.audit import answer_text
from carpool.semantic.judge import ANSWERS_AGREE
from carpool.upstream.function import FunctionUpstream
from carpool.wiring import build_gateway

RESULTS = Path(__file__).resolve().parent / "results"


def workload(meanings: int, per_meaning: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, meaning) pairs: each meaning's canonical question and some rewordings."""
    rng = random.Random(seed)
    picked = rng.sample(range(1500), meanings)
    requests = []
    for index in picked:
        canonical, core = question(index)
        wordings = [canonical, *(p.format(q=core) for p in PARAPHRASES)]
        requests += [(text, core) for text in rng.sample(wordings, min(per_meaning, len(wordings)))]
    rng.shuffle(requests)
    return requests


async def replay(
    requests: list[tuple[str, str]],
    budget: float | None,
    verifier_threshold: float,
    judge: bool = True,
) -> dict[str, Any]:
    """One run; ``judge``: the answers compared by the (labeled) judge, else by the guard."""
    meaning_of = dict(requests)
    agree_prefix = ANSWERS_AGREE.split("{", 1)[0]

    async def upstream(path: str, body: dict[str, Any]) -> dict[str, Any]:
        content = body["messages"][-1]["content"]
        if body["model"] == "judge":  # "do these two answers agree?": by meaning, as labeled
            assert content.startswith(agree_prefix)
            a, b = content.split("Answer A:\n", 1)[1].split("\n\nAnswer B:\n", 1)
            text = "yes" if a == b else "no"
        else:
            text = f"To {meaning_of[content]}: follow the steps in Settings."
        return {
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
        }

    config = Config(
        semantic={
            "enabled": True,
            "verifier_threshold": verifier_threshold,
            # The judge compares answers only (its band holds no candidate a rule let through).
            "judge": {"model": "judge" if judge else None, "band": [1.0, 1.0]},
            "audit_rate": 1.0,
            "max_wrong_rate": budget,
        }
    )
    gateway = build_gateway(config, upstreams=[FunctionUpstream(upstream)])
    audits = gateway.layers.audits
    assert audits is not None
    served = wrong = 0
    hits: list[bool] = []  # per served hit: wrong?
    wrong_over_time: list[int] = []
    states: list[str] = []
    try:
        for prompt, meaning in requests:
            reply = await gateway.request(
                "/v1/chat/completions",
                {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": prompt}]},
            )
            if reply.outcome is Outcome.SEMANTIC_HIT:
                served += 1
                got = answer_text(orjson.loads(reply.body))
                hits.append(got != f"To {meaning}: follow the steps in Settings.")
                wrong += hits[-1]
            wrong_over_time.append(wrong)
            await gateway.auditor.settle()
            states.append(audits.state(""))
    finally:
        await gateway.aclose()
    report = audits.snapshot().get("", {})
    true_rate = wrong / served if served else 0.0
    # The estimate is of the latest ``audit_window`` audits: compared with the same hits.
    recent = hits[-config.semantic.audit_window :]
    true_recent = sum(recent) / len(recent) if recent else 0.0
    return {
        "requests": len(requests),
        "semantic_hits": served,
        "wrong_hits": wrong,
        "true_wrong_rate": round(true_rate, 4),
        "true_wrong_rate_of_the_window": round(true_recent, 4),
        "audit": report,
        "interval_holds_true_rate": bool(report and report["low"] <= true_recent <= report["high"]),
        "wrong_over_time": wrong_over_time,
        "first_back_off": states.index("backed-off") if "backed-off" in states else None,
        "first_mark": states.index("mark") if "mark" in states else None,
        "judge_calls": gateway.layers.judge.calls if gateway.layers.judge else 0,
    }


def run(quick: bool, verifier_threshold: float = 0.2, seed: int = 7) -> dict[str, Any]:
    started = time.perf_counter()
    requests = workload(120 if quick else 400, 4, seed)
    audited = scenario.run_async(replay(requests, None, verifier_threshold))
    unjudged = scenario.run_async(replay(requests, None, verifier_threshold, judge=False))
    budget = max(0.001, audited["true_wrong_rate"] / 2)
    budgeted = scenario.run_async(replay(requests, budget, verifier_threshold))
    after = budgeted["first_back_off"]
    return {
        **scenario.machine(),
        "duration_s": round(time.perf_counter() - started, 1),
        "verifier_threshold": verifier_threshold,
        "budget": round(budget, 4),
        "audited": {k: v for k, v in audited.items() if k != "wrong_over_time"},
        "audited_by_the_guard": {k: v for k, v in unjudged.items() if k != "wrong_over_time"},
        "budgeted": {k: v for k, v in budgeted.items() if k != "wrong_over_time"},
        "wrong_after_back_off": {
            "no_budget": audited["wrong_over_time"][-1]
            - (audited["wrong_over_time"][after] if after is not None else 0),
            "budget": budgeted["wrong_over_time"][-1]
            - (budgeted["wrong_over_time"][after] if after is not None else 0),
        },
        "series": {
            "no_budget": audited["wrong_over_time"],
            "budget": budgeted["wrong_over_time"],
        },
    }


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(8, 4))
    ax.plot(result["series"]["no_budget"], label="audits, no budget")
    ax.plot(result["series"]["budget"], label=f"budget {result['budget']:.3f}")
    for name, style in (("first_back_off", ":"), ("first_mark", "--")):
        at = result["budgeted"][name]
        if at is not None:
            ax.axvline(at, linestyle=style, color="grey", label=name.replace("_", " "))
    ax.set_xlabel("requests")
    ax.set_ylabel("wrong semantic hits served (cumulative)")
    ax.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def summarize(result: dict[str, Any]) -> list[str]:
    a, b = result["audited"], result["budgeted"]
    est = a["audit"]
    return [
        f"requests {a['requests']}, semantic hits {a['semantic_hits']}, wrong {a['wrong_hits']}"
        f" (true rate {a['true_wrong_rate']:.3f})",
        f"audits: {est.get('audited')} audited, estimate {est.get('estimate', 0):.3f}"
        f" [{est.get('low', 0):.3f}, {est.get('high', 1):.3f}] over the latest audits, whose"
        f" true rate is {a['true_wrong_rate_of_the_window']:.3f}: held"
        f" {a['interval_holds_true_rate']}",
        f"without a judge (the guard compares the answers): estimate"
        f" {result['audited_by_the_guard']['audit'].get('estimate', 0):.3f}"
        f" [{result['audited_by_the_guard']['audit'].get('low', 0):.3f},"
        f" {result['audited_by_the_guard']['audit'].get('high', 1):.3f}], held"
        f" {result['audited_by_the_guard']['interval_holds_true_rate']}",
        f"budget {result['budget']:.3f}: backed off at request {b['first_back_off']},"
        f" mark at {b['first_mark']}; wrong hits served {b['wrong_hits']} (no budget:"
        f" {a['wrong_hits']}); after the back-off {result['wrong_after_back_off']}",
    ]


def main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verifier-threshold", type=float, default=0.2)
    args = parser.parse_args()
    result = run(args.quick, args.verifier_threshold)
    RESULTS.mkdir(exist_ok=True)
    plot(result, RESULTS / "audit.png")
    scenario.write_json(RESULTS / "audit.json", result)
    print("\n".join(summarize(result)))
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=2))


if __name__ == "__main__":
    main()
