"""Reading a prompt for the rules: words, sentences, and CJK characters, memoised per text."""

from __future__ import annotations

import functools
import re
import unicodedata

#: A word: letters, digits, apostrophes and joiners inside (``don't``, ``snake_case``, ``v2.1``);
#: a run of CJK ideographs counts character by character (Chinese has no spaces).
_WORD = re.compile(r"[\u4e00-\u9fff\u3400-\u4dbf]|[^\W_](?:[\w'’.-]*[^\W_])?|_\w*", re.UNICODE)
_SENTENCE_END = re.compile(r"[.!?。！？]\s*|\n+")


def norm(text: str) -> str:
    """NFKC (full-width digits and letters become ASCII), curly quotes made straight."""
    text = unicodedata.normalize("NFKC", text)
    return text.replace("’", "'").replace("‘", "'").replace("“", '"').replace("”", '"')


@functools.lru_cache(maxsize=8192)
def words(text: str) -> tuple[str, ...]:
    """The words of ``text`` as written (case kept), in order."""
    return tuple(m.group() for m in _WORD.finditer(norm(text)))


_POSSESSIVE = re.compile(r"'s$")


@functools.lru_cache(maxsize=8192)
def lower_words(text: str) -> tuple[str, ...]:
    """The words lower-cased, a possessive ``'s`` dropped ("Australia's" is "australia")."""
    return tuple(_POSSESSIVE.sub("", w.lower().strip(".")) for w in words(text))


def sentences(text: str) -> list[str]:
    """``text`` cut after each sentence end (and at line breaks), empty pieces dropped."""
    pieces = _SENTENCE_END.split(norm(text))
    return [p for p in pieces if p.strip()]


def is_cjk(ch: str) -> bool:
    return "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf"
