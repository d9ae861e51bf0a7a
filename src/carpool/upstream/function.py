"""Any async function as an upstream: carpool as a library, without HTTP on either side.

Contract: ``FunctionUpstream(call)`` wraps ``async def call(path: str, body: dict) -> dict``,
where ``path`` is relative to ``/v1`` (``"/chat/completions"``) and the returned dict is the
complete OpenAI-shaped response. The function is never asked to stream (``stream`` and
``stream_options`` are removed from ``body``); streaming clients get the answer as SSE. An
exception it raises, or a result that is no JSON object (an SDK's response object: return its
``model_dump()``), reaches every waiter of the flight as a 502 and is never stored; it is a
failed call of the replica (``upstream_errors``, a 502 in ``carpool_upstream_requests_total``),
which is left out for its back-off as any failing replica is (``routing.replicas``). A call is
bounded by ``limits.upstream_timeout`` (``timeout``, which ``build_gateway`` sets from the
config unless given): past it the function is cancelled and its clients get a 504
(``UpstreamTimeout``), as from an HTTP upstream that never answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from ..errors import PathNotAllowed, UpstreamError, UpstreamTimeout
from .base import (
    PassthroughResponse,
    RequestBody,
    UpstreamRequest,
    UpstreamResponse,
    unstreamed,
)

log = logging.getLogger("carpool.upstream")

Call = Callable[[str, dict[str, Any]], Awaitable[Mapping[str, Any]]]


class FunctionFailed(UpstreamError):
    """The wrapped function raised (its exception is the ``__cause__``, its traceback logged at
    debug) or returned no JSON object: a failed call of the replica (``routing.replicas``),
    logged as its failures are (once per ``routing.log_interval``), a 502 to its clients."""


class FunctionUpstream:
    def __init__(self, call: Call, name: str = "function", timeout: float | None = None) -> None:
        self.call = call
        self.name = name
        self.timeout = timeout  # (None: ``limits.upstream_timeout``, set by ``build_gateway``)

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        body = unstreamed(request.body)
        bound = asyncio.timeout(self.timeout)
        try:
            async with bound:
                result = await self.call(request.path, body)
        except Exception as error:  # (the function's own failure: a failed call of its replica)
            if isinstance(error, TimeoutError) and bound.expired():  # (not one of its own)
                raise UpstreamTimeout(
                    f"upstream {self.name} did not answer within {self.timeout:g} s"
                ) from None
            log.debug("upstream %s raised", self.name, exc_info=error)
            raise FunctionFailed(f"upstream {self.name} raised {type(error).__name__}") from error
        if not isinstance(result, Mapping):
            raise FunctionFailed(
                f"upstream {self.name} returned {type(result).__name__}, not a JSON object"
            )
        try:
            answer = orjson.dumps(result)
        except TypeError as error:  # (a value inside that JSON cannot hold)
            raise FunctionFailed(
                f"upstream {self.name} returned what is not JSON: {error}"
            ) from None
        return UpstreamResponse(200, {"content-type": "application/json"}, body=answer)

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: RequestBody
    ) -> PassthroughResponse:
        # Not a transport failure (which would down the replica): a path it does not serve.
        raise PathNotAllowed(path)

    async def aclose(self) -> None:
        return None
