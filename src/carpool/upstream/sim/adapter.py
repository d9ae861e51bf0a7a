"""The simulated engine in process: one ``SimReplica`` behind the ``Upstream`` protocol.

Contract:
- ``SimUpstream`` serves one replica through the ``Upstream`` protocol without sockets. A consumer
  that cancels or closes a stream frees the replica's slot at once (slots are held in try/finally).
  Its stream has no ``[DONE]`` to send: the iterator ending normally is the in-process ``[DONE]``
  (``upstream.base``), and it ends so only after every choice's finish chunk (and the usage chunk).
  Over HTTP (``sim_server.py``) every stream ends with ``data: [DONE]``.
- Every response carries ``x-carpool-simulated: true``; ``GET /models`` and ``/models/{id}`` are
  answered, any other passthrough is a 404 (``replies.not_found_reply``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

import orjson

from carpool.config import SimConfig
from carpool.upstream.base import (
    PassthroughResponse,
    RequestBody,
    UpstreamRequest,
    UpstreamResponse,
)
from carpool.upstream.sim.replica import SimReplica, build_replicas
from carpool.upstream.sim.replies import JSON_HEADERS, not_found_reply, strip_v1


async def _payloads(chunks: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[list[bytes], None]:
    """Chunk objects as SSE payload bytes, one at a time (``upstream.base``). Closing this closes the replica's stream at once (an
    outer generator does not close the one it iterates), which frees the replica's slot."""
    async with aclosing(chunks):  # type: ignore[type-var]  # (an async generator: it has aclose)
        async for chunk in chunks:
            yield [orjson.dumps(chunk)]


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


class SimUpstream:
    """The ``Upstream`` protocol served by one in-process ``SimReplica``: no sockets."""

    def __init__(self, replica: SimReplica) -> None:
        self.replica = replica
        self.name = replica.name

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        body: Any = request.body
        if isinstance(body, Mapping):
            # The request's flag decides, so the response is a stream exactly when asked for one.
            body = {**body, "stream": request.stream}
        reply = await self.replica.handle(request.path, body, request.headers)
        if reply.chunks is not None:
            events = _payloads(reply.chunks)
            return UpstreamResponse(
                reply.status,
                JSON_HEADERS | {"content-type": "text/event-stream"},
                events=events,
                close=events.aclose,
            )
        return UpstreamResponse(reply.status, JSON_HEADERS, body=orjson.dumps(reply.body))

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: RequestBody
    ) -> PassthroughResponse:
        path = strip_v1(path.split("?", 1)[0])
        payload: Any
        if method.upper() == "GET" and path == "/models":
            status, payload = 200, self.replica.models()
        elif method.upper() == "GET" and path.startswith("/models/"):
            self.replica.counted("models")  # (as ``sim_server`` counts what it answers)
            status, payload = 200, self.replica.model_card(path[len("/models/") :])
        else:
            self.replica.counted("other", error=True)
            reply = not_found_reply(method.upper(), path)
            status, payload = reply.status, reply.body
        content = orjson.dumps(payload)
        raw_headers = [(k.encode(), v.encode()) for k, v in JSON_HEADERS.items()]
        raw_headers.append((b"content-length", str(len(content)).encode()))
        return PassthroughResponse(status, raw_headers, _once(content))

    async def aclose(self) -> None:
        """Nothing to release: there is no connection pool."""


def build_upstreams(config: SimConfig) -> list[SimUpstream]:
    return [SimUpstream(replica) for replica in build_replicas(config)]
