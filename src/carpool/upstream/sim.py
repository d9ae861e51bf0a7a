"""The simulated engine: an OpenAI-compatible "model" with a realistic cost model, for demos,
tests and benchmarks. It is labelled as a simulator wherever it appears: ``system_fingerprint:
"carpool-sim"`` in bodies, ``x-carpool-simulated: true`` in headers, ``"simulated": true`` in stats.

Contract:
- Endpoints (paths relative to ``/v1``): ``/chat/completions``, ``/completions``, ``/embeddings``
  (POST) and ``/models`` (GET). Bodies and streamed chunks have OpenAI's shapes; any model name is
  accepted and echoed. An invalid body is a 400 and an unknown path a 404, both in OpenAI's error
  shape ``{"error": {"message", "type", "param", "code"}}``. The Responses API
  (``POST /responses``) and Anthropic's Messages API (``POST /messages``) are served too, as
  their chat equivalent (``sim_apis.py``: same text, cost model, prefix cache and pacing), in
  their own shapes and typed event streams (``SimReply.typed``); their other paths
  (``/responses/{id}``, ``/messages/count_tokens``) are a 404 that says so, the latter in
  Anthropic's error shape ``{"type": "error", "error": {"type": "not_found_error", "message"}}``.
- Text: words of a fixed vocabulary; a token is one word. The answer's natural length (8..40
  words) and its words come from a generator seeded with a blake2b hash, so they are stable across
  processes. Greedy decoding (``temperature: 0`` or ``top_k: 1``) hashes model + input, so every
  choice is the same; a ``seed`` (sampling) also hashes seed, temperature, top_p and the choice
  index; otherwise (sampled, no seed) each call draws fresh text. ``max_completion_tokens`` /
  ``max_tokens`` (default ``SimConfig.default_max_tokens``) cut the answer to a prefix of the same
  text, with ``finish_reason: "length"``; otherwise ``"stop"``.
- Prompt tokens: the words of every message (its role, name and content, tool calls) plus a few
  framing tokens per message, as chat templates add; tools count as a prefix before the messages.
- Cost model, per replica: at most ``max_concurrency`` requests are served at once, the rest queue
  (FIFO, via an asyncio.Semaphore). A served request first pays prefill,
  ``prefill_ms_per_token`` for each prompt token not in the replica's prefix cache, then decode,
  ``decode_ms_per_token`` per token step (the n choices of a request decode together, one step per
  token, as a batch does). Streams sleep before every token step, so chunks are spread over time;
  whole answers sleep once. Time to first token = queue wait + prefill + one decode step.
- Prefix (KV) cache: the prompt is cut into full blocks of ``block_tokens``; a block's id chains the
  previous block's id with its tokens, so equal ids mean equal prefixes. A request hits the leading
  blocks already present (never its very last token, which an engine always recomputes). After
  prefill all its blocks are touched in an LRU bounded by ``prefix_cache_tokens``.
- Counters (``SimReplica.stats()``): calls by endpoint, errors, prompt / cached prompt / completion
  tokens, busy and queue-wait seconds, in-flight now and at most, time-to-first-token sum and count.
- ``SimUpstream`` serves one replica through the ``Upstream`` protocol without sockets. A consumer
  that cancels or closes a stream frees the replica's slot at once (slots are held in try/finally).
  Its stream has no ``[DONE]`` to send: the iterator ending normally is the in-process ``[DONE]``
  (``upstream.base``), and it ends so only after every choice's finish chunk (and the usage chunk).
  Over HTTP (``sim_server.py``) every stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import random
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson

from carpool.config import SimConfig
from carpool.errors import RequestError
from carpool.upstream import sim_apis
from carpool.upstream.base import PassthroughResponse, UpstreamRequest, UpstreamResponse

MODEL_ID = "carpool-sim"
SYSTEM_FINGERPRINT = "carpool-sim"
SIMULATED_HEADER = ("x-carpool-simulated", "true")
JSON_HEADERS = {"content-type": "application/json", SIMULATED_HEADER[0]: SIMULATED_HEADER[1]}

MIN_ANSWER_WORDS, MAX_ANSWER_WORDS = 8, 40
MAX_CHOICES = 128
# Framing tokens a chat template adds: <|start|> role ... <|end|> per message, and the assistant
# header that primes the answer.
TOKENS_PER_MESSAGE = 3
ANSWER_PRIMING = ("<|start|>", "assistant")

VOCABULARY = (
    "the",
    "a",
    "model",
    "answer",
    "cache",
    "request",
    "token",
    "stream",
    "engine",
    "replica",
    "prefix",
    "block",
    "query",
    "result",
    "value",
    "system",
    "user",
    "data",
    "simple",
    "fast",
    "shared",
    "same",
    "again",
    "first",
    "next",
    "every",
    "one",
    "two",
    "many",
    "some",
    "is",
    "are",
    "was",
    "will",
    "can",
    "should",
    "may",
    "not",
    "and",
    "or",
    "but",
    "so",
    "then",
    "because",
    "with",
    "without",
    "from",
    "into",
    "over",
    "under",
    "after",
    "before",
    "while",
    "here",
    "there",
    "now",
    "later",
    "this",
    "that",
    "it",
    "we",
    "you",
    "they",
    "gateway",
    "carpool",
    "simulated",
    "text",
    "word",
    "line",
    "time",
    "cost",
    "queue",
    "batch",
    "decode",
    "prefill",
    "memory",
    "route",
    "hit",
    "miss",
    "store",
    "serve",
    "share",
    "compute",
    "twice",
    "never",
    "always",
    "quickly",
    "slowly",
    "clearly",
    "exactly",
    "about",
    "between",
    "within",
    "across",
)

ENDPOINTS = ("/chat/completions", "/completions", "/embeddings", "/responses", "/messages")
SERVED = (
    "it serves POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses "
    "and /v1/messages"
)


# ----------------------------------------------------------------------------- replies


@dataclass(slots=True)
class SimReply:
    """A replica's answer: a JSON body, or (streaming, 200) an async iterator of chunk objects."""

    status: int
    body: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    typed: bool = False  # the chunks are typed events (Responses, Messages): no [DONE]


def error_reply(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> SimReply:
    """An error in OpenAI's shape."""
    return SimReply(
        status, {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def not_found_reply(method: str, path: str) -> SimReply:
    if path.rstrip("/") == "/messages" or path.startswith("/messages/"):
        # Anthropic's Messages API (which the simulator does not serve): its own error shape,
        # so that its SDK reports a clear NotFoundError.
        return SimReply(
            404,
            {
                "type": "error",
                "error": {
                    "type": "not_found_error",
                    "message": f"the simulated engine does not serve {method} /v1{path}: {SERVED}",
                },
            },
        )
    if path.rstrip("/") == "/responses" or path.startswith("/responses/"):
        return error_reply(
            404,
            f"the simulated engine does not serve {method} /v1{path} (of "
            f"the Responses API): {SERVED}",
            code="unknown_url",
        )
    # OpenAI's own wording for a path it does not serve.
    return error_reply(404, f"Invalid URL ({method} /v1{path})")


# ----------------------------------------------------------------------------- tokens and text


def words(text: str) -> list[str]:
    return text.split()


def _stable_dump(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str)


def _content_tokens(content: Any) -> list[str]:
    """Tokens of a message's content: a string, or a list of parts (text parts give their words)."""
    if content is None:
        return []
    if isinstance(content, str):
        return words(content)
    if isinstance(content, list):
        tokens: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                tokens += words(str(part.get("text", "")))
            else:  # images, audio...: their JSON stands in for their tokens
                tokens += words(_stable_dump(part).decode())
        return tokens
    return words(_stable_dump(content).decode())


def chat_prompt_tokens(body: Mapping[str, Any]) -> list[str]:
    """The prompt a chat template would build: tools first, then each message framed."""
    tokens: list[str] = []
    if body.get("tools"):
        tokens += ["<|tools|>", *words(_stable_dump(body["tools"]).decode()), "<|end|>"]
    for message in body["messages"]:
        tokens += ["<|start|>", str(message.get("role"))]
        if message.get("name"):
            tokens.append(str(message["name"]))
        tokens += _content_tokens(message.get("content"))
        if message.get("tool_calls"):
            tokens += words(_stable_dump(message["tool_calls"]).decode())
        tokens.append("<|end|>")
    return tokens + list(ANSWER_PRIMING)


def input_tokens(item: str | list[int]) -> list[str]:
    """Tokens of one completion prompt or embedding input: words, or a token-id array."""
    if isinstance(item, str):
        return words(item)
    return [f"<{token_id}>" for token_id in item]


def _seed_from(*parts: Any) -> int:
    digest = hashlib.blake2b(_stable_dump(parts), digest_size=16).digest()
    return int.from_bytes(digest, "big")


def _draw_answer(rng: random.Random) -> list[str]:
    length = rng.randint(MIN_ANSWER_WORDS, MAX_ANSWER_WORDS)
    return [rng.choice(VOCABULARY) for _ in range(length)]


def is_greedy(body: Mapping[str, Any]) -> bool:
    # An absent temperature is the engine's default, which samples.
    return body.get("temperature") == 0 or body.get("top_k") == 1


def answer_words(body: Mapping[str, Any], endpoint: str, prompt: Any, choice: int) -> list[str]:
    """The natural (uncapped) answer of one choice; ``max_tokens`` only cuts it later."""
    model = body.get("model")
    if is_greedy(body):
        rng = random.Random(_seed_from(endpoint, model, prompt, body.get("tools")))
    elif body.get("seed") is not None:
        rng = random.Random(
            _seed_from(
                endpoint,
                model,
                prompt,
                body.get("tools"),
                body["seed"],
                body.get("temperature"),
                body.get("top_p"),
                choice,
            )
        )
    else:
        rng = random.Random(os.urandom(16))
    return _draw_answer(rng)


def embedding_vector(model: Any, item: str | list[int], dim: int) -> list[float]:
    """A deterministic unit-norm vector derived from the input's hash."""
    rng = random.Random(_seed_from("embedding", model, item))
    raw = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]


def _as_base64(vector: list[float]) -> str:
    # The openai SDK asks for base64 by default: little-endian float32, as OpenAI sends.
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


# ----------------------------------------------------------------------------- validation


def _is_token_array(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def parse_inputs(value: Any, param: str, allow_empty_text: bool) -> list[str | list[int]]:
    """A prompt / embedding input as a list of items: str, list[str], list[int], list[list[int]]."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif _is_token_array(value):
        items = [value]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, str) or _is_token_array(v) for v in value)
    ):
        items = value
    else:
        raise RequestError(
            f"'{param}' must be a string, a list of strings, a list of token ids "
            "or a list of lists of token ids",
            param=param,
        )
    if not allow_empty_text and any(item == "" for item in items):
        raise RequestError(f"'{param}' must not contain empty strings", param=param)
    return items


def _int_field(body: Mapping[str, Any], name: str, lowest: int, highest: int | None = None) -> None:
    value = body.get(name)
    if value is None:
        return
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < lowest
        or (highest is not None and value > highest)
    ):
        bounds = f"between {lowest} and {highest}" if highest is not None else f">= {lowest}"
        raise RequestError(f"'{name}' must be an integer {bounds}", param=name)


def _validate_generation(body: Mapping[str, Any]) -> None:
    _int_field(body, "n", 1, MAX_CHOICES)
    _int_field(body, "max_tokens", 1)
    _int_field(body, "max_completion_tokens", 1)
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise RequestError("'stream' must be a boolean", param="stream")
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or temperature < 0
    ):
        raise RequestError("'temperature' must be a number >= 0", param="temperature")


def max_new_tokens(body: Mapping[str, Any], default: int) -> int:
    # The newer name wins, as in OpenAI's API.
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return int(body[name])
    return default


# ----------------------------------------------------------------------------- prefix cache


class PrefixCache:
    """A simulated KV cache: LRU of prompt blocks identified by chained hashes."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def block_ids(self, tokens: list[str]) -> list[bytes]:
        """Ids of the full blocks of ``tokens``; each id covers the whole prefix up to its block."""
        ids: list[bytes] = []
        previous = b""
        for start in range(0, len(tokens) - self.block_tokens + 1, self.block_tokens):
            block = "\x00".join(tokens[start : start + self.block_tokens]).encode()
            previous = hashlib.blake2b(previous + b"\x01" + block, digest_size=16).digest()
            ids.append(previous)
        return ids

    def cached_tokens(self, ids: list[bytes], prompt_length: int) -> int:
        """Prompt tokens found: the leading blocks present, never the very last token."""
        hits = 0
        for block_id in ids:
            if block_id not in self._blocks:
                break
            hits += 1
        return min(hits * self.block_tokens, max(prompt_length - 1, 0))

    def touch(self, ids: list[bytes]) -> None:
        if self.capacity_blocks == 0:
            return
        # Touch the last block first so the first block is the most recent: eviction then trims
        # prefixes from their tail, and the shared heads (system prompts) stay longest.
        for block_id in reversed(ids):
            self._blocks[block_id] = None
            self._blocks.move_to_end(block_id)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


# ----------------------------------------------------------------------------- a request's plan


@dataclass(slots=True)
class Sequence:
    """One choice to generate: its index in ``choices``, its words and why it ended."""

    index: int
    words: list[str]
    finish_reason: str


@dataclass(slots=True)
class Plan:
    """Everything a generation request will do, decided before it is served."""

    endpoint: str
    body: Mapping[str, Any]
    prompts: list[list[str]]  # prompt tokens, one list per distinct prompt
    sequences: list[Sequence]
    stream: bool
    include_usage: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.words) for s in self.sequences)

    @property
    def decode_steps(self) -> int:
        return max((len(s.words) for s in self.sequences), default=0)

    @property
    def model(self) -> str:
        model = self.body.get("model")
        return model if isinstance(model, str) else MODEL_ID

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def _sequences(
    body: Mapping[str, Any], endpoint: str, prompts: list[Any], cap: int
) -> list[Sequence]:
    """n choices per prompt, indexed prompt-major as OpenAI does for a list of prompts."""
    n = body.get("n") or 1
    sequences = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            natural = answer_words(body, endpoint, prompt, i)
            reason = "length" if len(natural) > cap else "stop"
            sequences.append(Sequence(p * n + i, natural[:cap], reason))
    return sequences


# ----------------------------------------------------------------------------- the replica


Sleep = Callable[[float], Awaitable[Any]]


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

    # -- entry points

    async def handle(self, path: str, body: Any) -> SimReply:
        """Serve a POST to ``path`` (relative to /v1). Streams come back unstarted: the slot is
        taken when the consumer starts iterating, and released when it stops."""
        path = _strip_v1(path)
        if path not in ENDPOINTS:
            return not_found_reply("POST", path)
        self.calls[path.lstrip("/")] = self.calls.get(path.lstrip("/"), 0) + 1
        try:
            if not isinstance(body, Mapping):
                raise RequestError("the request body must be a JSON object")
            if path == "/embeddings":
                return await self._embeddings(body)
            if path in sim_apis.TYPED:
                plan = self._plan("/chat/completions", sim_apis.to_chat(path, body))
            else:
                plan = self._plan(path, body)
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
                200, sim_apis.from_chat(path, await self._complete(plan), plan.id, plan.created)
            )
        if plan.stream:
            return SimReply(200, chunks=self._stream(plan, self._clock()))
        return SimReply(200, await self._complete(plan))

    def models(self) -> dict[str, Any]:
        self.calls["models"] = self.calls.get("models", 0) + 1
        return {"object": "list", "data": [self.model_card(MODEL_ID)]}

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
            "prefix_cache_blocks": len(self.prefix_cache),
            "prefix_cache_capacity_blocks": self.prefix_cache.capacity_blocks,
        }

    # -- planning

    def _plan(self, endpoint: str, body: Mapping[str, Any]) -> Plan:
        _validate_generation(body)
        if endpoint == "/chat/completions":
            sim_apis.validate_messages(body)
            prompt_inputs: list[Any] = [body["messages"]]
            prompts = [chat_prompt_tokens(body)]
        else:
            if "prompt" not in body:
                raise RequestError("'prompt' is required", param="prompt")
            prompt_inputs = parse_inputs(body["prompt"], "prompt", allow_empty_text=True)
            prompts = [input_tokens(item) for item in prompt_inputs]
        cap = max_new_tokens(body, self.config.default_max_tokens)
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        include_usage = (
            stream and isinstance(options, Mapping) and bool(options.get("include_usage"))
        )
        return Plan(
            endpoint,
            body,
            prompts,
            _sequences(body, endpoint, prompt_inputs, cap),
            stream,
            include_usage,
        )

    # -- the cost model

    @asynccontextmanager
    async def _slot(
        self, arrived: float, slots: asyncio.Semaphore | None = None
    ) -> AsyncIterator[None]:
        """Hold one of ``max_concurrency`` slots; the time spent waiting for it is queue wait."""
        slots = slots or self._slots
        self.waiting += 1
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        started = self._clock()
        self.queue_wait_seconds += started - arrived
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
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
            await self._sleep(plan.decode_steps * step_seconds)
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
                for chunk in step_chunks(plan, step):
                    yield chunk
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
                    final = sim_apis.from_chat(api, completion_body(plan), plan.id, plan.created)
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
        _int_field(body, "dimensions", 1, 65536)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise RequestError(
                "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
            )
        dim = body.get("dimensions") or self.config.embedding_dim
        lengths = [len(input_tokens(item)) for item in items]
        tokens = sum(lengths)
        arrived = self._clock()
        async with self._slot(arrived, self._embedding_passes):
            # One forward pass computes every item of a call together (padded to the longest),
            # as an embedding server on a GPU does: a fixed cost per pass, then the longest item.
            # So a batch of items costs about what one item does: what makes batching pay.
            self.prompt_tokens += tokens
            await self._sleep(
                (self.config.embedding_call_ms + max(lengths) * self.config.prefill_ms_per_token)
                / 1000
            )
            self._first_token(arrived)
        model = body.get("model") if isinstance(body.get("model"), str) else MODEL_ID
        data = []
        for i, item in enumerate(items):
            vector = embedding_vector(model, item, dim)
            data.append(
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": _as_base64(vector) if encoding == "base64" else vector,
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


def _strip_v1(path: str) -> str:
    """Accept paths relative to the /v1 base and full ``/v1/...`` paths alike."""
    path = "/" + path.lstrip("/")
    return path[3:] if path.startswith("/v1/") else path


def build_replicas(config: SimConfig) -> list[SimReplica]:
    return [SimReplica(f"sim-{i}", config) for i in range(config.replicas)]


# ----------------------------------------------------------------------------- bodies and chunks


def _is_chat(plan: Plan) -> bool:
    return plan.endpoint == "/chat/completions"


def _envelope(plan: Plan, chunk: bool) -> dict[str, Any]:
    if _is_chat(plan):
        kind = "chat.completion.chunk" if chunk else "chat.completion"
        prefix = "chatcmpl-"
    else:
        kind, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + plan.id,
        "object": kind,
        "created": plan.created,
        "model": plan.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def completion_body(plan: Plan) -> dict[str, Any]:
    body = _envelope(plan, chunk=False)
    choices = []
    for seq in plan.sequences:
        text = " ".join(seq.words)
        if _is_chat(plan):
            choice = {
                "index": seq.index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": seq.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {
                "index": seq.index,
                "text": text,
                "finish_reason": seq.finish_reason,
                "logprobs": None,
            }
        choices.append(choice)
    body["choices"] = choices
    body["usage"] = plan.usage()
    return body


def _chunk(plan: Plan, index: int, piece: str | None, finish_reason: str | None) -> dict[str, Any]:
    """One streamed chunk for one choice; ``piece`` None is the empty final delta."""
    chunk = _envelope(plan, chunk=True)
    if _is_chat(plan):
        delta = {} if piece is None else {"content": piece}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {
            "index": index,
            "text": piece or "",
            "logprobs": None,
            "finish_reason": finish_reason,
        }
    chunk["choices"] = [choice]
    if plan.include_usage:
        chunk["usage"] = None
    return chunk


def opening_chunks(plan: Plan) -> Iterator[dict[str, Any]]:
    """Chat streams open with the assistant role for each choice; completions have no opening."""
    if not _is_chat(plan):
        return
    for seq in plan.sequences:
        chunk = _chunk(plan, seq.index, "", None)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield chunk


def step_chunks(plan: Plan, step: int) -> Iterator[dict[str, Any]]:
    """The chunks of one decode step: one token per unfinished choice, and the finish chunk of any
    choice whose last token that was."""
    for seq in plan.sequences:
        if step >= len(seq.words):
            continue
        piece = seq.words[step] if step == 0 else " " + seq.words[step]
        yield _chunk(plan, seq.index, piece, None)
        if step == len(seq.words) - 1:
            yield _chunk(plan, seq.index, None, seq.finish_reason)


def usage_chunk(plan: Plan) -> dict[str, Any]:
    chunk = _envelope(plan, chunk=True)
    chunk["choices"] = []
    chunk["usage"] = plan.usage()
    return chunk


# ----------------------------------------------------------------------------- Upstream adapter


async def _payloads(chunks: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[bytes, None]:
    """Chunk objects as SSE payload bytes. Closing this closes the replica's stream at once (an
    outer generator does not close the one it iterates), which frees the replica's slot."""
    async with aclosing(chunks):  # type: ignore[type-var]  # (an async generator: it has aclose)
        async for chunk in chunks:
            yield orjson.dumps(chunk)


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
        reply = await self.replica.handle(request.path, body)
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
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        path = _strip_v1(path.split("?", 1)[0])
        payload: Any
        if method.upper() == "GET" and path == "/models":
            status, payload = 200, self.replica.models()
        elif method.upper() == "GET" and path.startswith("/models/"):
            status, payload = 200, self.replica.model_card(path[len("/models/") :])
        else:
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
