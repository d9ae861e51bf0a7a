"""A generation request's plan: the request validated, and everything it will do decided before
it is served (its prompts' tokens, each choice's words and finish reason, streaming or not).

Contract:
- ``make_plan(endpoint, body, default_max_tokens)`` validates a ``/chat/completions`` or
  ``/completions`` body (raising ``RequestError``, a 400) and returns its ``Plan``. ``n`` choices
  per prompt (at most ``MAX_CHOICES``), indexed prompt-major as OpenAI does for a list of prompts.
- ``max_completion_tokens`` / ``max_tokens`` (the newer name wins; default
  ``SimConfig.default_max_tokens``) cut the answer to a prefix of the same text, with
  ``finish_reason: "length"``; otherwise ``"stop"``.
- ``Plan.usage()`` is OpenAI's ``usage`` object; ``cached_tokens`` is filled in by the replica's
  prefill.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from carpool.errors import RequestError
from carpool.upstream import sim_apis
from carpool.upstream.sim.replies import MODEL_ID
from carpool.upstream.sim.text import answer_words, chat_prompt_tokens, input_tokens

MAX_CHOICES = 128


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


def _validate_generation(body: Mapping[str, Any]) -> None:
    int_field(body, "n", 1, MAX_CHOICES)
    int_field(body, "max_tokens", 1)
    int_field(body, "max_completion_tokens", 1)
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


def make_plan(endpoint: str, body: Mapping[str, Any], default_max_tokens: int) -> Plan:
    """The plan of a chat or text completion request (raises ``RequestError`` if it is invalid)."""
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
    cap = max_new_tokens(body, default_max_tokens)
    stream = bool(body.get("stream"))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, Mapping) and bool(options.get("include_usage"))
    return Plan(
        endpoint,
        body,
        prompts,
        _sequences(body, endpoint, prompt_inputs, cap),
        stream,
        include_usage,
    )
