"""A chat text chunk's payload as a template: the next text chunks taken by their bytes alone.

No I/O; a template holds the list its texts go to. ``chunks.Assembly`` makes and uses them
(``Assembly.add_texts``).

Contract:
- ``TextTemplate.of(payload, chunk, text, content)``: from the raw ``payload`` of a text chunk
  (``chunk``, parsed: one choice whose delta is ``{"content": text}``), the payload cut around
  its text's JSON string: ``prefix`` up to the string's opening quote, ``suffix`` from its
  closing quote. None unless it checks out: no line break in the payload, the string found is
  ``text``, and the payload with a different string in its place parses as ``chunk`` with that
  text and nothing else changed.
- A payload that is ``prefix`` + the inside of one JSON string + ``suffix`` (and is at least as
  long as both) parses as ``chunk`` with that string as its text: a string token in place of
  another changes no other value. ``take_many(payloads, start)`` takes such payloads from
  ``start`` on, one after the other, and adds their texts to ``content``: the strings alone are
  parsed, from the opening quote to the closing one, all of them at once when each is exactly
  the JSON its text is written as (else one by one). It returns how many it took; the first
  payload that is not such (no string between the two, or not one) ends it and is not taken.
"""

from __future__ import annotations

from typing import Any

import orjson


class TextTemplate:
    """A chat text chunk's payload cut around its text: ``prefix`` up to the string's opening
    quote, ``suffix`` from its closing quote. Any payload made of both around one JSON string
    parses as the same chunk with that string as its text (a string token in place of another
    changes no other value). Made only when the payload checks out (the string found is the
    text, and another in its place changes nothing else), and only from payloads without a line
    break (framed as they came, then: ``Api.frame``)."""

    __slots__ = ("prefix", "suffix", "before", "after", "content", "took")

    def __init__(self, prefix: bytes, suffix: bytes, content: list[str]) -> None:
        self.prefix, self.suffix, self.content = prefix, suffix, content
        self.before, self.after = len(prefix), len(suffix)
        self.took = False  # whether a payload was taken by it

    def take_many(self, payloads: list[bytes], start: int) -> int:
        """How many of ``payloads`` from ``start`` on, one after the other, are ``prefix`` + one
        JSON string + ``suffix``: their texts are added to ``content``, in order; 0: nothing
        was done."""
        prefix, suffix, before, after = self.prefix, self.suffix, self.before, self.after
        strings: list[bytes] = []
        for at in range(start, len(payloads)):
            payload = payloads[at]
            end = len(payload) - after
            if end < before or not payload.startswith(prefix) or not payload.endswith(suffix):
                break
            # Quoted (the prefix ends in a quote, the suffix starts with one).
            strings.append(payload[before - 1 : end + 1])
        if not strings:
            return 0
        texts = _texts(strings)
        if texts is None:
            # One by one: one JSON value that begins and ends with a quote is a string, and
            # nothing else parses ('"a","b"': not one string); the first that does not ends it.
            texts = []
            for string in strings:
                try:
                    texts.append(orjson.loads(string))
                except orjson.JSONDecodeError:
                    break
            if not texts:
                return 0
        self.content.extend(texts)
        self.took = True
        return len(texts)

    @classmethod
    def of(
        cls, payload: bytes, chunk: dict[str, Any], text: str, content: list[str]
    ) -> TextTemplate | None:
        """The template of ``payload``, a text chunk (``chunk`` parsed, one choice whose delta
        is ``text`` alone), whose taken texts go to ``content``; None if it does not check
        out."""
        if payload.find(b"\n") != -1:
            return None
        # The text's string: the value of the last "content" key (none other is in a text
        # chunk; a "content" in some string would have escaped quotes).
        at = payload.rfind(b'"content"')
        if at == -1:
            return None
        start = _after_blanks(payload, at + 9)
        if payload[start : start + 1] != b":":
            return None
        start = _after_blanks(payload, start + 1)
        end = _string_end(payload, start)
        if end is None:
            return None
        prefix, suffix = payload[: start + 1], payload[end - 1 :]
        try:
            if orjson.loads(payload[start:end]) != text:
                return None
            # Another text in its place: a string that is not the text's (another field's
            # "content" after it, of the same value) would leave the text as it is. The other
            # text must differ from this one, or the check sees no change at all.
            other = "" if text else "_"
            swapped = orjson.loads(prefix + other.encode() + suffix)
        except orjson.JSONDecodeError:
            return None
        (choice,) = chunk["choices"]
        if swapped != {**chunk, "choices": [{**choice, "delta": {"content": other}}]}:
            return None
        return cls(prefix, suffix, content)


def _texts(strings: list[bytes]) -> list[str] | None:
    """The texts of ``strings`` parsed at once, as one array; None unless each string is
    exactly its text as written back (then each is one JSON string alone, read as its own
    parse reads it; one spelled otherwise, ``\\u00e9`` for ``é``, or one that is not a string
    alone, is left to be parsed by itself)."""
    if len(strings) == 1:
        return None
    try:
        texts: list[str] = orjson.loads(b"[" + b",".join(strings) + b"]")
    except orjson.JSONDecodeError:
        return None
    return texts if list(map(orjson.dumps, texts)) == strings else None


def _after_blanks(data: bytes, at: int) -> int:
    while data[at : at + 1] in (b" ", b"\t", b"\r"):
        at += 1
    return at


def _string_end(data: bytes, start: int) -> int | None:
    """The index after the JSON string that begins at ``start`` (its closing quote is one not
    escaped by an odd run of backslashes), or None when none begins there."""
    if data[start : start + 1] != b'"':
        return None
    at = start + 1
    while True:
        at = data.find(b'"', at)
        if at == -1:
            return None
        escapes = 0
        while data[at - 1 - escapes] == 0x5C:  # (a backslash)
            escapes += 1
        if escapes % 2 == 0:
            return at + 1
        at += 1
