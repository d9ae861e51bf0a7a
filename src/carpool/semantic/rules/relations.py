"""Whose relative: a relation reached through a possessive ("my wife's brother").

"What do I call my wife's brother?" / "...my brother's wife?", "my boss's boss" / "my boss",
"Queen Victoria's grandmother" / "...granddaughter" have nearly the same words, and the
verifier scored them 0.96-0.99: it reads which relatives are named, not how one is reached from
the other. The rule reads each side's links, an owner and a relative of :data:`RELATIVES`:

- "X's R" and "Xs' R" (a possessive before a relative, "ex-", "late", "step-"... between:
  "my husband's ex-wife") link X to R, and a chain links each step ("Zeus's father's father");
- "R of X" links X to R, and "R of X's S" links S to R ("the parent of a node's child"), so
  "the grandmother of Queen Victoria" is "Queen Victoria's grandmother".

It fires when a side has a possessive before a relative and the two sides' links differ, or
the relatives they name differ in number ("my landlord's approval" / "my landlord's landlord's
approval"). Relatives named without a possessive on either side ("my boss" / "my manager") are
the verifier's, which reads those. A relative is read in one form: plurals and "mom" / "mum" /
"mother", "kid" / "child" are one.
"""

from __future__ import annotations

import re
from collections import Counter

from ..verdict import Reason, Rule
from .text import memo, norm

#: Nouns that name someone by their relation to someone else.
RELATIVES = frozenset(
    """mother father parent sister brother sibling son daughter child wife husband spouse
    partner boyfriend girlfriend fiance fiancee ex cousin uncle aunt nephew niece grandmother
    grandfather grandparent grandson granddaughter grandchild stepmother stepfather stepparent
    stepdaughter stepson stepsister stepbrother stepchild boss manager supervisor employer
    employee colleague coworker teacher student mentor landlord tenant guest client owner
    neighbour neighbor friend roommate lawyer doctor""".split()
)
#: Other words for a relative of :data:`RELATIVES`.
SYNONYMS = {
    "mom": "mother",
    "mum": "mother",
    "mommy": "mother",
    "dad": "father",
    "daddy": "father",
    "kid": "child",
    "children": "child",
    "grandma": "grandmother",
    "grandpa": "grandfather",
    "grandchildren": "grandchild",
    "stepchildren": "stepchild",
}
#: Words between a possessive and its relative: "my husband's ex-wife", "Jo's late father".
_MODIFIERS = frozenset(
    "ex late former new current best older younger eldest youngest elder step own".split()
)
_DETERMINERS = frozenset("a an the my your his her our their its this that".split())
#: A word with its possessive kept: "wife's", "parents'" (a plural's apostrophe alone).
_WORD = re.compile(r"[^\W\d_]+(?:'s\b|s'(?!\w))?")


def relative(word: str) -> str | None:
    """``word`` as a relative of :data:`RELATIVES` (one form: "moms" is "mother"), or None."""
    word = SYNONYMS.get(word, word)
    if word in RELATIVES:
        return word
    if word.endswith("s"):
        word = SYNONYMS.get(word[:-1], word[:-1])
        return word if word in RELATIVES else None
    return None


def _owner(token: str) -> str | None:
    """The owner a possessive names ("wife's" is "wife", "parents'" is "parents"), or None."""
    if token.endswith("'s"):
        return token[:-2]
    if token.endswith("s'"):
        return token[:-1]
    return None


def _read_owned(tokens: list[str], i: int) -> tuple[int, str] | None:
    """Past the modifiers from ``i``: the place and the relative a possessive owns, or None."""
    while i < len(tokens) and tokens[i] in _MODIFIERS:
        i += 1
    if i == len(tokens):
        return None
    found = relative(_owner(tokens[i]) or tokens[i])
    return None if found is None else (i, found)


def _name_ends(written: list[str]) -> list[int]:
    """For each word, where the run of capitalised words it starts ends (itself when it or the
    next is not capitalised). Read once from the end: walking the run from each "R of" in it
    was quadratic ("Mom Of Mom Of ...": 100-270 ms at the guard's READ_CHARS)."""
    ends = list(range(len(written)))
    upper = [w[0].isupper() for w in written]
    for j in range(len(written) - 2, -1, -1):
        if upper[j] and upper[j + 1]:
            ends[j] = ends[j + 1]
    return ends


@memo
def _read(text: str) -> tuple[Counter[tuple[str, str]], Counter[str], bool]:
    """The links (owner, relative), the relatives named, and whether a possessive owns one."""
    written = _WORD.findall(norm(text))
    tokens = [t.lower() for t in written]
    name_end = _name_ends(written)
    links: Counter[tuple[str, str]] = Counter()
    possessed = False
    for i, token in enumerate(tokens):
        owner = _owner(token)
        if owner is not None:
            owned = _read_owned(tokens, i + 1)
            if owned is not None:
                links[(relative(owner) or owner, owned[1])] += 1
                possessed = True
            continue
        r = relative(token)
        if r is None or i + 2 >= len(tokens) or tokens[i + 1] != "of":
            continue
        j = i + 2
        while j < len(tokens) - 1 and tokens[j] in _DETERMINERS:
            j += 1
        # A name of several words is read by its last ("of Queen Victoria" is Victoria's).
        j = name_end[j]
        # "the parent of a node's child": the relative is the child's, not the node's.
        owned = _read_owned(tokens, j + 1) if _owner(tokens[j]) is not None else None
        if owned is not None:
            links[(owned[1], r)] += 1
        else:
            target = _owner(tokens[j]) or tokens[j]
            links[(relative(target) or target, r)] += 1
    named = Counter(r for t in tokens if (r := relative(_owner(t) or t)) is not None)
    return links, named, possessed


def differs(a: str, b: str) -> bool:
    links_a, named_a, possessed_a = _read(a)
    links_b, named_b, possessed_b = _read(b)
    if not (possessed_a or possessed_b):
        return False
    return links_a != links_b or named_a != named_b


RULE = Rule(Reason.RELATION, differs)
