"""A small edit of a qualifier: how many, on what condition, must or may, when, how much, in
what form.

"Do all vaccines contain live virus?" / "Do some vaccines...", "Will the flight be refunded if
the airline cancels it?" / "...unless...", "Must a primary key be unique?" / "Can a primary key
be unique?", "Was Pluto a planet?" / "Is Pluto a planet?", "Is my coffee too hot to drink?" /
"...hot enough...", "as a table" / "as a bulleted list": one word or a few changed, and the
verifier, which reads the shared words, scored them 0.97-0.99. The rule reads each family of
:data:`FAMILIES` (its phrases in :mod:`.qualifier_words`) in the words a small edit changed:

- the two texts differ in at most :data:`MOST` words a side (difflib's opcodes over the words),
  within :data:`SPAN` words; a longer rewording is the verifier's, which reads it;
- a phrase of a family belongs to the edit when it covers a changed word, read in the whole
  text ("even if" / "only if": "if" is shared, the phrase is not);
- the rule fires when the edit's phrases of one family differ in class on the two sides, both
  sides having one ("all" / "some", "if" / "unless", "must" / "may", "was" / "is", "too" /
  "enough"), or one side alone has a class that changes the question by itself (a family's
  ``solo``: "only", "all", "none", "exactly", "at least"; "unless", "only if", "even if",
  "whether or not", "except"; any output format). Another class added on one side only ("Can I"
  / "Can I really") is left to the verifier: "Do you need..." / "Is a license needed..." are
  one question.

Some classes are one against each other and not alone (a family's ``alike``): "every day" /
"each day" / "per day", "only staying" / "just staying" are one question, but "each" or "just"
added alone restricts nothing, and "just" against another class than "only" is often "simply"
("Is this some fantasy?" / "Is this just fantasy?"). Three ways of saying a tense are read as
the plain one first: "be going to" is "will" ("Is it going to rain" / "Will it rain"), a
perfect infinitive is the past ("Who is the first to have walked on the moon" / "Who was the
first to walk..."), and a polite past is no tense ("I was (just) wondering if..." / "I am
wondering if..."); contractions are read as their words ("I'm", "didn't"). A settled fact asked in
another tense otherwise stays refused: no word tells "What were the causes" /
"What are the causes" from "Was Pluto a planet?" / "Is Pluto a planet?".

A negation inside an edit that changes a condition is read with it ("provided I notify" / "if I
don't notify"); a negation alone is the verifier's (the guard's negation bar). And "only" moved
to another word, the rest the same words ("Are only mushrooms fungi?" / "Are mushrooms only
fungi?"), is another question.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter

from ..verdict import Reason, Rule
from .qualifier_words import FAMILIES, Family
from .text import common_ends, memo, norm

#: The most words an edit may change on a side: past this, the verifier reads a rewording.
MOST = 3
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


#: Words after "going to" that make it a motion ("going to the shop"), not the future.
_DETERMINERS = frozenset("a an the my your his her our their this that these those".split())
_PRESENT_BE = {"is": "was", "are": "were", "am": "was"}
#: A polite past asks now: "I was wondering if..." is "I am wondering if...".
_POLITE = frozenset("wondering hoping".split())
_BE = frozenset("am is are was were".split())
#: Contractions read as their words: of "be", "have", and the negated ones ("'s" only after a
#: pronoun or a question word: after a name it is a possessive).
_CONTRACTED = {
    **{f"{w}'m": (w, "am") for w in ("i",)},
    **{f"{w}'re": (w, "are") for w in "we you they who what where how there".split()},
    **{f"{w}'s": (w, "is") for w in "it he she that what who where how there here".split()},
    **{f"{w}'ve": (w, "have") for w in "i we you they who what where how".split()},
    # A negated one too: "Doesn't Apple make phones?" / "Didn't..." is another time.
    **{
        f"{w}n't": (w, "not")
        for w in "do does did is are was were has have had can could should would".split()
    },
    "won't": ("will", "not"),
    "can't": ("can", "not"),
}
#: Past participles that do not end in "-ed": "to have won", "to have been".
_PARTICIPLES = frozenset(
    """been done gone won made had seen run led held built sent spent lost found taught thought
    brought bought fought caught written become come begun flown known grown shown drawn thrown
    given taken eaten beaten broken chosen driven ridden risen spoken stolen sworn torn worn
    fallen forgotten gotten hidden bitten left met paid said sold told stood understood felt kept
    slept meant heard sung swum struck shot wrote""".split()
)


def _participle(word: str) -> bool:
    # "-ed" of five letters or more, not "-eed": "walked", "invented"; not "red", "need", "speed".
    return word in _PARTICIPLES or (
        len(word) >= 5 and word.endswith("ed") and not word.endswith("eed")
    )


def _just_polite(words: list[str], i: int) -> bool:
    """ "just wondering" at ``i``: "I was just wondering" is "I am just wondering"."""
    return words[i] == "just" and i + 1 < len(words) and words[i + 1] in _POLITE


def _tenses(words: list[str]) -> list[str]:
    """``words`` with two ways of saying a tense read as the plain one:

    - the future "be going to" as "will" ("Is it going to rain" is "Will it rain", "it's going
      to" is "it will"): the present "is" (up to two words before) is no present;
    - a perfect infinitive as the past: "Who is the first to have walked on the moon" asks what
      "Who was the first to walk" asks, so the nearest present "is" / "are" (up to six words
      before) is read as "was" / "were" and the "have" is dropped. Only "to have" before a
      participle: "Is it legal to have a dog" is the present;
    - a polite past as no tense: the "be" of "I was wondering", "we are hoping" is dropped (a
      first person's only: "The Democrats were hoping to win" is a past);
    - a contraction as its words: "I'm" is "I am", "it's" "it is", "I've" "I have", "didn't"
      "did not" ("I'm a US citizen" / "I was a US citizen" is another time, as with "I am").
    """
    out = [w for word in words for w in _CONTRACTED.get(word, (word,))]
    dropped = {
        i
        for i in range(1, len(out) - 1)
        if out[i - 1] in ("i", "we")
        and out[i] in _BE
        and (out[i + 1] in _POLITE or _just_polite(out, i + 1))
    }
    for i in range(len(out) - 2):
        if out[i] == "going" and out[i + 1] == "to" and out[i + 2] not in _DETERMINERS:
            for k in range(i - 1, max(-1, i - 3), -1):
                if out[k] in _PRESENT_BE:
                    out[k] = "will"
                elif out[k].endswith(("'s", "'re", "'m")):
                    out[k] = out[k].split("'")[0] + " will"
                else:
                    continue
                dropped.update((i, i + 1))
                break
        elif out[i] == "to" and out[i + 1] == "have" and _participle(out[i + 2]):
            for k in range(i - 1, max(-1, i - 7), -1):
                if out[k] in _PRESENT_BE:
                    out[k] = _PRESENT_BE[out[k]]
                    dropped.add(i + 1)
                    break
    return " ".join(w for i, w in enumerate(out) if i not in dropped).split()


@memo
def _words(text: str) -> tuple[str, ...]:
    return tuple(_tenses(_WORD.findall(norm(text).lower())))


def _phrases(words: tuple[str, ...], family: Family) -> list[tuple[int, int, str]]:
    """The family's phrases in ``words``: (start, end, class), the longest first, each word in
    one phrase at most."""
    taken = [False] * len(words)
    found = []
    for phrase, label in family.phrases:
        n = len(phrase)
        for i in range(len(words) - n + 1):
            if words[i : i + n] == phrase and not any(taken[i : i + n]):
                taken[i : i + n] = [True] * n
                found.append((i, i + n, label))
    return found


def _alike(labels: Counter[str], family: Family) -> Counter[str]:
    """The classes as compared against the other side's: "each" as "all" (:attr:`Family.alike`)."""
    folded: Counter[str] = Counter()
    for label, n in labels.items():
        folded[family.alike.get(label, label)] += n
    return Counter(set(folded)) if family.sets else folded


def _against(x: Counter[str], y: Counter[str], family: Family) -> Counter[str]:
    """``x`` without its loose classes that ``y`` has not the like of ("just" against no
    "only": :attr:`Family.loose`)."""
    if not family.loose:
        return x
    other = set(_alike(y, family))
    return Counter(
        {
            label: n
            for label, n in x.items()
            if label not in family.loose or family.alike[label] in other
        }
    )


def _edited(found: list[tuple[int, int, str]], changed: set[int], sets: bool) -> Counter[str]:
    """The classes of the phrases that cover a changed word."""
    labels = Counter(
        label for i, j, label in found if label != "-" and changed.intersection(range(i, j))
    )
    return Counter(set(labels)) if sets else labels


def _family_differs(
    a: tuple[str, ...], b: tuple[str, ...], ca: set[int], cb: set[int], family: Family
) -> bool:
    x = _edited(_phrases(a, family), ca, family.sets)
    y = _edited(_phrases(b, family), cb, family.sets)
    x, y = _against(x, y, family), _against(y, x, family)
    if _alike(x, family) == _alike(y, family) or set(x) | set(y) <= family.companions:
        return False
    if x and y:
        return True
    return any(label in family.solo for label in (x - y) + (y - x))


def _only_moved(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """The same words, "only" before another one."""
    if a == b or "only" not in a or Counter(a) != Counter(b):
        return False
    return [i for i, w in enumerate(a) if w == "only"] != [
        i for i, w in enumerate(b) if w == "only"
    ]


#: The most words between the first and the last change of a side: the edit is read there
#: (and :data:`MARGIN` words around it, for a phrase that covers a changed word), so a long
#: prompt costs its prefix and suffix only (difflib is quadratic: 60 ms for 700 repeated
#: words). Changes farther apart in a long prompt are the verifier's.
SPAN = 30
MARGIN = 3


@memo
def _differs(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    if a == b or abs(len(a) - len(b)) > MOST:
        return False
    start, end = common_ends(a, b)
    if max(len(a), len(b)) - start - end > SPAN:
        return False
    # The edit and its margin: the same words around it on both sides.
    lead = max(0, start - MARGIN)
    tail = max(0, end - MARGIN)
    a, b = a[lead : len(a) - tail], b[lead : len(b) - tail]
    if _only_moved(a, b):
        return True
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    ca: set[int] = set()
    cb: set[int] = set()
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            ca.update(range(i1, i2))
            cb.update(range(j1, j2))
            if len(ca) > MOST or len(cb) > MOST:
                return False
    return any(_family_differs(a, b, ca, cb, family) for family in FAMILIES)


def differs(a: str, b: str) -> bool:
    return _differs(_words(a), _words(b))


RULE = Rule(Reason.QUALIFIER, differs)
