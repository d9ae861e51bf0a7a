"""A direction between names of several words ("converts a Unix timestamp to an ISO 8601 string" /
"converts an ISO 8601 string to a Unix timestamp", "from Google Photos to iCloud" / "from iCloud
to Google Photos") is no exchange of two words: it is read as an ordered (source, target) pair of
phrases, from "from X to Y" (or "into", "onto"; "off X", "out of X" as "from X") anywhere, from
"X worth in Y" ("a euro worth in dollars") and from "X to Y" right after a verb of
:data:`DIRECTED`, each phrase at most :data:`PHRASE` words of one clause, without its
determiners, an "of" inside it read ("a list of dicts"), its plurals singular. The rule fires
when one side has (X, Y) and the other (Y, X), and neither has both ("a date to a timestamp and
a timestamp to a date" asks both ways on either side).
"""

from __future__ import annotations

import re

from .text import STOP, lower_words, memo, norm

#: Verbs whose object goes somewhere: "convert X to Y", "migrate X into Y" (-s, -ed, -ing read).
DIRECTED = frozenset(
    """convert migrate move transfer translate switch change port cast turn transform map
    upgrade downgrade export import copy send sync redirect forward rename""".split()
)
#: Words a phrase of a direction never holds: they end the target ("to YAML in Python").
_ENDS = STOP | {"using", "via", "without", "because", "while", "within", "into", "onto"}
#: Words of time that end a target too ("worth in dollars right now", "to euros today").
_WHEN = frozenset({"now", "today", "currently", "tomorrow", "yesterday"})
_DETERMINERS = frozenset("a an the my your our their his her its this that these those".split())
PHRASE = 6
#: Clauses: a direction never crosses punctuation (a dot inside "5.7" or "v2.1" is no stop).
_CLAUSE = re.compile(r"[,;:!?()\[\]\"]|\.(?!\w)")


#: Endings of words whose final -s is no plural ("class", "status", "analysis").
_NOT_S = ("ss", "us", "is")


def _singular(word: str) -> str:
    """A plural's final -s dropped: "a euro ... in dollars" / "a dollar ... in euros"."""
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith(_NOT_S) else word


def _phrase(words: tuple[str, ...]) -> tuple[str, ...] | None:
    """``words`` without their leading determiners, if a phrase: 1 to PHRASE words, no end but
    an "of" inside ("a list of dicts"); each word singular."""
    i = 0
    while i < len(words) and words[i] in _DETERMINERS:
        i += 1
    words = words[i:]
    if not 1 <= len(words) <= PHRASE or any(
        w in _ENDS and not (w == "of" and 0 < k < len(words) - 1) for k, w in enumerate(words)
    ):
        return None
    return tuple(map(_singular, words))


def _target_end(words: tuple[str, ...], k: int) -> int:
    """Where the target phrase after the marker at ``k`` ends: at an end word (an "of" between
    two words of a phrase goes on: "to a list of dicts")."""
    end = k + 1
    while end < len(words) and words[end] in _DETERMINERS:
        end += 1
    while end < len(words) and end - k <= PHRASE + 2:
        after = words[end + 1] if end + 1 < len(words) else ""
        if (
            (words[end] in _ENDS and not (words[end] == "of" and after and after not in _ENDS))
            or words[end] in _WHEN
            or (words[end] == "right" and after == "now")
        ):
            break
        end += 1
    return end


def _source_marker(words: tuple[str, ...], start: int) -> bool:
    """A source's marker ends at ``start``: "from", "off", "out of"."""
    w = words[start]
    return w in ("from", "off") or (w == "of" and start > 0 and words[start - 1] == "out")


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


@memo
def _directions(text: str) -> frozenset[tuple[tuple[str, ...], tuple[str, ...]]]:
    """The (source, target) pairs of phrases that ``text`` names a direction between."""
    found = set()
    for clause in _CLAUSE.split(norm(text)):
        words = lower_words(clause)
        for k, w in enumerate(words):
            worth = w == "in" and k > 0 and words[k - 1] == "worth"
            if w not in ("to", "into", "onto") and not worth:
                continue
            target = _phrase(words[k + 1 : _target_end(words, k)])
            if target is None:
                continue
            if worth:  # "what is a euro worth in dollars": the source is what is worth
                start = k - 1
                while start > 0 and k - start <= PHRASE and words[start - 1] not in _ENDS:
                    start -= 1
                source = _phrase(words[start : k - 1])
                if source is not None and source != target:
                    found.add((source, target))
                continue
            # The source: after "from" / "off" / "out of", or after a verb of DIRECTED, within
            # PHRASE words.
            for start in range(k - 1, max(-1, k - PHRASE - 3), -1):
                if _source_marker(words, start) or _verb(words[start]):
                    source = _phrase(words[start + 1 : k])
                    if source is not None and source != target:
                        found.add((source, target))
                    break
    return frozenset(found)


def reversed_direction(a: str, b: str) -> bool:
    """``a`` names a direction that ``b`` names the other way, and neither names both."""
    da, db = _directions(a), _directions(b)
    return any((y, x) in db and (y, x) not in da and (x, y) not in db for x, y in da)
