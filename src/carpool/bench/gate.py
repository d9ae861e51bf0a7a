"""An in-process upstream that holds its calls at a gate, for benchmarks that call the gateway as a
library (``Gateway.request``): the simulated engine (``SimUpstream``, at no cost by default)
behind an ``asyncio.Event``.

Contract:
- ``Gated(sim)`` serves the ``Upstream`` protocol. ``gate``: None (the default) lets a call
  through at once; an ``asyncio.Event`` holds every call until it is set. ``calls`` counts the
  calls and ``chunks`` the stream payloads that left the engine; ``answered_at`` is the
  ``time.perf_counter()`` at which the last whole answer was returned, or the last stream's first
  chunk left the engine.
- Passthrough calls go to the engine as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping

from ..config import SimConfig
from ..upstream.base import PassthroughResponse, RequestBody, UpstreamRequest, UpstreamResponse
from ..upstream.sim import SimReplica, SimUpstream


class Gated:
    name = "gated"

    def __init__(self, sim: SimConfig | None = None) -> None:
        from .upstream import ZERO_COST

        self.engine = SimUpstream(SimReplica("gated", sim or ZERO_COST))
        self.gate: asyncio.Event | None = None
        self.calls = 0
        self.chunks = 0
        self.answered_at = 0.0

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        response = await self.engine.send(request)
        if not response.streaming:
            self.answered_at = time.perf_counter()
            return response
        return UpstreamResponse(
            response.status, response.headers, events=self._stamped(response), close=response.aclose
        )

    async def _stamped(self, response: UpstreamResponse) -> AsyncIterator[list[bytes]]:
        first = True
        async for payloads in response.events():
            self.chunks += len(payloads)
            if first:
                self.answered_at = time.perf_counter()
                first = False
            yield payloads

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: RequestBody
    ) -> PassthroughResponse:
        return await self.engine.passthrough(method, path, query, headers, body)

    async def aclose(self) -> None:
        await self.engine.aclose()
