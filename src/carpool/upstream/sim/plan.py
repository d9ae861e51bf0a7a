"""A generation request's plan: the request validated, and everything it will do decided before
it is served (its prompts' tokens, each choice's words and finish reason, streaming or not).

Contract:
- ``await make_plan(endpoint, body, default_max_tokens)`` validates a ``/chat/completions`` or
  ``/completions`` body (raising ``RequestError``, a 400) and returns its ``Plan``. ``n`` choices
  per prompt (at most ``MAX_CHOICES``), indexed prompt-major as OpenAI does for a list of prompts.
- What one request may ask is bounded, so that no small body makes a large answer: a list
  ``prompt`` (or embeddings ``input``) holds at most ``MAX_INPUTS`` items (OpenAI's limit for an
  array of inputs), and a request at most ``MAX_SEQUENCES`` choices in all (prompts x ``n``).
  Past a limit: a 400 whose ``param`` is the field and whose message names the limit. What is
  allowed is planned a prompt at a time, handing the event loop back between prompts
  (``asyncio.sleep(0)``): the engine shares the gateway's loop when embedded, and a worker thread
  would still hold the GIL, could not be cancelled with its request, and would make tests wait
  on threads; one prompt's choices (at most ``MAX_CHOICES``) take about 2 ms.
- Sampling values are checked against OpenAI's ranges, a 400 naming the field otherwise:
  ``temperature`` 0..2, ``top_p`` 0..1, ``frequency_penalty`` / ``presence_penalty`` -2..2, ``seed``
  an integer (as the gateway checks it: ``apis.base.check_fields``, which checks only types, so the
  ranges are the engine's, as they are a real engine's); chat ``logprobs`` a boolean and
  ``top_logprobs`` 0..20; completions ``logprobs`` 0..5 and ``best_of`` 1..20, at least ``n``.
- ``max_completion_tokens`` / ``max_tokens`` (the newer name wins; default
  ``SimConfig.default_max_tokens``) cut the answer to a prefix of the same text, with
  ``finish_reason: "length"``; otherwise ``"stop"``.
- ``stop`` (a string or a list of strings; Messages' ``stop_sequences`` come as it) cuts each
  choice's text (within ``max_tokens``) just before the first occurrence of any of them, as
  OpenAI does: the stop string itself is not returned, ``finish_reason`` is ``"stop"`` and the
  choice's ``stop_sequence`` is the string that matched (the earliest; at one place, the first
  listed). Its tokens are the cut text's words, the last one possibly partial (or empty: the
  text is exactly what they join to), so streamed pieces add up to the whole text. Deterministic
  as the text is. Anything else in ``stop`` is a 400.
- ``Plan.usage()`` is OpenAI's ``usage`` object; ``cached_tokens`` is filled in by the replica's
  prefill.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from carpool.errors import RequestError
from carpool.upstream import sim_apis
from carpool.upstream.sim.replies import MODEL_ID
from carpool.upstream.sim.text import answers, chat_prompt_tokens, input_tokens

MAX_CHOICES = 128  # ``n``, as OpenAI's
MAX_INPUTS = 2048  # items of a list prompt or embeddings input, as OpenAI's
MAX_SEQUENCES = 2048  # choices of one request in all: prompts x n


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
    if len(items) > MAX_INPUTS:
        raise RequestError(
            f"'{param}' may hold at most {MAX_INPUTS} items, not {len(items)}", param=param
        )
    if not allow_empty_text and any(item == "" for item in items):
        raise RequestError(f"'{param}' must not contain empty strings", param=param)
    return items


def int_field(body: Mapping[str, Any], name: str, lowest: int, highest: int | None = None) -> None:
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


def number_field(body: Mapping[str, Any], name: str, lowest: float, highest: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not lowest <= value <= highest
    ):
        raise RequestError(f"'{name}' must be a number between {lowest} and {highest}", param=name)


def _validate_generation(endpoint: str, body: Mapping[str, Any]) -> None:
    int_field(body, "n", 1, MAX_CHOICES)
    int_field(body, "max_tokens", 1)
    int_field(body, "max_completion_tokens", 1)
    stop_strings(body)  # (validated here: before anything is generated)
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise RequestError("'stream' must be a boolean", param="stream")
    # OpenAI's ranges (module contract).
    number_field(body, "temperature", 0, 2)
    number_field(body, "top_p", 0, 1)
    number_field(body, "frequency_penalty", -2, 2)
    number_field(body, "presence_penalty", -2, 2)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError("'seed' must be an integer", param="seed")
    if endpoint == "/chat/completions":
        if not isinstance(body.get("logprobs", False), (bool, type(None))):
            raise RequestError("'logprobs' must be a boolean", param="logprobs")
        int_field(body, "top_logprobs", 0, 20)
    else:
        int_field(body, "logprobs", 0, 5)
        int_field(body, "best_of", 1, 20)
        if body.get("best_of") is not None and body["best_of"] < (body.get("n") or 1):
            raise RequestError("'best_of' must be greater than or equal to 'n'", param="best_of")


def max_new_tokens(body: Mapping[str, Any], default: int) -> int:
    # The newer name wins, as in OpenAI's API.
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return int(body[name])
    return default


@dataclass(slots=True)
class Sequence:
    """One choice to generate: its index in ``choices``, its words and why it ended."""

    index: int
    words: list[str]
    finish_reason: str
    # The stop string that ended it (``stop``), or None.
    stop_sequence: str | None = None


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


def _choices(
    body: Mapping[str, Any], endpoint: str, prompt: Any, p: int, cap: int, stops: list[str]
) -> list[Sequence]:
    """The n choices of prompt ``p``, indexed prompt-major as OpenAI does for a list of prompts."""
    n = body.get("n") or 1
    sequences = []
    for i, natural in enumerate(answers(body, endpoint, prompt, n)):
        reason = "length" if len(natural) > cap else "stop"
        sequence = Sequence(p * n + i, natural[:cap], reason)
        if stops:
            _cut_at_stop(sequence, stops)
        sequences.append(sequence)
    return sequences


def stop_strings(body: Mapping[str, Any], name: str = "stop") -> list[str]:
    """The request's ``stop`` strings (none: an empty list); anything but a string or a list of
    strings is a 400 naming ``name`` (Messages: ``stop_sequences``). Empty strings stop nothing."""
    stop = body.get(name)
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"'{name}' must be a string or a list of strings", param=name)
    return [s for s in stop if s]


def _cut_at_stop(sequence: Sequence, stops: list[str]) -> None:
    """``sequence`` cut just before the first occurrence of any of ``stops`` in its text, if
    one occurs (module contract)."""
    text = " ".join(sequence.words)
    found = [(at, order, s) for order, s in enumerate(stops) if (at := text.find(s)) != -1]
    if not found:
        return
    at, _, stop = min(found)
    sequence.words = text[:at].split(" ")  # (joined again, exactly the text before the stop)
    sequence.finish_reason = "stop"
    sequence.stop_sequence = stop


async def make_plan(endpoint: str, body: Mapping[str, Any], default_max_tokens: int) -> Plan:
    """The plan of a chat or text completion request (raises ``RequestError`` if it is invalid),
    made a prompt at a time, handing the loop back between prompts (module contract)."""
    _validate_generation(endpoint, body)
    if endpoint == "/chat/completions":
        sim_apis.validate_messages(body)
        prompt_inputs: list[Any] = [body["messages"]]
    else:
        if "prompt" not in body:
            raise RequestError("'prompt' is required", param="prompt")
        # (null: OpenAI's default prompt, the end of a text: an empty one here)
        prompt = "" if body["prompt"] is None else body["prompt"]
        prompt_inputs = parse_inputs(prompt, "prompt", allow_empty_text=True)
    n = body.get("n") or 1
    if len(prompt_inputs) * n > MAX_SEQUENCES:
        raise RequestError(
            f"a request may ask for at most {MAX_SEQUENCES} choices in all ('n' for each "
            f"prompt): {len(prompt_inputs)} prompts x n {n} is more",
            param="n",
        )
    cap = max_new_tokens(body, default_max_tokens)
    stops = stop_strings(body)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, Mapping) and bool(options.get("include_usage"))
    plan = Plan(endpoint, body, [], [], stream, include_usage)
    for p, prompt in enumerate(prompt_inputs):
        if p:
            await asyncio.sleep(0)
        if endpoint == "/chat/completions":
            plan.prompts.append(chat_prompt_tokens(body))
        else:
            plan.prompts.append(input_tokens(prompt))
        plan.sequences += _choices(body, endpoint, prompt, p, cap, stops)
    return plan
