"""The soak benchmark's upstream: an OpenAI-compatible app whose answers and faults are decided by
the request itself, so that the load generator can tell a wrong answer from an expected error.

    python benchmarks/soak_upstream.py --port 9001 --hold-s 4

Everything depends only on ``(tenant, text)``: the tenant is the ``Authorization`` header, the text
the last chat message (or one embeddings input). The load generator imports the same functions:

- ``answer_text(tenant, text)``: the chat answer, which names the tenant and the prompt and ends
  with words derived from a hash of both. A cut answer, another prompt's answer or another
  tenant's answer can never equal it.
- ``vector(tenant, text)``: an 8-float embedding, multiples of 1/256 (exact through JSON).
- ``fault_of(tenant, text)``: ``None`` for most chat prompts; for 5 % of them one of:
  ``"503"`` every call answers 503 (an OpenAI error body, code ``injected``);
  ``"500_once"`` the first call for the prompt answers 500, later calls answer normally;
  ``"timeout"`` nothing at all (not even headers) for ``--hold-s`` seconds (> the gateway's
  ``limits.upstream_timeout``): the gateway answers 504;
  ``"stall"`` a stream sends 2 words, then nothing for ``--hold-s``; a plain answer sends its
  headers and half its body, then nothing;
  ``"cut"`` the same, but the connection is dropped instead of stalling.
  Embeddings have no faults: the gateway merges concurrent inputs into one call, so one faulty
  input would fail every request of its batch.

Normal answers take a few ms (a hash-derived delay; streams a word every 1-3 ms), so that
identical requests overlap and clients that leave do so mid-call.

- ``GET /count``: ``{"calls", "chat", "embeddings", "faults": {kind: calls}, "in_flight"}``.

Served by uvicorn (uvloop, httptools) at log level critical: a deliberate cut is an exception in
the app, which uvicorn would otherwise log each time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import re
from typing import Any

import orjson
from _common import lifespan

CREATED = 1_700_000_000
_WORD = re.compile(r"\s*\S+")
FAULTS = ("503", "500_once", "timeout", "stall", "cut")
# Out of 10,000 chat prompts: 110 "503", 60 "500_once", 110 "timeout", 110 "stall", 110 "cut".
_FAULT_BANDS = ((110, "503"), (170, "500_once"), (280, "timeout"), (390, "stall"), (500, "cut"))


def _hash(tenant: str, text: str, salt: str = "") -> int:
    digest = hashlib.blake2b(f"{salt}\n{tenant}\n{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def fault_of(tenant: str, text: str) -> str | None:
    band = _hash(tenant, text, "fault") % 10_000
    for limit, kind in _FAULT_BANDS:
        if band < limit:
            return kind
    return None


def answer_text(tenant: str, text: str) -> str:
    h = _hash(tenant, text, "answer")
    words = " ".join(f"w{(h >> (5 * i)) & 0x3FF:03x}" for i in range(10))
    return f"[{tenant}] {text} => {words}"


def vector(tenant: str, text: str) -> list[float]:
    h = _hash(tenant, text, "vector")
    return [((h >> (8 * i)) & 0xFF) / 256 for i in range(8)]


def delay_s(tenant: str, text: str) -> float:
    """The answer's delay (plain answers) or the gap between two words (streams)."""
    h = _hash(tenant, text, "delay")
    return (5 + h % 25) / 1000


class _Cut(Exception):
    """Raised on purpose after the response started: uvicorn drops the connection."""


class App:
    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.calls = 0
        self.chat = 0
        self.embeddings = 0
        self.in_flight = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        parts, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        path = scope["path"]
        if path == "/count":
            await _json(
                send,
                200,
                {
                    "calls": self.calls,
                    "chat": self.chat,
                    "embeddings": self.embeddings,
                    "faults": dict(self.faults),
                    "in_flight": self.in_flight,
                },
            )
            return
        tenant = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                tenant = value.decode("latin-1").removeprefix("Bearer ")
        self.calls += 1
        self.in_flight += 1
        try:
            body = orjson.loads(b"".join(parts))
            if path.endswith("/chat/completions"):
                self.chat += 1
                await self._chat(tenant, body, send)
            elif path.endswith("/embeddings"):
                self.embeddings += 1
                await self._embeddings(tenant, body, send)
            else:
                await _json(send, 404, {"error": {"message": "no such path", "type": "invalid"}})
        finally:
            self.in_flight -= 1

    async def _chat(self, tenant: str, body: dict[str, Any], send: Any) -> None:
        prompt = body["messages"][-1]["content"]
        fault = fault_of(tenant, prompt)
        self.seen[(tenant, prompt)] += 1
        if fault is not None:
            self.faults[fault] += 1
        if fault == "503" or (fault == "500_once" and self.seen[(tenant, prompt)] == 1):
            status = 503 if fault == "503" else 500
            await _json(
                send,
                status,
                {
                    "error": {
                        "message": f"soak: injected {status}",
                        "type": "server_error",
                        "code": "injected",
                    }
                },
            )
            return
        if fault == "timeout":
            await asyncio.sleep(self.hold_s)
            return  # the gateway gave up long ago
        text = answer_text(tenant, prompt)
        gap = delay_s(tenant, prompt)
        if body.get("stream"):
            await self._stream(body, text, gap, fault, send)
            return
        await asyncio.sleep(gap)
        answer = orjson.dumps(
            {
                "id": "chatcmpl-soak",
                "object": "chat.completion",
                "created": CREATED,
                "model": body.get("model", "m"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20},
            }
        )
        if fault in ("stall", "cut"):  # the headers and half the body, then nothing
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(answer)).encode()),
                    ],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": answer[: len(answer) // 2],
                    "more_body": True,
                }
            )
            if fault == "cut":
                raise _Cut("cut on purpose")
            await asyncio.sleep(self.hold_s)
            return
        await _json(send, 200, answer)

    async def _stream(
        self, body: dict[str, Any], text: str, gap: float, fault: str | None, send: Any
    ) -> None:
        options = body.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage")
        model = body.get("model", "m")

        def frame(choices: list[dict[str, Any]], with_usage: Any = None) -> bytes:
            chunk: dict[str, Any] = {
                "id": "chatcmpl-soak",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": model,
                "choices": choices,
            }
            if usage:
                chunk["usage"] = with_usage
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        await emit(
            frame(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        )
        for sent, word in enumerate(_WORD.findall(text)):
            if sent == 2 and fault == "cut":
                raise _Cut("cut on purpose")
            if sent == 2 and fault == "stall":
                await asyncio.sleep(self.hold_s)
                return
            await asyncio.sleep(gap / 10)
            await emit(frame([{"index": 0, "delta": {"content": word}, "finish_reason": None}]))
        await emit(frame([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
        if usage:
            await emit(frame([], {"prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20}))
        await emit(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _embeddings(self, tenant: str, body: dict[str, Any], send: Any) -> None:
        items = body["input"] if isinstance(body["input"], list) else [body["input"]]
        await asyncio.sleep(0.005)
        await _json(
            send,
            200,
            {
                "object": "list",
                "model": body.get("model", "e"),
                "data": [
                    {"object": "embedding", "index": i, "embedding": vector(tenant, item)}
                    for i, item in enumerate(items)
                ],
                "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
            },
        )


async def _json(send: Any, status: int, payload: Any) -> None:
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--hold-s",
        type=float,
        default=4.0,
        help="how long a timeout or stall fault holds (> the gateway's timeout)",
    )
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(
        App(args.hold_s),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="critical",
        access_log=False,
        backlog=4096,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
