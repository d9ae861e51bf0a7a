"""A real OpenAI-compatible replica over pooled async HTTP (vLLM, SGLang, TGI, Ollama, OpenAI).

Contract (on top of ``upstream.base``):
- One pooled ``aiohttp.ClientSession`` per replica, opened on first use (inside the event loop);
  connect and read timeouts from ``limits``. aiohttp rather than httpx because this client is on
  every miss and bypass: measured side by side on this machine, a keep-alive request costs
  0.26 ms p50 through aiohttp and 0.55-0.68 ms through httpx (benchmarks/README.md).
- Transport errors are translated here, the aiohttp error kept as ``__cause__``: a timeout ->
  ``UpstreamTimeout`` (504), anything else before an answer -> ``UpstreamUnreachable`` (502), a
  failure while a stream is being read -> ``UpstreamStreamBroken`` (502).
- Request headers are forwarded except hop-by-hop ones and carpool's own controls; an upstream
  ``event: error`` in a stream is yielded as a payload ``{"error": ...}`` so the caller sees one
  shape for every mid-stream error.
- Bodies are never decompressed here: the cached endpoints ask the upstream for ``identity``, and
  pass-through relays the bytes with their ``content-encoding`` as they came.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import aiohttp
import orjson

from ..config import LimitsConfig
from ..errors import UpstreamStreamBroken, UpstreamTimeout, UpstreamUnreachable
from ..sse import SSEDecoder
from .base import PassthroughResponse, UpstreamRequest, UpstreamResponse

# Headers that describe one hop, or that are addressed to carpool itself, are not forwarded.
NOT_FORWARDED = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding", "cache-control",
    "idempotency-key", "x-idempotency-key", "content-type",
})
# Response headers not relayed by pass-through (the ASGI server frames the body itself).
NOT_RELAYED = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})

_TIMEOUTS = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)
# Idle pooled connections are dropped after this many seconds: before the upstream server drops
# them itself (uvicorn, hence vLLM and SGLang, llama.cpp's server and Node do after 5 s). Reusing
# a connection that the server is closing at that very moment makes the request fail with a
# reset (a 502), which a busy gateway, reusing its oldest idle connection first, hit 2-3 times
# in 2,000 requests with aiohttp's default of 15 s.
KEEPALIVE_S = 4.0


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items()
            if name not in NOT_FORWARDED and not name.startswith("x-carpool-")}


class HttpUpstream:
    def __init__(self, base_url: str, limits: LimitsConfig) -> None:
        self.name = base_url
        self.base_url = base_url.rstrip("/")
        self.limits = limits
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.limits.upstream_max_connections,
                                               limit_per_host=0, keepalive_timeout=KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None,
                                              sock_connect=self.limits.upstream_connect_timeout,
                                              sock_read=self.limits.upstream_timeout),
                auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        headers = forwarded_headers(request.headers)
        headers["content-type"] = "application/json"
        headers["accept-encoding"] = "identity"
        response = await self._open("POST", self.base_url + request.path,
                                    orjson.dumps(request.body), headers)
        content_type = response.headers.get("content-type", "")
        if request.stream and 200 <= response.status < 300 and "text/event-stream" in content_type:
            return UpstreamResponse(response.status, {"content-type": content_type},
                                    events=self._events(response), close=_closer(response))
        try:
            body = await response.read()
        except _TIMEOUTS as exc:
            raise UpstreamTimeout(f"upstream {self.name} timed out sending its answer") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"upstream {self.name} failed mid-answer: {exc!r}") from exc
        finally:
            response.release()
        return UpstreamResponse(response.status, {"content-type": content_type}, body=body)

    async def _open(self, method: str, url: str, body: bytes | None,
                    headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        try:
            return await self._client().request(method, url, data=body, headers=headers)
        except _TIMEOUTS as exc:
            raise UpstreamTimeout(f"upstream {self.name} did not answer in time") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"upstream {self.name} is unreachable: {exc!r}") from exc

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        decoder = SSEDecoder()
        try:
            async for data in response.content.iter_any():
                for event, payload in decoder.feed(data):
                    if payload == b"[DONE]":
                        return
                    if event == "error" and not payload.startswith(b'{"error"'):
                        payload = b'{"error":' + payload + b"}"
                    yield payload
        except _TIMEOUTS as exc:
            raise UpstreamStreamBroken(f"upstream {self.name} stalled mid-stream") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamStreamBroken(f"upstream {self.name} stream broke: {exc!r}") from exc
        finally:
            response.close()

    async def passthrough(self, method: str, path: str, query: bytes,
                          headers: Mapping[str, str], body: bytes) -> PassthroughResponse:
        out_headers = forwarded_headers(headers)
        for name in ("content-type", "accept-encoding"):
            if name in headers:
                out_headers[name] = headers[name]
        # Never ask for a compression the client did not: the bytes are relayed raw.
        out_headers.setdefault("accept-encoding", "identity")
        url = self.base_url + path + ("?" + query.decode("latin-1") if query else "")
        response = await self._open(method, url, body or None, out_headers)
        relayed = [(k, v) for k, v in response.raw_headers
                   if k.decode("latin-1").lower() not in NOT_RELAYED]

        async def content() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            finally:
                response.release()
        return PassthroughResponse(response.status, relayed, content())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _closer(response: aiohttp.ClientResponse):
    async def close() -> None:
        response.close()
    return close
