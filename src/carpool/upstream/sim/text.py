"""The simulated engine's text: what a prompt counts as in tokens, and what an answer says.

Contract:
- Text: words of a fixed vocabulary (``VOCABULARY``); a token is one word. The answer's natural
  length (8..40 words) and its words come from a generator seeded with a blake2b hash, so they are
  stable across processes. Greedy decoding (``temperature: 0`` or ``top_k: 1``) hashes model +
  input, so every choice is the same; a ``seed`` (sampling) also hashes seed, temperature, top_p
  and the choice index; otherwise (sampled, no seed) each call draws fresh text. ``max_tokens``
  only cuts the natural answer later (``plan.py``). A number is hashed as its value, not as it was
  spelled: an integral float as the integer (``1.0``, ``1e0`` and ``1`` are one temperature), as
  the gateway's fingerprint reads it (``canonical``), so an answer through the gateway is the
  engine's own for every spelling; a text as its composed form (NFC), as the key reads it
  (``café`` with a combining accent is one request to the gateway). A prompt is hashed once for all its choices (``answers``).
- Prompt tokens: the words of every message (its role, name and content, tool calls) plus a few
  framing tokens per message, as chat templates add; tools count as a prefix before the messages.
  A completion prompt or embedding input counts its words, or its token ids one each.
- Embeddings: a deterministic unit-norm vector per (model, input), from the input's hash;
  ``as_base64`` packs it as OpenAI does for ``encoding_format: "base64"``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import struct
from collections.abc import Mapping
from typing import Any

import orjson

from ...exact_json import INT_END, INT_MIN
from ...unicode_forms import normal_form

MIN_ANSWER_WORDS, MAX_ANSWER_WORDS = 8, 40
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


def words(text: str) -> list[str]:
    return text.split()


def _by_value(value: Any) -> Any:
    """``value`` with each integral float as the integer it is and each string in NFC (module
    contract)."""
    if isinstance(value, str):
        composed = normal_form("NFC", value)  # (None: read as sent, ``unicode_forms``)
        return value if composed is None else composed
    if isinstance(value, float):
        # (Within the integers the JSON parser reads as integers, i64 and u64: one outside them is
        # kept a float.)
        return int(value) if value.is_integer() and INT_MIN <= value < INT_END else value
    if isinstance(value, Mapping):
        return {k: _by_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_by_value(v) for v in value]
    return value


def _stable_dump(value: Any) -> bytes:
    return orjson.dumps(_by_value(value), option=orjson.OPT_SORT_KEYS, default=str)


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


def answers(body: Mapping[str, Any], endpoint: str, prompt: Any, n: int) -> list[list[str]]:
    """The natural (uncapped) answers of a prompt's ``n`` choices; ``max_tokens`` only cuts
    them later. The prompt is dumped and hashed once for all of them."""
    model = body.get("model")
    if is_greedy(body):
        return [
            _draw_answer(random.Random(_seed_from(endpoint, model, prompt, body.get("tools"))))
        ] * n
    if body.get("seed") is None:
        return [_draw_answer(random.Random(os.urandom(16))) for _ in range(n)]
    # ``_seed_from(endpoint, ..., choice)`` for each choice: the dump of a list is its items'
    # dumps joined, so the head (the prompt's dump) is hashed once and copied for each choice.
    head = hashlib.blake2b(digest_size=16)
    shared = (
        endpoint,
        model,
        prompt,
        body.get("tools"),
        body["seed"],
        body.get("temperature"),
        body.get("top_p"),
    )
    head.update(b"[" + b",".join(_stable_dump(part) for part in shared) + b",")
    drawn = []
    for choice in range(n):
        digest = head.copy()
        digest.update(_stable_dump(choice) + b"]")
        drawn.append(_draw_answer(random.Random(int.from_bytes(digest.digest(), "big"))))
    return drawn


def answer_words(body: Mapping[str, Any], endpoint: str, prompt: Any, choice: int) -> list[str]:
    """The natural (uncapped) answer of one choice; ``max_tokens`` only cuts it later."""
    return answers(body, endpoint, prompt, choice + 1)[choice]


def embedding_vector(model: Any, item: str | list[int], dim: int) -> list[float]:
    """A deterministic unit-norm vector derived from the input's hash."""
    rng = random.Random(_seed_from("embedding", model, item))
    raw = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [x / norm for x in raw]


def as_base64(vector: list[float]) -> str:
    # The openai SDK asks for base64 by default: little-endian float32, as OpenAI sends.
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
