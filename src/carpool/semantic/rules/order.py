"""The same words in another order: who does what to whom, and which way a conversion goes.

"The cat chased the mouse" / "the mouse chased the cat" and "convert JSON to YAML" / "convert
YAML to JSON" have the same words, so the same mean-pooled embedding, and opposite answers. The
rule fires when exchanging two words of one side makes it *the other side*, or nearly: for two
content words ``x`` and ``y`` found once on each side, in opposite orders, the side with ``x``
and ``y`` exchanged matches the other word for word but for at most :data:`SLACK` words
("How do I convert JSON to YAML?" / "How can I convert YAML to JSON?"), and by two words better
than before the exchange. Words joined only by one coordinator ("beauty and intelligence",
"MBA or CA", "Python as well as Java") may change places; "as the landlord or as the tenant's
guarantor" joins no two words ("as" is no coordinator). A reworded paraphrase that also moves
words ("the best way to learn Python" / "learn Python the best way") is far from the other side
after any one exchange, so it passes.
Chinese is read character by character, so "猫追老鼠" / "老鼠追猫" is caught too (a name of two
characters is exchanged as a unit only through its characters, which is enough).

"Word for word but for k words" is ``max(len) - LCS`` (the longest common subsequence), and the
rule reads it in linear time: an exchange changes two words, so it mends at most two; a pair
more than ``SLACK + 2`` words apart before any exchange never fires. Then ``y`` must land
within ``SLACK`` places of where it stands on the other side (and ``x`` too), which leaves a few
exchanges to try, each compared in a band of ``SLACK`` places. (Every pair of shared words, each
compared whole, cost seconds for a few hundred permuted words: a review found it.)

A direction between names of several words ("converts a Unix timestamp to an ISO 8601 string" /
"converts an ISO 8601 string to a Unix timestamp", "from Google Photos to iCloud" / "from iCloud
to Google Photos") is no exchange of two words: it is read as an ordered (source, target) pair of
phrases, from "from X to Y" (or "into") anywhere and from "X to Y" right after a verb of
:data:`DIRECTED`, each phrase at most :data:`PHRASE` words of one clause, without its
determiners. The rule fires when one side has (X, Y) and the other (Y, X), and neither has both
("a date to a timestamp and a timestamp to a date" asks both ways on either side).

Roles taken by a pronoun: "My landlord is suing me" / "I am suing my landlord" exchange "me" and
"landlord", but pronouns carry no role above (:data:`STOP`, as "How do I..." / "How can I..." must
pass). So each sentence is read a second time folded: a pronoun in its subject case ("me" is
"i", "him" "he", "her" "she"), no possessive ("my landlord" is "landlord"), "am/is/are" one verb
and a verb's -s dropped ("owes" is "owe"); the rule fires when one exchange of a pronoun of
:data:`PERSONS` with another word makes one side's sentence the other's (as above), or when two
pronouns, both on each side, exchanged wherever they stand do ("She asked him to marry her" /
"He asked her to marry him"). Measured on the development pairs, it refused no true rewording.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

from ..verdict import Reason, Rule
from .text import lower_words, norm

#: Words that carry no role: their place may change freely.
STOP = frozenset(
    """a an the to of in on at for by with from and or but is are was were be been
do does did can could should would will shall may might must i you he she it we they me him her
us them my your his its our their this that these those what which who whom how why when where
whether if than then so as not no please".split()""".split()
)
SLACK = 2
#: Words between two words whose order does not matter ("beauty and intelligence").
#: Not "as": "as the landlord or as the tenant's guarantor" names two roles, not a pair (only
#: "as well as" joins two words).
COORDINATORS = frozenset({"and", "or", "nor", "&", "vs", "versus", "plus"})


def _joined(between: tuple[str, ...]) -> bool:
    """``between`` joins two words whose order does not matter: one coordinator, or "as well
    as", with determiners ("beauty and the beast", "Python as well as Java")."""
    rest = tuple(w for w in between if w not in ("a", "an", "the"))
    return (len(rest) == 1 and rest[0] in COORDINATORS) or rest in (
        ("as", "well", "as"),
        ("and", "or"),
    )


def _mismatches(x: tuple[str, ...], y: tuple[str, ...], cap: int) -> int:
    """``max(len(x), len(y)) - LCS(x, y)``, or ``cap + 1`` when that is more than ``cap``.

    Within ``cap`` mismatches, a common subsequence never strays more than ``cap`` places off
    the diagonal: a band of ``2 * cap + 1`` cells a row is enough (O(len * cap))."""
    n, m = len(x), len(y)
    if abs(n - m) > cap:
        return cap + 1
    width = 2 * cap + 1
    prev = [0] * (width + 2)  # cell k of row i: LCS(x[:i], y[:j]) with j = i + k - 1 - cap
    for i in range(1, n + 1):
        row = [0] * (width + 2)
        for k in range(1, width + 1):
            j = i + k - 1 - cap
            if 1 <= j <= m:
                row[k] = prev[k] + 1 if x[i - 1] == y[j - 1] else max(prev[k + 1], row[k - 1])
        prev = row
    return min(max(n, m) - prev[m - n + cap + 1], cap + 1)


@functools.lru_cache(maxsize=4096)
def _swapped(a: tuple[str, ...], b: tuple[str, ...], roles: bool = False) -> bool:
    """One exchange of two words makes ``a`` nearly ``b``; with ``roles``, one of them a
    pronoun of :data:`PERSONS` (the words folded by :func:`_folded`)."""
    if abs(len(a) - len(b)) > SLACK:  # no exchange brings them within SLACK words
        return False
    count_a, count_b = Counter(a), Counter(b)
    stop = STOP - PERSONS if roles else STOP
    shared = {w for w in a if w not in stop and count_a[w] == 1 and count_b[w] == 1}
    if len(shared) < 2:
        return False
    before = _mismatches(a, b, SLACK + 2)
    if not 2 <= before <= SLACK + 2:  # an exchange mends two words at most
        return False
    place_a = {w: i for i, w in enumerate(a) if w in shared}
    place_b = {w: j for j, w in enumerate(b) if w in shared}
    at_b = {j: w for w, j in place_b.items()}
    for x, i in place_a.items():
        # y takes x's place: where y stands in b, within SLACK (and x where y stands in b).
        for spot in range(i - SLACK, i + SLACK + 1):
            y = at_b.get(spot)
            if y is None or not place_a[x] < place_a[y] or place_b[x] < place_b[y]:
                continue  # none there, or the pair's order is the same on both sides
            if roles and not {x, y} & PERSONS:
                continue  # two other words: the plain reading's, not a role through a pronoun
            j = place_a[y]
            if abs(place_b[x] - j) > SLACK or _joined(a[i + 1 : j]):
                continue  # x lands too far, or "X and Y" / "Y and X": the same pair either way
            exchanged = tuple(y if w == x else x if w == y else w for w in a)
            after = _mismatches(exchanged, b, SLACK)
            if after <= SLACK and after <= before - 2:
                return True
    return False


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


def _reversed(a: str, b: str) -> bool:
    da, db = _directions(a), _directions(b)
    return any((y, x) in db and (y, x) not in da and (x, y) not in db for x, y in da)


#: Pronouns in their subject form: "me" is "i", "him" is "he"; a role taken by a pronoun.
PERSONS = frozenset({"i", "he", "she", "we", "they"})
_CASES = {
    **{"me": "i", "him": "he", "her": "she", "us": "we", "them": "they"},
    **{"am": "be", "is": "be", "are": "be"},
}
#: Possessives dropped: "my brother" is the brother whoever's he is ("I owe my brother").
_POSSESSIVES = frozenset({"my", "our", "their", "his"})
_SENTENCE = re.compile(r"[.?!;]+(?:\s|$)")


def _folded(sentence: str) -> tuple[str, ...]:
    """The words of ``sentence`` with pronouns in one case, no possessive, a final -s dropped (a
    verb's agreement; a plural's too, on both sides alike): "My brother owes me" is "brother owe
    i", "I owe my brother" is "i owe brother"."""
    folded = []
    for w in lower_words(sentence):
        if w in _POSSESSIVES:
            continue
        w = _CASES.get(w, w)
        if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
            w = w[:-1]
        folded.append(w)
    return tuple(folded)


def _roles(a: str, b: str) -> bool:
    """A sentence of each side, the same but for a role taken by a pronoun and a name ("My
    manager keeps interrupting me" / "I keep interrupting my manager")."""
    sa, sb = _SENTENCE.split(norm(a)), _SENTENCE.split(norm(b))
    if len(sa) != len(sb):
        return False
    for x, y in zip(sa, sb, strict=True):
        fx, fy = _folded(x), _folded(y)
        if fx != fy and (_swapped(fx, fy, True) or _swapped(fy, fx, True) or _exchanged(fx, fy)):
            return True
    return False


def _exchanged(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Two pronouns, both on each side, exchanged wherever they stand: "She asked him to marry
    her" / "He asked her to marry him" (each said twice, so no one-word exchange reads it)."""
    if len(a) != len(b):
        return False
    pronouns = PERSONS & set(a) & set(b)
    for x in pronouns:
        for y in pronouns:
            if x < y and tuple(y if w == x else x if w == y else w for w in a) == b:
                return True
    return False


def differs(a: str, b: str) -> bool:
    wa, wb = lower_words(a), lower_words(b)
    return (
        _swapped(wa, wb) or _swapped(wb, wa) or _reversed(a, b) or _reversed(b, a) or _roles(a, b)
    )


RULE = Rule(Reason.ORDER, differs)
