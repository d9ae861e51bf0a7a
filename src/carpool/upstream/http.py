"""A real OpenAI-compatible replica over pooled async HTTP (vLLM, SGLang, TGI, Ollama, OpenAI).

Contract (on top of ``upstream.base``):
- One pooled ``httpx.AsyncClient`` per replica; connect and read timeouts from ``limits``.
- Transport errors are translated here, the httpx error kept as ``__cause__``: a timeout ->
  ``UpstreamTimeout`` (504), anything else before an answer -> ``UpstreamUnreachable`` (502), a
  failure while a stream is being read -> ``UpstreamStreamBroken`` (502).
- Request headers are forwarded except hop-by-hop ones and carpool's own controls; an upstream
  ``event: error`` in a stream is yielded as a payload ``{"error": ...}`` so the caller sees one
  shape for every mid-stream error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import httpx
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


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items()
            if name not in NOT_FORWARDED and not name.startswith("x-carpool-")}


class HttpUpstream:
    def __init__(self, base_url: str, limits: LimitsConfig) -> None:
        self.name = base_url
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(limits.upstream_timeout, connect=limits.upstream_connect_timeout),
            limits=httpx.Limits(max_connections=limits.upstream_max_connections,
                                max_keepalive_connections=limits.upstream_max_connections),
        )

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        headers = forwarded_headers(request.headers)
        headers["content-type"] = "application/json"
        outgoing = self._client.build_request(
            "POST", self.base_url + request.path, content=orjson.dumps(request.body),
            headers=headers)
        response = await self._open(outgoing)
        content_type = response.headers.get("content-type", "")
        if request.stream and response.is_success and "text/event-stream" in content_type:
            return UpstreamResponse(response.status_code, response.headers,
                                    events=self._events(response), close=response.aclose)
        try:
            body = await response.aread()
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream {self.name} timed out sending its answer") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"upstream {self.name} failed mid-answer: {exc!r}") from exc
        finally:
            await response.aclose()
        return UpstreamResponse(response.status_code, {"content-type": content_type}, body=body)

    async def _open(self, outgoing: httpx.Request) -> httpx.Response:
        try:
            return await self._client.send(outgoing, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream {self.name} did not answer in time") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"upstream {self.name} is unreachable: {exc!r}") from exc

    async def _events(self, response: httpx.Response) -> AsyncIterator[bytes]:
        decoder = SSEDecoder()
        try:
            async for data in response.aiter_bytes():
                for event, payload in decoder.feed(data):
                    if payload == b"[DONE]":
                        return
                    if event == "error" and not payload.startswith(b'{"error"'):
                        payload = b'{"error":' + payload + b"}"
                    yield payload
        except httpx.TimeoutException as exc:
            raise UpstreamStreamBroken(f"upstream {self.name} stalled mid-stream") from exc
        except httpx.HTTPError as exc:
            raise UpstreamStreamBroken(f"upstream {self.name} stream broke: {exc!r}") from exc
        finally:
            await response.aclose()

    async def passthrough(self, method: str, path: str, query: bytes,
                          headers: Mapping[str, str], body: bytes) -> PassthroughResponse:
        out_headers = forwarded_headers(headers)
        for name in ("content-type", "accept-encoding"):
            if name in headers:
                out_headers[name] = headers[name]
        # Never let httpx ask for a compression the client did not: the bytes are relayed raw.
        out_headers.setdefault("accept-encoding", "identity")
        url = self.base_url + path + ("?" + query.decode("latin-1") if query else "")
        response = await self._open(self._client.build_request(
            method, url, content=body or None, headers=out_headers))
        passed = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()
                  if k.lower() not in NOT_FORWARDED or k.lower() == "content-type"]

        async def content() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
        return PassthroughResponse(response.status_code, passed, content())

    async def aclose(self) -> None:
        await self._client.aclose()
