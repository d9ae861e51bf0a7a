"""Replay a workload against a gateway over HTTP and time every answer.

Contract:
- ``replay(workload, url, arrivals=..., concurrency=...)`` sends every request of the workload
  to ``url`` (the gateway's base URL, without ``/v1``) and returns a ``Run``: one ``Result`` per
  request, in workload order, plus the gateway's ``/stats`` before, during (polled every
  ``poll_s``) and after the run: the whole run's figures where the document has them (``run``:
  every worker's of ``carpool serve --workers N`` summed, whichever worker answers), not the
  answering worker's alone.
- Open loop (``arrivals``: one offset in seconds per request): request i is sent at
  ``start + arrivals[i]`` whether or not earlier ones have been answered, as independent users
  do; the lag between the planned and the actual send is recorded. Closed loop (``concurrency``
  C): C workers each send the next request as soon as their previous one is answered.
- Per request: the send time (seconds from the start), latency to the last byte, time to first
  byte of the body for streams (the first SSE bytes), status, ``x-carpool`` outcome (``-`` spelt
  ``_``: ``semantic_hit``), usage tokens of the answer when it carries them, and an error text for
  a transport failure, a non-2xx status, or a stream that did not end with ``data: [DONE]`` (for
  the Responses and Messages APIs: with the API's last event, ``response.completed`` or
  ``message_stop``) or carried an error event. A failure never stops the run. Usage is
  ``prompt_tokens`` / ``completion_tokens``, or the typed APIs' ``input_tokens`` (with the
  Messages prompt cache's tokens, counted apart, as the gateway's ``tokens_saved`` has them) /
  ``output_tokens`` (of the answer, or of the stream assembled by ``carpool.apis``). A request
  that carries its ``expected`` answer (non-streaming) is marked ``wrong`` when another was served.
  ``storable``: whether the answer is one the gateway stores, judged by its API as the gateway
  judges it (``Api.complete``: a Responses answer that ended ``incomplete`` or ``failed``, a
  message without a stop reason, are not), of a whole answer or an assembled typed stream; None
  when no answer came, and for a chat or completions stream (not assembled here, to keep the
  client cheap: one that ended with ``[DONE]`` is taken as stored). The oracle reads it.
- ``on_result`` is called once per finished request (the progress bar); ``settle``, when given,
  is awaited after the last answer and before the final ``/stats`` read (work the requests left
  running in the background, such as audits, to finish).
- The client is the benchmarks' own (``client.py``: asyncio + httptools, so it costs little next
  to the gateway it measures), with a pool of keep-alive connections and no limit on their number,
  reused as a real client fleet's would be. ``url`` may be https and may have a path prefix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..apis import api_at
from ..apis import messages as messages_api
from ..apis import responses as responses_api
from ..apis.base import tokens
from ..semantic.audit import answer_text
from .client import Address, Pool, build
from .workloads import MESSAGES, RESPONSES, BenchRequest, Workload

DONE = b"data: [DONE]"
TRANSPORT_ERRORS = (OSError, TimeoutError, ValueError)  # ValueError: a response that did not parse


@dataclass(slots=True)
class Result:
    index: int
    stream: bool
    sent: float = 0.0  # seconds from the start of the run
    lag: float = 0.0  # open loop: actual send - planned send
    latency: float | None = None  # seconds to the last byte
    ttfb: float | None = None  # streams: seconds to the first body bytes
    status: int | None = None
    outcome: str | None = None  # hit | semantic_hit | coalesced | miss | bypass
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    wrong: bool | None = None  # the request's ``expected`` answer known: was another served?
    storable: bool | None = None  # the answer is one the gateway stores (module contract)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class Run:
    results: list[Result]
    started_at: float  # wall clock (time.time()) at the start
    duration: float  # seconds from the first send to the last answer
    stats_before: dict[str, Any]
    stats_after: dict[str, Any]
    stats_series: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    sim_before: dict[str, Any] | None = None
    sim_after: dict[str, Any] | None = None


class GatewayUnreachable(RuntimeError):
    """The gateway's /stats did not answer."""


async def get_json(pool: Pool, path: str, headers: dict[str, str] | None = None) -> Any:
    url = f"{pool.address.url}{path}"
    try:
        response = await pool.request(build("GET", path, pool.address, b"", headers), 60.0)
    except TRANSPORT_ERRORS as error:
        raise GatewayUnreachable(f"cannot read {url}: {type(error).__name__}: {error}") from None
    if response.status == 401 and path == "/stats":
        # The gateway guards /stats with its admin token: say how to pass it, not just "401".
        raise GatewayUnreachable(
            f"GET {url}: HTTP 401: "
            + (
                "the gateway refused the admin token given (admin_token): give it its own"
                if headers
                else "the gateway has an admin token, which guards /stats: give carpool bench "
                "the same one, as admin_token in --config or in CARPOOL_ADMIN_TOKEN"
            )
        )
    if response.status != 200:
        raise GatewayUnreachable(f"GET {url}: HTTP {response.status}")
    try:
        return orjson.loads(response.body)
    except orjson.JSONDecodeError:
        raise GatewayUnreachable(f"GET {url}: not JSON") from None


async def _optional_json(pool: Pool, path: str, headers: dict[str, str] | None = None) -> Any:
    try:
        return await get_json(pool, path, headers)
    except GatewayUnreachable:
        return None


async def replay(
    workload: Workload,
    url: str,
    *,
    arrivals: Sequence[float] | None = None,
    concurrency: int | None = None,
    poll_s: float = 0.5,
    on_result: Callable[[Result], None] | None = None,
    request_timeout_s: float = 300.0,
    admin_token: str | None = None,
    settle: Callable[[], Awaitable[None]] | None = None,
) -> Run:
    """``admin_token``: the gateway's, sent with each read of its /stats (and only there: the
    workload's requests carry their own tenants' headers)."""
    if (arrivals is None) == (concurrency is None):
        raise ValueError("give either arrivals (open loop) or concurrency (closed loop)")
    requests = workload.requests
    results = [Result(i, r.stream) for i, r in enumerate(requests)]
    admin = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
    try:
        address = Address.parse(url)
    except ValueError as error:
        raise GatewayUnreachable(str(error)) from None
    pool, control = Pool(address), Pool(address)
    try:
        before = _run_figures(await get_json(control, "/stats", admin))
        sim_before = await _optional_json(control, "/sim/stats", admin)
        start = time.monotonic()
        started_at = time.time()
        series: list[tuple[float, dict[str, Any]]] = [(0.0, before)]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        poller = loop.create_task(_poll(control, start, poll_s, series, stop, admin))

        async def one(i: int) -> None:
            await _send(pool, requests[i], results[i], start, request_timeout_s)
            if on_result is not None:
                on_result(results[i])

        try:
            if arrivals is not None:
                tasks = []
                for i in sorted(range(len(requests)), key=lambda i: (arrivals[i], i)):
                    delay = start + arrivals[i] - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    results[i].lag = max(0.0, time.monotonic() - start - arrivals[i])
                    tasks.append(loop.create_task(one(i)))
                await asyncio.gather(*tasks)
            else:
                assert concurrency is not None
                queue = iter(range(len(requests)))

                async def worker() -> None:
                    for i in queue:
                        await one(i)

                await asyncio.gather(*(worker() for _ in range(concurrency)))
            if settle is not None:  # e.g. background work the requests started, before the end
                await settle()
        finally:
            stop.set()
            await poller
        end = time.monotonic()
        after = _run_figures(await get_json(control, "/stats", admin))
        series.append((end - start, after))
        sim_after = await _optional_json(control, "/sim/stats", admin) if sim_before else None
    finally:
        pool.close()
        control.close()
    first = min((r.sent for r in results), default=0.0)
    return Run(
        results, started_at, end - start - first, before, after, series, sim_before, sim_after
    )


async def _poll(
    control: Pool,
    start: float,
    every: float,
    series: list[tuple[float, dict[str, Any]]],
    stop: asyncio.Event,
    admin: dict[str, str] | None = None,
) -> None:
    while not stop.is_set():
        try:
            async with asyncio.timeout(every):
                await stop.wait()
        except TimeoutError:
            stats = await _optional_json(control, "/stats", admin)
            if stats is not None:
                series.append((time.monotonic() - start, _run_figures(stats)))


def _run_figures(stats: Any) -> Any:
    """A ``/stats`` document with its ``run``'s figures in place of the answering worker's
    (``carpool serve --workers N``: every worker's summed), the rest (its ``pid``...) as it is."""
    run = stats.get("run") if isinstance(stats, dict) else None
    return {**stats, **run} if isinstance(run, dict) else stats


async def _send(
    pool: Pool, request: BenchRequest, result: Result, start: float, timeout: float
) -> None:
    raw = build("POST", request.endpoint, pool.address, request.payload(), request.headers)
    sent = time.monotonic()
    result.sent = sent - start
    try:
        response = await pool.request(raw, timeout)
    except TRANSPORT_ERRORS as error:
        result.latency = time.monotonic() - sent
        result.error = f"{type(error).__name__}: {error}"[:300]
        return
    result.status = response.status
    result.latency = response.at - sent
    outcome = response.carpool
    result.outcome = outcome.replace("-", "_") if outcome else None
    if (response.content_type or "").startswith("text/event-stream"):
        if response.first_at is not None:
            result.ttfb = response.first_at - sent
        if request.endpoint in (RESPONSES, MESSAGES):
            _read_typed_stream(response.body, result, request.endpoint)
        else:
            _read_stream(response.body, result)
    else:
        _read_body(response.body, result, request)


def _usage(result: Result, usage: Any) -> None:
    if isinstance(usage, dict):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if prompt is None and completion is None:  # the Responses / Messages APIs
            prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
            # Messages counts its prompt cache's tokens apart; the gateway's tokens_saved has
            # them in the prompt, so the split of it (report.gpu_seconds_saved) must too.
            if isinstance(prompt, int):
                prompt += tokens(usage, *messages_api.MessagesApi.prompt_apart)
        result.prompt_tokens = prompt if isinstance(prompt, int) else None
        result.completion_tokens = completion if isinstance(completion, int) else 0


def _read_body(raw: bytes, result: Result, request: BenchRequest) -> None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if result.status is None or not 200 <= result.status < 300:
        message = body.get("error") if isinstance(body, dict) else None
        if isinstance(message, dict):
            message = message.get("message")
        result.error = f"HTTP {result.status}: {message or raw[:200]!r}"[:300]
        return
    if isinstance(body, dict):
        _usage(result, body.get("usage"))
        if request.expected is not None:
            result.wrong = answer_text(body) != request.expected
        api = api_at(request.endpoint)
        if api is not None:  # (always: a workload's endpoints are the cached APIs')
            result.storable = api.complete(body, request.body)
    else:
        result.error = "the answer is not a JSON object"


def _read_stream(raw: bytes, result: Result) -> None:
    if result.status is None or not 200 <= result.status < 300:
        result.error = f"HTTP {result.status}: {raw[:200]!r}"
        return
    frames = [f.strip() for f in raw.split(b"\n\n") if f.strip()]
    if not frames or frames[-1] != DONE:
        result.error = "the stream did not end with data: [DONE]"
    usage_seen = False
    for payload in reversed(frames):
        if not payload.startswith(b"data: {") or (
            b'"error"' not in payload and (usage_seen or b'"usage"' not in payload)
        ):
            continue
        try:
            chunk = orjson.loads(payload[6:])
        except orjson.JSONDecodeError:
            result.error = "a stream chunk is not valid JSON"
            continue
        if chunk.get("error") is not None:  # (``"error": null`` is no error: as the gateway)
            result.error = f"error event: {orjson.dumps(chunk['error'])[:200].decode()}"
        elif chunk.get("usage") and not usage_seen:
            _usage(result, chunk["usage"])
            usage_seen = True


def _read_typed_stream(raw: bytes, result: Result, endpoint: str) -> None:
    """A Responses / Messages stream: typed events, no [DONE], ended by the API's last event."""
    if result.status is None or not 200 <= result.status < 300:
        result.error = f"HTTP {result.status}: {raw[:200]!r}"
        return
    events = []
    for frame in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in frame.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            continue
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            result.error = "a stream event is not valid JSON"
            return
        if isinstance(event, dict):
            events.append(event)
    if any(event.get("type") == "error" for event in events):
        error = next(event for event in events if event.get("type") == "error")
        result.error = f"error event: {orjson.dumps(error.get('error'))[:200].decode()}"
        return
    last = (
        responses_api.LAST_EVENTS if endpoint == RESPONSES else frozenset({messages_api.LAST_EVENT})
    )
    if not events or events[-1].get("type") not in last:
        result.error = f"the stream did not end with {' or '.join(sorted(last))}"
        return
    api = responses_api if endpoint == RESPONSES else messages_api
    assembled = api.assemble(events)
    _usage(result, assembled.get("usage"))
    judge = api_at(endpoint)
    if judge is not None:
        result.storable = judge.complete(assembled)
