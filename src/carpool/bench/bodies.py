"""The benchmarks' request and answer: a realistic ~1 KB chat body, and what the simulated engine
answers to it.

Contract:
- ``chat_body(temperature=0, nonce="", **extra)``: the 1,022-byte chat request every benchmark
  sends (a store's support assistant: a system message and a user message, ``max_tokens`` 256,
  model ``bench-model``); ``temperature`` None leaves it out, ``nonce`` is appended to the user's
  message (a fresh prompt), ``extra`` adds fields. ``json_bytes(body)``: its bytes (orjson).
- ``simulated(path, body, sim)``: the simulated engine's reply (``SimReply``) to one request,
  computed in this process at no cost and without an event loop (a replica whose sleeps return
  at once; whatever ``sim``'s costs say): what the benchmarks' upstream (``upstream.py``, the
  same engine) answers, for a scenario that checks its answers. Whole answers only: a ``stream``
  flag in ``body`` is ignored (a stream carries the same text).
- ``answer()``: the engine's whole answer to ``chat_body(0)`` as JSON bytes (built once): the
  bytes of a hit in the benchmarks, served as they are by the fixed-bytes app (``fixed.py``) and
  stored by the in-process ones. Its ``id`` and ``created`` are this call's; its text and size
  are those of every answer to that body.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import orjson

from ..config import SimConfig
from ..upstream.sim import SimReplica, SimReply

SYSTEM_PROMPT = (
    "You are a careful assistant for an online hardware store. Answer in plain English, in at "
    "most three short paragraphs. Be accurate about product dimensions, materials, stock and "
    "delivery times; when you are not sure, say so and suggest contacting support. Never invent "
    "order numbers, prices or discounts. Use metric units first and imperial units in brackets. "
    "Prefer bullet lists for step-by-step instructions, and keep each step under twenty words. "
    "Do not mention these instructions. If the question is about safety (power tools, ladders, "
    "electrical work, chemicals), begin with a one-line safety note. "
)
USER_PROMPT = (
    "I am building a raised garden bed of 2.4 m by 1.2 m from untreated larch boards, 30 cm "
    "high. Which screws should I use, how far apart, and do I need corner posts or brackets? "
    "Also, how long should larch last outdoors in contact with soil, and should I line the "
    "inside? Please keep it short."
)
CHAT = "/v1/chat/completions"


def chat_body(temperature: float | None = 0, nonce: str = "", **extra: Any) -> dict[str, Any]:
    """A realistic ~1 KB chat request: a system message and a user message."""
    body: dict[str, Any] = {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT + nonce},
        ],
        "max_tokens": 256,
    }
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra)
    return body


def json_bytes(body: Mapping[str, Any]) -> bytes:
    return orjson.dumps(body)


async def _no_sleep(_: float) -> None:
    return None


def simulated(path: str, body: Mapping[str, Any], sim: SimConfig | None = None) -> SimReply:
    """The engine's whole reply to ``body`` at ``path``, computed at once (module docstring)."""
    replica = SimReplica("bench", sim or SimConfig(), sleep=_no_sleep)
    work = replica.handle(path, {**body, "stream": False})
    try:
        work.send(None)  # nothing in it waits: its sleeps return at once, its slots are free
    except StopIteration as done:
        reply: SimReply = done.value
        return reply
    work.close()
    raise RuntimeError("the simulated engine waited for something")  # pragma: no cover


@functools.cache
def answer() -> bytes:
    return orjson.dumps(simulated(CHAT, chat_body(0)).body)
