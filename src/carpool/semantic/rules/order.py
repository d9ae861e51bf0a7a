"""The same words in another order: who does what to whom, and which way a conversion goes.

"The cat chased the mouse" / "the mouse chased the cat" and "convert JSON to YAML" / "convert
YAML to JSON" have the same words, so the same mean-pooled embedding, and opposite answers. The
rule fires when exchanging two words of one side makes it *the other side*, or nearly: for two
content words ``x`` and ``y`` found once on each side, in opposite orders, the side with ``x``
and ``y`` exchanged matches the other word for word but for at most :data:`SLACK` words
("How do I convert JSON to YAML?" / "How can I convert YAML to JSON?"), and by two words better
than before the exchange; a plural is read as its singular ("How many liters are in a gallon?"
/ "How many gallons are in a liter?"). Words joined only by one coordinator ("beauty and
intelligence", "MBA or CA", "Python as well as Java"), or each before the same words ("Western
culture and Chinese culture"), may change places; "as the landlord or as the tenant's
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

A direction between phrases reversed is read by :mod:`.directions`.

Roles taken by a pronoun: "My landlord is suing me" / "I am suing my landlord" exchange "me" and
"landlord", but pronouns carry no role above (:data:`STOP`, as "How do I..." / "How can I..." must
pass). So each sentence, and each clause (also split at an ellipsis, a dash, and "and" / "but"
/ "so" before a subject pronoun: a question or a clause after it says a pronoun again), is read
a second time folded (:func:`.phrases.folded`): a pronoun in its subject case ("me" is "i",
"him" "he", "her" "she", or, before a word, a possessive: both readings tried), no possessive
("my landlord" is "landlord"), a verb's agreement and tense aside ("am/is/are/was/were" one
verb, "has" "have", "does" "do", a -s dropped: "owes" is "owe"), "I'm", "I'll", "I'd" spelled
out; a clause whose own verb holds both ways round ("married to", "friends with") names no role;
the rule fires when one exchange of a pronoun of
:data:`PERSONS` with another word makes one side's sentence the other's (as above), or when two
pronouns, both on each side, exchanged wherever they stand do ("She asked him to marry her" /
"He asked her to marry him"). Measured on the development pairs, it refused no true rewording.

A prompt often names a role again in its question ("...sponsoring the wife, what visa does the
wife need?"), so a word said more than once, as often on each side, may be exchanged too (at
its first place, or everywhere: "The landlord sued me after the landlord evicted me"), and
each clause (split at ``,;:!?`` and a sentence's dot) is also compared with the
other side's clause in its place, when both sides have as many. "an" is read as "a" (the article
follows the exchange: "an uncle adopted a nephew"). A capital letter after a word is a name
("Team A", "node B"), not the article. And two words exchanged wherever they stand, making one
side exactly the other, fire too ("Mary gave John the book John wanted"), unless they are joined
("Python or Java").

A role named by a phrase exchanged with a pronoun ("My friend's dog bit me" / "I bit my
friend's dog") and an owner exchanged with what it owns ("my wife's brother" / "my brother's
wife") are read by :mod:`.phrases`; a question asked of the other role ("Who did Cain kill?" /
"Who killed Cain?") by :mod:`.asked`.
"""

from __future__ import annotations

import re
from collections import Counter

from ..verdict import Reason, Rule
from .asked import other_role
from .directions import reversed_direction
from .phrases import (
    PERSONS,
    exchanged_with_a_phrase,
    folded,
    owner_exchanged,
    pronouns_exchanged,
    singular,
    symmetric,
)
from .text import STOP, exchanged, lower_words, memo, norm

SLACK = 2
#: Words between two words whose order does not matter ("beauty and intelligence"). Not "as":
#: "as the landlord or as the tenant's guarantor" names two roles ("as well as" joins two).
COORDINATORS = frozenset({"and", "or", "nor", "&", "vs", "versus", "plus"})


def _joined(between: tuple[str, ...]) -> bool:
    """``between`` joins two words whose order does not matter: one coordinator, or "as well
    as", with determiners ("beauty and the beast", "Python as well as Java")."""
    rest = tuple(w for w in between if w not in ("a", "an", "the"))
    return (len(rest) == 1 and rest[0] in COORDINATORS) or rest in (
        ("as", "well", "as"),
        ("and", "or"),
    )


def _coordinated(words: tuple[str, ...], i: int, j: int) -> bool:
    """``words[i]`` and ``words[j]`` joined: by a coordinator ("Chinese and Western cultures"),
    or each before the same words ("Western culture and Chinese culture")."""
    between = words[i + 1 : j]
    return _joined(between) or (
        len(between) >= 2
        and _joined(between[-1:])
        and words[j + 1 : j + len(between)] == between[:-1]
    )


def _mismatches(x: tuple[str, ...], y: tuple[str, ...], cap: int) -> int:
    """``max(len(x), len(y)) - LCS(x, y)``, or ``cap + 1`` when that is more than ``cap``: within
    ``cap`` mismatches, a common subsequence never strays more than ``cap`` places off the
    diagonal, so a band of ``2 * cap + 1`` cells a row is enough (O(len * cap))."""
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


@memo
def _swapped(a: tuple[str, ...], b: tuple[str, ...], roles: bool = False) -> bool:
    """One exchange of two words makes ``a`` nearly ``b``; with ``roles``, one of them a
    pronoun of :data:`PERSONS` (the words folded by :func:`.phrases.folded`)."""
    if abs(len(a) - len(b)) > SLACK:  # no exchange brings them within SLACK words
        return False
    count_a, count_b = Counter(a), Counter(b)
    stop = STOP - PERSONS if roles else STOP
    shared = {w for w in a if w not in stop and count_a[w] == count_b[w] <= 3}
    if len(shared) < 2:
        return False
    before = _mismatches(a, b, SLACK + 2)
    if not 2 <= before <= SLACK + 2:  # an exchange mends two words at most
        return False
    place_a: dict[str, int] = {}
    place_b: dict[str, int] = {}
    for i, w in enumerate(a):
        if w in shared:
            place_a.setdefault(w, i)
    for j, w in enumerate(b):
        if w in shared:
            place_b.setdefault(w, j)
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
            if abs(place_b[x] - j) > SLACK or _coordinated(a, i, j):
                continue  # x lands too far, or "X and Y" / "Y and X": the same pair either way
            # Everywhere ("the landlord sued me after the landlord evicted me": the role said
            # twice) or at their first places only ("...suing me, what should I do?": a word
            # said again in another clause is no role).
            first = list(a)
            first[i], first[j] = y, x
            everywhere = exchanged(a, x, y)
            for tried in (everywhere, tuple(first)):
                after = _mismatches(tried, b, SLACK)
                if after <= SLACK and after <= before - 2:
                    return True
    return False


#: (From a run's start, read whole: "!" * 4,095 + "x" was tried from every mark, 0.4 s.)
_SENTENCE = re.compile(r"(?<![.?!;])[.?!;]++(?:\s|$)")
#: Clauses: a role is exchanged within one ("The landlord evicted the tenant, and the tenant
#: appealed"), while a word said again elsewhere ("what visa does the wife need?") is no role.
_PIECES = re.compile(r"[,;:!?]|\.(?!\w)")
#: The same, and an ellipsis or a dash between words ("...suing me - what should I do?").
#: And "and" / "but" / "so" before a subject pronoun: "I lent my friend money and he spent
#: it" exchanges its roles in the first clause, the second saying the other pronoun.
_CLAUSE = re.compile(
    _PIECES.pattern
    + r"|\u2026|\s[-\u2013\u2014]+\s|(?i:\s(?:and|but|so)\s(?=(?:i|he|she|we|they)\b))"
)


def _roles(a: str, b: str) -> bool:
    """A sentence or a clause of each side, the same but for a role taken by a pronoun and a
    name ("My manager keeps interrupting me" / "I keep interrupting my manager"); clauses
    because a question after a comma or a dash says a pronoun again ("She asked him to marry
    her, what should he say?")."""
    for pieces in (_SENTENCE, _CLAUSE):
        sa, sb = pieces.split(norm(a)), pieces.split(norm(b))
        if len(sa) != len(sb):
            continue
        for x, y in zip(sa, sb, strict=True):
            # "her" read both ways, each side: "She fired her boss" / "Her boss fired her",
            # "He owes her money" / "She owes him money".
            for hers_x, hers_y in ((False, False), (True, True), (True, False), (False, True)):
                fx, fy = folded(x, hers_x), folded(y, hers_y)
                if symmetric(fx) and symmetric(fy):
                    break  # ("married to", "friends with": the same either way round)
                if fx != fy and (
                    _swapped(fx, fy, True)
                    or _swapped(fy, fx, True)
                    or pronouns_exchanged(fx, fy)
                    or exchanged_with_a_phrase(fx, fy, _joined)
                ):
                    return True
                if "her" not in lower_words(x) + lower_words(y):
                    break  # (no "her": one reading)
    return False


#: A capital letter after a word names someone or something ("Team A", "node B", "Player X"):
#: read as a name, not as the article "a" (a word of STOP). Not "I".
_LETTER_NAME = re.compile(r"(?<=[^\W\d_] )([A-HJ-Z])(?![\w'-])")


def _names(text: str) -> str:
    return _LETTER_NAME.sub(r"\1-name", norm(text))


_ARTICLES = {"an": "a", **dict.fromkeys("my your his her its our their".split(), "the")}


def _words(text: str) -> tuple[str, ...]:
    """The words, "an" as "a", a possessive as "the" (each follows its noun: "an uncle adopted a
    nephew" / "a nephew...", "the teacher sent her son" / "her son sent the teacher"), a plural
    as its singular (the number follows the question: "How many liters are in a gallon?" /
    "How many gallons are in a liter?" was served, 0.99)."""
    return tuple(singular(_ARTICLES.get(w, w)) for w in lower_words(text))


def _clauses(a: str, b: str) -> bool:
    """The same number of clauses on each side, and one of them the other's with two words
    exchanged (as :func:`_swapped` or :func:`_renamed` reads it)."""
    ca, cb = _PIECES.split(a), _PIECES.split(b)
    if len(ca) < 2 or len(ca) != len(cb):
        return False
    for x, y in zip(ca, cb, strict=True):
        wx, wy = _words(x), _words(y)
        if wx != wy and (_swapped(wx, wy) or _swapped(wy, wx) or _renamed(wx, wy)):
            return True
    return False


def _renamed(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Two words exchanged wherever they stand make ``a`` exactly ``b``: "Mary gave John the book
    John wanted" / "John gave Mary the book Mary wanted" (said more than once, no one-word
    exchange reads it), unless the two are joined ("Python or Java ... Java or Python")."""
    if len(a) != len(b):
        return False
    differ = {(x, y) for x, y in zip(a, b, strict=True) if x != y}
    if len(differ) != 2:
        return False
    (x, y), other = sorted(differ)
    if other != (y, x) or x in STOP or y in STOP or _mismatches(a, b, 2) < 2:
        return False  # (two neighbours exchanged: "earn money fast online" / "online fast")
    places = [i for i, w in enumerate(a) if w in (x, y)]
    return not any(
        a[i] != a[j] and _joined(a[i + 1 : j]) for i, j in zip(places, places[1:], strict=False)
    )


def differs(a: str, b: str) -> bool:
    if owner_exchanged(a, b) or owner_exchanged(b, a):
        return True
    a, b = _names(a), _names(b)
    wa, wb = _words(a), _words(b)
    return (
        _swapped(wa, wb)
        or _swapped(wb, wa)
        or _renamed(wa, wb)
        or _renamed(wb, wa)
        or reversed_direction(a, b)
        or reversed_direction(b, a)
        or _roles(a, b)
        or _clauses(a, b)
        or other_role(lower_words(a), lower_words(b))
    )


RULE = Rule(Reason.ORDER, differs)
