"""OpenAI's Responses API (``POST /v1/responses``), as OpenAI, vLLM and SGLang serve it.

Contract (``apis.base.Api``):
- The answer is a ``response`` object: ``{"id", "object": "response", "created_at", "status",
  "model", "output": [items], "usage": {"input_tokens", "output_tokens", ...}, ...}``. It is
  complete (storable) only with ``status: "completed"``; ``incomplete`` (``max_output_tokens``,
  a content filter), ``failed`` and anything else are served as the upstream sent them and never
  stored.
- Its stream is typed events (``event: response.created`` + ``data: {"type":
  "response.created", "sequence_number": 0, "response": {...}}``, ...,
  ``response.output_text.delta``, ..., ``response.completed``), with no ``[DONE]``. It ended
  whole once its last event came: ``response.completed``, ``response.incomplete`` or
  ``response.failed``, each carrying the whole response object, which is the assembled answer
  (its ``output``, if empty, is made of the ``response.output_item.done`` items). A stream that
  stops before one of them fails the flight; an ``error`` event is the upstream's failure,
  relayed to every client. The gateway's own ``error`` event (a stream that failed) is
  numbered after the events its client was sent (``error_event``'s ``sent``).
- Synthesized streams (a cached or whole answer for a streaming client) are the events OpenAI
  sends, numbered from 0: ``response.created`` and ``response.in_progress`` (status
  ``in_progress``, no output, no usage, and ``error`` / ``incomplete_details`` null: how it
  ended is said by its last event only); per output item ``response.output_item.added``, its
  content (a message's text parts as ``response.content_part.added``, one
  ``response.output_text.delta`` with the whole text and the part's ``logprobs``,
  ``response.output_text.done`` with them too, ``response.content_part.done``; refusals alike;
  a function call's arguments as one ``response.function_call_arguments.delta`` and ``.done``;
  a reasoning item's summary parts each as ``response.reasoning_summary_part.added``, one
  ``response.reasoning_summary_text.delta``, ``.done`` and
  ``response.reasoning_summary_part.done``, then its text parts (``reasoning_text``, vLLM's)
  each as ``response.content_part.added``, one ``response.reasoning_text.delta``, ``.done`` and
  ``response.content_part.done``) and ``response.output_item.done`` with the whole item; then
  the last event for the response's status with the whole response.
  The official SDK's ``responses.create(stream=True)`` and ``responses.stream()`` read them.
- Sharing: ``temperature`` absent is the upstream's default (1), which samples: ``bypass``, as
  for chat. ``background: true`` never shares (the answer is a queued job the client polls with
  ``GET /v1/responses/{id}``, which passes through). ``conversation`` never shares either: the
  upstream appends every call's input and output to the conversation, so two identical requests
  in one are not the same request (the second sees the first's turn) and a shared answer would
  leave the conversation short of a turn. ``previous_response_id`` names an immutable stored
  response: it is part of the key like any field. ``store`` is forwarded as it came (a cached
  answer's id is the one the upstream stored for the call that produced it).
- State: a stored response (``store`` not false) is kept by the replica that made it, alone.
  ``state_made`` is a whole answer's ``id``, or a stream lifecycle event's response's (the
  first event, ``response.created``, has it), unless it says ``store: false``;
  ``state_continued`` is a request's ``previous_response_id``. With several replicas, the
  follow-ups go to the one that made it (``routing.state``). A stored answer is tagged with
  both (``store.base.state_tag``, in its requester's tenant), so that a pass-through ``DELETE
  /v1/responses/{id}`` the upstream answers 2xx drops what is or continues that response
  (``Gateway.passthrough``).
- The semantic view: ``input`` when it is a string, or the last input item when it is a user
  message of plain text (``input_text`` parts); ``instructions``, earlier items and every
  parameter are in the scope. None when an earlier item is no message (a function call, its
  output: exact, whole, as a chat with a tool call). Only with ``store: false``: a stored answer's id names the
  response kept for its own input (``previous_response_id`` continues that conversation,
  ``input_items`` lists that input), which a paraphrase must not be handed. None either with
  vLLM's ``enable_response_messages`` (anything but false or null): the answer carries the
  whole prompt (``input_messages``; ``openai.answer_repeats_prompt`` reads it in the answer
  too, whatever asked for it).
- Errors: OpenAI's shape, as for chat. A failed stream ends with ``event: error`` whose data is
  the Responses API's error event (``type``, ``code``, ``message``, ``param``) carrying the error
  object under ``error`` too, so that the ``openai`` SDK raises ``APIError`` on it.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson

from ..errors import CarpoolError, RequestError, UpstreamStreamBroken
from ..sse import event_frame
from .base import (
    TypedApi,
    check_fields,
    ends_with,
    names_tenant_state,
    plain_text,
    text_parts,
    typed_frame,
)

# The events a stream ends with, each carrying the whole response object.
LAST = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}
LAST_EVENTS = frozenset(LAST.values())
_LIFECYCLE = frozenset(
    {"response.created", "response.queued", "response.in_progress", *LAST_EVENTS}
)
_INPUT_TEXT = frozenset({"input_text", "text"})


class ResponsesApi(TypedApi):
    kind, path, upstream_path = "responses", "/v1/responses", "/responses"
    answer_field = "output"
    last_event = staticmethod(ends_with(LAST_EVENTS))
    state_field = b'"response"'  # (only a lifecycle event carries the response)

    # --------------------------------------------------------------------------- the request

    def validate(self, body: dict[str, Any]) -> None:
        # ``model`` may be left to a stored prompt (``prompt: {"id": ...}``); ``input`` to
        # ``previous_response_id`` or ``conversation``: only their types are checked here.
        if "model" in body and not isinstance(body["model"], str):
            raise RequestError("'model' must be a string", param="model")
        value = body.get("input")
        if value is not None and not isinstance(value, (str, list)):
            raise RequestError("'input' must be a string or a list of input items", param="input")
        for name in ("background", "store"):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise RequestError(f"'{name}' must be a boolean", param=name)
        check_fields(body)

    def runs_detached(self, body: dict[str, Any]) -> bool:
        return body.get("background") is True

    def never_shared(self, body: dict[str, Any]) -> str | None:
        if body.get("background"):
            return "background"
        if body.get("conversation") is not None:
            return "conversation"
        # Tools the upstream runs itself (searches, code, remote MCP servers) act on, and read,
        # state that changes: two identical requests are not the same request.
        tools = body.get("tools")
        if isinstance(tools, list) and any(
            isinstance(tool, dict) and tool.get("type") not in (None, "function", "custom")
            for tool in tools
        ):
            return "server_tools"
        # A stored prompt without a version is its latest version, which may change.
        prompt = body.get("prompt")
        if isinstance(prompt, dict) and prompt.get("version") is None:
            return "prompt_latest"
        return super().never_shared(body)

    def tenant_bound(self, body: dict[str, Any]) -> bool:
        # Stored (the default), the answer's id names a response kept under the tenant that
        # made it: another tenant could neither continue from it nor fetch it. A stored prompt
        # (``prompt.id``) is the account's too.
        # Stateless, its reasoning (or a compaction, ``context_management``) may come back
        # encrypted for the organization that made it, which alone the upstream decrypts when
        # the next turn sends it (OpenAI: ``invalid_encrypted_content`` for another's); an
        # input item carrying one (``names_tenant_state``) is that organization's to send.
        # An input item with an ``id`` is looked up in the account's store: one by its id
        # alone (``item_reference``'s ``type`` is optional), a reasoning item without its
        # encrypted content, and an output item sent back with its id alike (another
        # account's: "Item with id ... not found").
        include = body.get("include")
        items = body.get("input")
        return (
            body.get("store") is not False
            or isinstance(body.get("prompt"), dict)
            or (isinstance(include, list) and "reasoning.encrypted_content" in include)
            or body.get("context_management") is not None
            or (
                isinstance(items, list)
                and any(isinstance(item, dict) and item.get("id") is not None for item in items)
            )
            or names_tenant_state(body)
        )

    def deterministic(self, body: dict[str, Any], engine: str = "generic") -> bool:
        # The Responses API has no ``seed`` nor ``top_k``: only temperature 0.
        temperature = body.get("temperature")
        return temperature is not None and not isinstance(temperature, bool) and temperature == 0

    def client_usage(self, body: dict[str, Any], stream: bool) -> bool:
        return stream  # the last event always carries the usage

    def input_texts(self, body: dict[str, Any]) -> list[str]:
        texts = [body["instructions"]] if isinstance(body.get("instructions"), str) else []
        value = body.get("input")
        if isinstance(value, str):
            return [*texts, value]
        for item in value if isinstance(value, list) else ():
            if isinstance(item, dict):
                texts += text_parts(item.get("content"))
        return texts

    def answer_texts(self, answer: dict[str, Any]) -> list[str]:
        # (Its output items, given back as the next turn's input items: ``input_texts``.)
        output = answer.get("output")
        texts: list[str] = []
        for item in output if isinstance(output, list) else ():
            if isinstance(item, dict):
                texts += text_parts(item.get("content"))
        return texts

    def keeps_state(self, body: dict[str, Any]) -> bool:
        return True  # stored unless ``store: false``, which still continues one

    def state_continued(self, body: dict[str, Any]) -> str | None:
        previous = body.get("previous_response_id")
        return previous if isinstance(previous, str) else None

    def semantic_split(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        if body.get("store") is not False:  # stored (the default): the id names another input
            return None
        if body.get("enable_response_messages") not in (None, False):
            return None  # (vLLM's: the answer carries the prompt, ``input_messages``)
        value = body.get("input")
        rest = {k: v for k, v in body.items() if k != "input"}
        if isinstance(value, str):
            return value, rest
        if not isinstance(value, list) or not value or not isinstance(value[-1], dict):
            return None
        last = value[-1]
        if last.get("role") != "user" or last.get("type", "message") != "message":
            return None
        if not all(
            isinstance(item, dict) and item.get("type", "message") == "message"
            for item in value[:-1]
        ):
            return None  # a function call or its output before: exact, whole, as in chat
        text = plain_text(last.get("content"), _INPUT_TEXT)
        if text is None:
            return None
        return text, {
            **rest,
            "input": [*value[:-1], {k: v for k, v in last.items() if k != "content"}],
        }

    # --------------------------------------------------------------------------- the stream

    def frame(self, payload: bytes, chunk: dict[str, Any] | None = None) -> bytes:
        return typed_frame(payload, chunk)

    def judge_stream(
        self, chunks: list[dict[str, Any]], asked: dict[str, Any] | None
    ) -> tuple[dict[str, Any], bool]:
        if not chunks or chunks[-1].get("type") not in LAST_EVENTS:
            raise UpstreamStreamBroken(
                "the upstream stream ended before its last event (response.completed)"
            )
        body = assemble(chunks)
        return body, self.complete(body)

    # --------------------------------------------------------------------------- the answer

    def complete(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        return (
            isinstance(body, dict)
            and body.get("status") == "completed"
            and isinstance(body.get("output"), list)
        )

    def final(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        # Queued (background), in progress, incomplete or failed: the upstream took the request
        # and holds a response for it (a job, a conversation turn): a retry must not run again.
        return (
            isinstance(body, dict)
            and body.get("object") == "response"
            and isinstance(body.get("status"), str)
        )

    def state_made(self, answer: dict[str, Any]) -> str | None:
        # A stream's lifecycle event carries the response; a whole body is one.
        response = answer.get("response") if answer.get("type") in _LIFECYCLE else answer
        if not isinstance(response, dict) or response.get("store") is False:
            return None
        made = response.get("id")
        return made if isinstance(made, str) and made else None

    def events(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        return synthesize(body)

    def error_event(self, error: CarpoolError, sent: int | None = 0) -> bytes:
        obj = error.error_object()
        event = {
            "type": "error",
            "code": obj.get("code"),
            "message": obj.get("message"),
            "param": obj.get("param"),
            "error": obj,
        }
        if sent is not None:
            # (Every event of a Responses stream is numbered, from 0 without a gap: OpenAI's
            # ``ResponseErrorEvent`` too. Without it a strict reader took the end for broken.)
            event["sequence_number"] = sent
        return event_frame(b"error", orjson.dumps(event))


def assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The response object of a stream: the last lifecycle event's, with the finished output
    items when it carries none."""
    response: dict[str, Any] = {}
    items: dict[int, Any] = {}
    for chunk in chunks:
        kind = chunk.get("type")
        if kind in _LIFECYCLE and isinstance(chunk.get("response"), dict):
            response = chunk["response"]
        elif kind == "response.output_item.done" and isinstance(chunk.get("output_index"), int):
            items[chunk["output_index"]] = chunk.get("item")
    body = dict(response)
    if not body.get("output") and items:
        body["output"] = [items[i] for i in sorted(items)]
    return body


def synthesize(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of a stream that makes ``body`` (see the module docstring)."""
    numbers = itertools.count()
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": next(numbers), **fields})

    head = {**body, "status": "in_progress", "output": [], "usage": None}
    for ending in ("error", "incomplete_details"):  # (not known yet while in progress)
        if ending in head:
            head[ending] = None
    emit("response.created", response=head)
    emit("response.in_progress", response=head)
    output = body.get("output")
    for index, item in enumerate(output if isinstance(output, list) else ()):
        if not isinstance(item, dict):
            continue
        where = {"item_id": item.get("id"), "output_index": index}
        if item.get("type") == "message" and isinstance(item.get("content"), list):
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            for position, part in enumerate(item["content"]):
                _part_events(emit, where, position, part)
        elif item.get("type") == "function_call" and isinstance(item.get("arguments"), str):
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        elif item.get("type") == "reasoning":
            _reasoning_events(emit, index, item)
        else:  # tool calls of the server...: whole
            emit("response.output_item.added", output_index=index, item=item)
        emit("response.output_item.done", output_index=index, item=item)
    status = body.get("status")
    emit(LAST.get(status if isinstance(status, str) else "", "response.failed"), response=body)
    return events


def _reasoning_events(emit: Any, index: int, item: dict[str, Any]) -> None:
    """A reasoning item: added with no summary (nor text) yet; each summary part (``summary_text``)
    added, its text as one delta, done; then each part of its text (``reasoning_text``, vLLM's)
    alike. (``response.output_item.done`` follows, with the whole item.)"""
    summary, content = item.get("summary"), item.get("content")
    added = dict(item)
    for name, parts in (("summary", summary), ("content", content)):
        if isinstance(parts, list):
            added[name] = []
    if "status" in item:
        added["status"] = "in_progress"
    emit("response.output_item.added", output_index=index, item=added)
    where = {"item_id": item.get("id"), "output_index": index}
    for position, part in enumerate(summary if isinstance(summary, list) else ()):
        if _text_of(part, "summary_text") is None:
            continue  # (a part OpenAI does not stream: in the whole item only)
        at = {**where, "summary_index": position}
        emit("response.reasoning_summary_part.added", **at, part={**part, "text": ""})
        emit("response.reasoning_summary_text.delta", **at, delta=part["text"])
        emit("response.reasoning_summary_text.done", **at, text=part["text"])
        emit("response.reasoning_summary_part.done", **at, part=part)
    for position, part in enumerate(content if isinstance(content, list) else ()):
        if _text_of(part, "reasoning_text") is None:
            continue
        at = {**where, "content_index": position}
        emit("response.content_part.added", **at, part={**part, "text": ""})
        emit("response.reasoning_text.delta", **at, delta=part["text"])
        emit("response.reasoning_text.done", **at, text=part["text"])
        emit("response.content_part.done", **at, part=part)


def _text_of(part: Any, kind: str) -> str | None:
    """The text of a part of type ``kind``, or None."""
    text = part.get("text") if isinstance(part, dict) and part.get("type") == kind else None
    return text if isinstance(text, str) else None


def _part_events(emit: Any, where: dict[str, Any], position: int, part: Any) -> None:
    """A message's content part: added, its text as one delta (with its logprobs), done."""
    at = {**where, "content_index": position}
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "output_text" and isinstance(part.get("text"), str):
        logprobs = part.get("logprobs")
        logprobs = logprobs if isinstance(logprobs, list) else []
        added = {**part, "text": "", **({"logprobs": []} if "logprobs" in part else {})}
        emit("response.content_part.added", **at, part=added)
        emit("response.output_text.delta", **at, delta=part["text"], logprobs=logprobs)
        emit("response.output_text.done", **at, text=part["text"], logprobs=logprobs)
    elif kind == "refusal" and isinstance(part.get("refusal"), str):
        emit("response.content_part.added", **at, part={**part, "refusal": ""})
        emit("response.refusal.delta", **at, delta=part["refusal"])
        emit("response.refusal.done", **at, refusal=part["refusal"])
    else:
        emit("response.content_part.added", **at, part=part)
    emit("response.content_part.done", **at, part=part)
