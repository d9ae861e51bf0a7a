"""Soak: 50,000 mixed requests at concurrency 200 with faults injected, through the real gateway.

    .venv/bin/python benchmarks/bench_soak.py [--quick] [--requests N] [--json]
    .venv/bin/python benchmarks/run.py --only soak [--quick]      # the same, via run.py

Not part of CI, nor of a plain ``run.py`` (only ``--only soak`` or ``--all`` run it): the full
soak takes a minute or two on a quiet 2-core machine, more on a busy one. Both commands write
``benchmarks/results/soak.json`` (with ``--quick``: ``soak-quick.json``).

Three processes, as in the other benchmarks: the upstream (the simulated engine,
``carpool.bench.upstream``: 1 ms a token, each tenant its own answers, faults injected), the
gateway (``carpool.bench.embedded``, the app of ``carpool serve``: ``limits.upstream_timeout``
2 s; the bounded per-key tables made small enough to fill during the warm-up: a 4 MiB exact
cache, 2,000 keys in the adaptive window's table, a 512 KiB repeat memo; the rest default) and
the load generator (``bench_soak.py --loadgen``: ``carpool.bench.client``'s keep-alive
connections, one per worker, 200 workers).

The workload (``plan``, deterministic from a seed): 4 tenants (``Authorization``), chat requests
(35 % of them streaming) and single-input embeddings (15 %); about 30 % of the requests repeat
an earlier one (most of them a recent one, so some join a call still running, others hit the
cache), and 10 % of the new chat prompts are questions every tenant asks. Faults, on about 5 % of
the requests: the upstream decides from the request itself (``carpool.bench.faults``) to
answer 503, 500 once, nothing at all (the gateway times out: 504), half an answer then nothing
(a stalled stream), or half an answer then a dropped connection (a cut stream); and 1 % of the
clients disconnect 2-40 ms after sending.

Every answer is judged against what the upstream's engine answers for that tenant and request
(``carpool.bench.upstream.expected``, computed before the load starts):
- **wrong**: a success whose text (or vector) is not exactly the one of its own tenant and prompt
  (``cross_tenant`` when it is another tenant's), a success for a prompt whose every call fails
  (a failed answer served as success), a stream that ends without ``[DONE]`` and without an
  error, or a failed stream whose text so far is not a prefix of the right answer;
- **expected error**: the error that the prompt's fault calls for (503 / 500 with the upstream's
  body, 504 ``upstream_timeout``, 502 ``upstream_stream_broken`` / ``upstream_unreachable``, or
  for a stream that had started an SSE error event);
- **unexpected error**: any other error (none is expected for a prompt without a fault);
- **hang**: no complete answer within ``HANG_S`` (30 s; the gateway's own bound is its 2 s
  timeout).
Also reported: upstream calls (counted by the upstream and by the gateway), duration, the
``x-carpool`` outcomes, latency, and the gateway's RSS sampled every 0.5 s: its growth after the
warm-up (the first 20 % of the requests, at least 2,500: the first seconds are the process
reaching its working set under 200 concurrent requests, 2-4 s timeouts included) must stay under
10 %. After the load, the gateway must come back to no flight and no waiter.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

from carpool.bench import process, scenario
from carpool.bench.client import Address, Conn, Response, build, connect, connect_many, fetch
from carpool.bench.embedded import gateway
from carpool.bench.faults import FaultPlan
from carpool.bench.stats import summary_ms
from carpool.bench.upstream import Options, expected, upstream
from carpool.config import Config, SimConfig

RESULTS = Path(__file__).resolve().parent / "results"
CHAT = "/v1/chat/completions"
TENANTS = ("tenant-a", "tenant-b", "tenant-c", "tenant-d")
FULL_N, QUICK_N = 50_000, 5_000
CONCURRENCY = 200
DUPLICATES = 0.30
STREAMING = 0.35
EMBEDDINGS = 0.15
COMMON = 0.10  # new chat prompts that are questions every tenant asks
DISCONNECT = 0.01  # clients that leave 2-40 ms after sending
UPSTREAM_TIMEOUT_S = 2.0  # the gateway's limits.upstream_timeout
HOLD_S = 4.0  # how long the upstream's timeout and stall faults hold
HANG_S = 30.0  # a request without a complete answer by then is a hang
WARMUP = 0.20  # of the requests: memory growth is measured after it...
WARMUP_MIN = 2_500  # ...and after at least these (the process reaching its working set)
MAX_GROWTH = 0.10
# Every per-key table of the gateway is bounded; the soak makes the bounds small enough to be
# reached during the warm-up (~7,000 distinct requests of 50,000; scaled with the request count),
# so that growth after it means a leak.
CACHE_BYTES = 4 * 1024 * 1024  # cache.max_bytes (default 256 MiB)
WINDOW_KEYS = 2_000  # coalesce.adaptive_keys (default 100,000)
MEMO_BYTES = 512 * 1024  # fingerprint.repeat_memo_bytes, where it exists
SEED = 8
# The upstream: normal answers take a few ms (1 ms a token, 8-40 tokens; streams a token every
# ms), so that identical requests overlap and clients that leave do so mid-call; no queue.
UPSTREAM = Options(
    sim=SimConfig(
        decode_ms_per_token=1.0,
        max_concurrency=4096,
        embedding_call_ms=5.0,
        embedding_concurrency=4096,
    ),
    tenant_answers=True,
    faults={"503": 0.011, "500_once": 0.006, "timeout": 0.011, "stall": 0.011, "cut": 0.011},
    hold_s=HOLD_S,
    log_level="critical",  # a deliberate cut is an exception in the app: not logged each time
)
FAULTS = FaultPlan(UPSTREAM.faults)

# The errors each fault allows: (status, error code) of a JSON error, or "sse" for a stream that
# had started and ends with an SSE error event (upstream_stream_broken).
ALLOWED: dict[str | None, set[Any]] = {
    None: set(),
    "503": {(503, "injected")},
    "500_once": {(500, "injected")},
    "timeout": {(504, "upstream_timeout")},
    "stall": {"sse", (502, "upstream_stream_broken"), (504, "upstream_timeout")},
    "cut": {"sse", (502, "upstream_stream_broken"), (502, "upstream_unreachable")},
}
ALWAYS_FAILS = {"503", "timeout", "stall", "cut"}


# ------------------------------------------------------------------------------------------------
# The workload


def plan(n: int, seed: int = SEED) -> list[dict[str, Any]]:
    """``n`` requests: ``{"tenant", "kind": chat|embedding, "text", "stream", "leave_ms"}``."""
    rng = random.Random(seed)
    common = [f"common question {i}: how do I reset my password?" for i in range(300)]
    history: list[tuple[str, str, str]] = []
    requests = []
    for i in range(n):
        if history and rng.random() < DUPLICATES:
            back = int(rng.expovariate(1 / 300))  # mostly recent ones
            at = len(history) - 1 - back if back < len(history) else rng.randrange(len(history))
            tenant, kind, text = history[at]
        else:
            tenant = rng.choice(TENANTS)
            kind = "embedding" if rng.random() < EMBEDDINGS else "chat"
            text = (
                rng.choice(common)
                if kind == "chat" and rng.random() < COMMON
                else f"{kind} request {i}: {rng.randrange(10**9)}"
            )
            history.append((tenant, kind, text))
        requests.append(
            {
                "tenant": tenant,
                "kind": kind,
                "text": text,
                "stream": kind == "chat" and rng.random() < STREAMING,
                "leave_ms": round(rng.uniform(2, 40), 1) if rng.random() < DISCONNECT else None,
            }
        )
    return requests


def request_body(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(path, body) of a planned request."""
    if spec["kind"] == "embedding":
        return "/v1/embeddings", {"model": "e", "input": spec["text"]}
    body = {
        "model": "m",
        "temperature": 0,
        "stream": spec["stream"],
        "messages": [{"role": "user", "content": spec["text"]}],
    }
    return CHAT, body


def request_bytes(spec: dict[str, Any], port: int) -> bytes:
    path, body = request_body(spec)
    headers = {"authorization": f"Bearer {spec['tenant']}"}
    return build("POST", path, Address.local(port), json.dumps(body).encode(), headers)


class Truth:
    """What the upstream's engine answers a tenant for a request (the chat text, or the vector),
    computed in this process (``upstream.expected``) and kept."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, str, str], Any] = {}

    def __call__(self, tenant: str, kind: str, text: str) -> Any:
        key = (tenant, kind, text)
        if key not in self.known:
            spec = {"tenant": tenant, "kind": kind, "text": text, "stream": False}
            reply = expected(*request_body(spec), tenant, UPSTREAM).body
            assert reply is not None
            if kind == "embedding":
                self.known[key] = reply["data"][0]["embedding"]
            else:
                self.known[key] = reply["choices"][0]["message"]["content"]
        return self.known[key]


# ------------------------------------------------------------------------------------------------
# Judging one answer


def _sse(body: bytes) -> tuple[str, bool, dict[str, Any] | None]:
    """(text, ended with [DONE], the error event if any) of an SSE body."""
    text, done, error = [], False, None
    for line in body.split(b"\n"):
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = chunk["error"]
            continue
        for choice in chunk.get("choices", []):
            text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text), done, error


def judge(spec: dict[str, Any], status: int, body: bytes, truth: Truth) -> tuple[str, str]:
    """("ok" | "expected" | "wrong" | "unexpected", a label for the counts)."""
    tenant, kind, text = spec["tenant"], spec["kind"], spec["text"]
    if kind == "embedding":
        if status != 200:
            return "unexpected", f"embedding {status} {_code(body)}"
        got = json.loads(body)["data"][0]["embedding"]
        if got == truth(tenant, kind, text):
            return "ok", "embedding"
        others = [t for t in TENANTS if t != tenant and got == truth(t, kind, text)]
        return "wrong", "embedding cross_tenant" if others else "embedding vector mismatch"
    fault = FAULTS.fault_of(tenant, text)
    right = truth(tenant, kind, text)
    label = fault or "none"
    if status == 200 and body.startswith(b"data:"):
        got, done, error = _sse(body)
        if error is not None:
            if done:
                return "wrong", f"{label}: error event and [DONE] in one stream"
            if not right.startswith(got):
                return "wrong", f"{label}: failed stream carried a wrong text"
            if "sse" in ALLOWED[fault] and error.get("code") == "upstream_stream_broken":
                return "expected", f"{label}: sse error event"
            return "unexpected", f"{label}: sse error {error.get('code')}"
        if not done:
            return "wrong", f"{label}: stream ended without [DONE] or an error"
    elif status == 200:
        got = json.loads(body)["choices"][0]["message"]["content"]
    else:
        code = _code(body)
        if (status, code) in ALLOWED[fault]:
            return "expected", f"{label}: {status} {code}"
        return "unexpected", f"{label}: {status} {code}"
    if got != right:
        others = [t for t in TENANTS if t != tenant and got == truth(t, kind, text)]
        return "wrong", f"{label}: cross_tenant" if others else f"{label}: text mismatch"
    if fault in ALWAYS_FAILS:
        return "wrong", f"{label}: a failing call served as success"
    return "ok", "chat stream" if spec["stream"] else "chat"


def _code(body: bytes) -> str | None:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "(not an OpenAI error body)"
    return error.get("code") if isinstance(error, dict) else None


# ------------------------------------------------------------------------------------------------
# The load generator (its own process)


async def _load(spec: dict[str, Any]) -> dict[str, Any]:
    port, n, concurrency = spec["gateway_port"], spec["n"], spec["concurrency"]
    address = Address.local(port)
    requests = plan(n, spec["seed"])
    raws = [request_bytes(r, port) for r in requests]
    truth = Truth()
    for r in requests:  # before the load: the load generator's time is the load's
        truth(r["tenant"], r["kind"], r["text"])
    verdicts: collections.Counter[str] = collections.Counter()
    labels: collections.Counter[str] = collections.Counter()
    outcomes: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[str] = collections.Counter()
    examples: dict[str, list[Any]] = collections.defaultdict(list)
    latencies: list[float] = []
    progress = {"next": 0}
    conns = await connect_many(address, concurrency)

    async def worker(conn: Conn) -> None:
        while progress["next"] < n:
            i = progress["next"]
            progress["next"] += 1
            request = requests[i]
            started = time.monotonic()
            future = conn.request(raws[i])
            if request["leave_ms"] is not None:
                await asyncio.wait([future], timeout=request["leave_ms"] / 1000)
                if not future.done():  # the client leaves: drop the connection
                    future.cancel()
                    conn.abort()
                    verdicts["left"] += 1
                    conn = await connect(address)
                    continue
            try:
                response: Response = await asyncio.wait_for(future, HANG_S)
            except TimeoutError:
                verdicts["hang"] += 1
                examples["hang"].append(request)
                conn.abort()
                conn = await connect(address)
                continue
            except Exception as error:  # a transport or parser failure
                verdicts["unexpected"] += 1
                labels[f"transport: {type(error).__name__}"] += 1
                conn.abort()
                conn = await connect(address)
                continue
            latencies.append(time.monotonic() - started)
            statuses[str(response.status)] += 1
            outcomes[response.carpool or "(none)"] += 1
            try:
                verdict, label = judge(request, response.status, response.body, truth)
            except (ValueError, KeyError, IndexError, TypeError) as error:
                verdict, label = "wrong", f"an answer that is not OpenAI-shaped: {error!r}"
            verdicts[verdict] += 1
            labels[f"{verdict}: {label}"] += 1
            if verdict in ("wrong", "unexpected") and len(examples[verdict]) < 5:
                examples[verdict].append(
                    {
                        **request,
                        "status": response.status,
                        "body": response.body[-300:].decode(errors="replace"),
                    }
                )

    t0 = time.monotonic()
    await asyncio.gather(*(worker(conn) for conn in conns))
    wall = time.monotonic() - t0
    seen: set[tuple[str, str, str]] = set()
    duplicates = 0
    for r in requests:
        key = (r["tenant"], r["kind"], r["text"])
        duplicates += key in seen
        seen.add(key)
    faulty = sum(
        r["kind"] == "chat" and FAULTS.fault_of(r["tenant"], r["text"]) is not None
        for r in requests
    )
    chat_keys = {(t, x) for t, kind, x in seen if kind == "chat"}
    return {
        "requests": n,
        "concurrency": concurrency,
        "wall_s": round(wall, 2),
        "requests_per_s": round(n / wall, 1),
        "distinct_requests": len(seen),
        "duplicate_share": round(duplicates / n, 4),
        "distinct_chat": len(chat_keys),
        "distinct_embedding": len(seen) - len(chat_keys),
        "distinct_chat_with_fault": sum(FAULTS.fault_of(*key) is not None for key in chat_keys),
        "streaming_share": round(sum(r["stream"] for r in requests) / n, 4),
        "embedding_share": round(sum(r["kind"] == "embedding" for r in requests) / n, 4),
        "fault_share": round((faulty + sum(r["leave_ms"] is not None for r in requests)) / n, 4),
        "upstream_fault_requests": faulty,
        "verdicts": dict(verdicts),
        "labels": dict(sorted(labels.items())),
        "outcomes": dict(outcomes),
        "statuses": dict(statuses),
        "latency": summary_ms(latencies) or None,
        "examples": dict(examples),
    }


# ------------------------------------------------------------------------------------------------
# The orchestrator


def _get(port: int, path: str) -> Any:
    return json.loads(fetch("GET", f"http://{process.HOST}:{port}{path}", timeout=10)[2])


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """The gateway's RSS every ``interval`` s, with its request count at that moment."""

    def __init__(self, pid: int, port: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.port, self.interval = pid, port, interval
        self.samples: list[tuple[float, int, int]] = []  # (t, requests, rss)
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            rss = _rss_bytes(self.pid)
            try:
                requests = _get(self.port, "/stats")["requests"]
            except OSError:
                continue
            if rss is not None:
                self.samples.append((round(time.monotonic() - self.t0, 2), requests, rss))


def memory(samples: list[tuple[float, int, int]], n: int) -> dict[str, Any]:
    warmup = max(WARMUP * n, WARMUP_MIN)
    warm = [s for s in samples if s[1] <= warmup]
    after = [s for s in samples if s[1] > warmup]
    if not warm or not after:
        return {"ok": False, "why": "too few samples", "samples": len(samples)}
    base = warm[-1][2]
    peak = max(s[2] for s in after)
    growth = peak / base - 1
    mib = 1024 * 1024
    return {
        "ok": growth < MAX_GROWTH,
        "samples": len(samples),
        "warmup_requests": int(warmup),
        "rss_start_mib": round(samples[0][2] / mib, 1),
        "rss_after_warmup_mib": round(base / mib, 1),
        "rss_peak_after_warmup_mib": round(peak / mib, 1),
        "rss_end_mib": round(samples[-1][2] / mib, 1),
        "growth_after_warmup": round(growth, 4),
        "max_growth": MAX_GROWTH,
        "series": [[t, r, round(rss / mib, 1)] for t, r, rss in samples],
    }


def _settle(gateway_port: int, upstream_port: int, timeout: float) -> dict[str, Any]:
    """Once the load is over: until the gateway holds no flight and no waiter, and the upstream
    has nothing in flight (its held faults end after HOLD_S)."""
    deadline = time.monotonic() + timeout
    while True:
        stats, count = _get(gateway_port, "/stats"), _get(upstream_port, "/bench/count")
        settled = stats["flights"] == stats["waiters"] == count["in_flight"] == 0
        if settled or time.monotonic() > deadline:
            return {
                "settled": settled,
                "flights": stats["flights"],
                "waiters": stats["waiters"],
                "upstream_in_flight": count["in_flight"],
            }
        time.sleep(0.1)


def gateway_config(n: int = FULL_N) -> dict[str, Any]:
    from carpool.config import FingerprintConfig

    scale = min(1.0, n / FULL_N)
    config: dict[str, Any] = {
        "log_level": "warning",
        "limits": {"upstream_timeout": UPSTREAM_TIMEOUT_S},
        "cache": {"max_bytes": int(CACHE_BYTES * scale)},
        "coalesce": {"adaptive_keys": max(1, int(WINDOW_KEYS * scale))},
    }
    if "repeat_memo_bytes" in FingerprintConfig.model_fields:
        config["fingerprint"] = {"repeat_memo_bytes": int(MEMO_BYTES * scale)}
    return config


def run(
    quick: bool = False, requests: int | None = None, concurrency: int = CONCURRENCY
) -> dict[str, Any]:
    n = requests or (QUICK_N if quick else FULL_N)
    config = Config.model_validate(gateway_config(n))
    with upstream(UPSTREAM) as up, gateway(config.model_copy(update={"upstreams": [up.url]})) as gw:
        sampler = Sampler(gw.pid, gw.port)
        sampler.start()
        spec = {"gateway_port": gw.port, "n": n, "concurrency": concurrency, "seed": SEED}
        t0 = time.monotonic()
        load = process.run_child([__file__, "--loadgen"], spec, timeout=max(600, n / 20))
        duration = time.monotonic() - t0
        settle = _settle(gw.port, up.port, HOLD_S + 10)
        sampler.stop.set()
        sampler.join()
        stats, count = _get(gw.port, "/stats"), up.count()
    mem = memory(sampler.samples, n)
    verdicts = load["verdicts"]
    result = {
        "load": load,
        "duration_s": round(duration, 1),
        "memory": mem,
        "after": settle,
        "upstream_calls": count["calls"],
        "upstream_chat_calls": count["chat"],
        "upstream_embedding_calls": count["embeddings"],
        "upstream_faults": count["faults"],
        "gateway": {
            k: stats[k]
            for k in (
                "requests",
                "hits",
                "coalesced",
                "misses",
                "bypass",
                "upstream_calls",
                "upstream_errors",
                "saved_fraction",
            )
        }
        | {"batching": stats.get("batching")},
        "config": {
            "requests": n,
            "concurrency": concurrency,
            "seed": SEED,
            "fault_hold_s": HOLD_S,
            "hang_s": HANG_S,
            "gateway": gateway_config(n),
        },
        "wrong": verdicts.get("wrong", 0),
        "hangs": verdicts.get("hang", 0),
        "unexpected_errors": verdicts.get("unexpected", 0),
        "expected_errors": verdicts.get("expected", 0),
    }
    result["ok"] = (
        result["wrong"] == 0
        and result["hangs"] == 0
        and mem["ok"]
        and settle["settled"]
        and sum(verdicts.values()) == n
    )
    return result


def summarize(result: dict[str, Any]) -> list[str]:
    load, mem = result["load"], result["memory"]
    errors = {
        k.split(": ", 1)[1]: v
        for k, v in load["labels"].items()
        if k.startswith(("expected", "unexpected"))
    }
    lat = load["latency"] or {}
    return [
        f"soak/{load['requests']:,} requests at concurrency {load['concurrency']} in "
        f"{result['duration_s']:.0f} s ({load['requests_per_s']:.0f} req/s): duplicates "
        f"{load['duplicate_share']:.0%}, faults {load['fault_share']:.1%}; wrong "
        f"{result['wrong']}, hangs {result['hangs']}, unexpected errors "
        f"{result['unexpected_errors']}  [{'OK' if result['ok'] else 'FAIL'}]",
        f"soak/verdicts {load['verdicts']}; upstream calls {result['upstream_calls']:,} "
        f"(gateway counted {result['gateway']['upstream_calls']:,}): chat "
        f"{result['upstream_chat_calls']:,} for {load['distinct_chat']:,} distinct chat "
        f"requests, embeddings {result['upstream_embedding_calls']:,} batched calls for "
        f"{load['distinct_embedding']:,} distinct inputs; latency p50 {lat.get('p50_ms', 0):.0f}"
        f" ms, p99 {lat.get('p99_ms', 0):.0f} ms, max {lat.get('max_ms', 0):.0f} ms",
        f"soak/errors by kind {errors}",
        f"soak/gateway RSS {mem.get('rss_after_warmup_mib')} MiB after warm-up, peak "
        f"{mem.get('rss_peak_after_warmup_mib')} MiB after (growth "
        f"{mem.get('growth_after_warmup', float('nan')):.1%}, limit {MAX_GROWTH:.0%}); "
        f"after the load: {result['after']}",
    ]


def document(result: dict[str, Any], quick: bool, duration: float) -> dict[str, Any]:
    """The same document as ``run.py --only soak`` writes."""
    return scenario.document(
        {"soak": result},
        headline(result),
        ok=result["ok"],
        errors={} if result["ok"] else {"soak": "a correctness check failed"},
        quick=quick,
        duration_s=duration,
        durations_s={"soak": round(duration, 2)},
    )


def headline(result: dict[str, Any]) -> dict[str, Any]:
    load = result["load"]
    return {
        "soak_requests": load["requests"],
        "soak_wrong": result["wrong"],
        "soak_hangs": result["hangs"],
        "soak_unexpected_errors": result["unexpected_errors"],
        "soak_expected_errors": result["expected_errors"],
        "soak_upstream_calls": result["upstream_calls"],
        "soak_distinct_requests": load["distinct_requests"],
        "soak_duration_s": result["duration_s"],
        "soak_rss_growth_after_warmup": result["memory"].get("growth_after_warmup"),
    }


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_N:,} requests")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--json", action="store_true", help="also print the full result")
    parser.add_argument(
        "--out", type=Path, default=None, help="[results/soak.json; --quick: soak-quick.json]"
    )
    parser.add_argument("--loadgen", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loadgen:  # the load generator's own process
        sys.stdout.write(json.dumps(scenario.run_async(_load(json.loads(args.loadgen)))))
        return
    if args.out is None:
        args.out = RESULTS / f"{scenario.result_name('soak', args.quick)}.json"
    started = time.monotonic()
    result = run(args.quick, args.requests, args.concurrency)
    scenario.write_json(args.out, document(result, args.quick, time.monotonic() - started))
    print("\n".join(summarize(result)))
    if args.json:
        print(json.dumps(result, indent=2))
    print(f"-> {args.out}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
