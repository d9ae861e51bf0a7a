"""The same workload through carpool, LiteLLM's proxy with its in-memory cache, and GPTCache's
exact cache, side by side in one run on one machine, with the same load generator.

    .venv/bin/python benchmarks/bench_peers.py [--quick] [--json] [--out PATH]

The peers are never carpool dependencies: on first use the benchmark creates one virtual
environment for each under ``benchmarks/.envs/`` (``python -m venv``, then ``pip install`` of
pinned versions, a few minutes) and reuses them afterwards (a marker file records what was
installed; ``peers/launch.py``). A peer whose install or start fails is recorded in the result
with the reason, and the rest runs on.

Processes (all on loopback, every server a single uvicorn process with uvloop and httptools; the
load generator is ``carpool.bench.loadgen`` with ``fresh_connections``: the same client for every
target, opening each target's connections right before its turn, so that none sits idle past
uvicorn's keep-alive timeout while the other targets run):
- ``upstream``: the simulated engine at no cost, counting its calls (``carpool.bench.upstream``);
  every proxy points at it. A second one is a target itself (``upstream_app``).
- ``raw_asgi``: the fixed-bytes app (``carpool.bench.fixed``): the limit.
- ``carpool``: the real gateway (``carpool.bench.embedded``) in front of the upstream.
- ``litellm``: ``litellm --config`` with one model (``openai/bench-model`` at the upstream) and
  its in-memory response cache on (``cache: true``, ``cache_params: {type: local}``), a fixed
  master key, no database; ``litellm_nocache``: the same without the cache (its bypass path).
- ``gptcache``: GPTCache's own server app with its exact cache (``peers/gptcache_http.py``).

Measured:
- ``latency``: sequential requests, one connection per target, in alternating blocks: the
  sampled body (temperature 0.7) direct to the upstream, via carpool (``bypass``) and via LiteLLM
  without cache (its added latency); the temperature-0 body as an exact hit via carpool, LiteLLM
  and GPTCache; and the raw ASGI app.
- ``throughput``: 64 connections sending the temperature-0 body back to back, rounds alternating
  between the raw ASGI app, the upstream app, carpool hits, LiteLLM hits and GPTCache hits.
  Ratios: carpool / raw ASGI (goal >= 0.5) and carpool / LiteLLM (goal >= 100).
- hits are checked, not assumed: the upstream's call counter is zeroed before the throughput
  rounds and must still be 0 after them (no hit target reached it), and every answer (of the
  latency blocks, the throughput rounds and 30 spot checks) is classified by its server's own
  sign of a hit (``x-carpool: hit``; LiteLLM's ``x-litellm-cache-key`` header, which it sets
  only on a cache hit; GPTCache's ``"gptcache": true`` in the body): ``hits_verified``.
- ``inprocess``: GPTCache's exact lookup of the ~1 KB chat body in its own process
  (``peers/gptcache_lookup.py``) against carpool's parse + fingerprint + lookup of the same bytes
  (``bench_fingerprint``), in the same run.

Every request carries the same ``Authorization: Bearer <LiteLLM master key>`` header (LiteLLM
refuses to start without a master key), so every target reads the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import bench_fingerprint
from peers.launch import (
    MASTER_KEY,
    PEERS,
    REPORTED_PACKAGES,
    REQUIREMENTS,
    ensure_env,
    env_python,
    peer_env,
    start_peers,
)

from carpool.bench import bodies, loadgen, scenario
from carpool.bench.client import fetch
from carpool.bench.embedded import gateway
from carpool.bench.fixed import fixed_app
from carpool.bench.process import HOST
from carpool.bench.stats import median, summary_ms
from carpool.bench.upstream import Upstream, upstream
from carpool.config import Config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

HEADERS = {"authorization": f"Bearer {MASTER_KEY}"}
GOAL_RAW_RATIO = 0.5
HIT_SIGN = {"carpool": "hit", "litellm": "litellm:hit", "gptcache": "gptcache:hit"}
GOAL_LITELLM_RATIO = 100.0


def _spot_check(name: str, port: int, body: dict[str, Any], n: int) -> dict[str, Any]:
    """Read ``n`` whole answers and tell whether each was a cache hit, by the peer's own sign."""
    hits, statuses = 0, {}
    for _ in range(n):
        status, headers, data = fetch("POST", f"http://{HOST}:{port}{bodies.CHAT}", body, HEADERS)
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if name == "carpool":
            hits += headers.get("x-carpool") == "hit"
        elif name == "litellm":
            hits += bool(headers.get("x-litellm-cache-key"))
        elif name == "gptcache":
            hits += json.loads(data).get("gptcache") is True
    sign = {
        "carpool": "x-carpool: hit",
        "litellm": "x-litellm-cache-key header",
        "gptcache": '"gptcache": true in the body',
    }[name]
    return {"n": n, "hits": hits, "sign": sign, "statuses": statuses}


# ------------------------------------------------------------------------------------------------
# Measurements


def _targets(*rows: tuple[str, int | None, dict[str, Any]]) -> list[dict[str, Any]]:
    """Load generator targets, the same ``Authorization`` for all; a peer not started is left out."""
    return [
        {"name": name, "port": port, "body": body, "headers": HEADERS}
        for name, port, body in rows
        if port is not None
    ]


def _latency(quick: bool, targets: list[dict[str, Any]]) -> dict[str, Any]:
    """Every target in one rotation of alternating blocks; the added p50 of the bypass paths."""
    n, warmup, block = (200, 30, 50) if quick else (1000, 100, 100)
    print(
        f"[peers] latency: {len(targets)} targets x {n} requests ...", file=sys.stderr, flush=True
    )
    spec = {"n": n, "warmup": warmup, "block": block, "fresh_connections": True}
    raw = loadgen.run("latency", {**spec, "targets": targets})
    latency: dict[str, Any] = {"n": n, "warmup": warmup, "block": block, "targets": {}}
    for name, r in raw.items():
        latency["targets"][name] = {
            **summary_ms(r["samples_s"]),
            "outcomes": r["outcomes"],
            "non_200": r["non_200"],
        }
    direct = raw["direct"]["samples_s"]
    for name in ("carpool_bypass", "litellm_bypass"):
        if name in raw:
            via = raw[name]["samples_s"]
            blocks = [
                median(via[i : i + block]) - median(direct[i : i + block])
                for i in range(0, min(len(direct), len(via)), block)
            ]
            peer = name.split("_")[0]
            latency[f"{peer}_added_p50_ms"] = round(
                latency["targets"][name]["p50_ms"] - latency["targets"]["direct"]["p50_ms"], 4
            )
            latency[f"{peer}_added_p50_blockwise_ms"] = round(median(blocks) * 1000, 4)
    return latency


def _throughput(quick: bool, targets: list[dict[str, Any]]) -> dict[str, Any]:
    concurrency, seconds, rounds = (64, 1.5, 1) if quick else (64, 3.0, 5)
    print(
        f"[peers] throughput: {len(targets)} targets x {rounds} rounds of {seconds} s ...",
        file=sys.stderr,
        flush=True,
    )
    spec = {"concurrency": concurrency, "seconds": seconds, "rounds": rounds, "warmup_s": 0.5}
    raw = loadgen.run("throughput", {**spec, "fresh_connections": True, "targets": targets})
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "rounds": rounds,
        "targets": {
            name: {
                "rps_median": round(median(r["rps"]), 1),
                "rps": [round(x, 1) for x in r["rps"]],
                "outcomes": r["outcomes"],
                "non_200": r["non_200"],
            }
            for name, r in raw.items()
        },
    }


def run_http(quick: bool, envs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    hit, sampled = bodies.chat_body(0), bodies.chat_body(0.7)
    with (
        tempfile.TemporaryDirectory(prefix="carpool-peers-") as tmp_name,
        contextlib.ExitStack() as stack,
    ):
        up: Upstream = stack.enter_context(upstream())
        raw = stack.enter_context(fixed_app()).port
        gw = stack.enter_context(gateway(Config(upstreams=[up.url], log_level="warning"))).port
        ref = stack.enter_context(upstream()).port  # the simulated engine as a target itself
        started = time.monotonic()
        ports, peer_errors = start_peers(Path(tmp_name), up.port, envs, stack)
        start_s = round(time.monotonic() - started, 1)
        latency = _latency(
            quick,
            _targets(
                ("direct", up.port, sampled),
                ("raw_asgi", raw, hit),
                ("carpool_bypass", gw, sampled),
                ("carpool_hit", gw, hit),
                ("litellm_bypass", ports.get("litellm_nocache"), sampled),
                ("litellm_hit", ports.get("litellm"), hit),
                ("gptcache_hit", ports.get("gptcache"), hit),
            ),
        )
        # Throughput: the hit targets (and the two bare apps), the upstream's counter at zero.
        before = up.count()["calls"]
        up.reset()
        throughput = _throughput(
            quick,
            _targets(
                ("raw_asgi", raw, hit),
                ("upstream_app", ref, hit),
                ("carpool_hit", gw, hit),
                ("litellm_hit", ports.get("litellm"), hit),
                ("gptcache_hit", ports.get("gptcache"), hit),
            ),
        )
        # Were the hits real? The spot checks are hits too: the counter must still be 0 after.
        spot_n = 10 if quick else 30
        spots = {
            name: _spot_check(name, port, hit, spot_n)
            for name, port in (
                ("carpool", gw),
                *((k, ports.get(k)) for k in ("litellm", "gptcache")),
            )
            if port is not None
        }
        calls = latency["n"] + latency["warmup"]
        checks = {
            "upstream_calls_during_latency": before,
            "upstream_calls_expected_during_latency": (
                3 * calls if "litellm_bypass" in latency["targets"] else 2 * calls
            )
            + sum(name in ports for name in ("litellm", "gptcache"))
            + 1,
            "upstream_calls_during_throughput_and_spot_checks": up.count()["calls"],
            "spot_checks": spots,
        }
    checks["note"] = (
        "the upstream is only reached by carpool, LiteLLM and GPTCache; 0 calls "
        "during the throughput rounds means none of the hit targets reached it"
    )
    # A target's hits are real when every answer it gave (latency, throughput, spot checks)
    # carried its own sign of a cache hit and the upstream saw no call meanwhile.
    checks["hits_verified"] = {}
    for name, spot in checks["spot_checks"].items():
        sign = HIT_SIGN[name]
        answers = [
            latency["targets"][f"{name}_hit"]["outcomes"],
            throughput["targets"][f"{name}_hit"]["outcomes"],
        ]
        checks["hits_verified"][name] = (
            spot["hits"] == spot["n"]
            and all(set(o) == {sign} for o in answers)
            and checks["upstream_calls_during_throughput_and_spot_checks"] == 0
        )
    return {
        "latency": latency,
        "throughput": throughput,
        "checks": checks,
        "peer_errors": peer_errors,
        "peers_start_s": start_s,
    }


def run_inprocess(quick: bool, gptcache_env: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if gptcache_env["ok"]:
        number, repeat = (2_000, 9) if quick else (10_000, 21)
        with tempfile.TemporaryDirectory(prefix="carpool-gptcache-") as tmp_name:
            tmp = Path(tmp_name)
            (tmp / "body.json").write_bytes(bodies.json_bytes(bodies.chat_body(0)))
            (tmp / "answer.json").write_bytes(bodies.answer())
            spec = {
                "body_file": str(tmp / "body.json"),
                "answer_file": str(tmp / "answer.json"),
                "number": number,
                "repeat": repeat,
                "data_dir": str(tmp / "data"),
            }
            try:
                done = subprocess.run(
                    [
                        str(env_python("gptcache")),
                        str(PEERS / "gptcache_lookup.py"),
                        json.dumps(spec),
                    ],
                    env=peer_env("gptcache"),
                    cwd=tmp,
                    capture_output=True,
                    timeout=900,
                    check=True,
                )
                out["gptcache"] = json.loads(done.stdout.decode().strip().splitlines()[-1])
            except subprocess.CalledProcessError as exc:
                out["gptcache_error"] = exc.stderr.decode(errors="replace")[-3000:]
    fp = bench_fingerprint.run(quick)
    out["carpool"] = {
        k: fp[k]
        for k in (
            "body_bytes",
            "number",
            "repeat",
            "total_us",
            "total_best_us",
            "split_us",
            "repeat_us",
            "repeat_best_us",
        )
    }
    out["carpool"]["total_without_loads_us"] = round(fp["total_us"] - fp["split_us"]["loads"], 3)
    return out


def _ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return round(a / b, digits) if a and b else None


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The side-by-side figures, flat."""
    out: dict[str, Any] = {}
    http = result.get("http")
    if http:
        thr = {k: v["rps_median"] for k, v in http["throughput"]["targets"].items()}
        lat = http["latency"]["targets"]
        out.update({f"{k}_rps": v for k, v in thr.items()})
        out["concurrency"] = http["throughput"]["concurrency"]
        out["carpool_hit_over_raw_asgi"] = _ratio(thr.get("carpool_hit"), thr.get("raw_asgi"))
        out["carpool_hit_over_raw_asgi_goal"] = GOAL_RAW_RATIO
        out["carpool_hit_over_litellm_hit"] = _ratio(
            thr.get("carpool_hit"), thr.get("litellm_hit"), 1
        )
        out["carpool_hit_over_litellm_hit_goal"] = GOAL_LITELLM_RATIO
        out["carpool_hit_over_gptcache_hit"] = _ratio(
            thr.get("carpool_hit"), thr.get("gptcache_hit"), 2
        )
        out["raw_asgi_over_upstream_app"] = _ratio(thr.get("raw_asgi"), thr.get("upstream_app"))
        # Rounds alternate the targets, so a round's ratio pairs figures taken moments apart.
        rounds = {k: v["rps"] for k, v in http["throughput"]["targets"].items()}
        for peer in ("raw_asgi", "litellm_hit", "gptcache_hit"):
            if peer in rounds:
                out[f"carpool_hit_over_{peer}_per_round"] = [
                    round(a / b, 3)
                    for a, b in zip(rounds["carpool_hit"], rounds[peer], strict=True)
                ]
                out[f"carpool_hit_over_{peer}_per_round_median"] = round(
                    median(out[f"carpool_hit_over_{peer}_per_round"]), 3
                )
        out["latency_p50_ms"] = {k: v["p50_ms"] for k, v in lat.items()}
        out["latency_p99_ms"] = {k: v["p99_ms"] for k, v in lat.items()}
        out["carpool_added_p50_ms"] = http["latency"].get("carpool_added_p50_ms")
        out["litellm_added_p50_ms"] = http["latency"].get("litellm_added_p50_ms")
        out["hits_verified"] = http["checks"]["hits_verified"]
    inproc = result.get("inprocess") or {}
    if "gptcache" in inproc:
        g = inproc["gptcache"]["us"]
        out["gptcache_lookup_us"] = g["last_content.adapter"]
        out["gptcache_lookup_all_content_us"] = g["all_content.adapter"]
        out["gptcache_lookup_with_loads_us"] = g["last_content.adapter_with_loads"]
        out["gptcache_map_lookup_only_us"] = g["last_content.dm_lookup"]
    if "carpool" in inproc:
        out["carpool_fingerprint_lookup_us"] = inproc["carpool"]["total_us"]
        out["carpool_fingerprint_lookup_without_loads_us"] = inproc["carpool"][
            "total_without_loads_us"
        ]
        out["carpool_repeat_lookup_us"] = inproc["carpool"]["repeat_us"]
    if "gptcache" in inproc and "carpool" in inproc:
        out["gptcache_over_carpool_lookup"] = _ratio(
            out["gptcache_lookup_with_loads_us"], out["carpool_fingerprint_lookup_us"], 2
        )
    return out


def run(quick: bool = False) -> dict[str, Any]:
    envs = {name: ensure_env(name) for name in REQUIREMENTS}
    result: dict[str, Any] = {"envs": envs, "errors": {}}
    for part, fn in (
        ("inprocess", lambda: run_inprocess(quick, envs["gptcache"])),
        ("http", lambda: run_http(quick, envs)),
    ):
        print(f"[peers] {part} ...", file=sys.stderr, flush=True)
        try:
            result[part] = fn()
        except Exception:  # noqa: BLE001 - recorded, and the rest runs on
            result["errors"][part] = traceback.format_exc()[-4000:]
            print(result["errors"][part], file=sys.stderr, flush=True)
    http = result.get("http")
    result["figures"] = figures(result)
    # A peer that could not be installed or started is reported, not fatal.
    measured = set(http["checks"]["spot_checks"]) if http else set()
    result["figures"]["peers_not_measured"] = {
        name: envs[name]["error"] or (http or {}).get("peer_errors", {}).get(name, "see errors")
        for name in ("litellm", "gptcache")
        if name not in measured
    }
    carpool_ok = bool(http) and (
        http["latency"]["targets"]["carpool_bypass"]["outcomes"].keys() == {"bypass"}
        and http["latency"]["targets"]["carpool_hit"]["outcomes"].keys() == {"hit"}
        and http["throughput"]["targets"]["carpool_hit"]["outcomes"].keys() == {"hit"}
        and http["checks"]["upstream_calls_during_throughput_and_spot_checks"] == 0
        and not any(t["non_200"] for t in http["throughput"]["targets"].values())
    )
    result["ok"] = carpool_ok and not result["errors"]
    return result


def summarize(result: dict[str, Any]) -> list[str]:
    f = result["figures"]
    lines = []
    for name, env in result["envs"].items():
        if env["ok"]:
            v = env["versions"]
            lines.append(
                f"peers/env          {name}: "
                + ", ".join(f"{k} {v[k]}" for k in REPORTED_PACKAGES[name][:2] if v.get(k))
            )
        else:
            lines.append(f"peers/env          {name}: FAILED: {env['error'][:200]}")
    if "raw_asgi_rps" in f:

        def rps(k: str) -> str:
            return f"{f[k]:.0f}" if f.get(k) is not None else "-"

        lines.append(
            f"peers/hit-rps      concurrency {f['concurrency']}: raw ASGI {rps('raw_asgi_rps')}, "
            f"upstream app {rps('upstream_app_rps')}, carpool hit {rps('carpool_hit_rps')}, "
            f"LiteLLM hit {rps('litellm_hit_rps')}, GPTCache hit {rps('gptcache_hit_rps')} req/s"
        )
        lines.append(
            f"peers/ratios       carpool/raw ASGI {f['carpool_hit_over_raw_asgi']} (goal >= "
            f"{GOAL_RAW_RATIO}), carpool/LiteLLM {f['carpool_hit_over_litellm_hit']} (goal >= "
            f"{GOAL_LITELLM_RATIO:.0f}), carpool/GPTCache {f['carpool_hit_over_gptcache_hit']}"
        )
        p50 = f["latency_p50_ms"]
        lines.append(
            "peers/latency-p50  " + ", ".join(f"{k} {v:.3f}" for k, v in p50.items()) + " ms"
        )
        lines.append(
            f"peers/added-p50    carpool bypass {f['carpool_added_p50_ms']} ms, LiteLLM "
            f"(no cache) {f['litellm_added_p50_ms']} ms"
        )
        lines.append(f"peers/hits-real    {f['hits_verified']}")
    if "gptcache_lookup_us" in f:
        lines.append(
            f"peers/lookup       GPTCache exact (OpenAI adapter, parsed body) "
            f"{f['gptcache_lookup_us']:.1f} us, with json.loads "
            f"{f['gptcache_lookup_with_loads_us']:.1f} us; carpool parse+fingerprint+lookup "
            f"{f['carpool_fingerprint_lookup_us']:.1f} us (a byte-identical repeat "
            f"{f['carpool_repeat_lookup_us']:.1f} us)"
        )
    for part, error in result["errors"].items():
        lines.append(f"peers/{part}: FAILED: {error.strip().splitlines()[-1]}")
    return lines


def git_state() -> dict[str, Any]:
    """The commit measured, and whether the work tree differed from it (``src/`` included)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "src_modified": bool(git("status", "--porcelain", "--", "src")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "src_modified": None}


def document(
    result: dict[str, Any], quick: bool, started: float, git: dict[str, Any]
) -> dict[str, Any]:
    """The same shape as ``run.py --only peers`` writes (plus the git state)."""
    return scenario.document(
        {"peers": result},
        result["figures"],
        ok=result["ok"],
        errors=result["errors"],
        quick=quick,
        duration_s=time.monotonic() - started,
        git=git,
    )


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples")
    parser.add_argument("--json", action="store_true", help="also print the full result")
    parser.add_argument(
        "--out", type=Path, default=None, help="[results/peers.json; --quick: peers-quick.json]"
    )
    args = parser.parse_args()
    if args.out is None:
        args.out = RESULTS / f"{scenario.result_name('peers', args.quick)}.json"
    started, git = time.monotonic(), git_state()
    result = run(args.quick)
    doc = document(result, args.quick, started, git)
    scenario.write_json(args.out, doc)
    print(
        f"carpool vs peers ({doc['mode']}), {doc['date']}, {doc['machine']}, "
        f"{doc['cpu_count']} CPUs, Python {doc['python']}, {doc['duration_s']:.0f} s"
    )
    print("\n".join(summarize(result)))
    if args.json:
        print(json.dumps(result, indent=2))
    print(f"-> {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
