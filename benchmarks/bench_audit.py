"""The semantic cache's audits and error budget against the true wrong-hit rate: three runs of
``carpool bench --workload audit`` (``carpool.bench.meanings``) side by side.

The workload: catalog questions in pairs of near meanings ("upgrade" / "downgrade my
subscription"), each asked in several wordings; the upstream answers by meaning, so the
benchmark knows which semantic hits were wrong, while the gateway only knows what its audits tell
it. The cache is set loose (``semantic.verifier_threshold``, default 0.2) so that it serves wrong
hits. Runs, the same requests each time (one seed), on the embedded gateway:
1. ``audit_rate`` 1.0, no budget: every served hit is audited, a labeled judge compares the
   answers. Reported: the audits' estimate and its 95% interval next to the true rate.
2. The same without a judge: the guard compares the answers.
3. Run 1 with ``max_wrong_rate`` at half its true rate: the namespace backs off, then only
   marks; the wrong hits served stop growing. ``audit.png`` plots the wrong hits served over the
   requests for runs 1 and 3.

    python benchmarks/bench_audit.py [--quick] [--json]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from carpool.bench import plots, scenario
from carpool.bench.runner import BenchOptions, run_bench
from carpool.config import Config

RESULTS = Path(__file__).resolve().parent / "results"
KEPT = ("semantic_hits", "wrong_hits", "true_wrong_rate", "true_wrong_rate_of_the_window")


def one(requests: int, rate: float, seed: int, semantic: dict[str, Any]) -> dict[str, Any]:
    """One ``carpool bench --workload audit`` run; its report's ``audit`` section."""
    with tempfile.TemporaryDirectory(prefix="carpool-bench-audit-") as out:
        options = BenchOptions(
            out=Path(out),
            config=Config(semantic=semantic),
            workload="audit",
            requests=requests,
            rate=rate,
            seed=seed,
            progress=False,
        )
        report = scenario.run_async(run_bench(options))
    assert report["errors"] == 0, report["error_samples"]
    graded: dict[str, Any] = report["audit"]
    return graded


def run(quick: bool, verifier_threshold: float = 0.2, seed: int = 7) -> dict[str, Any]:
    started = time.perf_counter()
    requests, rate = (600, 30.0) if quick else (1800, 30.0)
    loose = {"verifier_threshold": verifier_threshold}
    audited = one(requests, rate, seed, loose)
    by_the_guard = one(requests, rate, seed, {**loose, "judge": {"model": None}})
    budget = round(max(0.001, audited["true_wrong_rate"] / 2), 4)
    budgeted = one(requests, rate, seed, {**loose, "max_wrong_rate": budget})
    first = budgeted["state_changes"][0]["at_request"] if budgeted["state_changes"] else None

    def after(graded: dict[str, Any]) -> int | None:
        wrong = graded["series"]["wrong"]
        return None if first is None else wrong[-1] - wrong[max(0, first - 1)]

    def brief(graded: dict[str, Any]) -> dict[str, Any]:
        return {
            **{k: graded[k] for k in KEPT},
            "audit": graded["audit"],
            "interval_holds_true_rate": graded["interval_holds_true_rate"],
            "state_changes": graded["state_changes"],
            "judge_calls": graded["judge_calls"],
        }

    return {
        **scenario.machine(),
        "duration_s": round(time.perf_counter() - started, 1),
        "command": "carpool bench --workload audit",
        "requests": requests,
        "rate": rate,
        "seed": seed,
        "verifier_threshold": verifier_threshold,
        "budget": budget,
        "audited": brief(audited),
        "audited_by_the_guard": brief(by_the_guard),
        "budgeted": brief(budgeted),
        "wrong_after_first_back_off": {"no_budget": after(audited), "budget": after(budgeted)},
        "series": {"no_budget": audited["series"]["wrong"], "budget": budgeted["series"]["wrong"]},
    }


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(8, 4))
    ax.plot(result["series"]["no_budget"], label="audits, no budget")
    ax.plot(result["series"]["budget"], label=f"budget {result['budget']:.3f}")
    plots.state_lines(ax, result["budgeted"]["state_changes"])
    ax.set_xlabel("requests (send order)")
    ax.set_ylabel("wrong semantic hits served (cumulative)")
    ax.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)


def summarize(result: dict[str, Any]) -> list[str]:
    a, g, b = result["audited"], result["audited_by_the_guard"], result["budgeted"]

    def estimate(graded: dict[str, Any]) -> str:
        e = graded["audit"]
        return f"{e.get('estimate', 0):.3f} [{e.get('low', 0):.3f}, {e.get('high', 1):.3f}]"

    changes = ", ".join(f"{c['state']} at {c['at_request']}" for c in b["state_changes"])
    return [
        f"requests {result['requests']}, semantic hits {a['semantic_hits']}, wrong "
        f"{a['wrong_hits']} (true rate {a['true_wrong_rate']:.3f})",
        f"audits by a judge: estimate {estimate(a)} over the latest audits, whose true rate is"
        f" {a['true_wrong_rate_of_the_window']:.3f}: held {a['interval_holds_true_rate']}",
        f"audits by the guard: estimate {estimate(g)}: held {g['interval_holds_true_rate']}",
        f"budget {result['budget']:.3f}: {changes or 'no state change'}; wrong hits served "
        f"{b['wrong_hits']} (no budget: {a['wrong_hits']}); after the first back-off "
        f"{result['wrong_after_first_back_off']}",
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
    name = scenario.result_name("audit", args.quick)
    plot(result, RESULTS / f"{name}.png")
    scenario.write_json(RESULTS / f"{name}.json", result)
    print("\n".join(summarize(result)))
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=2))


if __name__ == "__main__":
    main()
