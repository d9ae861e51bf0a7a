"""Run every core benchmark in one go and write ``benchmarks/results/core.json`` (with ``--all``;
``core-partial.json`` without it, ``*-quick.json`` with ``--quick``: never the published figures).

    .venv/bin/python benchmarks/run.py            # the core ones (a few minutes at most)
    .venv/bin/python benchmarks/run.py --quick    # smaller samples (about a minute)
    .venv/bin/python benchmarks/run.py --all      # also the side-by-side with LiteLLM, GPTCache

See benchmarks/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import bench_coalesce
import bench_distributed
import bench_fingerprint
import bench_overhead
import bench_peers
import bench_routing
import bench_semantic
import bench_soak
import bench_window

from carpool.bench import scenario

RESULTS = Path(__file__).resolve().parent / "results"

BENCHMARKS = {
    "fingerprint": bench_fingerprint,
    "coalesce": bench_coalesce,
    "overhead": bench_overhead,
    "window": bench_window,
    "semantic": bench_semantic,
    "distributed": bench_distributed,
    "routing": bench_routing,
    "peers": bench_peers,
    "soak": bench_soak,
}
# Run only when named (--only peers) or with --all: they install LiteLLM and GPTCache into
# benchmarks/.envs/ on first use (a few minutes, from PyPI) and take a few minutes each run.
# soak: 50,000 requests with faults injected, several minutes.
OPTIONAL = {"peers", "soak"}


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The figures the gateway's issue asks for, flat, for a quick look or a diff."""
    out: dict[str, Any] = {}
    if "fingerprint" in results:
        f = results["fingerprint"]
        out.update(
            fingerprint_lookup_us=f["total_us"],
            fingerprint_split_us=f["split_us"],
            fingerprint_target_us=f["target_us"],
        )
    if "coalesce" in results:
        h, p = results["coalesce"]["http"], results["coalesce"]["inprocess"]
        out.update(
            coalesce_http_n=h["n"],
            coalesce_http_upstream_calls=h["upstream_calls"],
            coalesce_http_outcomes=h["outcomes"],
            coalesce_http_wall_ms=round(h["wall_s_median"] * 1000, 2),
            coalesce_http_answer_to_last_client_ms=round(h["release_last_s_median"] * 1000, 2),
            coalesce_inprocess_n=p["n"],
            coalesce_inprocess_upstream_calls=p["upstream_calls"],
            coalesce_inprocess_release_ms=round(p["release_s_median"] * 1000, 2),
            coalesce_inprocess_traced_bytes=p["traced_held_bytes"],
            coalesce_inprocess_bytes_per_waiter=p["traced_bytes_per_waiter"],
            coalesce_inprocess_rss_delta_bytes=p["rss_held_bytes_median"],
        )
    if "overhead" in results:
        pcts = ("p50_ms", "p90_ms", "p99_ms")
        lat, thr = results["overhead"]["latency"], results["overhead"]["throughput"]
        out.update(
            bypass_direct_ms={k: lat["direct"][k] for k in pcts},
            bypass_gateway_ms={k: lat["gateway"][k] for k in pcts},
            bypass_added_p50_ms=lat["added_p50_ms"],
            bypass_added_p50_target_ms=lat["target_added_p50_ms"],
            hit_gateway_ms={k: lat["gateway_hit"][k] for k in pcts},
            hit_rps=thr["gateway_hit_rps_median"],
            upstream_rps=thr["upstream_rps_median"],
            hit_rps_ratio=thr["ratio_hit_over_upstream"],
            throughput_concurrency=thr["concurrency"],
        )
    if "window" in results:
        out.update(
            window_policies=results["window"]["policies"],
            window_verdict=results["window"]["verdict"],
        )
    if "semantic" in results:
        sem = results["semantic"]
        out.update(
            semantic_embed_p50_ms=sem["embed"]["single"]["p50_ms"],
            semantic_ann_entries=sem["ann"]["entries"],
            semantic_ann_p50_ms=sem["ann"]["lookup"]["p50_ms"],
            semantic_bytes_per_entry=sem["entry"]["total_bytes_per_entry"],
            semantic_hit_p50_ms=sem["hit"]["semantic_hit"]["p50_ms"],
        )
    if "peers" in results:
        out["peers"] = results["peers"]["figures"]
    if "soak" in results:
        out.update(bench_soak.headline(results["soak"]))
    return out


def ok_of(name: str, result: dict[str, Any]) -> bool:
    if name == "coalesce":
        return result["http"]["ok"] and result["inprocess"]["ok"]
    if name == "overhead":
        return result["ok"]
    if name == "semantic":
        return result["hit"]["ok"]
    if name in ("peers", "soak"):
        return result["ok"]
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples, about a minute")
    parser.add_argument(
        "--only",
        choices=sorted(BENCHMARKS),
        action="append",
        help="run only this benchmark (repeatable)",
    )
    parser.add_argument(
        "--all", action="store_true", help=f"also the optional ones ({', '.join(sorted(OPTIONAL))})"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="[results/core.json with --all; results/core-partial.json without; with --only: "
        "results/<names>.json; -quick in the name with --quick]",
    )
    args = parser.parse_args()
    if args.out is None:  # a partial or quick run never overwrites the full run's figures
        name = "-".join(args.only) if args.only else "core" if args.all else "core-partial"
        args.out = RESULTS / f"{scenario.result_name(name, args.quick)}.json"

    started = time.monotonic()
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    durations: dict[str, float] = {}
    lines: list[str] = []
    for name, module in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        if not args.only and not args.all and name in OPTIONAL:
            continue
        t0 = time.monotonic()
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        try:
            results[name] = module.run(args.quick)
            lines += module.summarize(results[name])
            if not ok_of(name, results[name]):
                errors[name] = "a correctness check failed (see its result)"
        except Exception:
            errors[name] = traceback.format_exc()
            print(errors[name], file=sys.stderr)
        durations[name] = round(time.monotonic() - t0, 2)

    document = scenario.document(
        results,
        headline(results),
        ok=not errors,
        errors=errors,
        quick=args.quick,
        duration_s=time.monotonic() - started,
        durations_s=durations,
    )
    scenario.write_json(args.out, document)
    if "routing" in results:  # its plot beside its figures: routing.png with routing.json only
        stem = args.out.stem
        name = f"{stem}.png" if stem.startswith("routing") else f"{stem}-routing.png"
        bench_routing.plot(results["routing"], args.out.with_name(name))
    print(
        f"carpool benchmarks ({document['mode']}), {document['date']}, {document['machine']}, "
        f"{document['cpu_count']} CPUs, Python {document['python']}, "
        f"{document['duration_s']:.0f} s"
    )
    print("\n".join(lines))
    for name, error in errors.items():
        print(f"{name}: FAILED: {error.strip().splitlines()[-1]}")
    print(f"-> {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
