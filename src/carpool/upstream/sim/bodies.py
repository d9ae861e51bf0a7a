"""The OpenAI-shaped bodies and stream chunks of a planned chat or text completion.

Contract:
- ``completion_body(plan)``: a ``chat.completion`` (one assistant ``message`` per choice) or a
  ``text_completion`` (one ``text`` per choice), with ``usage``; ids ``chatcmpl-...`` /
  ``cmpl-...``; ``system_fingerprint: "carpool-sim"``.
- Streams: chat streams open with the assistant role for each choice (``opening_chunks``); then
  each decode step gives one token per unfinished choice and the finish chunk of any choice whose
  last token that was (``step_chunks``); with ``stream_options.include_usage`` every chunk has
  ``usage: null`` and a final ``usage_chunk`` (no choices) carries the usage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from carpool.upstream.sim.plan import Plan
from carpool.upstream.sim.replies import SYSTEM_FINGERPRINT


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
