"""One word, for the meaning-change guard: its base form, when two words are one word, and the
word classes and relations built from the lists in :mod:`carpool.semantic.guard_words`.

Everything here is about a single word, whatever its context, so it is computed once per word
and shared by every text (:mod:`carpool.semantic.analysis` reads a text, and describes the
normalisation as a whole):

- :func:`base_form`: a crude lemma, the same for a word's inflections and spelling variants
  ("branches"/"branch", "thicker"/"thick", "colour"/"color");
- :func:`same_word`: two words are one: the same base form, a derivation ("text"/"textual"), a
  listed synonym ("PC"/"computer") or a typo (same first letter, five letters or more, one edit
  apart, two from nine letters; never a word of a closed list, nor two known words:
  "quiet"/"quite");
- :func:`word_facts`: which closed lists a word is in (negation cue, number, date, unit,
  audience, scope, possessor, quantifier, question word, particle), read by the analysis;
- the tables built once at import: antonyms and synonyms by base form, audience groups, verb
  particle pairs, and the word classes (stop, function, evaluative and known common words).
"""

from __future__ import annotations

from functools import lru_cache

from carpool.semantic import guard_words as W

# ================================================================================================
# Base forms


_VOWELS = frozenset("aeiouy")


def _strip_e(w: str) -> str:
    return w[:-1] if len(w) > 3 and w.endswith("e") and not w.endswith("ee") else w


def _undouble(s: str) -> str:
    if len(s) >= 3 and s[-1] == s[-2] and s[-1] not in "lsz" and s[-1] not in _VOWELS:
        return s[:-1]
    return s


def _has_vowel(s: str) -> bool:
    return any(c in _VOWELS for c in s)


_ISE = ("ise", "ised", "ises", "ising", "isation", "isations")
_ISE_KEEP = ("wise", "rise", "cise", "vise", "mise", "ertise", "prise", "guise", "noise", "poise",
             "raise", "cruise", "bruise", "chise")


@lru_cache(maxsize=65536)
def base_form(w: str) -> str:
    """A crude lemma, the same for the inflections of one word ("thicker", "thick" -> "thick")."""
    w = W.SPELLING_VARIANTS.get(w, w)
    irregular = W.IRREGULAR.get(w)
    if irregular is not None:
        return _strip_e(irregular)
    n = len(w)
    if n <= 3 or not w.isalpha():
        return w
    if n > 4 and w.endswith(_ISE) and not any(x in w for x in _ISE_KEEP):
        k = w.rfind("is")
        w = w[:k] + "iz" + w[k + 2:]
    if n > 4 and w.endswith(("ies", "ied", "ier")):
        return w[:-3] + "y"
    if n > 5 and w.endswith("iest"):
        return w[:-4] + "y"
    if n > 5 and w.endswith("ily"):
        return w[:-3] + "y"
    if n > 5 and w.endswith("ing"):
        s = w[:-3]
        if _has_vowel(s):
            return _strip_e(_undouble(s))
        return w
    if n > 4 and w.endswith("ed") and not w.endswith("eed"):
        s = w[:-2]
        if _has_vowel(s):
            return _strip_e(_undouble(s))
        return w
    if n > 5 and w.endswith("est"):
        return _strip_e(_undouble(w[:-3]))
    if n > 4 and w.endswith("er") and not w.endswith("eer"):
        s = w[:-2]
        if _has_vowel(s) and len(s) >= 3:
            return _strip_e(_undouble(s))
        return w
    if n > 5 and w.endswith("ly"):
        return _strip_e(w[:-2])
    if w.endswith(("sses", "shes", "ches", "xes", "zes")):
        return w[:-2]
    if w.endswith("s") and not w.endswith(("ss", "us", "sis", "ics")):
        return _strip_e(w[:-1])
    return _strip_e(w)


# ================================================================================================
# Relations and word classes


def _build_antonyms() -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for x, y in W.ANTONYM_PAIRS:
        if " " in x or " " in y:
            continue
        bx, by = base_form(x), base_form(y)
        if bx == by:
            continue
        for p, q in ((x, y), (bx, by), (x, by), (bx, y)):
            out.setdefault(p, set()).add(by if q in (y, by) else bx)
            out.setdefault(q, set()).add(bx if p in (x, bx) else by)
    return {k: frozenset(v) for k, v in out.items()}


ANTONYMS = _build_antonyms()
_ANTONYM_WORDS = frozenset(ANTONYMS)


def _build_synonyms() -> dict[str, frozenset[int]]:
    out: dict[str, set[int]] = {}
    for i, group in enumerate(W.SYNONYM_GROUPS):
        for word in group:
            out.setdefault(base_form(word), set()).add(i)
    return {k: frozenset(v) for k, v in out.items()}


SYNONYMS = _build_synonyms()


def _build_synonym_words() -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for group in W.SYNONYM_GROUPS:
        bases = {base_form(w) for w in group}
        for b in bases:
            out.setdefault(b, set()).update(bases)
    return {k: frozenset(v) for k, v in out.items()}


SYNONYM_WORDS = _build_synonym_words()

#: Audience noun -> the number of its group (child, kid, children: one group).
AUDIENCE: dict[str, int] = {}
for _i, _group in enumerate(W.AUDIENCE_GROUPS):
    for _w in _group:
        AUDIENCE.setdefault(_w, _i)
#: Verb particle -> its opposite ("up" <-> "down", "in" <-> "out").
PARTICLES: dict[str, str] = {}
for _x, _y in W.PARTICLE_PAIRS:
    PARTICLES[_x] = _y
    PARTICLES[_y] = _x

STOP = W.STOP_WORDS | W.POLITENESS
_FILLER = frozenset("a an the please pls plz kindly thanks thank thx ty cheers hi hello hey dear "
                    "really just actually so very quite basically exactly simply".split())
#: Words that carry grammar, not content: a slot made only of these is no content change.
_FUNCTION = frozenset("""
    a an the be am is are was were been being do does did have has had can could may might must
    shall should will would to of for with at by in on from as that which who what how this
    these those it its i me my we us our you your he him his she her they them their there here
    and or but if so than then not no also too either just very
""".split())
_CLOSED = (_ANTONYM_WORDS | frozenset(W.NUMBER_WORDS) | frozenset(W.ORDINAL_WORDS)
           | frozenset(AUDIENCE) | W.NEGATION_CUES | frozenset(W.MONTHS) | frozenset(W.WEEKDAYS)
           | frozenset(W.DATE_WORDS) | frozenset(W.TIME_UNITS) | W.SCOPE_WORDS
           | W.QUANT_UNIVERSAL | W.QUANT_SINGLE | W.QUANT_DUAL | W.QUANT_PARTIAL
           | W.POSSESSOR_SELF | W.POSSESSOR_OTHER | STOP)
#: Evaluative and degree words: swapping one for another ("best" / "most interesting") is not a
#: change of topic, so the one-slot rule does not count them as content.
_EVALUATIVE = frozenset("""
    good great best top nice cool awesome excellent amazing fantastic wonderful interesting
    fascinating important main major key effective efficient useful helpful ideal perfect
    popular famous favorite favourite greatest biggest actual really totally
""".split())
SOFT_BASES = frozenset(base_form(w) for w in STOP | _EVALUATIVE) | STOP | _EVALUATIVE
FUNCTION_BASES = frozenset(base_form(w) for w in _FUNCTION) | _FUNCTION
#: Words that are never a typo of another word.
_NO_TYPO = (frozenset(W.NUMBER_WORDS) | frozenset(W.ORDINAL_WORDS) | frozenset(AUDIENCE)
            | W.NEGATION_CUES | frozenset(W.MONTHS) | frozenset(W.WEEKDAYS)
            | frozenset(W.DATE_WORDS) | frozenset(W.TIME_UNITS) | W.SCOPE_WORDS
            | W.QUANT_UNIVERSAL | W.QUANT_SINGLE | W.QUANT_DUAL | W.QUANT_PARTIAL
            | W.POSSESSOR_SELF | W.POSSESSOR_OTHER)
#: Words known to be ordinary English (a capitalised one is not taken for a named entity).
COMMON = (_CLOSED | frozenset(SYNONYMS) | frozenset(w for g in W.SYNONYM_GROUPS for w in g)
          | frozenset(W.IRREGULAR) | W.IMPLICIT_NEGATORS) - frozenset(
              W.MONTHS) - frozenset(W.WEEKDAYS)
_QUANT = (("u", W.QUANT_UNIVERSAL), ("s", W.QUANT_SINGLE), ("d", W.QUANT_DUAL),
          ("p", W.QUANT_PARTIAL))
ARTICLES = frozenset(("a", "an"))
#: Words that spell a number ("twenty", "five", "thousand").
NUMBER_TEXT = frozenset(W.NUMBER_WORDS) | frozenset(("hundred", "thousand", "million",
                                                     "billion", "trillion"))
#: Words of amount that are not a number to compare ("a couple", "half").
NOT_NUMBERS = frozenset(("single", "once", "couple", "pair", "double", "triple", "half",
                         "quarter", "nil"))
_POSS_OTHER_DET = frozenset(("his", "her", "hers", "their", "theirs"))
_POSS_OTHER_PRON = frozenset(("someone", "somebody", "another", "anyone", "anybody"))


# ================================================================================================
# When two words are one word


def within_edits(a: str, b: str, limit: int) -> bool:
    """Optimal-string-alignment distance of ``a`` and ``b`` is at most ``limit`` (1 or 2)."""
    la, lb = len(a), len(b)
    if abs(la - lb) > limit:
        return False
    if limit == 1:
        if la == lb:
            diff = [i for i in range(la) if a[i] != b[i]]
            if len(diff) <= 1:
                return True
            return (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                    and a[diff[1]] == b[diff[0]])
        if la > lb:
            a, b, la, lb = b, a, lb, la
        i = 0
        while i < la and a[i] == b[i]:
            i += 1
        return a[i:] == b[i + 1:]
    prev2: list[int] = []
    prev = list(range(lb + 1))
    for i in range(1, la + 1):
        cur = [i] + [0] * lb
        best = i
        for j in range(1, lb + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            v = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                v = min(v, prev2[j - 2] + 1)
            cur[j] = v
            best = min(best, v)
        if best > limit:
            return False
        prev2, prev = prev, cur
    return prev[lb] <= limit


def _typo(a: str, b: str) -> bool:
    """``a`` and ``b`` are one word, mistyped: same first letter, five letters or more, one edit
    apart (two from nine letters), neither in a closed list (numbers, dates, negations, scope
    words), and not both known words ("quiet"/"quite" are two words)."""
    if a[0] != b[0] or not a.isalpha() or not b.isalpha():
        return False
    n = min(len(a), len(b))
    if n < 5 or a in _NO_TYPO or b in _NO_TYPO or (a in COMMON and b in COMMON):
        return False
    return within_edits(a, b, 2 if n >= 9 else 1)


@lru_cache(maxsize=65536)
def same_word(a: str, b: str) -> bool:
    """``a`` and ``b`` (words or base forms) are one word: equal, inflections, derivations
    ("text"/"textual"), listed synonyms, or a typo."""
    if a == b:
        return True
    ba, bb = base_form(a), base_form(b)
    if ba == bb:
        return True
    sa = SYNONYMS.get(a) or SYNONYMS.get(ba)
    if sa is not None:
        sb = SYNONYMS.get(b) or SYNONYMS.get(bb)
        if sb is not None and not sa.isdisjoint(sb):
            return True
    if _derived(a, b) or _derived(b, a):
        return True
    return _typo(a, b)


_DERIVATIONS = ("al", "ual", "ic", "ical", "ity", "ness", "ment", "tion", "ation", "ive", "ly",
                "ous", "ist", "ism", "ize", "ise", "ization", "isation", "ally", "er", "or")


def _derived(a: str, b: str) -> bool:
    """``b`` is ``a`` with a derivational suffix ("text"/"textual", "nation"/"national")."""
    if len(a) < 4 or not b.startswith(a[:-1]) or a in _NO_TYPO or b in _NO_TYPO:
        return False
    for stem in (a, a[:-1]):
        if b.startswith(stem) and b[len(stem):] in _DERIVATIONS:
            return True
    return False


# ================================================================================================
# Facts of one word


class WordFacts:
    """Static facts about one lower-case word (memoised); ``plain`` words have none but a base."""

    __slots__ = ("base", "plain", "in_seq", "in_keys", "neg", "implicit", "article", "numtext",
                 "ordinal", "month", "weekday", "date", "time_unit", "unit", "unit_ambiguous",
                 "audience", "scope", "poss", "quant", "wh", "particle", "stop")

    def __init__(self, w: str) -> None:
        b = base_form(w)
        self.base = b
        self.in_seq = w not in W.POLITENESS and w not in _FILLER
        self.in_keys = w not in W.POLITENESS and w not in ("a", "an", "the")
        self.neg = w in W.NEGATION_CUES and w not in W.NEGATION_UNCOUNTED
        self.implicit = w in W.IMPLICIT_NEGATORS
        self.article = w in ARTICLES
        self.numtext = w in NUMBER_TEXT and w not in NOT_NUMBERS
        self.ordinal = W.ORDINAL_WORDS.get(w, 0)
        self.month = W.MONTHS.get(w, 0)
        self.weekday = W.WEEKDAYS.get(w)
        self.date = W.DATE_WORDS.get(w)
        self.time_unit = W.TIME_UNITS.get(w) or W.TIME_UNITS.get(b)
        self.unit = W.UNITS.get(w) or W.UNITS.get(b) or (
            W.UNITS.get(w[:-1]) if w.endswith("s") and len(w) > 3 else None)
        self.unit_ambiguous = w in W.AMBIGUOUS_UNITS or b in W.AMBIGUOUS_UNITS
        g = AUDIENCE.get(w)
        self.audience = AUDIENCE.get(b) if g is None else g
        self.scope = w in W.SCOPE_WORDS
        self.poss = (1 if w in W.POSSESSOR_SELF else 2 if w in _POSS_OTHER_DET
                     else 3 if w in _POSS_OTHER_PRON else 0)
        self.quant = next((code for code, group in _QUANT if w in group), "")
        self.wh = w in W.WH_DISTINCT or w == "how"
        self.particle = w in PARTICLES
        self.stop = w in STOP
        self.plain = not (self.neg or self.implicit or self.article or self.numtext
                          or self.ordinal or self.month or self.weekday or self.date
                          or self.time_unit or self.unit or self.audience is not None
                          or self.scope or self.poss or self.quant or self.wh or self.particle)


_WORD_FACTS: dict[str, WordFacts] = {}


def word_facts(w: str) -> WordFacts:
    """The facts of ``w``, memoised (the table is emptied past 100,000 words, to bound memory)."""
    f = _WORD_FACTS.get(w)
    if f is None:
        if len(_WORD_FACTS) > 100_000:
            _WORD_FACTS.clear()
        f = _WORD_FACTS[w] = WordFacts(w)
    return f
