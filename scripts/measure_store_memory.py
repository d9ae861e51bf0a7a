"""What the in-process caches count against their byte budgets vs what the process holds.

Three measurements, each in a process of its own (so that one's freed memory does not hide
another's growth), each printing the cache's own count next to the growth of the process's
resident memory (VmRSS, Linux) over the same load:

- ``store``: N small answers (a ~200-byte chat body, ``--frames`` SSE frames if asked, a short
  prompt prefix, a distinct BLAKE2b key each, as the fingerprint makes them) put in a
  ``MemoryStore`` whose budget keeps them all; then every one read once (a hit marks its entry
  in place: it moved it to the end of the map, which doubled its table), and again. The keys
  read are made a chunk at a time: a list of them all, freed, would stay in glibc's heap (8 MB
  at 1M) and count as the store's.
- ``memo``: N distinct requests remembered by a ``RepeatMemo`` with its configured budget.
- ``idempotency``: N records begun and finished (a ~200-byte response each) in
  ``MemoryIdempotencyRecords`` with their configured bounds, each of a client of its own (the
  most a record holds: each tenant's share is kept apart).

Not a test: a measurement, run by hand.

    PYTHONPATH=src python scripts/measure_store_memory.py [--entries 1000000] [--body-bytes 200]
        [--frames 0] [--only store|memo|idempotency] [--json]

``--json`` (with ``--only``): the last line printed is a JSON object of every report, by name
(``benchmarks/bench_perf.py`` reads it).

Measured: see docs/architecture.md ("The in-process caches").
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import gc
import hashlib
import subprocess
import sys
import time

KINDS = ("store", "memo", "idempotency")
# Keys read a chunk at a time: a list of a million keys takes 8 MB of malloc's heap (glibc keeps
# it once freed: a resized dict's freed table raised its mmap threshold), the strings 96 MB.
READ_CHUNK = 4096


def rss() -> int:
    """The resident set size of this process, in bytes (Linux: /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def trimmed_rss() -> int:
    """The RSS once glibc returned to the system what it keeps of freed memory (``malloc_trim``):
    a resized dict's old table, mostly. What the process holds, not what its allocator keeps."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # (not glibc: as it is)
    return rss()


def body(i: int, length: int) -> bytes:
    head = (
        f'{{"id":"chatcmpl-{i:012d}","object":"chat.completion","model":"m",'
        f'"choices":[{{"index":0,"message":{{"role":"assistant","content":"'
    )
    tail = '"},"finish_reason":"stop"}],"usage":{"total_tokens":42}}'
    return (head + "y" * max(0, length - len(head) - len(tail)) + tail).encode()


def key(i: int) -> str:
    """A key as the fingerprint makes them: a 32-hex-digit BLAKE2b digest."""
    return hashlib.blake2b(b"%d" % i, digest_size=16).hexdigest()


RESULTS: dict[str, dict[str, int | None]] = {}  # what ``--json`` prints: each report, by name


def report(name: str, count: int, counted: int, before: int, budget: int | None) -> None:
    grown = rss() - before
    held = trimmed_rss() - before
    RESULTS[name] = {
        "entries": count,
        "counted_bytes": counted,
        "rss_growth_bytes": grown,
        "rss_growth_trimmed_bytes": held,
        "budget_bytes": budget,
    }
    print(f"{name}")
    print(f"  entries:        {count:>14,}")
    print(f"  counted bytes:  {counted:>14,}  ({counted / max(count, 1):,.0f} per entry)")
    print(f"  RSS growth:     {grown:>14,}  ({grown / max(count, 1):,.0f} per entry)")
    print(f"  ... trimmed:    {held:>14,}  ({held / max(count, 1):,.0f} per entry: malloc_trim)")
    if grown > 0:
        print(f"  counted / RSS:  {counted / grown:>14.2f}")
    if budget is not None:
        print(f"  budget:         {budget:>14,}  (RSS growth within it: {grown <= budget})")


async def store(entries: int, body_bytes: int, frames: int) -> None:
    from carpool.answer import Answer
    from carpool.store import Entry, MemoryStore

    cache = MemoryStore(1 << 62)
    gc.collect()
    before = rss()
    for i in range(entries):
        raw = body(i, body_bytes)
        streamed = [b"data: " + raw[j::frames] + b"\n\n" for j in range(frames)] if frames else None
        answer = Answer("chat", raw, True, tokens=300 + i % 100, frames=streamed)
        prefix = f"What is the capital of country {i}?"
        # As the gateway stores it: the expiry is the answer's creation time plus the TTL.
        await cache.put(key(i), Entry(answer, answer.created + 3600, (), "", prefix))
    gc.collect()
    report("store: filled", cache.entries, cache.bytes, before, None)
    for rounds in (1, 2):
        hits, took = 0, 0.0
        for start in range(0, entries, READ_CHUNK):
            keys = [key(i) for i in range(start, min(entries, start + READ_CHUNK))]  # (not timed)
            started = time.process_time()
            hits += sum(cache.get_now(k) is not None for k in keys)
            took += time.process_time() - started
        del keys
        gc.collect()
        report(f"store: after reading every entry {rounds}x", hits, cache.bytes, before, None)
        print(f"  reads:          {took / entries * 1e9:>14,.0f} ns each (mean)")


async def memo(entries: int, body_bytes: int) -> None:
    from carpool.config import Config
    from carpool.fingerprint import fingerprint
    from carpool.repeat_memo import RepeatMemo
    from carpool.request import ClientRequest, parse

    config = Config()
    repeats = RepeatMemo((), config.fingerprint.repeat_memo_bytes)
    headers = {"authorization": "Bearer sk-test", "content-type": "application/json"}
    path = "/v1/chat/completions"

    def request_body(i: int) -> bytes:
        head = b'{"model":"m","messages":[{"role":"user","content":"'
        text = b"What is the capital of country %d?" % i
        pad = b" " * max(0, body_bytes - len(head) - len(text) - 4)
        return head + text + pad + b'"}]}'

    template = parse(ClientRequest(path, request_body(0), headers), 1 << 20)
    fingerprinted = fingerprint(template, config)
    max_age = float(config.cache.default_ttl)
    gc.collect()
    before = rss()
    for i in range(entries):
        memo_key = repeats.key_of(ClientRequest(path, request_body(i), headers))
        assert memo_key is not None
        repeats.remember(
            memo_key, template, dataclasses.replace(fingerprinted, key=key(i)), max_age
        )
    gc.collect()
    report("repeat memo", len(repeats), repeats.bytes, before, repeats.max_bytes)


async def idempotency(entries: int, body_bytes: int) -> None:
    from carpool.config import Config
    from carpool.idempotency.memory import MemoryIdempotencyRecords
    from carpool.idempotency.records import StoredResponse

    records = MemoryIdempotencyRecords(Config().idempotency.retention)
    headers = [(b"content-type", b"application/json"), (b"x-carpool", b"miss")]
    gc.collect()
    before = rss()
    for i in range(entries):
        idempotency_key = f"client-{i:012d}\norder-{i:012d}"  # (scope, then key: scope_of)
        begun = await records.begin(idempotency_key, key(i))
        assert begun.token is not None
        response = StoredResponse(200, list(headers), body(i, body_bytes))
        await records.finish(idempotency_key, begun.token, response)
    gc.collect()
    budget = records.max_bytes
    report("idempotency records", len(records), records.bytes, before, budget)
    print(f"  max records:    {records.max_records:>14,}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--body-bytes", type=int, default=200)
    parser.add_argument("--frames", type=int, default=0, help="SSE frames an answer keeps")
    parser.add_argument("--only", choices=KINDS, help="one measurement, in this process")
    parser.add_argument("--json", action="store_true", help="also print the reports as JSON")
    args = parser.parse_args()
    if args.only is None:
        for kind in KINDS:  # each in a fresh process
            subprocess.run([sys.executable, *sys.argv, "--only", kind], check=True)
    elif args.only == "store":
        asyncio.run(store(args.entries, args.body_bytes, args.frames))
    elif args.only == "memo":
        asyncio.run(memo(args.entries, args.body_bytes))
    else:
        asyncio.run(idempotency(args.entries, args.body_bytes))
    if args.json and args.only is not None:
        import json

        print(json.dumps(RESULTS))
