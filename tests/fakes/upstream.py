"""A controllable, counting, OpenAI-compatible fake upstream (a raw ASGI app).

Serve it over real HTTP with ``tests.fakes.serving.serve_app`` and point clients at ``url + "/v1"``.

Endpoints (all under ``/v1``):
- ``POST /v1/chat/completions``   chat.completion, or a chat.completion.chunk SSE stream
- ``POST /v1/completions``        text_completion (``prompt``: a string or a list), or a stream
- ``POST /v1/embeddings``         a list of embeddings (``encoding_format`` float or base64)
- ``POST /v1/responses``          OpenAI Responses API: a ``response`` object, or its typed stream
- ``POST /v1/messages``           Anthropic Messages API: a ``message``, or its typed stream
- ``GET  /v1/models``             the models in ``self.models``
- anything else under ``/v1``     a JSON echo ``{"path", "method", "query", "body", "echo": true}``
- outside ``/v1``                 404 with the OpenAI error shape

Which upstream call produced an answer (call numbers are 1-based, over all recorded calls):
- the answer text is ``f"answer {n} to {prompt}"`` (prompt: the last message's content, or the
  completion prompt), unless ``answer_text(n, body)`` overrides it;
- chat/completions ``id`` is ``f"chatcmpl-fake-{n}"``, completions ``id`` is ``f"cmpl-fake-{n}"``;
  a response's is ``f"resp_fake_{n}"`` (its message item's ``f"msg_fake_{n}"``), a message's
  ``f"msg_fake_{n}"``;
- embeddings carry it in ``model``: ``f"{model}#call{n}"`` (the vectors themselves depend only on
  the input, so they are equal across calls);
- every response has the header ``x-fake-call: n``.

Choices: ``n`` (a positive integer, default 1) choices per prompt, all with the same text, indexed
prompt-major as OpenAI does (``index = prompt * n + choice``; a completion's list ``prompt`` is one
prompt per item). ``best_of`` is ignored.

Streams (``"stream": true``) are ``text/event-stream`` of ``data: {json}\\n\\n`` frames:
(chat only) a first chunk with ``delta {"role": "assistant", "content": ""}`` for each choice; one
chunk per word of each choice's answer, choice after choice (the word with its leading space, so
the pieces join back to the answer); a chunk with an empty delta and ``finish_reason`` for every
choice; with ``stream_options.include_usage`` a last chunk with ``"choices": []`` and ``usage``
(and ``"usage": null`` on the others; with ``continuous_usage_stats`` too, the usage on every
chunk, as vLLM); then ``data: [DONE]``.

The Responses API (``/v1/responses``): the prompt is ``input`` (a string), or the text of the
last input item; the answer is ``{"id", "object": "response", "created_at", "status":
"completed", "error": null, "incomplete_details": null, "instructions", "model", "output":
[{"id", "type": "message", "status": "completed", "role": "assistant", "content": [{"type":
"output_text", "text", "annotations": []}]}], "parallel_tool_calls", "previous_response_id",
"store", "temperature", "tool_choice", "tools", "top_p", "usage": {"input_tokens",
"input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"}}`` (tokens are
words). Its stream (``"stream": true``) is typed SSE events, ``event: NAME`` then ``data:
{"type": NAME, "sequence_number": i, ...}``, with no ``[DONE]``: ``response.created``,
``response.in_progress`` (status ``in_progress``, no output, usage null),
``response.output_item.added``, ``response.content_part.added``, one
``response.output_text.delta`` per word (the content events), ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.completed`` (the whole
response).

The Messages API (``/v1/messages``): the prompt is the last message's text; the answer is
``{"id", "type": "message", "role": "assistant", "model", "content": [{"type": "text", "text"}],
"stop_reason": "end_turn", "stop_sequence": null, "usage": {"input_tokens", "output_tokens"}}``.
Its stream is typed events with no ``[DONE]``: ``message_start`` (the message without content,
``stop_reason`` null, ``output_tokens`` 1), ``content_block_start``, ``ping``, one
``content_block_delta`` (``text_delta``) per word (the content events), ``content_block_stop``,
``message_delta`` (``stop_reason``, ``usage.output_tokens``), ``message_stop``. Its errors
(``fail_status``, a body that is not an object) are in Anthropic's shape ``{"type": "error",
"error": {"type", "message"}}``.

The stream controls below act on these typed streams too, counting content events where chat
counts content chunks (``chunk_gate``, ``chunk_delay``, ``cut_after``, ``empty_stream``);
``omit_done`` ends a typed stream cleanly without its last event (``response.completed``,
``message_stop``), ``typed_done`` with ``data: [DONE]`` in its place; ``omit_finish_reason``
makes the answer one that ended without completing: a response with status ``incomplete``
(``incomplete_details.reason: "max_output_tokens"``; its stream ends with
``response.incomplete``), a message with ``stop_reason: null``.

Records:
- ``calls: list[Call]``: every HTTP request, with ``path``, parsed JSON ``body`` (None when absent
  or not JSON), lower-case ``headers``, ``method``, ``query``, 1-based ``number``, ``peer`` (the
  client's host and port: calls with the same ``peer`` came on the same connection).
- ``count(path=None)``: number of calls (to ``path`` only, when given).
- ``in_flight``: requests being processed now.
- ``cancelled``: requests whose client went away (or whose handler was cancelled) before the answer
  was fully sent; ``cancel_seen`` (an Event) is set at each increment.
- ``arrived``: Event set at each recorded call (tests may ``clear()`` it).
- ``chunk_gate_reached``: Event set when a stream stops at ``chunk_gate``.
- ``completed``: responses fully sent.

Controls (plain attributes; set them before or during a test; ``reset()`` restores the defaults):
- ``gate: asyncio.Event | None``: each request, once recorded, waits for it before answering
  anything (status and headers included, streams too). Requests read the gate when they arrive.
- ``delay: float``: seconds to wait before answering (after the gate).
- ``hang: bool``: never answer; the handler ends only when the client disconnects (counted in
  ``cancelled``) or the server shuts down.
- ``fail_status: int | None`` and ``fail_body: dict | None``: answer that status with the OpenAI
  error shape (default body ``{"error": {"message": "fake upstream failure", "type":
  "server_error", "code": None}}``; on ``/v1/messages`` Anthropic's ``{"type": "error", "error":
  {"type": "api_error", "message": "fake upstream failure"}}``), on every path.
  ``fail_times: int | None``: when set, only that many more requests fail (it counts down),
  then answers are normal again.
- ``refuse: Callable[[Call], str | None] | None``: a call for which it gives a message is
  answered 400 ``invalid_request_error`` with that message (an upstream refusing one field of
  one request, its ``user`` say), on every path.
- ``response_headers``: ``(name, value)`` byte pairs added to every 2xx answer's headers, JSON and
  streams (a ``cache-control`` pair: one more line beside a stream's own ``no-cache``).
- ``redirect_to: str | None``: any other path (the echo below) answers 307 to that URL.
- ``chunk_delay: float``: seconds between streamed chunks.
- ``chunk_gate: asyncio.Event | None`` and ``chunk_gate_after: int`` (default 2): a stream sends
  that many content chunks, sets ``chunk_gate_reached``, then waits for the event before the rest.
- ``cut_after: int | None``: a stream sends that many content chunks, then the connection is
  dropped without the terminating chunk. With httpx the client sees ``httpx.RemoteProtocolError``
  ("incomplete chunked read") while iterating the body, after the chunks already sent; no
  ``finish_reason`` and no ``[DONE]`` ever arrive.
- ``omit_finish_reason: bool``: streams end cleanly with ``[DONE]`` but no finish chunk;
  non-streaming answers get ``finish_reason: null``.
- ``finish_reason: str``: the finish reason used otherwise (default ``"stop"``).
- ``omit_done: bool``: streams end cleanly (the whole HTTP body sent, the connection kept) after
  their last chunk, finish and usage chunks included, but without ``data: [DONE]``.
- ``typed_done: bool``: a typed stream (Responses, Messages) ends with ``data: [DONE]`` in
  place of its last event, as a proxy that ends every stream as chat's would end one it cut.
- ``drop_choices: set[int]``: choice indices that never appear: no chunk of a stream, no item of
  a non-streaming body's ``choices`` (the others keep their indices).
- ``unfinished_choices: set[int]``: choice indices whose finish never comes: a stream sends their
  text but leaves them out of the finish chunk (still ending with ``[DONE]``); a non-streaming
  body gives them ``finish_reason: null``.
- ``answer_text: Callable[[int, dict], str] | None``: the answer text for call ``n`` and its body.
- ``tool_call: tuple[str, str] | None``: (name, arguments): every chat choice answers with one
  call of that function instead of text: ``message {"role": "assistant", "content": null,
  "tool_calls": [{"id": f"call_fake_{n}", "type": "function", "function": {"name",
  "arguments"}}]}`` and ``finish_reason: "tool_calls"``. Streamed as ``tool_call_style`` says.
- ``tool_call_style: str``: how a tool call is streamed. ``"openai"`` (default): a first delta
  ``{"role": "assistant", "content": null}``, then one delta with the call's ``index``, ``id``,
  ``type``, ``name`` and ``arguments: ""``, then the arguments in pieces (one per word) with only
  ``index`` and ``function.arguments``. ``"llama.cpp"``, as llama-cpp-python's server streams a
  forced tool choice: a first delta ``{"role": "assistant", "content": null, "function_call":
  null, "tool_calls": null}``, then per piece of the arguments a delta ``{"role": null,
  "content": null, "function_call": {"name", "arguments": piece}, "tool_calls": [{"index": 0,
  "id", "type", "function": {"name", "arguments": piece}}]}`` (the name, id and type repeated
  in every chunk), and the finish chunk's delta has all four null; its non-streaming answer
  carries the legacy ``function_call`` beside ``tool_calls``.
- ``ignore_include_usage: bool``: streams never carry usage, whatever ``stream_options`` says
  (llama-cpp-python's server); non-streaming answers still have it.
- ``empty_stream: bool``: a stream is answered 200 ``text/event-stream`` with no event at all,
  not even ``[DONE]``, and ends (llama-cpp-python's server on a prompt over its context).
- ``broken_list_embeddings: bool``: an embeddings call with a list of several inputs answers
  the first one's right vector and, for every other item, a wrong one (a deterministic vector
  of the item's index and the whole list), as llama-cpp-python's server does; a single input
  (or a list of one) is answered right. Or a function of the ``Call``, broken when it says so:
  a router in front that sends some keys or headers to such an engine.
- ``fail_embeddings: Callable[[Any], bool] | None``: an embeddings call with an input item for
  which it says True is answered 500 ``server_error``, the whole call (a list's other items
  unanswered), as llama.cpp's server answers an input over its physical batch (512 tokens).
- ``drop_embeddings: set[int]``: input indices whose vector never appears in an embeddings
  answer's ``data`` (the others keep their indices): an engine that answered fewer inputs.
- ``embedding_fn: Callable[[str | list[int]], list[float]] | None``: the vector of one input item
  (default: 8 floats, a unit vector derived from a hash of the item; ``dimensions`` is honoured).
- ``models: list[str]``: what ``GET /v1/models`` lists.
- ``error_after: int | None``: a typed stream (Responses, Messages) sends that many content
  events, then the API's error event (``event: error``: Responses' ``{"type": "error", "code":
  "server_error", "message": "fake upstream stream failure", "param": null,
  "sequence_number"}``, Messages' ``{"type": "error", "error": {"type": "overloaded_error",
  "message": "fake upstream stream failure"}}``) and ends.
- ``message_events: Callable[[list[dict]], list[dict]] | None``: a Messages stream's events
  (each event's data, with its ``type``) are what it returns for them: the blocks, deltas,
  fields and events a newer API streams. The content events of what it returns are its
  ``content_block_delta``s.
- ``message_content: list | None``: the content blocks of every Messages answer (a tool call,
  say) in place of its one text block. Streamed, each block is a ``content_block_start`` of it
  without its text or input, then its text one word a delta (``text_delta``), or its tool
  input's JSON, as the fake writes it, in two ``input_json_delta`` halves, then a
  ``content_block_stop``.
- ``names_after_request_id: bool``: a chat or completion answer is named after the request id
  it was sent, as vLLM names it (``_base_request_id``): ``f"chatcmpl-{rid}"`` (``cmpl-``), where
  ``rid`` is the ``x-request-id`` header, else the body's ``request_id``; neither: as usual.
- ``chat_extra: dict``: top-level fields added to every whole chat answer (an engine's own,
  such as vLLM's ``prompt_token_ids``).
- ``return_token_ids`` in a chat or completions request (vLLM's): the answer carries token
  ids, one per word (``token_id``): a chat answer the prompt's (its messages' words) as a
  top-level ``prompt_token_ids``, each choice those of its text as ``token_ids``; a completion
  both on each choice. A stream carries them as vLLM streams them: each chunk's choice the ids of
  its new words (``[]`` for none), the prompt's once (chat: top-level, on the first chunk; a
  completion: on each choice's first chunk).
- ``embeddings_extra: dict``: top-level fields added to every embeddings answer (an ``error``
  beside its ``data``, say); ``completions_extra``: to every whole completions answer
  (``{"usage": None}``: an engine that reports none).
- ``responses_output: list | None``: the ``output`` items of every whole Responses answer (a
  reasoning model's items, logprobs...) in place of the one message; a stream asked of it is a
  400 (it streams only its own message).
- ``keeps_responses: bool``: the fake keeps the responses it makes (``store`` not false), in
  ``kept`` (id -> response), as vLLM and SGLang do, each replica its own: their ids then name
  this fake (``f"resp_{tag}_{n}"``, ``tag`` unique to the instance, so two fakes never make the
  same id); ``GET /v1/responses/{id}`` answers the kept response, ``DELETE`` of it forgets it
  (``{"id", "object": "response", "deleted": true}``), any other call under
  ``/v1/responses/{id}/`` the echo, and ``POST /v1/responses`` with a ``previous_response_id`` it
  kept the usual answer; an id it did not keep is a 404 (``invalid_request_error``, "Response
  with id '...' not found.").
- ``keeps_completions: bool``: the fake keeps the chat completions asked with ``store: true``
  (whole or streamed), in ``kept_completions`` (id -> completion), as OpenAI does: their ids
  then name this fake (``f"chatcmpl-{tag}-{n}"``); ``GET /v1/chat/completions/{id}`` answers the
  kept completion, ``POST`` to it sets its ``metadata`` and answers it, ``GET
  /v1/chat/completions/{id}/messages`` lists its request's messages, ``DELETE`` of it forgets it
  (``{"id", "object": "chat.completion.deleted", "deleted": true}``); an id it did not keep is a
  404 (``invalid_request_error``). A completion asked without ``store: true`` is not kept.
- ``keeps_files: bool``: the fake keeps the files uploaded to it and the batches made of them in
  its own process, as SGLang does (``/v1/files``, ``/v1/batches``), each replica its own, in
  ``files`` (id -> the uploaded bytes) and ``batches`` (id -> batch): ``POST /v1/files`` keeps
  its raw body (``f"file-{tag}-{n}"``), ``GET /v1/files/{id}`` answers the file object, ``GET
  .../content`` its bytes, ``DELETE`` forgets it; ``POST /v1/batches`` with an
  ``input_file_id`` it keeps makes a batch (``f"batch_{tag}_{n}"``), done at once: its output
  is a file of its own (``output_file_id``); ``GET /v1/batches/{id}`` answers it, ``POST
  .../cancel`` too (``cancelled``). An id it does not keep is a 404 (a batch's input file
  included).
- ``valid_keys: set[str] | dict[str, set[str]] | None``: when set, a request is answered only if
  it presents at least one key (``Authorization: Bearer K``, ``api-key: K``, ``x-api-key: K``)
  and every key it presents is valid: in the set, or (a dict) mapped to a set of models that
  holds the body's ``model``; otherwise 401 ``invalid_api_key`` (recorded as a call like any
  other).

Disconnects are seen in raw ASGI terms: once the request body is read, a watcher awaits
``receive()``, which returns ``http.disconnect`` when the client goes away; every wait of the
handler (gate, delay, hang, chunk gate, chunk delay) races against it, and each streamed chunk is
followed by a check. (uvicorn's ``send`` silently does nothing after a disconnect, hence the
watcher.)
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import logging
import math
import re
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fakes.waiting import WAIT_S

__all__ = ["ANTHROPIC_FAIL_BODY", "Call", "FakeUpstream", "DEFAULT_FAIL_BODY", "CREATED"]

CREATED = 1_700_000_000  # fixed "created" timestamp: answers are fully deterministic
DEFAULT_FAIL_BODY: dict[str, Any] = {
    "error": {"message": "fake upstream failure", "type": "server_error", "code": None}
}
ANTHROPIC_FAIL_BODY: dict[str, Any] = {
    "type": "error",
    "error": {"type": "api_error", "message": "fake upstream failure"},
}
_WORD = re.compile(r"\s*\S+")
_TAGS = itertools.count(1)  # each fake's own, for the ids of the responses it keeps


@dataclass
class Call:
    """One request received by the fake."""

    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]  # lower-case names
    method: str = "POST"
    query: str = ""
    number: int = 0  # 1-based index among all calls
    raw_body: bytes = field(default=b"", repr=False)
    peer: tuple[str, int] | None = None  # the client's (host, port): which connection it came on

    @property
    def stream(self) -> bool:
        return bool(isinstance(self.body, dict) and self.body.get("stream"))


class _ClientGone(Exception):
    """The client disconnected before the answer was fully sent."""


class _CutConnection(Exception):
    """Raised on purpose (``cut_after``) so that uvicorn drops the connection mid-stream."""


class _HideDeliberateCuts(logging.Filter):
    """Keep uvicorn's "Exception in ASGI application" log quiet for deliberate cuts."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, _CutConnection)


logging.getLogger("uvicorn.error").addFilter(_HideDeliberateCuts())


def _block_events(index: int, block: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]]:
    """A Messages content block streamed (``message_content``): its start, its deltas (content
    events), its stop."""
    if block.get("type") == "text":
        start = {**block, "text": ""}
        deltas = [{"type": "text_delta", "text": word} for word in _WORD.findall(block["text"])]
    elif "input" in block:
        start = {**block, "input": {}}
        written = json.dumps(block["input"])
        half = len(written) // 2
        deltas = [
            {"type": "input_json_delta", "partial_json": piece}
            for piece in (written[:half], written[half:])
        ]
    else:
        start, deltas = block, []
    return [
        ("content_block_start", {"index": index, "content_block": start}, False),
        *[("content_block_delta", {"index": index, "delta": delta}, True) for delta in deltas],
        ("content_block_stop", {"index": index}, False),
    ]


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or a list of parts (``{"type": "text"}``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content
        )
    return str(content)


def _count_words(text: object) -> int:
    # (Anything the fuzzer sends: an engine counts what it reads, and a fake must not answer
    # a 500 of its own, which the gateway would pass on.)
    return len(text.split()) if isinstance(text, str) else len(str(text).split())


def token_id(word: str) -> int:
    """The fake's token id of a word (``return_token_ids``), its leading space taken off."""
    return int.from_bytes(hashlib.sha256(word.strip().encode()).digest()[:2], "big")


def _token_ids(text: str) -> list[int]:
    return [token_id(word) for word in _WORD.findall(text)]


def _hash_vector(item: Any, dims: int) -> list[float]:
    data = item.encode() if isinstance(item, str) else _json(item)
    raw = hashlib.shake_256(data).digest(2 * dims)
    values = [v / 32767.5 - 1.0 for v in struct.unpack(f"<{dims}H", raw)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


class FakeUpstream:
    """An OpenAI-compatible ASGI app with counters and controls. See the module docstring."""

    def __init__(self, *, models: list[str] | None = None) -> None:
        self._default_models = list(models or ["fake-model"])
        self.tag = f"fake{next(_TAGS)}"
        self.reset()

    # ---------------------------------------------------------------- state, controls, waiting

    def reset(self) -> None:
        """Forget the calls and counters, restore every control to its default.

        Meant for between tests: requests already waiting on old events keep waiting on them.
        """
        self.calls: list[Call] = []
        self.in_flight = 0
        self.cancelled = 0
        self.completed = 0
        self.arrived = asyncio.Event()
        self.cancel_seen = asyncio.Event()
        self.chunk_gate_reached = asyncio.Event()
        self._changed = asyncio.Event()  # pulsed (set, then replaced) on every state change

        self.models: list[str] = list(self._default_models)
        self.gate: asyncio.Event | None = None
        self.delay: float = 0.0
        self.hang: bool = False
        self.fail_status: int | None = None
        self.fail_body: dict[str, Any] | None = None
        self.fail_times: int | None = None
        self.refuse: Callable[[Call], str | None] | None = None
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.redirect_to: str | None = None
        self.chunk_delay: float = 0.0
        self.chunk_gate: asyncio.Event | None = None
        self.chunk_gate_after: int = 2
        self.cut_after: int | None = None
        self.omit_finish_reason: bool = False
        self.finish_reason: str = "stop"
        self.omit_done: bool = False
        self.typed_done: bool = False
        self.drop_choices: set[int] = set()
        self.unfinished_choices: set[int] = set()
        self.answer_text: Callable[[int, dict[str, Any]], str] | None = None
        self.tool_call: tuple[str, str] | None = None
        self.tool_call_style: str = "openai"
        self.ignore_include_usage: bool = False
        self.empty_stream: bool = False
        self.broken_list_embeddings: bool | Callable[[Call], bool] = False
        self.embedding_fn: Callable[[Any], list[float]] | None = None
        self.drop_embeddings: set[int] = set()
        self.fail_embeddings: Callable[[Any], bool] | None = None
        self.valid_keys: set[str] | dict[str, set[str]] | None = None
        self.error_after: int | None = None
        self.names_after_request_id: bool = False
        self.chat_extra: dict[str, Any] = {}
        self.embeddings_extra: dict[str, Any] = {}
        self.completions_extra: dict[str, Any] = {}
        self.message_events: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
        self.responses_output: list[dict[str, Any]] | None = None
        self.message_content: list[dict[str, Any]] | None = None
        self.omit_message_usage: bool = False  # (a whole message without ``usage``)
        self.keeps_responses: bool = False
        self.kept: dict[str, dict[str, Any]] = {}
        self.keeps_completions: bool = False
        self.kept_completions: dict[str, dict[str, Any]] = {}
        self.keeps_files: bool = False
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}

    def _authorized(self, headers: dict[str, str], body: Any) -> bool:
        """Like OpenAI and Azure: one presented key, and every key presented, must be valid (for
        the body's model, when ``valid_keys`` maps keys to models)."""
        keys = (
            [headers["authorization"].removeprefix("Bearer ")] if "authorization" in headers else []
        )
        keys += [headers[name] for name in ("api-key", "x-api-key") if name in headers]
        valid = self.valid_keys
        assert valid is not None
        model = body.get("model") if isinstance(body, dict) else None
        return bool(keys) and all(
            key in valid and (isinstance(valid, set) or model in valid[key]) for key in keys
        )

    def count(self, path: str | None = None) -> int:
        """Number of calls received (to ``path`` only, e.g. ``"/v1/chat/completions"``)."""
        if path is None:
            return len(self.calls)
        return sum(1 for c in self.calls if c.path == path)

    async def _hold_at_gate(self, chunk_gate: asyncio.Event, gone: asyncio.Event) -> None:
        """A stream at its ``chunk_gate``: say so, then wait for the gate (or the client going)."""
        self.chunk_gate_reached.set()
        self._notify()
        if not chunk_gate.is_set():
            await self._until(chunk_gate.wait(), gone)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_until(
        self, predicate: Callable[[], bool], timeout: float = WAIT_S, what: str = "condition"
    ) -> None:
        """Return once ``predicate()`` is true (re-checked at each state change of the fake).

        Raises ``TimeoutError`` after ``timeout`` seconds.
        """

        async def _wait() -> None:
            while not predicate():
                await self._changed.wait()

        try:
            await asyncio.wait_for(_wait(), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"fake upstream: {what} not reached within {timeout} s "
                f"(calls={len(self.calls)}, in_flight={self.in_flight}, "
                f"cancelled={self.cancelled}, completed={self.completed})"
            ) from None

    async def wait_for_calls(self, n: int, timeout: float = WAIT_S) -> list[Call]:
        """Return (the first ``n`` calls) once at least ``n`` calls have been recorded."""
        await self.wait_until(lambda: len(self.calls) >= n, timeout, f"{n} call(s)")
        return self.calls[:n]

    async def wait_for_cancelled(self, n: int = 1, timeout: float = WAIT_S) -> None:
        """Return once at least ``n`` requests have been cancelled by their clients."""
        await self.wait_until(lambda: self.cancelled >= n, timeout, f"{n} cancellation(s)")

    async def wait_idle(self, timeout: float = WAIT_S) -> None:
        """Return once no request is in flight."""
        await self.wait_until(lambda: self.in_flight == 0, timeout, "no request in flight")

    # ---------------------------------------------------------------- ASGI entry point

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict]],
        send: Callable[[dict], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return  # websockets are not part of the OpenAI API
        await self._handle_http(scope, receive, send)

    async def _handle_http(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[dict]],
        send: Callable[[dict], Awaitable[None]],
    ) -> None:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before the request was even complete: not a call
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)

        headers: dict[str, str] = {}
        for name, value in scope.get("headers", []):
            key, val = name.decode("latin-1").lower(), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        call = Call(
            path=scope["path"],
            body=body if isinstance(body, dict) else None,
            headers=headers,
            method=scope["method"],
            query=scope.get("query_string", b"").decode("latin-1"),
            number=len(self.calls) + 1,
            raw_body=raw,
            peer=tuple(scope["client"]) if scope.get("client") else None,
        )
        self.calls.append(call)
        self.in_flight += 1
        self.arrived.set()
        self._notify()

        gone = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch_disconnect(receive, gone))
        try:
            await self._respond(call, send, gone)
            self.completed += 1
        except _ClientGone:
            self._count_cancel()
        except asyncio.CancelledError:
            self._count_cancel()
            raise
        finally:
            watcher.cancel()
            await asyncio.wait([watcher])
            self.in_flight -= 1
            self._notify()

    @staticmethod
    async def _watch_disconnect(
        receive: Callable[[], Awaitable[dict]], gone: asyncio.Event
    ) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    def _count_cancel(self) -> None:
        self.cancelled += 1
        self.cancel_seen.set()

    @staticmethod
    async def _until(awaitable: Awaitable[Any], gone: asyncio.Event) -> None:
        """Await ``awaitable`` unless the client disconnects first (then raise ``_ClientGone``)."""
        if gone.is_set():
            raise _ClientGone
        work = asyncio.ensure_future(awaitable)
        leave = asyncio.ensure_future(gone.wait())
        try:
            done, _ = await asyncio.wait({work, leave}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            leave.cancel()
            await asyncio.wait({work, leave})
        if work in done and not work.cancelled():
            work.result()
            return
        raise _ClientGone

    # ---------------------------------------------------------------- answering

    async def _respond(
        self, call: Call, send: Callable[[dict], Awaitable[None]], gone: asyncio.Event
    ) -> None:
        gate = self.gate
        if gate is not None and not gate.is_set():
            await self._until(gate.wait(), gone)
        if self.delay > 0:
            await self._until(asyncio.sleep(self.delay), gone)
        if self.hang:
            await self._until(asyncio.Event().wait(), gone)  # only a disconnect ends this
        if gone.is_set():
            raise _ClientGone

        if self.valid_keys is not None and not self._authorized(call.headers, call.body):
            await self._send_json(
                send,
                call,
                401,
                {
                    "error": {
                        "message": "Incorrect API key provided",
                        "type": "invalid_request_error",
                        "code": "invalid_api_key",
                    }
                },
            )
            return
        if self.fail_status is not None and (self.fail_times is None or self.fail_times > 0):
            if self.fail_times is not None:
                self.fail_times -= 1
            default = (
                ANTHROPIC_FAIL_BODY if call.path.startswith("/v1/messages") else DEFAULT_FAIL_BODY
            )
            await self._send_json(send, call, self.fail_status, self.fail_body or default)
            return
        refused = self.refuse(call) if self.refuse is not None else None
        if refused is not None:
            await self._send_error(send, call, 400, refused, "invalid_request_error")
            return

        path = call.path.rstrip("/") or "/"
        method = call.method
        if not (path == "/v1" or path.startswith("/v1/")):
            await self._send_error(
                send, call, 404, f"no route for {method} {call.path}", "invalid_request_error"
            )
            return
        if method == "POST" and path in (
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
        ):
            if call.body is None:
                await self._send_error(
                    send, call, 400, "the body must be a JSON object", "invalid_request_error"
                )
                return
            if path == "/v1/chat/completions":
                await self._chat(call, send, gone)
            elif path == "/v1/completions":
                await self._completions(call, send, gone)
            else:
                await self._embeddings(call, send)
            return
        if self.keeps_files and (path.startswith(("/v1/files", "/v1/batches"))):
            await self._kept_file(call, send, path.split("/")[2:])
            return
        if self.keeps_completions and path.startswith("/v1/chat/completions/"):
            await self._kept_completion(call, send, path.split("/")[4:])
            return
        if self.keeps_responses and path.startswith("/v1/responses"):
            named = (
                path.split("/")[3]
                if path.startswith("/v1/responses/")
                else (call.body or {}).get("previous_response_id")
            )
            if named is not None and named not in self.kept:
                await self._send_error(
                    send,
                    call,
                    404,
                    f"Response with id '{named}' not found.",
                    "invalid_request_error",
                )
                return
            if method == "GET" and path == f"/v1/responses/{named}":
                await self._send_json(send, call, 200, self.kept[named])
                return
            if method == "DELETE" and path == f"/v1/responses/{named}":
                del self.kept[named]
                deleted = {"id": named, "object": "response", "deleted": True}
                await self._send_json(send, call, 200, deleted)
                return
        if method == "POST" and path in ("/v1/responses", "/v1/messages"):
            if call.body is None:
                await self._send_error(
                    send, call, 400, "the body must be a JSON object", "invalid_request_error"
                )
            elif path == "/v1/responses":
                await self._responses(call, send, gone)
            else:
                await self._messages(call, send, gone)
            return
        if method == "GET" and path == "/v1/models":
            data = [
                {"id": m, "object": "model", "created": CREATED, "owned_by": "fake-upstream"}
                for m in self.models
            ]
            await self._send_json(send, call, 200, {"object": "list", "data": data})
            return
        if self.redirect_to is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 307,
                    "headers": [
                        (b"location", self.redirect_to.encode()),
                        (b"content-length", b"0"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await self._send_json(
            send,
            call,
            200,
            {
                "path": call.path,
                "method": method,
                "query": call.query,
                "body": call.body,
                "echo": True,
            },
        )

    def _named(self, call: Call, prefix: str) -> str | None:
        """The id an answer is named by after the request id it was sent (vLLM's
        ``_base_request_id``: the ``X-Request-Id`` header, else the body's ``request_id``), when
        ``names_after_request_id``; else None."""
        if not self.names_after_request_id:
            return None
        given = call.headers.get("x-request-id") or (call.body or {}).get("request_id")
        return f"{prefix}{given}" if given else None

    def _answer(self, call: Call, prompt: str) -> str:
        if self.answer_text is not None:
            return self.answer_text(call.number, call.body or {})
        return f"answer {call.number} to {prompt}"

    def _finish(self, index: int = 0) -> str | None:
        if self.omit_finish_reason or index in self.unfinished_choices:
            return None
        return "tool_calls" if self.tool_call is not None else self.finish_reason

    def _tool_call_message(self, call: Call) -> dict[str, Any]:
        assert self.tool_call is not None
        name, arguments = self.tool_call
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_fake_{call.number}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        }
        if self.tool_call_style == "llama.cpp":
            message["function_call"] = {"name": name, "arguments": arguments}
        return message

    @staticmethod
    def _n(body: dict[str, Any]) -> int:
        n = body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def _chat(
        self, call: Call, send: Callable[[dict], Awaitable[None]], gone: asyncio.Event
    ) -> None:
        body = call.body or {}
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            await self._send_error(
                send, call, 400, "'messages' must be a non-empty list", "invalid_request_error"
            )
            return
        last = messages[-1] if isinstance(messages[-1], dict) else {}
        text = (
            self._answer(call, _text_of(last.get("content")))
            if self.tool_call is None
            else self.tool_call[1]
        )
        model = body.get("model", "fake-model")
        prompt_tokens = sum(
            _count_words(_text_of(m.get("content"))) for m in messages if isinstance(m, dict)
        )
        texts = [text] * self._n(body)
        usage = self._usage(prompt_tokens, sum(_count_words(t) for t in texts))
        keep = self.keeps_completions and body.get("store") is True
        cid = f"chatcmpl-{self.tag}-{call.number}" if keep else f"chatcmpl-fake-{call.number}"
        cid = self._named(call, "chatcmpl-") or cid
        if keep:
            self.kept_completions[cid] = {
                "id": cid,
                "object": "chat.completion",
                "created": CREATED,
                "model": model,
                "choices": [
                    {"index": i, "message": {"role": "assistant", "content": t}}
                    for i, t in enumerate(texts)
                ],
                "metadata": body.get("metadata") or {},
                "messages": messages,
            }
        ids = bool(body.get("return_token_ids"))
        # Tokenized only when asked: a hash per word in Python, which for a big prompt held the
        # event loop the fake shares with the gateway in a test (measured as the gateway's).
        prompt_ids = (
            [
                i
                for m in messages
                if isinstance(m, dict)
                for i in _token_ids(_text_of(m.get("content")))
            ]
            if ids
            else []
        )
        if body.get("stream"):
            await self._stream(
                call,
                send,
                gone,
                chat=True,
                cid=cid,
                model=model,
                texts=texts,
                usage=usage,
                prompt_ids=prompt_ids if ids else None,
            )
            return
        await self._send_json(
            send,
            call,
            200,
            {
                "id": cid,
                "object": "chat.completion",
                "created": CREATED,
                "model": model,
                "choices": [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": t}
                        if self.tool_call is None
                        else self._tool_call_message(call),
                        "logprobs": None,
                        "finish_reason": self._finish(i),
                        **({"token_ids": _token_ids(t)} if ids else {}),
                    }
                    for i, t in enumerate(texts)
                    if i not in self.drop_choices
                ],
                "usage": usage,
                "system_fingerprint": "fp_fake",
                **({"prompt_token_ids": prompt_ids} if ids else {}),
                **self.chat_extra,
            },
        )

    async def _kept_completion(
        self, call: Call, send: Callable[[dict], Awaitable[None]], rest: list[str]
    ) -> None:
        """A call on a kept chat completion: ``rest`` is the path after /v1/chat/completions/."""
        kept = self.kept_completions.get(rest[0])
        if kept is None:
            await self._send_error(
                send,
                call,
                404,
                f"Chat completion with id '{rest[0]}' not found.",
                "invalid_request_error",
            )
            return
        shown = {k: v for k, v in kept.items() if k != "messages"}
        if rest[1:] == ["messages"] and call.method == "GET":
            listed = [{"id": f"{kept['id']}-{i}", **m} for i, m in enumerate(kept["messages"])]
            await self._send_json(send, call, 200, {"object": "list", "data": listed})
        elif rest[1:] or call.method not in ("GET", "POST", "DELETE"):
            await self._send_error(
                send, call, 404, f"no route for {call.method} {call.path}", "invalid_request_error"
            )
        elif call.method == "DELETE":
            del self.kept_completions[rest[0]]
            deleted = {"id": rest[0], "object": "chat.completion.deleted", "deleted": True}
            await self._send_json(send, call, 200, deleted)
        else:
            if call.method == "POST":
                kept["metadata"] = (call.body or {}).get("metadata") or {}
                shown["metadata"] = kept["metadata"]
            await self._send_json(send, call, 200, shown)

    def _file(self, file_id: str) -> dict[str, Any]:
        size = len(self.files[file_id])
        return {"id": file_id, "object": "file", "bytes": size, "purpose": "batch"}

    async def _kept_file(
        self, call: Call, send: Callable[[dict], Awaitable[None]], named: list[str]
    ) -> None:
        """A call on the files or batches it keeps (``keeps_files``): ``named`` is the path
        after /v1/ (``["files"]``, ``["batches", id, "cancel"]``...)."""
        kind, rest, method = named[0], named[1:], call.method
        number = call.number
        if kind == "files" and not rest and method == "POST":
            file_id = f"file-{self.tag}-{number}"
            self.files[file_id] = call.raw_body
            await self._send_json(send, call, 200, self._file(file_id))
            return
        if kind == "batches" and not rest and method == "POST":
            input_id = (call.body or {}).get("input_file_id")
            if input_id not in self.files:
                await self._send_error(
                    send, call, 404, f"File '{input_id}' not found.", "invalid_request_error"
                )
                return
            batch_id, output_id = f"batch_{self.tag}_{number}", f"file-{self.tag}-{number}-out"
            self.files[output_id] = b'{"custom_id": "done"}\n'
            batch = {"id": batch_id, "object": "batch", "status": "completed"}
            batch |= {"input_file_id": input_id, "output_file_id": output_id}
            self.batches[batch_id] = batch
            await self._send_json(send, call, 200, batch)
            return
        kept = self.files if kind == "files" else self.batches
        if not rest or rest[0] not in kept:
            what = "File" if kind == "files" else "Batch"
            message = f"{what} '{rest[0] if rest else ''}' not found."
            await self._send_error(send, call, 404, message, "invalid_request_error")
        elif kind == "files" and rest[1:] == ["content"] and method == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": self.files[rest[0]]})
        elif kind == "files" and not rest[1:] and method in ("GET", "DELETE"):
            shown = self._file(rest[0])
            if method == "DELETE":
                del self.files[rest[0]]
                shown = {"id": rest[0], "object": "file", "deleted": True}
            await self._send_json(send, call, 200, shown)
        elif kind == "batches" and (
            (not rest[1:] and method == "GET") or (rest[1:] == ["cancel"] and method == "POST")
        ):
            if rest[1:]:
                self.batches[rest[0]]["status"] = "cancelled"
            await self._send_json(send, call, 200, self.batches[rest[0]])
        else:
            await self._send_error(
                send, call, 404, f"no route for {method} {call.path}", "invalid_request_error"
            )

    async def _completions(
        self, call: Call, send: Callable[[dict], Awaitable[None]], gone: asyncio.Event
    ) -> None:
        body = call.body or {}
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
            prompts = [p if isinstance(p, str) else json.dumps(p) for p in prompt]  # a batch
        else:
            prompts = [prompt if isinstance(prompt, str) else json.dumps(prompt)]
        texts = [self._answer(call, p) for p in prompts for _ in range(self._n(body))]
        model = body.get("model", "fake-model")
        usage = self._usage(
            sum(_count_words(p) for p in prompts), sum(_count_words(t) for t in texts)
        )
        cid = self._named(call, "cmpl-") or f"cmpl-fake-{call.number}"
        ids = bool(body.get("return_token_ids"))
        # (Each choice's prompt: ``n`` per prompt, prompt-major; tokenized only when asked.)
        prompt_ids = [_token_ids(p) for p in prompts for _ in range(self._n(body))] if ids else []
        if body.get("stream"):
            await self._stream(
                call,
                send,
                gone,
                chat=False,
                cid=cid,
                model=model,
                texts=texts,
                usage=usage,
                prompt_ids=prompt_ids if ids else None,
            )
            return
        await self._send_json(
            send,
            call,
            200,
            {
                "id": cid,
                "object": "text_completion",
                "created": CREATED,
                "model": model,
                "choices": [
                    {
                        "text": t,
                        "index": i,
                        "logprobs": None,
                        "finish_reason": self._finish(i),
                        **(
                            {"token_ids": _token_ids(t), "prompt_token_ids": prompt_ids[i]}
                            if ids
                            else {}
                        ),
                    }
                    for i, t in enumerate(texts)
                    if i not in self.drop_choices
                ],
                "usage": usage,
                "system_fingerprint": "fp_fake",
                **self.completions_extra,
            },
        )

    async def _embeddings(self, call: Call, send: Callable[[dict], Awaitable[None]]) -> None:
        body = call.body or {}
        raw_input = body.get("input")
        if isinstance(raw_input, str) or (
            isinstance(raw_input, list) and raw_input and all(isinstance(x, int) for x in raw_input)
        ):
            items: list[Any] = [raw_input]
        elif isinstance(raw_input, list) and raw_input:
            items = raw_input
        else:
            await self._send_error(
                send,
                call,
                400,
                "'input' must be a string or a non-empty list",
                "invalid_request_error",
            )
            return
        fails = self.fail_embeddings
        if fails is not None and any(fails(item) for item in items):
            await self._send_error(send, call, 500, "input is too large to process", "server_error")
            return
        dims = body.get("dimensions") or 8
        model = body.get("model", "fake-embedding")
        broken = self.broken_list_embeddings
        if callable(broken):
            broken = broken(call)
        data = []
        for i, item in enumerate(items):
            vector = (
                self.embedding_fn(item)
                if self.embedding_fn is not None
                else _hash_vector(item, int(dims))
            )
            if broken and i > 0:
                vector = _hash_vector(["wrong", i, items], len(vector))
            encoded: Any = vector
            if body.get("encoding_format") == "base64":
                encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            if i not in self.drop_embeddings:
                data.append({"object": "embedding", "index": i, "embedding": encoded})
        tokens = sum(_count_words(x) if isinstance(x, str) else len(x) for x in items)
        await self._send_json(
            send,
            call,
            200,
            {
                "object": "list",
                "data": data,
                "model": f"{model}#call{call.number}",
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                **self.embeddings_extra,
            },
        )

    async def _stream(
        self,
        call: Call,
        send: Callable[[dict], Awaitable[None]],
        gone: asyncio.Event,
        *,
        chat: bool,
        cid: str,
        model: str,
        texts: list[str],
        usage: dict[str, int],
        prompt_ids: Any = None,
    ) -> None:
        """``prompt_ids`` (``return_token_ids``): the prompt's token ids, chat's (a list), or
        each completion choice's (a list of them); None: no token ids at all."""
        body = call.body or {}
        stream_options = body.get("stream_options")
        include_usage = (
            bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
            and not self.ignore_include_usage
        )
        continuous = include_usage and stream_options.get("continuous_usage_stats") is True
        tool_call = self.tool_call if chat else None
        llama = self.tool_call_style == "llama.cpp"
        nulls = {"role": None, "content": None, "function_call": None, "tool_calls": None}
        chunk_gate = self.chunk_gate
        gate_after = self.chunk_gate_after
        cut_after = self.cut_after
        chunk_delay = self.chunk_delay
        omit_done = self.omit_done
        shown = [i for i in range(len(texts)) if i not in self.drop_choices]
        finishing = [(i, reason) for i in shown if (reason := self._finish(i)) is not None]

        ids = prompt_ids is not None
        begun: set[int] = set()  # the completion choices that said their prompt's ids

        def frame(
            choices: list[dict[str, Any]],
            with_usage: dict[str, int] | None = None,
            prompt: list[int] | None = None,
        ) -> bytes:
            chunk: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": CREATED,
                "model": model,
                "system_fingerprint": "fp_fake",
                "choices": choices,
            }
            if include_usage:
                chunk["usage"] = usage if continuous and with_usage is None else with_usage
            if prompt is not None:
                chunk["prompt_token_ids"] = prompt
            return b"data: " + _json(chunk) + b"\n\n"

        def tool_delta(piece: str, first: bool) -> dict[str, Any]:
            assert tool_call is not None
            name, _ = tool_call
            if llama:  # id, type and name in every chunk
                return {
                    "role": None,
                    "content": None,
                    "function_call": {"name": name, "arguments": piece},
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": f"call_fake_{call.number}",
                            "type": "function",
                            "function": {"name": name, "arguments": piece},
                        }
                    ],
                }
            if first:
                return {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": f"call_fake_{call.number}",
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}

        def choice(index: int, piece: str | None, finish_reason: str | None) -> dict[str, Any]:
            if chat:
                if piece is None:
                    delta = dict(nulls) if tool_call is not None and llama else {}
                elif tool_call is not None:
                    delta = tool_delta(piece, False)
                else:
                    delta = {"content": piece}
                out = {
                    "index": index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            else:
                out = {
                    "text": piece or "",
                    "index": index,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            if ids:
                out["token_ids"] = _token_ids(piece or "")
                if not chat and index not in begun:
                    begun.add(index)
                    out["prompt_token_ids"] = prompt_ids[index]
            return out

        async def emit(data: bytes) -> None:
            if gone.is_set():
                raise _ClientGone
            await send({"type": "http.response.body", "body": data, "more_body": True})
            if gone.is_set():
                raise _ClientGone

        sent = 0
        gate_passed = False

        async def checkpoint() -> None:
            """Before a content chunk or the end: chunk_gate, cut_after, chunk_delay."""
            nonlocal gate_passed
            if chunk_gate is not None and not gate_passed and sent >= gate_after:
                gate_passed = True
                await self._hold_at_gate(chunk_gate, gone)
            if cut_after is not None and sent >= cut_after:
                raise _CutConnection(f"cut after {sent} content chunk(s)")
            if chunk_delay > 0:
                await self._until(asyncio.sleep(chunk_delay), gone)

        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-fake-call", str(call.number).encode()),
                    *self.response_headers,
                ],
            }
        )
        if self.empty_stream:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if chat and shown:
            first: dict[str, Any] = {"role": "assistant", "content": ""}
            if tool_call is not None:
                first = (
                    {**nulls, "role": "assistant"}
                    if llama
                    else {"role": "assistant", "content": None}
                )
            await emit(
                frame(
                    [
                        {
                            "index": i,
                            "delta": first,
                            "logprobs": None,
                            "finish_reason": None,
                            **({"token_ids": []} if ids else {}),
                        }
                        for i in shown
                    ],
                    prompt=prompt_ids if ids else None,
                )
            )
        for index in shown:
            if tool_call is not None and not llama:
                await emit(
                    frame(
                        [
                            {
                                "index": index,
                                "delta": tool_delta("", True),
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            for word in _WORD.findall(texts[index]):
                await checkpoint()
                await emit(frame([choice(index, word, None)]))
                sent += 1
        await checkpoint()
        if finishing:
            await emit(frame([choice(i, None, reason) for i, reason in finishing]))
        if include_usage:
            await emit(frame([], usage))
        if not omit_done:
            await emit(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # ---------------------------------------------------------------- Responses and Messages

    async def _responses(
        self, call: Call, send: Callable[[dict], Awaitable[None]], gone: asyncio.Event
    ) -> None:
        body = call.body or {}
        value = body.get("input")
        items = value if isinstance(value, list) else [{"role": "user", "content": value or ""}]
        texts = [_text_of(item.get("content")) for item in items if isinstance(item, dict)]
        text = self._answer(call, texts[-1] if texts else "")
        instructions = body.get("instructions")
        input_tokens = sum(map(_count_words, texts)) + _count_words(instructions or "")
        item_id = f"msg_fake_{call.number}"
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {
            "id": item_id,
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }
        complete = not self.omit_finish_reason
        response = {
            "id": f"resp_{self.tag}_{call.number}"
            if self.keeps_responses
            else f"resp_fake_{call.number}",
            "object": "response",
            "created_at": CREATED,
            "status": "completed" if complete else "incomplete",
            "error": None,
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "instructions": instructions,
            "model": body.get("model", "fake-model"),
            "output": [item],
            "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store", True),
            "temperature": body.get("temperature"),
            "tool_choice": "auto",
            "tools": [],
            "top_p": body.get("top_p"),
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": _count_words(text),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + _count_words(text),
            },
        }
        if self.responses_output is not None:
            if body.get("stream"):
                await self._send_error(
                    send, call, 400, "responses_output: whole only", "invalid_request_error"
                )
                return
            response["output"] = self.responses_output
        if self.keeps_responses and body.get("store") is not False:
            self.kept[response["id"]] = response
        if not body.get("stream"):
            await self._send_json(send, call, 200, response)
            return
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        head = {
            **response,
            "status": "in_progress",
            "output": [],
            "usage": None,
            "incomplete_details": None,
        }
        events: list[tuple[str, dict[str, Any], bool]] = [
            ("response.created", {"response": head}, False),
            ("response.in_progress", {"response": head}, False),
            (
                "response.output_item.added",
                {"output_index": 0, "item": {**item, "status": "in_progress", "content": []}},
                False,
            ),
            ("response.content_part.added", {**at, "part": {**part, "text": ""}}, False),
            *[
                ("response.output_text.delta", {**at, "delta": word, "logprobs": []}, True)
                for word in _WORD.findall(text)
            ],
            ("response.output_text.done", {**at, "text": text, "logprobs": []}, False),
            ("response.content_part.done", {**at, "part": part}, False),
            ("response.output_item.done", {"output_index": 0, "item": item}, False),
            (
                "response.completed" if complete else "response.incomplete",
                {"response": response},
                False,
            ),
        ]
        events = [
            (name, {"type": name, "sequence_number": number, **event}, content)
            for number, (name, event, content) in enumerate(events)
        ]
        await self._typed_stream(
            call,
            send,
            gone,
            events,
            {
                "type": "error",
                "code": "server_error",
                "message": "fake upstream stream failure",
                "param": None,
                "sequence_number": len(events),
            },
        )

    async def _messages(
        self, call: Call, send: Callable[[dict], Awaitable[None]], gone: asyncio.Event
    ) -> None:
        body = call.body or {}
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            await self._send_json(
                send,
                call,
                400,
                {
                    "type": "error",
                    "error": {
                        "type": "invalid_request_error",
                        "message": "messages: field required",
                    },
                },
            )
            return
        last = messages[-1] if isinstance(messages[-1], dict) else {}
        text = self._answer(call, _text_of(last.get("content")))
        input_tokens = _count_words(_text_of(body.get("system"))) + sum(
            _count_words(_text_of(m.get("content"))) for m in messages if isinstance(m, dict)
        )
        stop_reason = None if self.omit_finish_reason else "end_turn"
        usage = {"input_tokens": input_tokens, "output_tokens": _count_words(text)}
        message = {
            "id": f"msg_fake_{call.number}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "fake-model"),
            "content": (
                [{"type": "text", "text": text}]
                if self.message_content is None
                else self.message_content
            ),
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            if self.omit_message_usage:
                del message["usage"]
            await self._send_json(send, call, 200, message)
            return
        blocks = [
            event
            for index, block in enumerate(message["content"])
            for event in _block_events(index, block)
        ]
        events: list[tuple[str, dict[str, Any], bool]] = [
            (
                "message_start",
                {
                    "message": {
                        **message,
                        "content": [],
                        "stop_reason": None,
                        "usage": {**usage, "output_tokens": 1},
                    }
                },
                False,
            ),
            *blocks[:1],
            ("ping", {}, False),  # (after the first block's start, as Anthropic sends it)
            *blocks[1:],
            (
                "message_delta",
                {
                    "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                    "usage": {"output_tokens": usage["output_tokens"]},
                },
                False,
            ),
            ("message_stop", {}, False),
        ]
        events = [(name, {"type": name, **event}, content) for name, event, content in events]
        if self.message_events is not None:
            events = [
                (event["type"], event, event["type"] == "content_block_delta")
                for event in self.message_events([event for _, event, _ in events])
            ]
        await self._typed_stream(
            call,
            send,
            gone,
            events,
            {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "fake upstream stream failure"},
            },
        )

    async def _typed_stream(
        self,
        call: Call,
        send: Callable[[dict], Awaitable[None]],
        gone: asyncio.Event,
        events: list[tuple[str, dict[str, Any], bool]],
        error: dict[str, Any],
    ) -> None:
        """A typed event stream (``event: NAME`` + ``data: {...}``), no ``[DONE]``. The third
        item of each event says whether it carries content (the gate, cut and error counts)."""
        chunk_gate, gate_after = self.chunk_gate, self.chunk_gate_after
        cut_after, error_after = self.cut_after, self.error_after
        if self.omit_done or self.typed_done:
            events = events[:-1]  # ends cleanly, without its last event
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-fake-call", str(call.number).encode()),
                    *self.response_headers,
                ],
            }
        )
        if self.empty_stream:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

        async def emit(name: str, event: dict[str, Any]) -> None:
            if gone.is_set():
                raise _ClientGone
            data = b"event: " + name.encode() + b"\ndata: " + _json(event) + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
            if gone.is_set():
                raise _ClientGone

        sent = 0
        gate_passed = content_over = False
        for name, event, content in events:
            # As chat's streams: the controls act before each content event, and once after the
            # last one (when there were fewer content events than they count).
            if content or (sent and not content_over):
                content_over = not content
                if chunk_gate is not None and not gate_passed and sent >= gate_after:
                    gate_passed = True
                    await self._hold_at_gate(chunk_gate, gone)
                if cut_after is not None and sent >= cut_after:
                    raise _CutConnection(f"cut after {sent} content event(s)")
                if error_after is not None and sent >= error_after:
                    await emit("error", error)
                    break
            if content:
                if self.chunk_delay > 0:
                    await self._until(asyncio.sleep(self.chunk_delay), gone)
                sent += 1
            await emit(name, event)
        else:  # (no error event ended it)
            if self.typed_done:
                end = b"data: [DONE]\n\n"
                await send({"type": "http.response.body", "body": end, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # ---------------------------------------------------------------- plain responses

    async def _send_json(
        self, send: Callable[[dict], Awaitable[None]], call: Call, status: int, payload: Any
    ) -> None:
        data = _json(payload)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"x-fake-call", str(call.number).encode()),
                    *self.response_headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def _send_error(
        self,
        send: Callable[[dict], Awaitable[None]],
        call: Call,
        status: int,
        message: str,
        kind: str,
    ) -> None:
        await self._send_json(
            send, call, status, {"error": {"message": message, "type": kind, "code": None}}
        )
