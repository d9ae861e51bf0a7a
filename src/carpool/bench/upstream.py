"""The benchmarks' upstream: the simulated engine (``carpool.upstream.sim_server``) in a process of
its own, with the controls a benchmark needs in front of it.

    python -m carpool.bench.upstream '<options as JSON>'      # announces its port (process.py)

Contract:
- ``upstream(options, log_path)`` (context manager) starts it and yields an ``Upstream``: ``port``,
  ``pid``, ``url`` (the base URL, ending in ``/v1``) and its controls ``count()``, ``reset()``,
  ``release()``.
- ``Options``: ``sim`` (the engine's ``SimConfig``; by default ``ZERO_COST``: no prefill, no
  decode, no queue, so that it stands for an engine that answers at once), ``hold``,
  ``tenant_answers``, ``faults`` (shares by kind, ``faults.FaultPlan``), ``hold_s`` (how long a
  timeout or stall fault holds), ``log_level``, and ``by_meaning``: catalog questions answered
  by meaning and a labeled judge in front of the engine (``meanings.MeaningAnswers``).
- In front of the engine (``Controls``, plain ASGI):
  * every POST under ``/v1/`` is a call, counted by endpoint, with the calls in flight;
  * ``hold``: a call waits until ``POST /bench/release`` (at most 30 s) before the engine sees
    it; ``POST /bench/reset`` zeroes the counters and holds again;
  * ``answered_at``: ``time.monotonic()`` when the last chat answer started to be sent;
  * ``tenant_answers``: the tenant (the ``Authorization`` token, without ``Bearer``) joins the
    model name the engine sees (``tenant_model``), so two tenants asking the same text get
    different answers and vectors, and one served to the other shows;
  * ``faults``: chat calls whose ``(tenant, last message)`` draws a fault get it (``faults.py``);
  * ``GET /bench/count``: ``{"calls", "chat", "embeddings", "faults": {kind: calls},
    "in_flight", "answered_at"}``.
  Everything else is the engine's own (``/v1/models``, ``/sim/stats``, 404s).
- ``expected(path, body, tenant, options)``: what this upstream's engine answers to ``body`` from
  ``tenant`` (a whole answer: ``bodies.simulated``), for a benchmark that checks its answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config import SimConfig
from ..upstream.sim import SimReply
from . import process
from .bodies import simulated
from .client import fetch
from .faults import FaultPlan, send_json

ZERO_COST = SimConfig(
    prefill_ms_per_token=0,
    decode_ms_per_token=0,
    max_concurrency=65_536,
    embedding_call_ms=0,
    embedding_concurrency=65_536,
)
HOLD_LIMIT_S = 30.0


@dataclass
class Options:
    sim: SimConfig = field(default_factory=lambda: ZERO_COST.model_copy())
    hold: bool = False
    tenant_answers: bool = False
    faults: dict[str, float] = field(default_factory=dict)
    hold_s: float = 4.0
    log_level: str = "warning"
    by_meaning: bool = False

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "sim": self.sim.model_dump(mode="json")})

    @classmethod
    def from_json(cls, text: str) -> Options:
        data = json.loads(text)
        return cls(**{**data, "sim": SimConfig.model_validate(data["sim"])})


def tenant_model(model: Any, tenant: str) -> str:
    return f"{model}@{tenant}"


def expected(path: str, body: Mapping[str, Any], tenant: str, options: Options) -> SimReply:
    if options.tenant_answers:
        body = {**body, "model": tenant_model(body.get("model"), tenant)}
    return simulated(path, body, options.sim)


@dataclass(frozen=True)
class Upstream:
    server: process.Server

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def pid(self) -> int:
        return self.server.pid

    @property
    def url(self) -> str:
        return self.server.url + "/v1"

    def _control(self, method: str, name: str) -> Any:
        status, _, body = fetch(method, f"{self.server.url}/bench/{name}")
        if status != 200:
            raise RuntimeError(f"{method} /bench/{name}: HTTP {status}")
        return json.loads(body)

    def count(self) -> dict[str, Any]:
        result: dict[str, Any] = self._control("GET", "count")
        return result

    def reset(self) -> None:
        self._control("POST", "reset")

    def release(self) -> None:
        self._control("POST", "release")


@contextlib.contextmanager
def upstream(options: Options | None = None, log_path: Path | None = None) -> Iterator[Upstream]:
    options = options or Options()
    with process.server(
        "carpool.bench.upstream",
        [options.to_json()],
        name="the benchmark upstream",
        health="/bench/count",
        log_path=log_path,
    ) as child:
        yield Upstream(child)


# ---------------------------------------------------------------------------------- the child


class Controls:
    """The controls in front of the engine's app (module docstring)."""

    def __init__(self, app: ASGIApp, options: Options) -> None:
        self.app, self.options = app, options
        self.faults = FaultPlan(options.faults) if options.faults else None
        self.reset()

    def reset(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.fault_calls: collections.Counter[str] = collections.Counter()
        self.in_flight = 0
        self.answered_at: float | None = None
        self.released: asyncio.Event | None = None
        if self.faults is not None:
            self.faults.seen.clear()

    def _released(self) -> asyncio.Event:
        if self.released is None:
            self.released = asyncio.Event()
        return self.released

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif path.startswith("/bench/"):
            await self._control(path[len("/bench/") :], send)
        elif scope["method"] == "POST" and path.startswith("/v1/"):
            self.calls[path[len("/v1/") :]] += 1
            self.in_flight += 1
            try:
                await self._call(scope, receive, send)
            finally:
                self.in_flight -= 1
        else:
            await self.app(scope, receive, send)

    async def _call(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(receive)
        if self.options.hold:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLD_LIMIT_S):
                    await self._released().wait()
        tenant = _tenant(scope)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict) and self.options.tenant_answers:
            body["model"] = tenant_model(body.get("model"), tenant)
            raw = orjson.dumps(body)
        chat = scope["path"].endswith("/chat/completions")
        if chat:
            send = self._stamping(send)
        replay = replaying(raw, receive)
        messages = body.get("messages") if isinstance(body, dict) else None
        if chat and self.faults is not None and isinstance(messages, list) and messages:
            text = str(messages[-1].get("content") if isinstance(messages[-1], dict) else "")
            fault = self.faults.fault_of(tenant, text)
            if fault is not None:
                self.fault_calls[fault] += 1
                await self.faults.inject(
                    fault, (tenant, text), scope, replay, send, self.app, self.options.hold_s
                )
                return
        await self.app(scope, replay, send)

    def _stamping(self, send: Send) -> Send:
        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.answered_at = time.monotonic()
            await send(message)

        return stamped

    async def _control(self, name: str, send: Send) -> None:
        if name == "count":
            await send_json(
                send,
                200,
                {
                    "calls": sum(self.calls.values()),
                    "chat": self.calls["chat/completions"],
                    "embeddings": self.calls["embeddings"],
                    "faults": dict(self.fault_calls),
                    "in_flight": self.in_flight,
                    "answered_at": self.answered_at,
                },
            )
            return
        if name == "release":
            self._released().set()
        elif name == "reset":
            self.reset()
        else:
            await send_json(send, 404, {"error": {"message": f"no control {name!r}"}})
            return
        await send_json(send, 200, {})


async def read_body(receive: Receive) -> bytes:
    """The whole request body (what came before a disconnect, if one came first)."""
    parts, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


def replaying(raw: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``raw`` as the whole body, then waits as the real one does."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


def _tenant(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1").removeprefix("Bearer "))
    return ""


def main() -> None:
    from ..upstream.sim import SimReplica
    from ..upstream.sim_server import create_app
    from .meanings import MeaningAnswers

    options = Options.from_json(sys.argv[1])
    engine = create_app(SimReplica("bench-upstream", options.sim))
    app = Controls(MeaningAnswers(engine) if options.by_meaning else engine, options)
    sock = process.listen()
    process.announce(sock)
    process.serve(app, sock, options.log_level, lifespan="auto")


if __name__ == "__main__":
    main()
