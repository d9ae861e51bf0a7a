"""Judging OpenAI answer bodies: complete? how many choices? how many tokens?

Pure functions; no I/O.

Contract:

- ``is_complete(kind, body, choices=None)`` says whether a body is a complete, successful answer
  worth caching: never one with a non-null top-level ``error`` (``"error": null`` is none);
  for "chat"/"completion" a non-empty ``choices`` whose every finish_reason is set
  (and is not vLLM's "abort" or "error") and, with ``choices`` (a count), one such choice for every
  index 0..choices-1 (a choice without ``index`` counts at its position); for "embedding" a
  non-empty ``data`` whose every item has an ``embedding``, their indexes exactly 0..n-1 once
  each (an item without ``index`` counts at its position), n being ``choices`` when given (one
  vector per input), else the items there are, and every vector sound: non-empty, all of one
  length, all lists of numbers or all base64 of float32s, none NaN or infinite. ``expected_choices(kind, request)`` is that count
  for a request body: ``n`` (default 1) per prompt, so ``n`` times the prompts of a completion's
  list ``prompt`` (``best_of`` picks among candidates but returns ``n``); for embeddings the
  inputs (a list of strings or of token lists: one each; a string or one token list: 1); None
  when it cannot tell (another kind, an ``n`` that is not a positive integer, an ``input`` of
  no such shape). ``usage_tokens(body)`` is prompt + completion tokens. None of them ever
  raises, and none costs more than the answer it is given: the count asked for (the client's
  ``n``, any integer, 2**62 as well) is compared with what came, never built.
- A complete "chat"/"completion" answer is also ``well_formed``: each choice of the shape a
  stream is made of (a chat ``message`` an object, with ``tool_calls`` null or a list of
  objects and ``function_call`` null or an object; a completion's ``text`` a string), so that
  every answer stored can be served to a streaming client. ``well_formed(kind, body)`` says so
  of any body (true of one without choices, and of other kinds').
"""

from __future__ import annotations

import base64
import math
from typing import Any

# vLLM reports a request it gave up on as finish_reason "abort"; such an answer is not complete.
_FAILED = frozenset(("abort", "error"))


def is_complete(kind: str, body: Any, choices: int | None = None) -> bool:
    """A complete, successful answer: no top-level error; every choice finished
    (chat/completion), and each of the ``choices`` asked for is there; or every item has an
    embedding ("embedding"). Malformed bodies are simply not complete; never raises."""
    try:
        if body.get("error") is not None:
            # An answer reporting an error is no success, whatever else it holds (as the same
            # error in a stream's chunk fails it); ``"error": null`` is no error (some servers
            # write every field).
            return False
        if kind in ("chat", "completion"):
            found = body["choices"]
            if (
                not isinstance(found, list)
                or not found
                or not all(
                    isinstance(c, dict)
                    and c.get("finish_reason") is not None
                    and c["finish_reason"] not in _FAILED
                    and _well_formed(kind, c)
                    for c in found
                )
            ):
                return False
            # A choice that never came (or whose finish never came: a stream assembles only what
            # it saw) is missing here, though every choice present finished.
            return choices is None or _every_index(
                {c.get("index", position) for position, c in enumerate(found)}, choices
            )
        if kind == "embedding":
            data = body["data"]
            if (
                not isinstance(data, list)
                or not data
                or not all(
                    isinstance(d, dict) and isinstance(d.get("embedding"), (list, str))
                    for d in data
                )
            ):
                return False
            # One vector per input, no more, no fewer: an answer short of some inputs (an
            # engine that dropped them) would be served, as a hit, to every client of the
            # request without them (the batcher's ``_split`` holds a merged call to the same).
            wanted = len(data) if choices is None else choices
            return (
                len(data) == wanted
                and sorted(d.get("index", position) for position, d in enumerate(data))
                == list(range(wanted))
                and _sound([d["embedding"] for d in data])
            )
    except Exception:
        return False
    return False


def sound_vectors(vectors: list[Any]) -> bool:
    """``_sound``, false rather than raising for what is no vector (a null, a number)."""
    try:
        return all(isinstance(v, (list, str)) for v in vectors) and _sound(vectors)
    except Exception:
        return False


def _sound(vectors: list[Any]) -> bool:
    """Whether ``vectors`` are the answer of a sound engine: each non-empty, all of one
    length, either every one a list of numbers or every one base64 of float32s; none NaN or
    infinite (a fault, fp16 overflowing, would be served for the whole TTL). Linear in the
    answer, in C (``sum``, each number looked at only when the sum is not finite: finite
    numbers may add up past the largest float); raises on what is no vector (the caller's
    ``except``)."""
    if isinstance(vectors[0], str):
        vectors = [memoryview(base64.b64decode(v, validate=True)).cast("f") for v in vectors]
    length = len(vectors[0])
    return length > 0 and all(
        isinstance(v, (list, memoryview))
        and len(v) == length
        and (math.isfinite(sum(v)) or all(map(math.isfinite, v)))
        for v in vectors
    )


def _every_index(indexes: set[Any], wanted: int) -> bool:
    """Whether ``indexes`` (those of the choices that came) hold each of 0..wanted-1. Counted
    first, so that nothing is sized by ``wanted``: that is the client's ``n``, any integer (an
    engine that ignores it, Ollama, answers one choice to a request for 2**62; a set of every
    index asked for would take the event loop and all memory)."""
    return len(indexes) >= wanted and all(i in indexes for i in range(wanted))


def well_formed(kind: str, body: Any) -> bool:
    """Whether every choice of a "chat"/"completion" body is of the shape its stream is made of
    (``_well_formed``): true of a body without choices (``choices`` absent, null or empty),
    and of any other kind's. Never raises."""
    if kind not in ("chat", "completion") or not isinstance(body, dict):
        return True
    found = body.get("choices")
    if not found:
        return True
    return isinstance(found, list) and all(_well_formed(kind, c) for c in found)


def _well_formed(kind: str, choice: Any) -> bool:
    # What a stream is synthesized from (``chunks.synthesize``) and an engine always sends: a
    # chat choice's ``message`` an object, its ``tool_calls`` (unless null) a list of objects
    # and its legacy ``function_call`` (unless null) an object; a completion's ``text`` a string.
    if not isinstance(choice, dict):
        return False
    if kind != "chat":
        return isinstance(choice.get("text"), str)
    message = choice.get("message")
    if not isinstance(message, dict):
        return False
    calls = message.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and all(isinstance(call, dict) for call in calls)
    ):
        return False
    call = message.get("function_call")
    return call is None or isinstance(call, dict)


def expected_choices(kind: str, request: Any) -> int | None:
    """How many choices a complete answer to the request body ``request`` has: ``n`` per prompt
    (a completion's list ``prompt`` is one prompt per item, a flat list of token ids one prompt);
    for embeddings, how many vectors: one per input (a list of strings or of token lists), or 1
    (a string, one token list). None when that cannot be told: another kind, ``n`` not a
    positive integer, an ``input`` of none of those shapes (the upstream then refuses the
    request anyway). Never raises."""
    try:
        if not isinstance(request, dict):
            return None
        if kind == "embedding":
            given = request.get("input")
            if isinstance(given, str):
                return 1
            if not isinstance(given, list) or not given:
                return None
            if type(given[0]) is int:
                return 1
            return len(given) if isinstance(given[0], (str, list)) else None
        if kind not in ("chat", "completion"):
            return None
        n = request.get("n")
        if n is None:
            n = 1
        if type(n) is not int or n < 1:
            return None
        prompt = request.get("prompt") if kind == "completion" else None
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return n * len(prompt)
        return n
    except Exception:
        return None


def usage_tokens(body: Any) -> int:
    """prompt_tokens + completion_tokens of ``body["usage"]``; 0 for what is absent or not a
    non-negative int. Never raises."""
    try:
        usage = body["usage"]
        if not isinstance(usage, dict):
            return 0
    except Exception:
        return 0
    total = 0
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key)
        if type(value) is int and value >= 0:
            total += value
    return total
