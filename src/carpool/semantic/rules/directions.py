"""A direction between names of several words ("converts a Unix timestamp to an ISO 8601 string" /
"converts an ISO 8601 string to a Unix timestamp", "from Google Photos to iCloud" / "from iCloud
to Google Photos") is no exchange of two words: it is read as an ordered (source, target) pair of
phrases, from "from X to Y" (or "into") anywhere and from "X to Y" right after a verb of
:data:`DIRECTED`, each phrase at most :data:`PHRASE` words of one clause, without its
determiners. The rule fires when one side has (X, Y) and the other (Y, X), and neither has both
("a date to a timestamp and a timestamp to a date" asks both ways on either side).
"""

from __future__ import annotations

import functools
import re

from .text import STOP, lower_words, norm

#: Verbs whose object goes somewhere: "convert X to Y", "migrate X into Y" (-s, -ed, -ing read).
DIRECTED = frozenset(
    """convert migrate move transfer translate switch change port cast turn transform map
    upgrade downgrade export import copy send sync redirect forward rename""".split()
)
#: Words a phrase of a direction never holds: they end the target ("to YAML in Python").
_ENDS = STOP | {"using", "via", "without", "because", "while", "within", "into", "onto"}
_DETERMINERS = frozenset("a an the my your our their his her its this that these those".split())
PHRASE = 6
#: Clauses: a direction never crosses punctuation (a dot inside "5.7" or "v2.1" is no stop).
_CLAUSE = re.compile(r"[,;:!?()\[\]\"]|\.(?!\w)")


def _phrase(words: tuple[str, ...]) -> tuple[str, ...] | None:
    """``words`` without their leading determiners, if a phrase: 1 to PHRASE words, no end."""
    i = 0
    while i < len(words) and words[i] in _DETERMINERS:
        i += 1
    words = words[i:]
    if not 1 <= len(words) <= PHRASE or any(w in _ENDS for w in words):
        return None
    return words


def _verb(word: str) -> bool:
    """``word`` is a form of a verb of :data:`DIRECTED` ("converts", "migrating", "moved")."""
    return any(
        word.endswith(suffix)
        and (
            word[: len(word) - len(suffix)] in DIRECTED
            or word[: len(word) - len(suffix)] + "e" in DIRECTED
        )
        for suffix in ("", "s", "es", "d", "ed", "ing")
    )


@functools.lru_cache(maxsize=4096)
def _directions(text: str) -> frozenset[tuple[tuple[str, ...], tuple[str, ...]]]:
    """The (source, target) pairs of phrases that ``text`` names a direction between."""
    found = set()
    for clause in _CLAUSE.split(norm(text)):
        words = lower_words(clause)
        for k, w in enumerate(words):
            if w not in ("to", "into"):
                continue
            end = k + 1
            while end < len(words) and words[end] in _DETERMINERS:
                end += 1
            while end < len(words) and end - k <= PHRASE + 2 and words[end] not in _ENDS:
                end += 1
            target = _phrase(words[k + 1 : end])
            if target is None:
                continue
            # The source: after "from", or after a verb of DIRECTED, within PHRASE words.
            for start in range(k - 1, max(-1, k - PHRASE - 3), -1):
                if words[start] == "from" or _verb(words[start]):
                    source = _phrase(words[start + 1 : k])
                    if source is not None and source != target:
                        found.add((source, target))
                    break
    return frozenset(found)


def reversed_direction(a: str, b: str) -> bool:
    """``a`` names a direction that ``b`` names the other way, and neither names both."""
    da, db = _directions(a), _directions(b)
    return any((y, x) in db and (y, x) not in da and (x, y) not in db for x, y in da)
