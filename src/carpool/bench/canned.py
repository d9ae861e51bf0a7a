"""The canned engine: an upstream that answers every chat call at once from memory, for measuring
what a gateway adds to a call without an engine in Python taking the same cores.

    python -m carpool.bench.canned '{"tokens": 32}'      # announces its port (process.py)

Why: the simulated engine behind uvicorn (``carpool.bench.upstream``) spends about as much CPU on
a streamed answer as the gateway in front of it (Starlette, and one ASGI send per chunk); on a
2-core machine it saturates first, and a benchmark of the gateway then measures the engine.

Contract:
- ``canned(tokens, log_path)`` (context manager) runs it in a child process and yields its
  ``process.Server``; ``url`` + ``/v1`` is its base URL.
- Every POST is answered 200 with a chat completion of ``tokens`` tokens (the same text each
  time; a fresh ``id``; the request's ``model``; ``finish_reason`` "length", so that the answer
  is complete), without validating anything. A body with ``"stream": true`` is answered as an
  OpenAI stream: a role chunk, one chunk per token, a finish chunk, a usage chunk when
  ``stream_options.include_usage`` asks, ``data: [DONE]``; its first chunk sent alone, the rest
  in one piece right after (an engine with its first token at once and the rest a moment
  later). Any other request is answered 200 ``{}``.
- On uvicorn with uvloop and httptools, access log off (``process.serve``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from . import process
from .upstream import read_body

WORDS = ("the", "cache", "answers", "once", "and", "every", "client", "shares", "it")


@contextlib.contextmanager
def canned(tokens: int = 32, log_path: Path | None = None) -> Iterator[process.Server]:
    with process.server(
        "carpool.bench.canned",
        [json.dumps({"tokens": tokens})],
        name="the canned engine",
        log_path=log_path,
    ) as child:
        yield child


def chunks(tokens: int, model: Any, call: int, usage: bool) -> list[bytes]:
    """The SSE frames of one streamed answer (module contract)."""
    top = {
        "id": f"chatcmpl-canned-{call}",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "system_fingerprint": "canned",
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            **top,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": f" {WORDS[i % len(WORDS)]}"}) for i in range(tokens)]
    out.append(chunk({}, "length"))
    if usage:
        out.append({**top, "choices": [], "usage": _usage(tokens)})
    return [b"data: " + orjson.dumps(item) + b"\n\n" for item in out] + [b"data: [DONE]\n\n"]


def whole(tokens: int, model: Any, call: int) -> bytes:
    """The non-streaming answer (module contract)."""
    text = "".join(f" {WORDS[i % len(WORDS)]}" for i in range(tokens))
    return orjson.dumps(
        {
            "id": f"chatcmpl-canned-{call}",
            "object": "chat.completion",
            "created": 1,
            "model": model,
            "system_fingerprint": "canned",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": _usage(tokens),
        }
    )


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 16, "completion_tokens": tokens, "total_tokens": 16 + tokens}


def main() -> None:
    tokens = int(json.loads(sys.argv[1])["tokens"]) if len(sys.argv) > 1 else 32
    calls = itertools.count(1)
    json_head = [(b"content-type", b"application/json")]
    sse_head = [(b"content-type", b"text/event-stream")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 200, "headers": json_head})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        try:
            asked = orjson.loads(body)
        except orjson.JSONDecodeError:
            asked = {}
        asked = asked if isinstance(asked, dict) else {}
        model, call = asked.get("model"), next(calls)
        if asked.get("stream") is not True:
            await send({"type": "http.response.start", "status": 200, "headers": json_head})
            await send({"type": "http.response.body", "body": whole(tokens, model, call)})
            return
        options = asked.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        first, *rest = chunks(tokens, model, call, usage)
        await send({"type": "http.response.start", "status": 200, "headers": sse_head})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await send({"type": "http.response.body", "body": b"".join(rest)})

    sock = process.listen()
    process.announce(sock)
    process.serve(app, sock, lifespan="off")


if __name__ == "__main__":
    main()
