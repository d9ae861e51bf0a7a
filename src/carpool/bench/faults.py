"""Faults the benchmarks' upstream injects in front of the simulated engine, decided by the request
itself, so that a load generator can tell a wrong answer from an error it should expect.

Contract:
- ``FaultPlan(shares)``: ``shares`` maps a kind (``KINDS``) to the share of chat prompts that get
  it. ``fault_of(tenant, text)`` is the kind for a ``(tenant, text)`` (the ``Authorization``
  token and the last chat message's content), or None: a BLAKE2b hash of both picks one of
  10,000 bands, the kinds taking theirs in the order given; the same in any process.
- ``inject(kind, ...)`` serves one chat call with that fault (``serve`` is the engine's app, to
  which a call is passed on when the fault lets it through):
  * ``"503"``: every call answers 503, an OpenAI error body with code ``injected``;
  * ``"500_once"``: the first call for the prompt answers 500 (same body), later calls are served;
  * ``"timeout"``: nothing at all, not even headers, for ``hold_s`` seconds (more than the
    gateway's upstream timeout);
  * ``"stall"``: the engine's answer is cut after its headers and half its body (a whole answer)
    or after its first ``STREAM_FRAMES`` frames (a stream: the role, then two tokens), then
    nothing for ``hold_s``;
  * ``"cut"``: the same cut, then the connection is dropped (an exception after the response
    started: uvicorn closes the connection; run the server at log level critical to keep its
    log quiet).
- ``send_json(send, status, payload)``: a whole JSON response, for the errors and the controls.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KINDS = ("503", "500_once", "timeout", "stall", "cut")
STREAM_FRAMES = 3
BANDS = 10_000


class Cut(Exception):
    """Raised on purpose after the response started: the server drops the connection."""


class FaultPlan:
    def __init__(self, shares: Mapping[str, float]) -> None:
        unknown = set(shares) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
        self.shares = dict(shares)
        self.bands: list[tuple[int, str]] = []
        limit = 0
        for kind, share in shares.items():
            limit += round(share * BANDS)
            self.bands.append((limit, kind))
        if limit > BANDS:
            raise ValueError("fault shares add up to more than 1")
        self.seen: dict[tuple[str, str], int] = {}

    def fault_of(self, tenant: str, text: str) -> str | None:
        digest = hashlib.blake2b(f"fault\n{tenant}\n{text}".encode(), digest_size=8).digest()
        band = int.from_bytes(digest, "big") % BANDS
        for limit, kind in self.bands:
            if band < limit:
                return kind
        return None

    async def inject(
        self,
        kind: str,
        key: tuple[str, str],
        scope: Scope,
        receive: Receive,
        send: Send,
        serve: ASGIApp,
        hold_s: float,
    ) -> None:
        self.seen[key] = self.seen.get(key, 0) + 1
        if kind == "503" or (kind == "500_once" and self.seen[key] == 1):
            await _error(send, 503 if kind == "503" else 500)
        elif kind == "timeout":
            await asyncio.sleep(hold_s)  # the gateway gave up long ago
        elif kind in ("stall", "cut"):
            await serve(scope, receive, _cutting(send, kind, hold_s))
        else:
            await serve(scope, receive, send)


def _cutting(send: Send, kind: str, hold_s: float) -> Send:
    """``send`` that passes the response on until its cut, then stalls or drops it."""
    frames = 0
    stream = False

    async def cut() -> None:
        if kind == "stall":
            await asyncio.sleep(hold_s)
        raise Cut(f"{kind} on purpose")

    async def wrapped(message: Message) -> None:
        nonlocal frames, stream
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            await send(message)
            return
        if message["type"] != "http.response.body":
            await send(message)
            return
        if stream:
            frames += 1
            if frames <= STREAM_FRAMES:
                await send(message)
                return
        else:
            body = message.get("body", b"")
            await send(
                {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
            )
        await cut()

    return wrapped


async def _error(send: Send, status: int) -> None:
    error = {
        "message": f"bench upstream: injected {status}",
        "type": "server_error",
        "param": None,
        "code": "injected",
    }
    await send_json(send, status, {"error": error})


async def send_json(send: Send, status: int, payload: Any) -> None:
    """A whole JSON response (the upstream's controls send theirs with it too)."""
    data = orjson.dumps(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})
