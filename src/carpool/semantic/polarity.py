"""Polarity, for the meaning-change guard: do two texts ask the same thing with opposite sign?

This is the ``negation`` / ``antonym`` rule of :mod:`carpool.semantic.guard`, whose docstring
states it. Each text's negation cues are counted when it is analysed
(:mod:`carpool.semantic.analysis`); here the two are compared: the antonym swaps between words
present on one side only, and the flipped particles after the same verb, must equal the
difference of negation counts, since each negation cancels one swap ("not safe" = "dangerous");
without a swap, an implicit negator may cancel a negation ("won't fit" = "too big to fit").

A swap that negations cancel is no change of content, so :func:`polarity` also returns the words
it explains, and the later rules (``content_word``, ``detail``) leave them out.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from carpool.semantic import guard_words as W
from carpool.semantic.analysis import Analysis
from carpool.semantic.lexicon import ANTONYMS, PARTICLES, SYNONYM_WORDS, base_form, same_word


def polarity(a: Analysis, b: Analysis) -> tuple[str | None, frozenset[str]]:
    """Negation counts and antonym swaps; see the module docstring. Also returns the words that a
    cancelled swap explains (they are not a content change)."""
    if len(a.bag) == len(a.bases) and len(b.bag) == len(b.bases):
        only_a = a.bag - b.bag
        only_b = b.bag - a.bag
    else:                                   # repeated words: "guilty or guilty"
        ca, cb = Counter(a.bases), Counter(b.bases)
        only_a = frozenset(ca - cb)
        only_b = frozenset(cb - ca)
    swaps = 0
    explained: set[str] = set()
    if only_a and only_b and _may_swap(only_a, only_b):
        for x in only_a:
            if x in W.NEGATION_CUES or x in PARTICLES:
                continue
            partner = _antonym_in(x, only_b, explained)
            if partner is not None and (
                    any(same_word(x, y) for y in only_b if y != partner)
                    or any(same_word(partner, y) for y in only_a if y != x)):
                partner = None          # x has a synonym on the other side: not a swap
            if partner is not None:
                explained.add(partner)
                explained.add(x)
                swaps += 1
    if (a.particles or b.particles) and a.particles != b.particles:
        pa = a.particles - b.particles
        pb = b.particles - a.particles
        for (head, particle) in pa:
            if (head, PARTICLES[particle]) in pb:
                swaps += 1
    diff = abs(a.neg - b.neg)
    if swaps == diff or (not swaps and a.neg - b.neg == b.implicit - a.implicit):
        if diff:
            explained.update(W.NEGATION_CUES)
            explained.update(W.IMPLICIT_NEGATORS)
        return None, frozenset(explained)
    return ("antonym" if swaps else "negation"), frozenset()


def _may_swap(only_a: frozenset[str], only_b: frozenset[str]) -> bool:
    """A quick superset test of "some word of only_a is an antonym of some word of only_b"."""
    ka: set[str] = set()
    ya: set[str] = set()
    for x in only_a:
        ax, sx, yx = _ant_facts(x)
        ka.update(ax)
        ka.update(sx)
        ya.update(yx)
    for y in only_b:
        ay, sy, yy = _ant_facts(y)
        if not ka.isdisjoint(yy) or not ya.isdisjoint(ay) or not ya.isdisjoint(sy):
            return True
    return False


def _antonym_in(x: str, pool: frozenset[str], used: set[str]) -> str | None:
    for y in pool:
        if y not in used and y not in PARTICLES and y not in W.NEGATION_CUES and _antonyms(x, y):
            return y
    return None


def _antonyms(x: str, y: str) -> bool:
    """Base forms ``x`` and ``y`` are antonyms: listed, by prefix (un-, in-, dis-, ...) or
    -ful/-less, directly or through one listed synonym of either ("right" ~ "correct" /
    "incorrect"); never two synonyms."""
    ax, sx, yx = _ant_facts(x)
    ay, sy, yy = _ant_facts(y)
    if y in yx:
        return False
    return y in ax or x in ay or not sx.isdisjoint(yy) or not sy.isdisjoint(yx)


@lru_cache(maxsize=65536)
def _ant_facts(w: str) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(antonyms of w or of a synonym of w, including prefix/suffix stems of its synonyms;
    w's own prefix/suffix stems; w and its synonyms)."""
    syn = SYNONYM_WORDS.get(w, frozenset()) | {w}
    ants: set[str] = set()
    for p in syn:
        ants.update(ANTONYMS.get(p, ()))
        if p != w:
            ants.update(_stems(p))
    return frozenset(ants), _stems(w), frozenset(syn)


@lru_cache(maxsize=65536)
def _stems(x: str) -> frozenset[str]:
    """What ``x`` negates by its form: "unsafe" -> {"safe"}, "harmless" -> {"harm", "harmful"}."""
    out: set[str] = set()
    if x not in W.FALSE_PREFIX_ANTONYMS:
        for p in W.ANTONYM_PREFIXES:
            if x.startswith(p) and len(x) - len(p) >= 3:
                rest = x[len(p):].lstrip("-")
                out.add(rest)
                out.add(base_form(rest))
    if x.endswith("less") and len(x) > 6:
        stem = x[:-4]
        out.update((stem, stem + "ful", base_form(stem)))
    elif x.endswith("ful") and len(x) > 5:
        out.add(x[:-3] + "less")
    return frozenset(out)
