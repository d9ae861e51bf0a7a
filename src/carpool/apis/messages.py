"""Anthropic's Messages API (``POST /v1/messages``), as Anthropic, vLLM and SGLang serve it.

Contract (``apis.base.Api``):
- The answer is a message: ``{"id", "type": "message", "role": "assistant", "content":
  [blocks], "model", "stop_reason", "stop_sequence", "usage": {"input_tokens",
  "output_tokens", ...}}``; its prompt's tokens are ``input_tokens`` plus those its prompt
  cache wrote and read (``cache_creation_input_tokens``, ``cache_read_input_tokens``, counted
  apart): ``usage_tokens`` (``tokens_saved``) adds all of them to ``output_tokens``. It is
  complete (storable) when it has a ``stop_reason`` (``end_turn``, ``max_tokens``,
  ``stop_sequence``, ``tool_use``...: like chat's finish reasons, ``max_tokens`` included); one
  without, or with ``pause_turn`` (a turn paused for the client to continue), is served as the
  upstream sent it and never stored (an idempotent retry still replays it: ``final``).
- Its stream is typed events with no ``[DONE]``: ``message_start`` (the message, no content),
  per block ``content_block_start``, ``content_block_delta`` (``text_delta``,
  ``input_json_delta``, ``thinking_delta``, ``signature_delta``, ``citations_delta``,
  ``compaction_delta``) and ``content_block_stop``, then ``message_delta`` (its ``delta``:
  ``stop_reason``, ``stop_sequence``...; the cumulative ``usage``; beside them message fields
  such as ``context_management``) and ``message_stop``; ``ping`` events anywhere. It ended
  whole at ``message_stop``: a stream that stops before it fails the flight; an ``error`` event
  is the upstream's failure, relayed to every client.
- Assembly is what the non-streaming call answers, as the ``anthropic`` SDK's own accumulation
  makes it: the blocks in index order, texts and thinking concatenated, a tool call's
  ``input`` parsed from its JSON pieces (an integer past 64 bits as written: ``exact_json``),
  a compaction block's ``content`` and
  ``encrypted_content`` from its ``compaction_delta``, the ``model`` of a ``fallback`` block's
  ``to`` as the message's; ``message_delta``'s delta (a null ``container`` aside), usage (its
  non-null counts) and other fields (non-null: ``context_management``,
  ``input_transformations``) laid over ``message_start``'s. A stream with an event or a delta
  it does not know, or a delta on a block of another type, or a tool call whose pieces make
  no JSON object (``max_tokens`` cut it mid-way: its ``input`` is then ``{}``, an object as
  the schema and the SDK have it), assembles into what it could make, which may lack what the
  stream carried: served to the clients of its call, never stored (``judge_stream``'s False).
- Synthesized streams (a cached or whole answer for a streaming client): ``message_start``
  (the message with no content, ``stop_reason``, ``stop_sequence`` and ``context_management``
  null, its usage), per block a start, its text (or thinking, or a tool call's input as JSON,
  or a compaction's summary in a ``compaction_delta``) as one delta, a stop; then
  ``message_delta`` with the stop fields, the usage and ``context_management``, and
  ``message_stop``. The official ``anthropic`` SDK's ``messages.create(stream=True)`` and
  ``messages.stream()`` read them.
- Sharing: Anthropic's default temperature is 1, so an absent ``temperature`` samples:
  ``bypass`` (``temperature: 0`` or ``top_k: 1`` shares, where the upstream takes them:
  Anthropic's API version 2026-10-21 refuses both, and only ``x-carpool-share: sampled``
  shares there; docs/design.md). The tenant comes from ``x-api-key``
  like any credential; ``anthropic-version`` and ``anthropic-beta`` are forwarded and, as
  headers that may change the answer, part of the key (``fingerprint.varying_headers``). Out
  of the key: ``stream``, and a ``metadata`` of at most its ``user_id``; every other field is
  in, OpenAI's ``user`` too (Anthropic refuses what it does not know: ``canonical``).
- The semantic view: the last message when it is the user's, of plain text; ``system``, the
  earlier turns and every parameter are in the scope.
- Errors are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}`` (the type
  from the status: ``invalid_request_error``, ``authentication_error``, ``billing_error``,
  ``permission_error``, ``not_found_error``, ``request_too_large``, ``rate_limit_error``,
  ``timeout_error`` (504: the upstream timed out), ``overloaded_error`` (529, and the
  gateway's own 503s: overloaded, shutting down), else ``api_error``);
  an upstream's error passes through as it came, and idempotency problems stay problem+json.
  A failed stream ends with ``event: error`` carrying the same shape (the SDK raises on it).
"""

from __future__ import annotations

from typing import Any

import orjson

from .. import exact_json
from ..errors import (
    CarpoolError,
    GatewayOverloaded,
    RequestError,
    ShuttingDown,
    UpstreamStatusError,
    UpstreamStreamBroken,
)
from ..sse import event_frame
from .base import (
    TypedApi,
    check_messages,
    ends_with,
    last_user_turn,
    names_tenant_state,
    passed_through,
    text_parts,
    typed_frame,
)

LAST_EVENT = "message_stop"
# The message fields that a stream sends in ``message_delta`` rather than ``message_start``.
# Stop reasons of a turn not finished: none yet, or ``pause_turn`` (Anthropic paused a long
# turn of its own tools for the client to send back and go on). Served, never stored.
_UNFINISHED = (None, "pause_turn")
_DELTA_FIELDS = ("stop_reason", "stop_sequence", "stop_details", "container")
# The message fields that it sends beside ``message_delta``'s delta, at the top of the event.
_END_FIELDS = ("context_management",)
_TOOL_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
# The block types each delta type is for (what the ``anthropic`` SDK's accumulation lays it on).
_DELTA_BLOCKS = {
    "text_delta": frozenset({"text"}),
    "citations_delta": frozenset({"text"}),
    "input_json_delta": _TOOL_BLOCKS,
    "thinking_delta": frozenset({"thinking"}),
    "signature_delta": frozenset({"thinking"}),
    "compaction_delta": frozenset({"compaction"}),
}
# The events that add nothing to the message; and message_delta's own fields (the others are
# the message's).
_NO_CONTENT_EVENTS = frozenset({"content_block_stop", "ping", LAST_EVENT})
_DELTA_EVENT_OWN = frozenset({"type", "delta", "usage"})
# Anthropic's error types, by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class MessagesApi(TypedApi):
    kind, path, upstream_path = "messages", "/v1/messages", "/messages"
    answer_field = "content"
    last_event = staticmethod(ends_with(frozenset({LAST_EVENT})))
    # Anthropic counts the prompt tokens its prompt cache wrote and read apart from
    # ``input_tokens`` (OpenAI's cached tokens are inside ``prompt_tokens``).
    prompt_apart = ("cache_creation_input_tokens", "cache_read_input_tokens")

    # --------------------------------------------------------------------------- the request

    def validate(self, body: dict[str, Any]) -> None:
        check_messages(body)

    def never_shared(self, body: dict[str, Any]) -> str | None:
        # Server tools (web search, code execution, fetches), MCP servers and containers act on,
        # and read, state that changes: two identical requests are not the same request.
        if body.get("mcp_servers") or body.get("container") is not None:
            return "server_tools"
        tools = body.get("tools")
        if isinstance(tools, list) and any(
            isinstance(tool, dict)
            and isinstance(tool.get("type"), str)
            and tool["type"].startswith(("web_search", "web_fetch", "code_execution"))
            for tool in tools
        ):
            return "server_tools"
        return super().never_shared(body)

    def deterministic(self, body: dict[str, Any], engine: str = "generic") -> bool:
        # The Messages API has no ``seed``: temperature 0 or top_k 1 (absent temperature is
        # Anthropic's default, 1).
        if body.get("top_k") == 1:
            return True
        temperature = body.get("temperature")
        return temperature is not None and not isinstance(temperature, bool) and temperature == 0

    def final(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        # A message, finished or not (no stop reason): the upstream generated it.
        return isinstance(body, dict) and body.get("type") == "message"

    def client_usage(self, body: dict[str, Any], stream: bool) -> bool:
        return stream  # message_start and message_delta always carry it

    def input_texts(self, body: dict[str, Any]) -> list[str]:
        texts = text_parts(body.get("system"))
        for message in body["messages"]:
            texts += text_parts(message.get("content"))
        return texts

    def answer_texts(self, answer: dict[str, Any]) -> list[str]:
        return text_parts(answer.get("content"))

    def tenant_bound(self, body: dict[str, Any]) -> bool:
        # Compaction (``context_management``, or its own ``compaction``) answers with a signed
        # block whose ``encrypted_content`` the next turn sends back verbatim (a turn carrying
        # one is bound: ``names_tenant_state``): whether Anthropic takes it from another
        # organization is not said, so not shared.
        return (
            body.get("context_management") is not None
            or body.get("compaction") is not None
            or names_tenant_state(body)
        )

    def semantic_split(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        return last_user_turn(body)

    # --------------------------------------------------------------------------- the stream

    def frame(self, payload: bytes, chunk: dict[str, Any] | None = None) -> bytes:
        return typed_frame(payload, chunk)

    def judge_stream(
        self, chunks: list[dict[str, Any]], asked: dict[str, Any] | None
    ) -> tuple[dict[str, Any], bool]:
        if not chunks or chunks[-1].get("type") != LAST_EVENT:
            raise UpstreamStreamBroken("the upstream stream ended before message_stop")
        body, faithful = assembled(chunks)
        return body, faithful and self.complete(body)

    # --------------------------------------------------------------------------- the answer

    def complete(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        return (
            isinstance(body, dict)
            and body.get("type") == "message"
            and body.get("stop_reason") not in _UNFINISHED
            and isinstance(body.get("content"), list)
        )

    def events(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        return synthesize(body)

    def error_event(self, error: CarpoolError, sent: int | None = 0) -> bytes:
        return event_frame(b"error", orjson.dumps({"type": "error", "error": _error_object(error)}))

    def error_body(self, error: CarpoolError) -> bytes:
        if passed_through(error):
            return error.body()
        return orjson.dumps({"type": "error", "error": _error_object(error)})


def _error_object(error: CarpoolError) -> dict[str, Any]:
    """Anthropic's error object: the upstream's own when it sent one (in its stream, or as its
    answer), else the gateway's error as one."""
    if (isinstance(error, UpstreamStatusError) and not error.rewritten) or (
        isinstance(error, UpstreamStreamBroken) and error.upstream_error is not None
    ):
        upstream = error.error_object()
        if isinstance(upstream.get("type"), str) and isinstance(upstream.get("message"), str):
            return upstream
    # (The client's own error is never Anthropic's ``api_error``, its internal failure: a
    # transfer coding refused is a 501, RFC 9112's status, and the request's fault. The
    # gateway's own 503s that say "try again", overloaded or stopping, are Anthropic's overload.)
    if isinstance(error, (GatewayOverloaded, ShuttingDown)):
        return {"type": "overloaded_error", "message": error.message}
    client = 400 <= error.status < 500 or isinstance(error, RequestError)
    return {
        "type": _ERROR_TYPES.get(error.status, "invalid_request_error" if client else "api_error"),
        "message": error.message,
    }


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a stream makes (see the module docstring)."""
    return assembled(chunks)[0]


def assembled(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """(the message a stream makes, whether it is faithful: every event and delta in it is one
    this assembly knows, each delta on a block of the type it is for, every tool input's
    pieces a JSON object). What is not faithful may lack what the stream carried: served,
    never stored."""
    message: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    pieces: dict[int, list[str]] = {}  # a tool call's input, as JSON text in pieces
    faithful = True
    for chunk in chunks:
        kind = chunk.get("type")
        if kind == "message_start" and isinstance(chunk.get("message"), dict):
            message = dict(chunk["message"])
            start_usage = message.get("usage")  # never trusted to be well formed
            usage = dict(start_usage) if isinstance(start_usage, dict) else {}
        elif kind == "content_block_start" and isinstance(chunk.get("index"), int):
            block = chunk.get("content_block")
            blocks[chunk["index"]] = dict(block) if isinstance(block, dict) else {}
            to = blocks[chunk["index"]].get("to")
            if blocks[chunk["index"]].get("type") == "fallback" and isinstance(to, dict):
                # The model that served what follows: the whole answer is labelled with it.
                if "model" in to:
                    message["model"] = to["model"]
        elif kind == "content_block_delta" and isinstance(chunk.get("index"), int):
            delta = chunk.get("delta")
            if isinstance(delta, dict):
                faithful &= _add_delta(
                    blocks.setdefault(chunk["index"], {}),
                    pieces.setdefault(chunk["index"], []),
                    delta,
                )
            else:
                faithful = False
        elif kind == "message_delta":
            delta = chunk.get("delta")
            if isinstance(delta, dict):
                # (A container is sent once, and kept when a later delta says null.)
                message.update(
                    (k, v) for k, v in delta.items() if v is not None or k != "container"
                )
            if isinstance(chunk.get("usage"), dict):
                # Cumulative counts: they replace message_start's; absent ones keep them.
                usage.update((k, v) for k, v in chunk["usage"].items() if v is not None)
            # Its other fields (context_management, input_transformations...) are the
            # message's, laid over message_start's; a null one keeps message_start's.
            message.update(
                (k, v) for k, v in chunk.items() if k not in _DELTA_EVENT_OWN and v is not None
            )
        elif kind not in _NO_CONTENT_EVENTS:
            faithful = False  # an event this assembly does not know, or a malformed one
    for index, parts in pieces.items():
        if parts:
            text = "".join(parts)
            try:
                value = exact_json.loads(text) if text else {}
            except orjson.JSONDecodeError:
                value = None
            if not isinstance(value, dict):
                # JSON cut short (by ``max_tokens`` mid-call) or no object: the input is an
                # object all the same, as the schema has it and as the SDK's accumulation makes
                # of an unfinished key (``{}``; it parses a prefix, where this does not). Short
                # of what the stream carried: served to this call's clients, never stored.
                value, faithful = {}, False
            blocks[index]["input"] = value
    message["content"] = [blocks[i] for i in sorted(blocks)]
    if usage or "usage" in message:
        message["usage"] = usage
    return message, faithful


def _add_delta(block: dict[str, Any], pieces: list[str], delta: dict[str, Any]) -> bool:
    """Lay ``delta`` on ``block``; whether it is a delta of that block's type, as the
    ``anthropic`` SDK's accumulation takes it (another is laid on all the same)."""
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = str(block.get("text") or "") + str(delta.get("text") or "")
    elif kind == "input_json_delta":
        pieces.append(str(delta.get("partial_json") or ""))
    elif kind == "thinking_delta":
        block["thinking"] = str(block.get("thinking") or "") + str(delta.get("thinking") or "")
    elif kind == "signature_delta":
        block["signature"] = delta.get("signature")
    elif kind == "citations_delta":
        block["citations"] = [*(block.get("citations") or []), delta.get("citation")]
    elif kind == "compaction_delta":
        # The summary and its opaque form, whole: each delta replaces them.
        block["content"] = delta.get("content")
        block["encrypted_content"] = delta.get("encrypted_content")
    else:
        return False
    return block.get("type") in _DELTA_BLOCKS[kind]


def synthesize(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a stream that makes ``body`` (see the module docstring)."""
    usage = body.get("usage")
    # The message as message_start sends it: no content and no stop yet, in the body's order.
    start = {
        k: None if k in _DELTA_FIELDS else v for k, v in body.items() if k not in _DELTA_FIELDS[2:]
    }
    start.update(content=[], stop_reason=None, stop_sequence=None)
    start.update((k, None) for k in _END_FIELDS if k in start)
    if not isinstance(usage, dict):
        # (An engine's message without one: the SDKs build the message from message_start's
        # and add message_delta's counts to its usage, which must be there: the stream helper
        # raised on such a hit. Zeros, as message_delta's below; the reply says the usage is
        # missing, ``x-carpool-usage``.)
        start["usage"] = {"input_tokens": 0, "output_tokens": 0}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    content = body.get("content")
    for index, block in enumerate(content if isinstance(content, list) else ()):
        events += _block_events(index, block if isinstance(block, dict) else {})
    delta = {k: body.get(k) for k in _DELTA_FIELDS[:2]}
    delta.update((k, body[k]) for k in _DELTA_FIELDS[2:] if k in body)
    last: dict[str, Any] = {
        "type": "message_delta",
        "delta": delta,
        "usage": usage if isinstance(usage, dict) else {"output_tokens": 0},
    }
    last.update((k, body[k]) for k in _END_FIELDS if body.get(k) is not None)
    events.append(last)
    events.append({"type": LAST_EVENT})
    return events


def _block_events(index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
    kind = block.get("type")
    if kind == "text" and isinstance(block.get("text"), str):
        start, delta = {**block, "text": ""}, {"type": "text_delta", "text": block["text"]}
    elif kind in _TOOL_BLOCKS and isinstance(block.get("input"), dict):
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}
    elif kind == "thinking" and isinstance(block.get("thinking"), str):
        # (An empty signature to begin, as Anthropic's streams have it, only for a signed block:
        # an engine's unsigned one gained a signature it never had.)
        start = {**block, "thinking": ""}
        if isinstance(block.get("signature"), str):
            start["signature"] = ""
        delta = {"type": "thinking_delta", "thinking": block["thinking"]}
    elif kind == "compaction":
        start = {**block, "content": None, "encrypted_content": None}
        delta = {
            "type": "compaction_delta",
            "content": block.get("content"),
            "encrypted_content": block.get("encrypted_content"),
        }
    else:  # redacted thinking, tool results, a fallback...: whole
        start, delta = block, None
    events: list[dict[str, Any]] = [
        {"type": "content_block_start", "index": index, "content_block": start}
    ]
    if delta is not None:
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
    if kind == "thinking" and isinstance(block.get("signature"), str) and delta is not None:
        events.append(
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "signature_delta", "signature": block["signature"]},
            }
        )
    events.append({"type": "content_block_stop", "index": index})
    return events
