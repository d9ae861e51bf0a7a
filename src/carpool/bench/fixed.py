"""The fixed-bytes app: the ceiling of any Python ASGI server on this stack, for comparisons.

    python -m carpool.bench.fixed          # announces its port (process.py)

Contract:
- Every HTTP request is answered 200 with the same bytes, ``bodies.answer()`` (the simulated
  engine's answer to the benchmarks' chat body: the payload every target of a comparison
  answers), without reading the request: no framework, no routing, no counting, no parsing; on
  uvicorn with uvloop and httptools, access log off (``process.serve``). Not an upstream: a
  reference target that a gateway's exact hits are measured against.
- ``fixed_app(log_path)`` (context manager) runs it in a child process and yields its
  ``process.Server``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import process
from .bodies import answer


@contextlib.contextmanager
def fixed_app(log_path: Path | None = None) -> Iterator[process.Server]:
    with process.server(
        "carpool.bench.fixed", name="the fixed-bytes app", log_path=log_path
    ) as child:
        yield child


def main() -> None:
    body = answer()
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    message = {"type": "http.response.body", "body": body}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send(start)
        await send(message)

    sock = process.listen()
    process.announce(sock)
    process.serve(app, sock, lifespan="off")


if __name__ == "__main__":
    main()
