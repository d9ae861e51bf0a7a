"""A name on one side must occur on the other.

"How do I get a visa for Canada?" / "...for Australia?" embed alike and differ in everything that
matters. A name is a capitalised word that does not start a sentence ("Canada", "Python",
"Monday", "Tesla"), read case-insensitively: each side's names must all occur as words of the
other (so "python" on the other side matches "Python"). Not names:

- the first word of a sentence, and words after a colon or a quote (no case to read there);
- "I" and its contractions, and :data:`COMMON` words often capitalised in prose;
- anything in a text whose longer words (4 letters or more, at least 4 of them, not starting a
  sentence) are mostly capitalised (a title, shouting): no case to read at all.

Chinese has no case; Chinese names are left to the verifier.
"""

from __future__ import annotations

import re

from ..verdict import Reason, Rule
from .text import lower_words, memo, norm, plain

COMMON = frozenset(
    {
        "i",
        "i'm",
        "i've",
        "i'll",
        "i'd",
        "ok",
        "okay",
        "mr",
        "mrs",
        "ms",
        "dr",
        "hi",
        "hello",
        "please",
        "thanks",
    }
)
_WORD = re.compile(r"[^\W\d_][\w'’-]*")
#: What starts a sentence before a word (then white space): no case to read after it.
_STARTERS = frozenset('.!?:;\n"“(')


def _inside(text: str) -> list[re.Match[str]]:
    """The words of ``text`` that do not start it or a sentence: in one pass, each word judged
    by the gap since the previous one (its last character before white space, or a line break
    within that white space). (Searching the whole text before every word was quadratic.)"""
    inside = []
    end = 0
    for m in _WORD.finditer(text):
        gap = text[end : m.start()]
        before = gap.rstrip()
        starts = m.start() == 0 or "\n" in gap[len(before) :] or before[-1:] in _STARTERS
        if not starts:
            inside.append(m)
        end = m.end()
    return inside


@memo
def _names(text: str) -> frozenset[str]:
    text = norm(text)
    inside = _inside(text)
    long_words = [m.group() for m in inside if len(m.group()) > 3]
    if len(long_words) >= 4 and sum(w[0].isupper() for w in long_words) > 0.6 * len(long_words):
        return frozenset()  # a title or shouting: no case to read
    return frozenset(
        plain(m.group())
        for m in inside
        if m.group()[0].isupper() and m.group().lower() not in COMMON
    )


def _covered(names: frozenset[str], other: str) -> bool:
    words = set(lower_words(other))
    flat = norm(other).lower()
    return all(n in words or n.rstrip("s") in words or n in flat.replace(" ", "") for n in names)


def differs(a: str, b: str) -> bool:
    return not (_covered(_names(a), b) and _covered(_names(b), a))


RULE = Rule(Reason.ENTITY, differs)
