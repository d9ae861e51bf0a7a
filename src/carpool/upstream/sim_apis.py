"""The simulated engine's Responses API (``/responses``) and Anthropic Messages API
(``/messages``): each request is served as its chat equivalent, and the chat answer is turned
into the API's own object and typed event stream.

Contract:
- ``to_chat(api, body)`` is the chat request a Responses / Messages request stands for (raises
  ``RequestError`` for a malformed one, naming the field as the client sent it: the fields
  that become chat's are checked by chat's rules under their own names first, so a 400 says
  ``max_output_tokens`` or ``stop_sequences``, not ``max_tokens`` or ``stop``). Responses:
  ``instructions`` is a system message,
  ``input`` (a string, or items with a ``role`` and text content; other items count by their
  JSON) the messages, ``max_output_tokens`` the ``max_tokens``. Messages: ``system`` (string or
  text blocks) is a system message, ``messages`` the messages, ``max_tokens`` and
  ``stop_sequences`` (as ``stop``) kept. ``model``, ``temperature``, ``top_p``, ``top_k``,
  ``tools`` and ``stream`` are kept; nothing else (the APIs have no ``n`` nor ``seed``). So the
  same cost model, determinism (temperature 0 or top_k 1) and prefix cache apply as for chat.
- ``from_chat(api, chat_body, ...)`` is the API's answer for a chat answer: Responses, a
  ``response`` object (``status`` ``completed``, or ``incomplete`` with ``incomplete_details``
  ``max_output_tokens`` when the answer was cut), one output message with one ``output_text``,
  ``usage`` ``input_tokens`` / ``output_tokens`` / ``total_tokens`` (cached tokens in
  ``input_tokens_details``); Messages, a ``message`` with one ``text`` block, ``stop_reason``
  ``end_turn``, ``max_tokens`` or ``stop_sequence`` (when one of ``stop_sequences`` ended it:
  ``stop_sequence`` names it, the text ends before it), ``usage`` ``input_tokens`` / ``output_tokens``.
- Streams: the events ``apis.{responses,messages}.synthesize`` makes of the final answer, with
  its single text delta replaced by one delta per decoded token, sent at the decode pace (see
  ``SimReplica._typed_stream``). Responses' ``sequence_number`` counts every event sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from carpool.apis import messages as messages_api
from carpool.apis import responses as responses_api
from carpool.errors import RequestError
from carpool.upstream.sim.plan import int_field, stop_strings

RESPONSES, MESSAGES = "/responses", "/messages"
TYPED = (RESPONSES, MESSAGES)
_KEPT = ("model", "temperature", "top_p", "top_k", "tools", "stream")
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _text(content: Any, param: str) -> Any:
    """A message's content as chat content: a string, or the text of its text parts (other
    parts stay as they are, so their JSON counts as tokens)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS:
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                parts.append(part)
        return parts
    raise RequestError(
        f"'{param}' content must be a string or a list of content parts", param=param
    )


def to_chat(api: str, body: Mapping[str, Any]) -> dict[str, Any]:
    chat: dict[str, Any] = {k: body[k] for k in _KEPT if k in body}
    messages: list[dict[str, Any]] = []
    if api == RESPONSES:
        if isinstance(body.get("instructions"), str):
            messages.append({"role": "system", "content": body["instructions"]})
        value = body.get("input")
        if isinstance(value, str):
            messages.append({"role": "user", "content": value})
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Mapping) and isinstance(item.get("role"), str):
                    role = "system" if item["role"] == "developer" else item["role"]
                    messages.append(
                        {"role": role, "content": _text(item.get("content"), f"input[{i}]")}
                    )
                else:  # function calls and their outputs...: their JSON stands for them
                    messages.append({"role": "user", "content": orjson.dumps(item).decode()})
        else:
            raise RequestError("'input' must be a string or a list of input items", param="input")
        int_field(body, "max_output_tokens", 1)
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
    else:
        system = body.get("system")
        if system is not None:
            messages.append({"role": "system", "content": _text(system, "system")})
        validate_messages(body)
        for i, message in enumerate(body["messages"]):
            messages.append(
                {
                    "role": message["role"],
                    "content": _text(message.get("content"), f"messages[{i}]"),
                }
            )
        int_field(body, "max_tokens", 1)
        if body.get("max_tokens") is not None:
            chat["max_tokens"] = body["max_tokens"]
        stop_strings(body, "stop_sequences")
        if body.get("stop_sequences") is not None:
            chat["stop"] = body["stop_sequences"]
    if not messages:
        raise RequestError("'input' must not be empty", param="input")
    chat["messages"] = messages
    return chat


def from_chat(
    api: str,
    chat_body: Mapping[str, Any],
    plan_id: str,
    created: int,
    stop_sequence: str | None = None,
) -> dict[str, Any]:
    """The API's answer for a chat answer; ``stop_sequence``: the stop string that ended it."""
    choice = chat_body["choices"][0]
    text = choice["message"]["content"]
    cut = choice["finish_reason"] == "length"
    usage = chat_body["usage"]
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    model = chat_body["model"]
    if api == RESPONSES:
        return {
            "id": "resp_" + plan_id,
            "object": "response",
            "created_at": created,
            "status": "incomplete" if cut else "completed",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": model,
            "output": [
                {
                    "type": "message",
                    "id": "msg_" + plan_id,
                    "status": "incomplete" if cut else "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]
                },
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            },
        }
    return {
        "id": "msg_" + plan_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "max_tokens"
        if cut
        else ("stop_sequence" if stop_sequence is not None else "end_turn"),
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": prompt, "output_tokens": completion},
    }


def events(api: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The API's typed events for ``body``, its whole text in one delta."""
    events: list[dict[str, Any]] = (responses_api if api == RESPONSES else messages_api).synthesize(
        body
    )
    return events


def is_text_delta(event: Mapping[str, Any]) -> bool:
    if event.get("type") == "response.output_text.delta":
        return True
    delta = event.get("delta")
    return (
        event.get("type") == "content_block_delta"
        and isinstance(delta, Mapping)
        and delta.get("type") == "text_delta"
    )


def with_piece(event: dict[str, Any], piece: str) -> dict[str, Any]:
    """A copy of a text delta event carrying ``piece``."""
    if event.get("type") == "response.output_text.delta":
        return {**event, "delta": piece}
    return {**event, "delta": {**event["delta"], "text": piece}}


# Anthropic's first API version that refuses the sampling parameters on every model, even at
# their defaults (the ``anthropic`` SDK 2.x sends it unless told otherwise).
SAMPLING_REFUSED_SINCE = "2026-10-21"


def check_anthropic_version(body: Mapping[str, Any], headers: Mapping[str, str]) -> None:
    """A Messages body's sampling parameters under the ``anthropic-version`` it is sent with:
    from :data:`SAMPLING_REFUSED_SINCE` on, ``temperature``, ``top_p`` or ``top_k`` is a 400,
    as Anthropic answers (an older version, or none, takes them)."""
    if headers.get("anthropic-version", "") < SAMPLING_REFUSED_SINCE:
        return
    for name in ("temperature", "top_p", "top_k"):
        if name in body:
            raise RequestError(f"{name}: Extra inputs are not permitted", param=name)


def validate_messages(body: Mapping[str, Any]) -> None:
    """A non-empty ``messages`` list of objects with a ``role`` (chat, Messages), else 400."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(
                f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]"
            )
