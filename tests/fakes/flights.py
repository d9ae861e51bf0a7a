"""Getting several clients onto one flight through the gateway, over HTTP, without sleeping."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from .waiting import eventually

CHAT = "/v1/chat/completions"


def flight_clients(served: Any) -> int:
    """Clients on the gateway's flights right now."""
    return sum(f.clients for f in served.gateway.flights.running())


async def stream(served: Any, path: str, body: dict[str, Any]) -> tuple[httpx.Response, str]:
    """``body`` as a streaming request read to its end: (response, raw SSE text)."""
    async with served.client.stream("POST", path, json={**body, "stream": True}) as response:
        return response, (await response.aread()).decode()


async def leader_and_joiners(
    served: Any, fake: Any, path: str, body: dict[str, Any], *, leader_streams: bool = True
) -> tuple[tuple[httpx.Response, str] | httpx.Response, tuple[httpx.Response, str], httpx.Response]:
    """A leader (streaming or not), then a streaming and a non-streaming joiner of its flight,
    all read to the end. The fake upstream holds its stream after ``chunk_gate_after`` chunks
    until the three clients are in the flight."""
    fake.chunk_gate = asyncio.Event()
    leader = asyncio.create_task(
        stream(served, path, body) if leader_streams else served.client.post(path, json=body)
    )
    await fake.chunk_gate_reached.wait()
    streaming = asyncio.create_task(stream(served, path, body))
    plain = asyncio.create_task(served.client.post(path, json=body))
    await eventually(lambda: flight_clients(served) == 3, what="three clients in the flight")
    fake.chunk_gate.set()
    results = await asyncio.gather(leader, streaming, plain)
    fake.chunk_gate = None
    return results[0], results[1], results[2]
