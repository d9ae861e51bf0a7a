"""A pair's core: what is left of two prompts without the wording they share at their edges.

Shared wording around a one-word difference drowned it for the packaged verifier: "Hey there,
how do I bake bread?" / "...cake?" scored 0.995 (0.83 bare), "Hello! Why do cats purr?" /
"...hiss?" 0.996 (0.035 bare); over 32 pairs one content word apart, a greeting shared by both
got 10 served, "Question: " 7, " Answer briefly." 4, none bare. So the verifier scores such a
pair both as sent and as its core, and keeps the lower score (``verifier.CrossEncoder``).

Contract: ``core(a, b)`` is the pair without the clauses and sentences both open or end with,
word for word (case and spacing aside; at least one clause left a side), and without shared
words before a question word ("hey there how do i..." has no mark to cut at); None when they
share no such edge, or when what is left is not one content word apart (the same words but
one, a content word on both sides, not another form of one word: ``rules.substitution``). A
longer rewording read without its context lost it ("My girlfrien just left me..." cut to a
clause scored 0.79): only a one-word difference is read bare. Measured on the held-out
development pairs: no decision changed (always scoring the core lost 7 true rewordings).
Linear in the texts.

``turns(a, b)``: two conversations' earlier turns (``verifier.render_context``) as the pairs the
verifier reads: each turn that differs, alone, where both hold as many turns of the same roles
in order; None (refused unasked) where they do not (a turn on one side only: the verifier,
asked about a text against nothing, scored an instruction against none 0.99; read whole, an
extra exchange hid a change in another turn, 0.987-0.993, served) or where more than
``MAX_ALONE`` turns differ (a pair a turn: 280 turns made 2,240 model runs of one lookup).
Read whole, a long shared turn drowned a change in another ("did not find some" / "...any",
"take it in the morning" / "...at night" after a 40-word request: 0.985-0.992, served;
0.01-0.06 alone). Read alone, a short statement reworded is rarely the same to the verifier,
trained on questions ("Sure." / "Sure thing." 0.017, 0.989 in its context): hits given up for
wrong answers not served.
"""

from __future__ import annotations

import re

from .rules.substitution import another_thing, one_changed
from .rules.text import lower_words

#: A clause with the marks after it: what a pair's shared edges are cut in.
_SEGMENT = re.compile(r"[^,.?!;:\n]+[,.?!;:\n]*|[,.?!;:\n]+")
_QUESTION = frozenset("how what why where when which who whom whose".split())
#: Where a rendered context's turns begin (a turn's own line breaks are indented).
_TURN = re.compile(r"\n(?! )")
#: The most turns read alone (``turns``).
MAX_ALONE = 2


def core(a: str, b: str) -> tuple[str, str] | None:
    """The pair without the wording both share at their edges (the module's contract)."""
    x, y = _SEGMENT.findall(a), _SEGMENT.findall(b)
    shortest = min(len(x), len(y))
    head = 0
    while head < shortest - 1 and _same(x[head], y[head]):
        head += 1
    tail = 0
    while tail < shortest - head - 1 and _same(x[-1 - tail], y[-1 - tail]):
        tail += 1
    cx = "".join(x[head : len(x) - tail]).strip()
    cy = "".join(y[head : len(y) - tail]).strip()
    # An opener without a mark ("hey there how do i..."): shared words before a question word.
    wx, wy = cx.split(), cy.split()
    shared = 0
    while shared < min(len(wx), len(wy)) - 1 and wx[shared].lower() == wy[shared].lower():
        shared += 1
    # (A word both sides say: the first one they differ in may be a question word on one side
    # only, "how" / "(how", and the cut, made in one order, was not in the other.)
    opener = max((i for i in range(1, shared) if wx[i].lower() in _QUESTION), default=0)
    if opener:
        cx, cy = " ".join(wx[opener:]), " ".join(wy[opener:])
    elif not head and not tail:
        return None
    if not cx or not cy or cx == cy or not _one_word_apart(cx, cy):
        return None
    return cx, cy


def _same(u: str, v: str) -> bool:
    return u.strip().lower() == v.strip().lower()


def _one_word_apart(a: str, b: str) -> bool:
    """The same words but one, a content word on both sides, not another form of one word."""
    x, y = lower_words(a), lower_words(b)
    i = one_changed(x, y)
    return i is not None and another_thing(x[i], y[i])


def turns(a: str, b: str) -> list[tuple[str, str]] | None:
    """Two contexts' pairs for the verifier, or None (the module's contract)."""
    x, y = _TURN.split(a), _TURN.split(b)
    if len(x) != len(y):
        return None
    pairs = list(zip(x, y, strict=True))
    if any(u.partition(":")[0] != v.partition(":")[0] for u, v in pairs):  # (the roles)
        return None
    differ = [(u, v) for u, v in pairs if u != v]
    return differ if len(differ) <= MAX_ALONE else None
