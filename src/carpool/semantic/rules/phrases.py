"""Roles, for :mod:`.order`: a sentence folded for its roles, pronouns exchanged, a role between
a pronoun and a phrase, an owner and what it owns.

``folded(sentence)`` is the roles reading's words (pronouns in their subject case, no
possessive, a verb's agreement and tense aside, "I'm" as "I am"). ``symmetric(words)``: a
predicate that holds both ways round links the two ("married to", "dating", "friends with",
"the same age as"), so no role: "I'm married to my cousin" / "My cousin is married to me" say the
same.

:mod:`.order` reads a role taken by a pronoun through one word exchanged with it ("My landlord
is suing me" / "I am suing my landlord": "me" and "landlord"), so a role named by more words
passed: "My friend's dog bit me" / "I bit my friend's dog" (0.99 to the verifier, served), "The
police are chasing me" / "I am chasing the police". Here the words (``folded``: pronouns in
their subject case, no possessive) around the exchange are the same on both sides,
and what is left is a pronoun, the same middle, and a phrase of up to :data:`LONGEST` words, in
one order on one side and in the other order on the other: ``p M Y`` / ``Y M p``. A middle that
only joins the two ("I and my brother" / "my brother and I"), or only says which is which ("I am
the executor of my dad's will" / "The executor of my dad's will is me"), exchanges no role.

An owner and what it owns exchanged, two neighbours: "the solvent's solute" / "the solute's
solvent", "my wife's brother" / "my brother's wife". Neighbours exchanged pass :mod:`.order`
("earn money fast online" / "...online fast"), and the words are read there without their
possessive, so the possessive is kept for this one reading: "x's y" on one side where the other
says "y's x", the rest word for word.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .text import STOP, common_ends, exchanged, lower_words, memo, norm

#: Pronouns in their subject form: "me" is "i", "him" is "he"; a role taken by a pronoun.
PERSONS = frozenset({"i", "you", "he", "she", "we", "they"})
_CASES = {
    **{"me": "i", "him": "he", "her": "she", "us": "we", "them": "they"},
    # (The verb agreeing with the other person, its tense aside: "My friend's kids were bullying
    # me" / "I was bullying my friend's kids", "has" / "have", "does" / "do".)
    **dict.fromkeys(("am", "is", "are", "was", "were"), "be"),
    **{"has": "have", "does": "do", "doesn't": "don't", "hasn't": "haven't", "wasn't": "weren't"},
    "had": "would",  # ("I'd" is either)
}
#: "I'm", "we've", "they're", "I'll", "she'd": the pronoun and its verb, as "I am" says them.
_CONTRACTED = re.compile(r"(?i)\b(i|you|he|she|we|they)['\u2019](m|ve|re|ll|d)\b")
_UNCONTRACTED = {"m": "am", "ve": "have", "re": "are", "ll": "will", "d": "would"}
#: A predicate that holds both ways round, linking the two ("i be married to cousin", folded:
#: "-s" dropped, so "friends" is "friend"), the clause's own, its first verb; not one elsewhere
#: in it ("...now that I'm dating someone", "the same office") nor a noun ("My roommate owes
#: me": a role).
_SYMMETRIC = re.compile(
    r"^(?:\S+ ){1,4}be (?:(?:married|engaged|related) to|(?:friend|roommate|neighbor|neighbour|cousin"
    r"|sibling) with|dating|(?:fighting|arguing) with|the same \S+ as) \S"
)


def symmetric(words: tuple[str, ...]) -> bool:
    """``words`` (``folded``) say a relation that holds both ways round between two: "I'm married
    to my cousin" / "My cousin is married to me" name no role."""
    return _SYMMETRIC.search(" ".join(words)) is not None


#: Possessives dropped: "my brother" is the brother whoever's he is ("I owe my brother").
_POSSESSIVES = frozenset({"my", "your", "our", "their", "his"})


#: Plurals that do not end in -s ("How many meters are in a foot?" / "...feet in a meter?").
_IRREGULAR = dict(
    pair.split("/")
    for pair in """feet/foot teeth/tooth men/man women/woman mice/mouse geese/goose people/person
    children/child oxen/ox cacti/cactus criteria/criterion wolves/wolf knives/knife leaves/leaf
    lives/life halves/half shelves/shelf thieves/thief wives/wife calves/calf loaves/loaf
    elves/elf""".split()
)


def singular(word: str) -> str:
    """``word`` without a plural's ending: "liters" "liter", "inches" "inch", "cities" "city"
    (a verb's -s too: the two sides are read alike)."""
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if len(word) <= 3 or not word.endswith("s") or word.endswith(("ss", "us", "is")):
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("ches", "shes", "xes")):
        return word[:-2]
    return word[:-1]


@memo
def folded(sentence: str, hers: bool = False) -> tuple[str, ...]:
    """The words of ``sentence`` with pronouns in one case, no possessive, a final -s dropped (a
    verb's agreement; a plural's too, on both sides alike): "My brother owes me" is "brother owe
    i", "I owe my brother" is "i owe brother". With ``hers``, "her" before a word that is no
    stop word is a possessive ("She fired her boss"), else a person ("He owes her money")."""
    out = []
    words = lower_words(
        _CONTRACTED.sub(lambda m: f"{m[1]} {_UNCONTRACTED[m[2].lower()]}", sentence)
    )
    for k, w in enumerate(words):
        if w in _POSSESSIVES or (
            hers and w == "her" and k + 1 < len(words) and words[k + 1] not in STOP
        ):
            continue
        out.append(singular(_CASES.get(w, w)))
    return tuple(out)


def pronouns_exchanged(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Two pronouns, both on each side, exchanged wherever they stand: "She asked him to marry
    her" / "He asked her to marry him" (each said twice, so no one-word exchange reads it)."""
    if len(a) != len(b):
        return False
    pronouns = PERSONS & set(a) & set(b)
    for x in pronouns:
        for y in pronouns:
            if x < y and exchanged(a, x, y) == b:
                return True
    return False


#: The most words a phrase taking a role may have ("the company's new lawyer").
LONGEST = 5


def exchanged_with_a_phrase(
    a: tuple[str, ...], b: tuple[str, ...], joined: Callable[[tuple[str, ...]], bool]
) -> bool:
    """``a`` is ``pre p M Y post`` and ``b`` is ``pre Y M p post`` (or the other way), ``p``
    a pronoun of :data:`PERSONS`, ``Y`` a phrase of 1 to :data:`LONGEST` words without ``p``, ``M``
    one word or more that ``joined`` does not read as a coordinator."""
    if len(a) != len(b) or a == b:
        return False
    start, end = common_ends(a, b)
    return _at_the_ends(a[start : len(a) - end], b[start : len(b) - end], joined)


def _at_the_ends(
    x: tuple[str, ...], y: tuple[str, ...], joined: Callable[[tuple[str, ...]], bool]
) -> bool:
    """``x`` is ``p M Y`` and ``y`` is ``Y M p``, or ``x`` is ``Y M p`` and ``y`` ``p M Y``."""
    for pronoun_at_start in (True, False):
        p = x[0] if pronoun_at_start else x[-1]
        if p not in PERSONS or (y[-1] if pronoun_at_start else y[0]) != p:
            continue
        for size in range(1, min(LONGEST, len(x) - 2) + 1):
            phrase = x[-size:] if pronoun_at_start else x[:size]
            if p in phrase:
                continue
            if pronoun_at_start:
                middle, again, there = x[1:-size], y[size:-1], y[:size]
            else:
                middle, again, there = x[size:-1], y[1:-size], y[-size:]
            # ("be" alone says who is who either way round)
            if there == phrase and middle == again and middle not in ((), ("be",)):
                if not joined(middle):
                    return True
    return False


#: A word with its possessive kept ("solvent's").
_OWNING = re.compile(r"[^\W_]+(?:'s\b)?")


def owner_exchanged(a: str, b: str) -> bool:
    """An owner and what it owns exchanged: "x's y" on one side, "y's x" on the other."""
    wa: list[str] = _OWNING.findall(norm(a).lower())
    wb: list[str] = _OWNING.findall(norm(b).lower())
    if len(wa) != len(wb):
        return False
    changed = [i for i, (x, y) in enumerate(zip(wa, wb, strict=True)) if x != y]
    if len(changed) != 2 or changed[1] != changed[0] + 1:
        return False
    i = changed[0]
    x, y = wa[i], wa[i + 1]
    return x.endswith("'s") and wb[i] == y + "'s" and wb[i + 1] == x[:-2]
