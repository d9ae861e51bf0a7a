"""What the in-process exact store counts against its byte budget vs what the process holds.

Puts N small answers (a ~200-byte chat body, ``--frames`` SSE frames if asked, a short prompt
prefix, a distinct 32-hex-digit key each) into a ``MemoryStore`` with a budget large enough to
keep them all, then prints the store's ``bytes`` next to the growth of the process's resident
memory (VmRSS, Linux) over the same puts. Not a test: a measurement, run by hand.

    PYTHONPATH=src python scripts/measure_store_memory.py [--entries 1000000] [--body-bytes 200]

Measured (CPython 3.11, 1,000,000 entries, 200-byte bodies): before the store counted what the
process holds, 437,888,890 bytes counted for 867,225,600 of RSS growth (0.50); since, 884,000,000
counted for 867,254,272 (1.02).
"""

from __future__ import annotations

import argparse
import asyncio
import gc

from carpool.answer import Answer
from carpool.store import Entry, MemoryStore


def rss() -> int:
    """The resident set size of this process, in bytes (Linux: /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def body(i: int, length: int) -> bytes:
    head = (
        f'{{"id":"chatcmpl-{i:012d}","object":"chat.completion","model":"m",'
        f'"choices":[{{"index":0,"message":{{"role":"assistant","content":"'
    )
    tail = '"},"finish_reason":"stop"}],"usage":{"total_tokens":42}}'
    return (head + "y" * max(0, length - len(head) - len(tail)) + tail).encode()


async def main(entries: int, body_bytes: int, frames: int) -> None:
    store = MemoryStore(1 << 62)
    gc.collect()
    before = rss()
    for i in range(entries):
        raw = body(i, body_bytes)
        streamed = [b"data: " + raw[j::frames] + b"\n\n" for j in range(frames)] if frames else None
        answer = Answer("chat", raw, True, tokens=300 + i % 100, frames=streamed)
        prefix = f"What is the capital of country {i}?"
        # As the gateway stores it: the expiry is the answer's creation time plus the TTL.
        await store.put(f"{i:032x}", Entry(answer, answer.created + 3600, (), "", prefix))
    gc.collect()
    grown = rss() - before
    print(f"entries:        {store.entries:>14,}")
    print(f"counted bytes:  {store.bytes:>14,}  ({store.bytes / store.entries:,.0f} per entry)")
    print(f"RSS growth:     {grown:>14,}  ({grown / store.entries:,.0f} per entry)")
    print(f"counted / RSS:  {store.bytes / grown:>14.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--body-bytes", type=int, default=200)
    parser.add_argument("--frames", type=int, default=0, help="SSE frames an answer keeps")
    args = parser.parse_args()
    asyncio.run(main(args.entries, args.body_bytes, args.frames))
