"""Measure the meaning-change guard alone on the labelled pairs in shared/data/semantic.

Every pair is judged as if it had passed the embedding threshold, so this is the guard's own
accept rate on should-hit pairs and reject rate on should-miss pairs, per file and per category,
with the reasons that fired. Multi-turn rows compare the last user turn of each side (earlier
turns are scoped by exact match elsewhere).

    .venv/bin/python benchmarks/guard_eval.py                 # all rows
    .venv/bin/python benchmarks/guard_eval.py --half odd      # held-out half (odd line numbers)
    .venv/bin/python benchmarks/guard_eval.py --half even --errors 30 --file semantoneg
    .venv/bin/python benchmarks/guard_eval.py --json          # machine-readable summary
    .venv/bin/python benchmarks/guard_eval.py --timing        # time per pair, per file
    .venv/bin/python benchmarks/guard_eval.py --strict        # the guard in strict mode (the
                                                              # cache's lower similarity band)

Line numbers count from 0: ``--half even`` is lines 0, 2, 4, ... (the development half),
``--half odd`` lines 1, 3, 5, ... (the check half).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from carpool.semantic import analysis, guard  # noqa: E402

DATA_CANDIDATES = (ROOT / "shared" / "data" / "semantic", ROOT.parent / "shared" / "data" / "semantic")


def last_user_turn(x: Any) -> str:
    """The text of a prompt: a string, or the content of the last user message of a list."""
    if isinstance(x, str):
        return x
    for msg in reversed(x):
        if msg.get("role") == "user":
            content = msg.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def load(data_dir: Path, half: str | None, only: str | None) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for path in sorted(data_dir.glob("*.jsonl")):
        if only and only not in path.stem:
            continue
        rows = []
        with path.open() as f:
            for i, line in enumerate(f):
                if half == "even" and i % 2:
                    continue
                if half == "odd" and not i % 2:
                    continue
                r = json.loads(line)
                r["line"] = i
                rows.append(r)
        out[path.stem] = rows
    return out


def timing(rows: list[dict], limit: int = 2000, repeats: int = 5,
           strict: bool = False) -> dict[str, float]:
    """check() cost per pair: both texts never seen (each analysed), only the new one unseen
    (the cached prompt's analysis memoised, the usual case), and both memoised. Word-level
    caches are warm, as in a running server."""
    pairs = [(last_user_turn(r["a"]), last_user_turn(r["b"])) for r in rows[:limit]]
    for a, b in pairs:                          # warm the word caches
        guard.check(a, b, strict=strict)
    out: dict[str, list[float]] = {"cold": [], "one_new": [], "warm": []}
    for _ in range(repeats):
        analysis.analyse.cache_clear()
        t0 = time.perf_counter()
        for a, b in pairs:
            guard.check(a, b, strict=strict)
        out["cold"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for a, b in pairs:
            guard.check(a, b, strict=strict)
        out["warm"].append(time.perf_counter() - t0)
        analysis.analyse.cache_clear()
        for _a, b in pairs:
            analysis.analyse(b)
        t0 = time.perf_counter()
        for a, b in pairs:
            analysis.analyse(b)
            guard.check(a + " ", b, strict=strict)  # a text not seen before, same meaning
        out["one_new"].append(time.perf_counter() - t0)
    words = sum(len(analysis.analyse(a).bases) + len(analysis.analyse(b).bases) for a, b in pairs)
    res = {k: round(statistics.median(v) / len(pairs) * 1e6, 1) for k, v in out.items()}
    res["words_per_text"] = round(words / (2 * len(pairs)), 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None, help="folder of *.jsonl pair files")
    ap.add_argument("--half", choices=("even", "odd"), default=None)
    ap.add_argument("--file", default=None, help="only files whose name contains this")
    ap.add_argument("--errors", type=int, default=0, help="print up to N errors of each kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timing", action="store_true",
                    help="also time check() per file: both texts new, and with analyses memoised")
    ap.add_argument("--strict", action="store_true",
                    help="judge with check(..., strict=True), as in the lower similarity band")
    args = ap.parse_args()

    data_dir = args.data or next((d for d in DATA_CANDIDATES if d.is_dir()), None)
    if data_dir is None:
        print("no data folder found; pass --data", file=sys.stderr)
        return 2
    files = load(data_dir, args.half, args.file)
    summary: dict[str, Any] = {"half": args.half or "all", "strict": args.strict, "files": {}}
    errors: dict[str, list[str]] = defaultdict(list)
    total_pairs = 0
    total_time = 0.0
    for name, rows in files.items():
        cats: dict[str, Counter] = defaultdict(Counter)
        reasons: dict[str, Counter] = defaultdict(Counter)
        for r in rows:
            a, b = last_user_turn(r["a"]), last_user_turn(r["b"])
            t0 = time.perf_counter()
            v = guard.check(a, b, strict=args.strict)
            total_time += time.perf_counter() - t0
            total_pairs += 1
            key = (r["category"], r["same_answer"])
            c = cats[f"{r['category']}|{'hit' if r['same_answer'] else 'miss'}"]
            c["n"] += 1
            c["accepted" if v.ok else "rejected"] += 1
            if not v.ok:
                reasons[f"{r['category']}|{'hit' if r['same_answer'] else 'miss'}"][v.reason] += 1
            wrong = v.ok != r["same_answer"]
            if wrong:
                kind = f"{name}:{key[0]}:{'false-reject' if r['same_answer'] else 'false-accept'}"
                errors[kind].append(f"  [{r['line']}] {v.reason}: {a!r}  |  {b!r}")
        fsum: dict[str, Any] = {}
        for cat, c in sorted(cats.items()):
            hit = cat.endswith("|hit")
            rate = (c["accepted"] if hit else c["rejected"]) / c["n"]
            fsum[cat] = {"n": c["n"], ("accept" if hit else "reject"): round(rate, 4),
                         "reasons": dict(reasons[cat].most_common())}
        summary["files"][name] = fsum
    summary["pairs"] = total_pairs
    summary["us_per_pair_first_seen"] = round(total_time / max(1, total_pairs) * 1e6, 1)

    if args.timing:
        summary["timing_us"] = {name: timing(rows, strict=args.strict)
                                for name, rows in files.items()}

    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        mode = "strict" if args.strict else "normal"
        print(f"guard alone ({mode}), half={summary['half']}, {total_pairs} pairs, "
              f"{summary['us_per_pair_first_seen']} us/pair (first sight of each text)")
        for name, fsum in summary["files"].items():
            print(f"\n{name}")
            for cat, s in fsum.items():
                what = "accept" if "accept" in s else "reject"
                reasons = ", ".join(f"{k} {v}" for k, v in s["reasons"].items())
                print(f"  {cat:34s} n={s['n']:5d}  {what} {100 * s[what]:5.1f}%   {reasons}")
    if args.timing and not args.json:
        print("\ntiming, us per pair (median of 5 runs over up to 2,000 pairs):")
        for name, t in summary["timing_us"].items():
            print(f"  {name:16s} words/text {t['words_per_text']:5.1f}   both texts new "
                  f"{t['cold']:6.1f}   cached prompt memoised {t['one_new']:6.1f}   both memoised "
                  f"{t['warm']:6.1f}")
    if args.errors:
        rng = random.Random(args.seed)
        for kind, lines in sorted(errors.items()):
            print(f"\n{kind}: {len(lines)}")
            sample = lines if len(lines) <= args.errors else rng.sample(lines, args.errors)
            for line in sample:
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
