"""A tiny counting OpenAI-compatible upstream for the benchmarks (raw ASGI, no framework).

    python benchmarks/upstream_app.py --port 9001 [--delay-ms 200] [--hold]

- ``POST /v1/chat/completions``: answers one fixed chat completion (``finish_reason: stop``, with
  usage), after ``--delay-ms`` and, with ``--hold``, only once ``POST /release`` was called (or
  after 30 s), so that every client of a coalescing test can pile up first. Each call is counted.
- ``GET /count``: ``{"calls": n, "answered_at": t}``, ``t`` the ``time.monotonic()`` (a
  system-wide clock on Linux) at which the last chat answer started being sent.
- ``POST /release``: lets every held request answer (and the later ones, until ``/reset``).
- ``POST /reset``: zero the counter and hold again.

Served by uvicorn with uvloop and httptools, access log off, so it costs as little as it can:
it stands for an engine that answers instantly.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
from _common import ANSWER, lifespan

JSON_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(ANSWER)).encode()),
]


class App:
    def __init__(self, delay_ms: float, hold: bool) -> None:
        self.delay = delay_ms / 1000
        self.hold = hold
        self.calls = 0
        self.answered_at: float | None = None
        self.released: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self.released is None:
            self.released = asyncio.Event()
        return self.released

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        more = True
        while more:  # drain the request body
            message = await receive()
            more = message.get("more_body", False)
        path = scope["path"]
        if path.endswith("/chat/completions"):
            self.calls += 1
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.hold:
                try:
                    await asyncio.wait_for(self._event().wait(), 30)
                except TimeoutError:
                    pass
            self.answered_at = time.monotonic()
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            await send({"type": "http.response.body", "body": ANSWER})
            return
        if path == "/count":
            body = orjson.dumps({"calls": self.calls, "answered_at": self.answered_at})
        elif path == "/release":
            self._event().set()
            body = b"{}"
        elif path == "/reset":
            self.calls, self.answered_at, self.released = 0, None, None
            body = b"{}"
        else:
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [(b"content-length", b"0")],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=0)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(
        App(args.delay_ms, args.hold),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
