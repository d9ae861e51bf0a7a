"""Phrases exchanged, for :mod:`.order`: a role between a pronoun and a phrase, an owner and
what it owns.

:mod:`.order` reads a role taken by a pronoun through one word exchanged with it ("My landlord
is suing me" / "I am suing my landlord": "me" and "landlord"), so a role named by more words
passed: "My friend's dog bit me" / "I bit my friend's dog" (0.99 to the verifier, served), "The
police are chasing me" / "I am chasing the police". Here the words (as :mod:`.order` folds them:
pronouns in their subject case, no possessive) around the exchange are the same on both sides,
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
from collections.abc import Callable, Collection

from .text import norm

#: The most words a phrase taking a role may have ("the company's new lawyer").
LONGEST = 5


def exchanged_with_a_phrase(
    a: tuple[str, ...],
    b: tuple[str, ...],
    persons: Collection[str],
    joined: Callable[[tuple[str, ...]], bool],
) -> bool:
    """``a`` is ``pre p M Y post`` and ``b`` is ``pre Y M p post`` (or the other way), ``p``
    a pronoun of ``persons``, ``Y`` a phrase of 1 to :data:`LONGEST` words without ``p``, ``M``
    one word or more that ``joined`` does not read as a coordinator."""
    if len(a) != len(b) or a == b:
        return False
    start = 0
    while a[start] == b[start]:
        start += 1
    end = len(a)
    while a[end - 1] == b[end - 1]:
        end -= 1
    return _at_the_ends(a[start:end], b[start:end], persons, joined)


def _at_the_ends(
    x: tuple[str, ...],
    y: tuple[str, ...],
    persons: Collection[str],
    joined: Callable[[tuple[str, ...]], bool],
) -> bool:
    """``x`` is ``p M Y`` and ``y`` is ``Y M p``, or ``x`` is ``Y M p`` and ``y`` ``p M Y``."""
    for pronoun_at_start in (True, False):
        p = x[0] if pronoun_at_start else x[-1]
        if p not in persons or (y[-1] if pronoun_at_start else y[0]) != p:
            continue
        for size in range(1, min(LONGEST, len(x) - 2) + 1):
            phrase = x[-size:] if pronoun_at_start else x[:size]
            if p in phrase:
                continue
            if pronoun_at_start:
                middle, again, there = x[1:-size], y[size:-1], y[:size]
            else:
                middle, again, there = x[size:-1], y[1:-size], y[-size:]
            if there == phrase and middle == again and middle not in ((), ("be",)):
                if not joined(middle):  # ("be" alone says who is who either way round)
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
