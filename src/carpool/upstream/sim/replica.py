"""One simulated engine replica and its cost model.

Contract:
- Cost model, per replica: at most ``max_concurrency`` requests are served at once, the rest queue
  (FIFO, via an asyncio.Semaphore). A served request first pays prefill,
  ``prefill_ms_per_token`` for each prompt token not in the replica's prefix cache
  (``prefix_cache.py``), then decode, ``decode_ms_per_token`` per token step (the n choices of a
  request decode together, one step per token, as a batch does). Streams sleep before every token
  step, so chunks are spread over time; whole answers sleep once. Time to first token = queue
  wait + prefill + one decode step. Embeddings: one forward pass per call (at most
  ``embedding_concurrency`` at once), ``embedding_call_ms`` plus prefill of the longest item.
- The Responses and Messages APIs' typed event streams are paced as the chat stream they come
  from (``sim_apis.py``).
- Counters (``SimReplica.stats()``): calls by endpoint (every call it answers: ``models`` its
  list and cards, ``other`` a path it does not serve), errors, prompt / cached prompt / completion
  tokens (a whole answer abandoned mid-decode counts the steps it decoded, as a stream does),
  busy seconds (each request's time holding its slot, summed: slot-seconds, past wall time
  when requests overlap) and queue-wait seconds and the requests waiting (embeddings
  included), time-to-first-token sum and count (generation requests only). In flight now and
  at most are counted apart:
  ``in_flight`` / ``max_in_flight`` are generation requests holding one of ``max_concurrency``
  slots (never more), ``embedding_in_flight`` / ``max_embedding_in_flight`` embeddings calls in
  one of ``embedding_concurrency`` passes (never more).
- What one request may ask is bounded, a 400 naming the limit past it (generation: ``plan.py``).
  Embeddings: at most ``MAX_INPUTS`` (2048) inputs, as OpenAI, ``dimensions`` at most
  ``MAX_DIMENSIONS`` (4096), and at most ``MAX_EMBEDDING_VALUES`` numbers in all (inputs x
  dimensions: 2048 x 512), so a small body never makes an answer of hundreds of MB. The vectors
  are computed an item at a time, handing the event loop back between items (``asyncio.sleep(0)``,
  not a worker thread: ``plan.py`` says why): one vector takes about 2 ms at 4096 dimensions.
  A stream hands the loop back every ``MAX_CHOICES`` chunks of a decode step too: a step of
  many choices is thousands of chunks, each one the gateway's to fan out before the next.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any

from carpool.config import SimConfig
from carpool.errors import RequestError
from carpool.upstream import sim_apis
from carpool.upstream.sim.bodies import completion_body, opening_chunks, step_chunks, usage_chunk
from carpool.upstream.sim.plan import (
    MAX_CHOICES,
    MAX_INPUTS,
    Plan,
    int_field,
    make_plan,
    parse_inputs,
)
from carpool.upstream.sim.prefix_cache import PrefixCache
from carpool.upstream.sim.replies import (
    ENDPOINTS,
    MODEL_ID,
    SimReply,
    error_reply,
    not_found_reply,
    strip_v1,
)
from carpool.upstream.sim.text import as_base64, embedding_vector, input_tokens

Sleep = Callable[[float], Awaitable[Any]]

# What one embeddings call may ask (module contract): ``dimensions`` up to the largest of
# OpenAI's models and a little more, and about 20 MB of JSON in all.
MAX_DIMENSIONS = 4096
MAX_EMBEDDING_VALUES = 2048 * 512


class SimReplica:
    """One simulated engine replica: its own prefix cache, concurrency limit and counters."""

    def __init__(
        self,
        name: str,
        config: SimConfig | None = None,
        *,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.config = config or SimConfig()
        self.prefix_cache = PrefixCache(self.config.prefix_cache_tokens, self.config.block_tokens)
        self._slots = asyncio.Semaphore(self.config.max_concurrency)
        self._embedding_passes = asyncio.Semaphore(self.config.embedding_concurrency)
        self._sleep = sleep  # injectable so tests can observe the pacing without wall clocks
        self._clock = clock
        self.calls: dict[str, int] = {}
        self.errors = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.completion_tokens = 0
        self.busy_seconds = 0.0
        self.queue_wait_seconds = 0.0
        self.ttft_seconds_sum = 0.0
        self.ttft_count = 0
        self.waiting = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.embedding_in_flight = 0
        self.max_embedding_in_flight = 0

    # -- entry points

    async def handle(
        self, path: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> SimReply:
        """Serve a POST to ``path`` (relative to /v1), with the request's ``headers`` (lower-case
        names; Messages reads ``anthropic-version``). Streams come back unstarted: the slot is
        taken when the consumer starts iterating, and released when it stops."""
        path = strip_v1(path)
        if path not in ENDPOINTS:
            return not_found_reply("POST", path)
        self.counted(path.lstrip("/"))
        try:
            if not isinstance(body, Mapping):
                raise RequestError("the request body must be a JSON object")
            if path == "/embeddings":
                return await self._embeddings(body)
            if path == sim_apis.MESSAGES:
                sim_apis.check_anthropic_version(body, headers or {})
            if path in sim_apis.TYPED:
                plan = await make_plan(
                    "/chat/completions",
                    sim_apis.to_chat(path, body),
                    self.config.default_max_tokens,
                )
            else:
                plan = await make_plan(path, body, self.config.default_max_tokens)
        except RequestError as exc:
            self.errors += 1
            if path == sim_apis.MESSAGES:
                return SimReply(
                    400,
                    {
                        "type": "error",
                        "error": {"type": "invalid_request_error", "message": exc.message},
                    },
                )
            return error_reply(400, exc.message, param=exc.param, code=exc.code)
        if path in sim_apis.TYPED:
            if plan.stream:
                return SimReply(
                    200, chunks=self._typed_stream(path, plan, self._clock()), typed=True
                )
            return SimReply(
                200,
                sim_apis.from_chat(
                    path,
                    await self._complete(plan),
                    plan.id,
                    plan.created,
                    plan.sequences[0].stop_sequence,
                ),
            )
        if plan.stream:
            return SimReply(200, chunks=self._stream(plan, self._clock()))
        return SimReply(200, await self._complete(plan))

    def models(self) -> dict[str, Any]:
        self.counted("models")
        return {"object": "list", "data": [self.model_card(MODEL_ID)]}

    def counted(self, call: str, error: bool = False) -> None:
        """A call the engine answered, by what it called (``handle``'s, and those answered
        outside it, by ``sim_server`` or the embedded ``SimUpstream``: a model's card, a body
        that is not JSON, a path it does not serve as ``other``): every call the engine answers
        is in ``calls``, as the gateway's ``upstream_calls`` counts it; a refusal in
        ``errors``."""
        self.calls[call] = self.calls.get(call, 0) + 1
        self.errors += error

    def model_card(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "carpool-sim"}

    def stats(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "simulated": True,
            "calls": dict(self.calls),
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "busy_seconds": self.busy_seconds,
            "queue_wait_seconds": self.queue_wait_seconds,
            "ttft_seconds_sum": self.ttft_seconds_sum,
            "ttft_count": self.ttft_count,
            "ttft_seconds_mean": (
                self.ttft_seconds_sum / self.ttft_count if self.ttft_count else None
            ),
            "waiting": self.waiting,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "max_concurrency": self.config.max_concurrency,
            "embedding_in_flight": self.embedding_in_flight,
            "max_embedding_in_flight": self.max_embedding_in_flight,
            "embedding_concurrency": self.config.embedding_concurrency,
            "prefix_cache_blocks": len(self.prefix_cache),
            "prefix_cache_capacity_blocks": self.prefix_cache.capacity_blocks,
        }

    # -- the cost model

    @asynccontextmanager
    async def _slot(self, arrived: float, embeddings: bool = False) -> AsyncIterator[None]:
        """Hold one of ``max_concurrency`` slots (``embeddings``: of ``embedding_concurrency``
        passes); the time spent waiting for it is queue wait."""
        slots = self._embedding_passes if embeddings else self._slots
        self.waiting += 1
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        started = self._clock()
        self.queue_wait_seconds += started - arrived
        if embeddings:
            self.embedding_in_flight += 1
            self.max_embedding_in_flight = max(
                self.max_embedding_in_flight, self.embedding_in_flight
            )
        else:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
            if embeddings:
                self.embedding_in_flight -= 1
            else:
                self.in_flight -= 1
            self.busy_seconds += self._clock() - started
            slots.release()

    async def _prefill(self, prompts: list[list[str]]) -> int:
        """Sleep for the prompt tokens not in the prefix cache, then cache them; returns hits."""
        cached = 0
        block_ids = []
        for tokens in prompts:
            ids = self.prefix_cache.block_ids(tokens)
            cached += self.prefix_cache.cached_tokens(ids, len(tokens))
            block_ids.append(ids)
        total = sum(len(t) for t in prompts)
        self.prompt_tokens += total
        self.cached_prompt_tokens += cached
        await self._sleep((total - cached) * self.config.prefill_ms_per_token / 1000)
        for ids in block_ids:
            self.prefix_cache.touch(ids)
        return cached

    def _first_token(self, arrived: float, still_to_come: float = 0.0) -> None:
        """Record time to first token: queue wait + prefill + the first decode step."""
        self.ttft_seconds_sum += self._clock() - arrived + still_to_come
        self.ttft_count += 1

    async def _complete(self, plan: Plan) -> dict[str, Any]:
        arrived = self._clock()
        async with self._slot(arrived):
            plan.cached_tokens = await self._prefill(plan.prompts)
            step_seconds = self.config.decode_ms_per_token / 1000
            # A whole answer decodes in one sleep; its first token would have come one step in.
            self._first_token(arrived, still_to_come=step_seconds)
            decode_started = self._clock()
            try:
                await self._sleep(plan.decode_steps * step_seconds)
            except asyncio.CancelledError:
                # Its client left part-way: the tokens decoded so far count, as a stream's do.
                elapsed = self._clock() - decode_started
                steps = int(elapsed / step_seconds) if step_seconds > 0 else plan.decode_steps
                self.completion_tokens += sum(min(steps, len(s.words)) for s in plan.sequences)
                raise
            self.completion_tokens += plan.completion_tokens
        return completion_body(plan)

    async def _stream(self, plan: Plan, arrived: float) -> AsyncIterator[dict[str, Any]]:
        async with self._slot(arrived):
            plan.cached_tokens = await self._prefill(plan.prompts)
            for chunk in opening_chunks(plan):
                yield chunk
            decode_started = self._clock()
            for step in range(plan.decode_steps):
                # Sleep to a deadline, not a fixed interval, so a slow consumer does not stretch
                # the engine's pace (nor does timer slack accumulate).
                deadline = decode_started + (step + 1) * self.config.decode_ms_per_token / 1000
                await self._sleep(max(0.0, deadline - self._clock()))
                if step == 0:
                    self._first_token(arrived)
                # Count as decoded, so a stream cut short still counts the tokens it produced.
                self.completion_tokens += sum(step < len(seq.words) for seq in plan.sequences)
                for sent, chunk in enumerate(step_chunks(plan, step), 1):
                    yield chunk
                    if sent % MAX_CHOICES == 0:  # (a step of many choices: module contract)
                        await asyncio.sleep(0)
            if plan.include_usage:
                yield usage_chunk(plan)

    async def _typed_stream(
        self, api: str, plan: Plan, arrived: float
    ) -> AsyncIterator[dict[str, Any]]:
        """The API's typed events, paced as the chat stream they come from: the opening events
        once prefill is done, one text delta per decoded token, the closing events at the end."""
        plan.include_usage = False
        numbers = 0
        closing: list[dict[str, Any]] = []
        delta: dict[str, Any] | None = None

        def numbered(event: dict[str, Any]) -> dict[str, Any]:
            nonlocal numbers
            if "sequence_number" in event:
                event = {**event, "sequence_number": numbers}
                numbers += 1
            return event

        async with aclosing(self._stream(plan, arrived)) as chunks:  # type: ignore[type-var]  # (an async generator: it has aclose)
            async for chunk in chunks:
                piece = chunk["choices"][0]["delta"].get("content")
                if "role" in chunk["choices"][0]["delta"]:
                    # Prefill is done: the text and usage are known, so is the whole answer.
                    final = sim_apis.from_chat(
                        api,
                        completion_body(plan),
                        plan.id,
                        plan.created,
                        plan.sequences[0].stop_sequence,
                    )
                    events = sim_apis.events(api, final)
                    at = next(
                        (i for i, e in enumerate(events) if sim_apis.is_text_delta(e)), len(events)
                    )
                    delta, closing = (events[at] if at < len(events) else None), events[at + 1 :]
                    for event in events[:at]:
                        yield numbered(event)
                elif piece and delta is not None:
                    yield numbered(sim_apis.with_piece(delta, piece))
        for event in closing:
            yield numbered(event)

    async def _embeddings(self, body: Mapping[str, Any]) -> SimReply:
        if "input" not in body:
            raise RequestError("'input' is required", param="input")
        items = parse_inputs(body["input"], "input", allow_empty_text=False)
        int_field(body, "dimensions", 1, MAX_DIMENSIONS)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise RequestError(
                "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
            )
        dim = body.get("dimensions") or self.config.embedding_dim
        if len(items) * dim > MAX_EMBEDDING_VALUES:
            raise RequestError(
                f"an embeddings call may return at most {MAX_EMBEDDING_VALUES} numbers in all "
                f"({MAX_INPUTS} inputs of {MAX_EMBEDDING_VALUES // MAX_INPUTS} dimensions): "
                f"{len(items)} inputs x {dim} dimensions is more",
                param="dimensions" if body.get("dimensions") else "input",
            )
        lengths = [len(input_tokens(item)) for item in items]
        tokens = sum(lengths)
        arrived = self._clock()
        async with self._slot(arrived, embeddings=True):
            # One forward pass computes every item of a call together (padded to the longest),
            # as an embedding server on a GPU does: a fixed cost per pass, then the longest item.
            # So a batch of items costs about what one item does: what makes batching pay.
            self.prompt_tokens += tokens
            await self._sleep(
                (self.config.embedding_call_ms + max(lengths) * self.config.prefill_ms_per_token)
                / 1000
            )
        model = body.get("model") if isinstance(body.get("model"), str) else MODEL_ID
        data = []
        for i, item in enumerate(items):
            if i:
                await asyncio.sleep(0)  # (module contract: the loop is handed back between items)
            vector = embedding_vector(model, item, dim)
            data.append(
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": as_base64(vector) if encoding == "base64" else vector,
                }
            )
        return SimReply(
            200,
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )


def build_replicas(config: SimConfig) -> list[SimReplica]:
    return [SimReplica(f"sim-{i}", config) for i in range(config.replicas)]
