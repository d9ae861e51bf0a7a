"""The raw ASGI limit: an app that answers every request with the same fixed bytes.

    python benchmarks/peers/raw_asgi.py --port 9002

No framework, no routing, no counting, no body parsing: the app sends one fixed chat completion
(the same bytes the benchmark upstream and the gateway's hits return, so every target answers
the same payload), on uvicorn + uvloop + httptools with the access log off. It is the ceiling
any Python ASGI server on this stack can reach on this machine; the peers benchmark reports the
gateway's exact-hit throughput as a share of it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import ANSWER  # noqa: E402

START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(ANSWER)).encode()),
    ],
}
BODY = {"type": "http.response.body", "body": ANSWER}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send(START)
    await send(BODY)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
        lifespan="off",
    )


if __name__ == "__main__":
    main()
