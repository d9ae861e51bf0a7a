"""The meaning-change guard: may a cached answer to one prompt be served for another?

The semantic cache finds candidates by embedding similarity, and embeddings are blind to the small
edits that flip an answer: "Is ibuprofen safe with alcohol?" and "...unsafe with alcohol?" score
0.99. :func:`check` runs on every candidate pair (new prompt, cached prompt) that passed the
similarity threshold and rejects the pair when the two prompts differ in something that changes
the answer. It is pure, deterministic and fast (a few tens of microseconds for short prompts; each
text's analysis is memoised, so a cached prompt is analysed once), and uses no model: rules, and
the word lists in :mod:`carpool.semantic.guard_words`.

Contract
--------
``check(new, cached, strict=False) -> Verdict(ok, reason)``; ``reason`` is ``None`` when ``ok``,
else one code of :data:`REASONS` (the first rule that fired, in the order below), used as a metric
label. The verdict is symmetric: ``check(a, b) == check(b, a)``. For a conversation, pass the last
user turn of each side (earlier turns are scoped by exact match elsewhere).

``strict`` is for the less similar candidates: the cache passes ``strict=True`` when the
similarity is below ``cache.STRICT_ABOVE`` (two bands: in [threshold, STRICT_ABOVE) the strict
guard, above it the normal one). Very similar pairs rarely differ in more than the edits every
rule looks for, and there a stricter test mostly rejects harmless rewordings; in the lower band,
"related but different question" pairs are common, and strict mode adds the rules marked
*(strict)* below.

Normalisation, never a change of meaning: Unicode NFKC, curly quotes, case (except to find named
entities and acronyms), white space and punctuation, politeness ("please", "thanks", "hi", "could
you"), articles, contractions ("isn't" -> "is not", "what's" -> "what is", "child's" -> "child"
with a possessive mark, also without apostrophe: "dont"), hyphens ("hash-map" = "hash map";
"non-zero" = "nonzero"), British/American spelling, inflection ("branches"/"branch",
"thicker"/"thick", "slowly"/"slow"), derivation ("text"/"textual"), listed synonyms
("PC"/"computer", "returns"/"yields") and typos: two words of five letters or more with the same
first letter, one edit apart (two from nine letters), unless one is a word of a closed list
(numbers, dates, negations, scope and quantity words, audience nouns) or both are known words
("quiet"/"quite").

Rules, in order; the first that fires names the reason:

``quoted``
    A quoted string ('...', "...") on one side does not occur, as the same words, on the other.
``number``
    The multisets of numbers differ: digits ("1,000", "3.5", "20k"), spelled-out numbers ("twenty
    five"), ordinals of a thing ("the 3rd", "the third floor"; not the adverb "first"), times
    ("7pm" = "19:00"), versions ("v2.1" = "version 2.1"), codes of digits ("7734-991"). A spelled
    "one" only counts against another number ("for one" vs "for two"); against an article ("one
    week" / "a week") or as a pronoun ("which one") it is no number.
``unit``
    Units or currencies differ ("miles" vs "km", "$" vs "EUR"; "$5" = "5 dollars").
``date``
    Calendar words differ: months, week days, today/tomorrow/yesterday/tonight, seasons,
    daily/weekly, periods anchored by last/next/this/per or a number ("last week" vs "last
    month"). A date on one side only counts when it is specific (a month, a week day,
    "tomorrow", an anchored period).
``identifier``
    A code or identifier on one side is absent from the other: words with digits ("S24",
    "python3"), snake_case, dotted names, ALLCAPS acronyms, ``code spans``, e-mails, URLs, paths.
    Case-insensitive; a dotted name matches its parts, an acronym the initials of a capitalised run
    or of a CamelCase word ("HF" = "Hugging Face", "JS" = "JavaScript").
``entity``
    A named entity (a capitalised word that does not start a sentence, or a mixed-case one like
    "iPhone"; known common words excepted) on one side does not occur on the other in any casing,
    glued to its neighbour ("HuggingFace" = "Hugging Face"), as an acronym, or as the same name
    with a demonym or plural ending ("India"/"Indians"). A text that is mostly capitalised (a
    headline, shouting) names no entities by case.
``negation`` / ``antonym``
    Polarity. Each side counts its negation cues (not, no, never, n't, without, none, nothing,
    hardly, ...), except an opening "No," interjection, "whether ... or not", "not only", and the
    mirrored negation of a tag question (", aren't you?"). Antonym swaps are counted between words
    present on one side only: listed pairs (safe/dangerous, increase/decrease, buy/sell,
    before/after, max/min, enable/disable, ..., about 570), prefix antonyms by rule (un-, in-,
    im-, il-, ir-, dis-, non-, de-, ab-, anti-, mis-, ...: "unsafe" when "safe" is on the other
    side), -ful/-less, one listed synonym away ("right" ~ "correct" / "incorrect"), and flipped
    particles after the same verb ("turn up"/"turn down", "log in"/"log out"). A word that has a
    synonym on the other side is not swapped. The pair passes only when the number of swaps equals
    the difference of negation counts: each swap is cancelled by a negation ("not safe" =
    "dangerous", "not unfair" = "fair"). Without a swap, one negation may also be cancelled by an
    implicit negator on the other side (avoid, prevent, omit, lack, missing, except, unless, "too
    X to": "won't fit" = "too big to fit"). Otherwise the reason is ``antonym`` if there was a
    swap, else ``negation``.
``scope``
    Who or what the answer is for: audience nouns (child/kid, adult, baby, senior, woman, dog,
    student, employee, company, resident, visitor, son, ...) of a group on one side only against a
    group on the other side only, or a "strong" audience noun (child, baby, teen, adult, senior,
    man/woman, pregnant, pets, family members, ...) on one side only; or a scope word on one side
    only (except, excluding, outside).
``possessor``
    Whose thing it is: first or second person ("my", "your", "own") on one side against third
    person only ("his", "her", "their", "someone's", "another user's") on the other. "my" vs
    "your" is no change (people write "your" for a generic reader).
``quantity``
    Conflicting quantifiers: universal (all, every, whole, entire, everyone) against single (one,
    single) or partial (part, portion, half), or dual (both) against single.
``order``
    The same things swapped around a directional word (to/into, from, than): "convert miles to km"
    vs "convert km to miles", "is A better than B" vs "is B better than A", and for any words, the
    content words just before and just after a directional word swapped ("convert amphetamine to
    methamphetamine" vs "convert methamphetamine to amphetamine").
``question``
    Different question words opening a question among when/where/who/why, or one of these against
    "how" ("when did it begin" vs "how did it begin"). Also when/where/who/why on one side against
    a question opening with what/which/how or an auxiliary on the other, unless that side names
    what the question word asks for ("when" ~ "what time", "why" ~ "what is the reason", "what
    makes", "the benefits"; "where" ~ "which place"): "When will the price drop?" vs "What is the
    price?", "Was it wise to sell?" vs "Why did they sell?". *(strict)* A yes/no question ("Should
    I ...?", "Is X good?") against a what/how/wh question ("How do I ...?", "What is X?"), unless
    it asks whether something can be done ("Can I ...?", "Is there a way to ...?", "Is it possible
    to ...?"), which a "how" answers.
``content_word``
    The two prompts are the same sequence of words except one slot, where one to three words on
    each side differ and each side has a content word with no counterpart (same word, inflection,
    derivation, listed synonym or typo) anywhere on the other ("mobile startup" vs "web startup",
    "not natural" vs "not sharp"). Evaluative words (good, best, interesting, ...) are not content.
    Rewordings that change more than one slot are left to the embedding threshold. A slot of a
    question word against the noun it asks for ("what time" / "when") is no swap.
``detail``
    A kind of scope change: one side carries a qualifier that the other lacks. The words compared
    are the content words with no counterpart on the other side (same word, inflection,
    derivation, listed synonym or typo), leaving out neutral words: what a question asks for in
    general ("the best way", "some tips", "the steps"), hedges, asking and opinion verbs
    (:data:`~carpool.semantic.guard_words.DETAIL_NEUTRAL`), evaluative words, politeness and
    filler, articles and pronouns (so "How do I" / "How do you" / "How does one" never differ).
    It fires when

    - a restrictive word (:data:`~carpool.semantic.guard_words.DETAIL_QUALIFIERS`: cheap, free,
      beginner, advanced, abroad, overseas, online, local, private, used, ...) is on one side
      only, wherever it stands ("cheap shopping sites" vs "best sites for clothes shopping");
    - or the other side has no such word at all (a pure addition), and an added word is in a
      phrase opened by a qualifying preposition (in, for, from, with, during, at, on, using, ...:
      "cancel my subscription" vs "... from abroad", "unethical behaviour" vs "... in the
      workplace", "near me"), or is coordinated with a shared word ("mechanical engineering" vs
      "mechanical and electrical engineering"), or modifies one ("attack dogs" vs "dogs") when
      the shorter side has at most 8 words or in strict mode;
    - *(strict)* or, in a pure addition, any added content word that is not an adverb in -ly or
      in a verb's place (after a pronoun, an auxiliary or "to").

    A rewording changes words on both sides, and then only the restrictive words count: the
    rest is left to the embedding. Light words (:data:`~carpool.semantic.guard_words.DETAIL_LIGHT`:
    use, make, get, process, order, size, ...) are never a detail but, left unmatched, mark their
    side as reworded. Texts of more than 12 words on both sides (filler left out) are left alone: a
    reworded paragraph routinely adds or drops a phrase.

Known limits: no syntax (negation scope is the whole prompt, so two negations in different clauses
cancel), no world knowledge (a lower-case name is an ordinary word; an unlisted synonym in a
one-slot rewording is rejected; a paraphrase that turns a word into its negated antonym without a
listed pair, "it expired" vs "it no longer works", is rejected as a negation; an added word
that restates the other side without a listed synonym, "change my flight" vs "change my flight
booking", is a detail in strict mode; a detail added inside a rewording, with other words
changed on both sides, is left to the embedding unless it is a restrictive word).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from carpool.semantic import guard_words as W

__all__ = ["Verdict", "check", "REASONS"]

#: Every reason code :func:`check` can return.
REASONS = ("quoted", "number", "unit", "date", "identifier", "entity", "negation", "antonym",
           "scope", "possessor", "quantity", "order", "question", "content_word", "detail")


@dataclass(frozen=True, slots=True)
class Verdict:
    """``ok``: the cached answer may be served; ``reason``: why not (``None`` when ok)."""

    ok: bool
    reason: str | None = None

    def __bool__(self) -> bool:
        return self.ok


_OK = Verdict(True, None)
_VERDICTS = {r: Verdict(False, r) for r in REASONS}


def check(new: str, cached: str, strict: bool = False) -> Verdict:
    """Judge whether the answer cached for ``cached`` answers ``new``; see the module docstring.
    ``strict`` adds the rules meant for the less similar pairs (``detail`` in full)."""
    a = _analyse(new)
    b = _analyse(cached)
    if a.keys == b.keys:
        return _OK
    reason = _compare(a, b, new, cached, strict)
    return _OK if reason is None else _VERDICTS[reason]


# ================================================================================================
# Word forms


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
def _base(w: str) -> str:
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


def _build_antonyms() -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for x, y in W.ANTONYM_PAIRS:
        if " " in x or " " in y:
            continue
        bx, by = _base(x), _base(y)
        if bx == by:
            continue
        for p, q in ((x, y), (bx, by), (x, by), (bx, y)):
            out.setdefault(p, set()).add(by if q in (y, by) else bx)
            out.setdefault(q, set()).add(bx if p in (x, bx) else by)
    return {k: frozenset(v) for k, v in out.items()}


_ANTONYMS = _build_antonyms()
_ANTONYM_WORDS = frozenset(_ANTONYMS)


def _build_synonyms() -> dict[str, frozenset[int]]:
    out: dict[str, set[int]] = {}
    for i, group in enumerate(W.SYNONYM_GROUPS):
        for word in group:
            out.setdefault(_base(word), set()).add(i)
    return {k: frozenset(v) for k, v in out.items()}


_SYNONYMS = _build_synonyms()


def _build_synonym_words() -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for group in W.SYNONYM_GROUPS:
        bases = {_base(w) for w in group}
        for b in bases:
            out.setdefault(b, set()).update(bases)
    return {k: frozenset(v) for k, v in out.items()}


_SYNONYM_WORDS = _build_synonym_words()

_AUDIENCE: dict[str, int] = {}
for _i, _group in enumerate(W.AUDIENCE_GROUPS):
    for _w in _group:
        _AUDIENCE.setdefault(_w, _i)
#: Audience groups that change the answer even when named on one side only.
_STRONG_AUDIENCE = frozenset(
    _AUDIENCE[w] for w in ("child", "baby", "teen", "adult", "senior", "man", "woman", "boy",
                           "girl", "male", "female", "pregnant", "dog", "cat", "horse", "bird",
                           "rabbit", "pet", "diabetic", "smoker", "vegetarian", "veteran",
                           "pregnancy", "son", "daughter", "brother", "sister", "parent",
                           "grandparent", "grandchild")
)

_STOP = W.STOP_WORDS | W.POLITENESS
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
           | frozenset(_AUDIENCE) | W.NEGATION_CUES | frozenset(W.MONTHS) | frozenset(W.WEEKDAYS)
           | frozenset(W.DATE_WORDS) | frozenset(W.TIME_UNITS) | W.SCOPE_WORDS
           | W.QUANT_UNIVERSAL | W.QUANT_SINGLE | W.QUANT_DUAL | W.QUANT_PARTIAL
           | W.POSSESSOR_SELF | W.POSSESSOR_OTHER | _STOP)
#: Evaluative and degree words: swapping one for another ("best" / "most interesting") is not a
#: change of topic, so the one-slot rule does not count them as content.
_EVALUATIVE = frozenset("""
    good great best top nice cool awesome excellent amazing fantastic wonderful interesting
    fascinating important main major key effective efficient useful helpful ideal perfect
    popular famous favorite favourite greatest biggest actual really totally
""".split())
_SOFT_BASES = frozenset(_base(w) for w in _STOP | _EVALUATIVE) | _STOP | _EVALUATIVE
_FUNCTION_BASES = frozenset(_base(w) for w in _FUNCTION) | _FUNCTION
#: Words that are never a typo of another word.
_NO_TYPO = (frozenset(W.NUMBER_WORDS) | frozenset(W.ORDINAL_WORDS) | frozenset(_AUDIENCE)
            | W.NEGATION_CUES | frozenset(W.MONTHS) | frozenset(W.WEEKDAYS)
            | frozenset(W.DATE_WORDS) | frozenset(W.TIME_UNITS) | W.SCOPE_WORDS
            | W.QUANT_UNIVERSAL | W.QUANT_SINGLE | W.QUANT_DUAL | W.QUANT_PARTIAL
            | W.POSSESSOR_SELF | W.POSSESSOR_OTHER)
#: Words known to be ordinary English (a capitalised one is not taken for a named entity).
_COMMON = (_CLOSED | frozenset(_SYNONYMS) | frozenset(w for g in W.SYNONYM_GROUPS for w in g)
           | frozenset(W.IRREGULAR) | W.IMPLICIT_NEGATORS) - frozenset(
               W.MONTHS) - frozenset(W.WEEKDAYS)
_QUANT = (("u", W.QUANT_UNIVERSAL), ("s", W.QUANT_SINGLE), ("d", W.QUANT_DUAL),
          ("p", W.QUANT_PARTIAL))
_DIRECTIONAL = {"to": "to", "into": "to", "towards": "to", "toward": "to", "from": "from",
                "than": "than"}


def _within(a: str, b: str, limit: int) -> bool:
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
    if n < 5 or a in _NO_TYPO or b in _NO_TYPO or (a in _COMMON and b in _COMMON):
        return False
    return _within(a, b, 2 if n >= 9 else 1)


@lru_cache(maxsize=65536)
def _same_word(a: str, b: str) -> bool:
    """``a`` and ``b`` (words or base forms) are one word: equal, inflections, derivations
    ("text"/"textual"), listed synonyms, or a typo."""
    if a == b:
        return True
    ba, bb = _base(a), _base(b)
    if ba == bb:
        return True
    sa = _SYNONYMS.get(a) or _SYNONYMS.get(ba)
    if sa is not None:
        sb = _SYNONYMS.get(b) or _SYNONYMS.get(bb)
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
# Analysis of one text


_CODE_RE = re.compile(r"`+([^`\n]+?)`+")
_URL_RE = re.compile(
    r"(?:https?://|www\.)[^\s<>\"']+|[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
    r"|(?<![\w/])(?:~|\.{1,2})?(?:/[\w.@-]+){2,}/?|[A-Za-z]:\\[^\s]+")
_QUOTE_RE = re.compile(r"(?:(?<=^)|(?<=[\s(\[{:]))(['\"])([^'\"\n]{1,200}?)\1(?=$|[\s.,;:!?)\]}])")
_TOKEN_RE = re.compile(
    r"[$€£¥₹]?\d[\d,]*(?:\.\d+)*(?:[:/\-]\d+)*(?:\s?[ap]\.?m\b\.?)?[A-Za-z%]*"
    r"|[A-Za-z\u00C0-\u024F][\w\u00C0-\u024F]*(?:['’][A-Za-z]+)*(?:[._\-+#@][\w\u00C0-\u024F]+)*"
    r"[+#]*")
_BOUNDARY = frozenset(".!?:;\n()[]\"*•>|")
_NUM_RE = re.compile(r"^(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([a-z%]*)$")
_TIME_RE = re.compile(r"^(\d{1,2})(?::(\d{2}))?\s?([ap])\.?m\.?$")
_CLOCK_RE = re.compile(r"^(\d{1,2}):(\d{2})$")
_ORD_RE = re.compile(r"^(\d+)(st|nd|rd|th)$")
_VERSION_RE = re.compile(r"^v\d+(?:\.\d+)*$")
_PARTS_RE = re.compile(r"[a-z0-9]+")
_CURRENCY = {"$": "usd", "€": "eur", "£": "gbp", "¥": "jpy", "₹": "inr"}
_ARTICLES = frozenset(("a", "an"))
_JOIN_PREFIXES = frozenset("non un re pre co multi sub anti semi".split())
_NUMBER_TEXT = frozenset(W.NUMBER_WORDS) | frozenset(("hundred", "thousand", "million",
                                                      "billion", "trillion"))
_NOT_NUMBERS = frozenset(("single", "once", "couple", "pair", "double", "triple", "half",
                          "quarter", "nil"))
_PARTICLES: dict[str, str] = {}
for _x, _y in W.PARTICLE_PAIRS:
    _PARTICLES[_x] = _y
    _PARTICLES[_y] = _x
_POSS_OTHER_DET = frozenset(("his", "her", "hers", "their", "theirs"))
_POSS_OTHER_PRON = frozenset(("someone", "somebody", "another", "anyone", "anybody"))


def _num_str(x: float) -> str:
    if x == int(x):
        return str(int(x))
    return repr(round(x, 6))


def _compact(s: str) -> str:
    return "".join(_PARTS_RE.findall(s))


class _Side:
    __slots__ = ("keys", "bases", "neg", "numbers", "ones", "units", "dates", "specific_dates",
                 "idents", "entities", "runs", "quoted", "vocab", "audience", "scope", "poss_self",
                 "poss_other", "quant", "wh", "bindings", "seq", "text_norm", "articles",
                 "particles", "implicit", "how", "roots", "bag", "seqw", "polar", "what",
                 "lbindings")

    def __init__(self) -> None:
        self.bases: list[str] = []          # base form of every word, in order
        self.bag: frozenset[str] = frozenset()
        self.neg = 0
        self.implicit = 0                   # words that negate without a cue ("avoid", "too")
        self.numbers: Counter[str] = Counter()
        self.ones = 0                       # "one" spelled out (not a pronoun)
        self.units: Counter[str] = Counter()
        self.dates: Counter[str] = Counter()
        self.specific_dates = 0
        self.idents: set[str] = set()
        self.entities: set[str] = set()
        self.runs: dict[str, str] = {}     # entity -> initials of its capitalised run
        self.quoted: list[str] = []
        self.vocab: set[str] = set()       # everything a critical token may be found as
        self.audience: set[int] = set()
        self.scope: set[str] = set()
        self.poss_self = False
        self.poss_other = False
        self.quant: set[str] = set()
        self.wh: set[str] = set()
        self.bindings: dict[str, set[str]] = {}
        self.seq: tuple[str, ...] = ()
        self.seqw: tuple[str, ...] = ()     # the word of each ``seq`` slot, as written (lower)
        self.polar = ""                     # the auxiliary opening a sentence ("Is it ...?")
        self.what = False                   # a sentence opens with "what" or "which"
        # content words (before, after) around each to/from/than
        self.lbindings: dict[str, list[tuple[frozenset[str], frozenset[str]]]] = {}
        self.keys: tuple[str, ...] = ()
        self.text_norm = ""
        self.articles = 0
        self.particles: Counter[tuple[str, str]] = Counter()
        self.how = False                    # "how" as a question word (not "how come")
        self.roots: set[str] = set()        # entity roots ("indian", "india" -> "indi")


def _squash(s: str) -> str:
    return " ".join(_PARTS_RE.findall(s.lower()))


def _is_abbrev(low: str) -> bool:
    parts = [p for p in low.split(".") if p]
    return all(len(p) == 1 and p.isalpha() for p in parts)


def _expand(low: str) -> tuple[list[str], bool]:
    """Contractions -> words; the flag says a possessive "'s" was removed."""
    full = W.CONTRACTIONS.get(low)
    if full is not None:
        return full.split(), False
    if "'" not in low:
        return [low], False
    if low.endswith("n't"):
        stem = low[:-3]
        stem = {"ca": "can", "wo": "will", "ai": "is", "sha": "shall"}.get(stem, stem)
        return [stem, "not"], False
    for suffix, word in W.SUFFIX_CONTRACTIONS.items():
        if low.endswith(suffix):
            return [low[: -len(suffix)], word], False
    if low.endswith("'s"):
        stem = low[:-2]
        if stem in W.S_IS:
            return [stem, "is"], False
        if stem == "let":
            return ["let", "us"], False
        return [stem], True
    if low.endswith("s'"):
        return [low[:-1]], True
    return [low.replace("'", "")], False


_SHAPE_LOWER, _SHAPE_CAPITAL, _SHAPE_CAPS, _SHAPE_MIXED, _SHAPE_LOWER_MIXED = range(5)
_RUN_GLUE = frozenset(("of", "and", "the", "for", "de", "la", "von", "van"))


@lru_cache(maxsize=65536)
def _token(tok: str) -> tuple:
    """Static facts about one token, whatever its context.

    ``("n", low, facts)`` a number (facts from :func:`_number_facts`), ``("i", low)`` an
    identifier, or ``("w", pieces, is_poss, shape, head, humps)`` words."""
    low = tok.lower().rstrip(".")
    if not low:
        return ("x",)
    first = tok[0]
    if first.isdigit() or first in _CURRENCY or _VERSION_RE.match(low):
        return ("n", low, _number_facts(low[1:] if low[0] == "v" else low))
    if _IDENT_RE.search(low) and not _is_abbrev(low):
        return ("i", low)
    if "." in low:                       # "e.g.", "U.S."
        low = low.replace(".", "")
        tok = tok.replace(".", "")
    pieces, is_poss = _expand(low)
    if "-" in low and len(pieces) == 1 and low not in W.SPELLING_VARIANTS:
        parts = [x for x in low.split("-") if x]
        if parts and (parts[0] in _JOIN_PREFIXES or (
                any(x in _NUMBER_TEXT for x in parts)
                and not all(x in _NUMBER_TEXT for x in parts))):
            pieces = ["".join(parts)]
        else:
            pieces = parts or [low]
    letters = tok.replace("'", "").replace("-", "")
    humps = ""
    if first.isupper() and first.isalpha():
        if letters.isupper() and len(letters) >= 2:
            shape = _SHAPE_CAPS
        elif letters[1:] and not letters[1:].islower():
            shape = _SHAPE_MIXED
            humps = "".join(c for c in letters if c.isupper()).lower()
        else:
            shape = _SHAPE_CAPITAL
    elif first.islower() and any(c.isupper() for c in letters[1:]):
        shape = _SHAPE_LOWER_MIXED
    else:
        shape = _SHAPE_LOWER
    return ("w", tuple(pieces), is_poss, shape, pieces[0], humps)


_IDENT_RE = re.compile(r"[\d_@.]|[+#]$")


@lru_cache(maxsize=8192)
def _analyse(text: str) -> _Side:
    side = _Side()
    t = unicodedata.normalize("NFKC", text)
    if "’" in t or "‘" in t or "“" in t or "”" in t:
        t = t.replace("’", "'").replace("‘", "'").replace("“", '"').replace("”", '"')
    side.text_norm = ""
    idents = side.idents
    vocab = side.vocab

    if "`" in t:
        t = t.replace("```", "\n")

        def _code(m: re.Match[str]) -> str:
            body = m.group(1).strip().lower()
            if body:
                idents.add(body.removesuffix("()"))
            return " "

        t = _CODE_RE.sub(_code, t)

    if "/" in t or "@" in t or "www." in t or "\\" in t:
        def _url(m: re.Match[str]) -> str:
            idents.add(m.group(0).lower().rstrip(".,;:!?)"))
            return " "

        t = _URL_RE.sub(_url, t)
    if '"' in t or " '" in t or t[:1] == "'" or "('" in t:
        side.text_norm = " " + _squash(t) + " "
        for m in _QUOTE_RE.finditer(t):
            q = _squash(m.group(2))
            if q:
                side.quoted.append(q)

    toks: list[str] = []
    initials: list[bool] = []
    gaps: list[str] = []
    last_end = 0
    prev_dot = True
    boundary = _BOUNDARY
    for m in _TOKEN_RE.finditer(t):
        tok = m.group(0)
        start = m.start()
        gap = t[last_end:start]
        toks.append(tok)
        gaps.append(gap)
        initials.append(prev_dot or not boundary.isdisjoint(gap))
        prev_dot = tok[-1] == "."
        last_end = m.end()

    infos = [_token(tok) for tok in toks]
    # Is case informative on this side (not a Title Case headline, not shouting)?
    n_alpha = caps = 0
    for info, ini in zip(infos, initials, strict=True):
        if info[0] == "w" and not ini:
            n_alpha += 1
            if info[3] in (_SHAPE_CAPITAL, _SHAPE_CAPS, _SHAPE_MIXED):
                caps += 1
    case_ok = not (n_alpha >= 3 and caps > 0.6 * n_alpha)

    words: list[str] = []
    starts: set[int] = set()                # positions of sentence-initial words
    kinds: list[str] = []                   # w: word, n: number, i: identifier
    poss: list[bool] = []
    run: list[str] = []                     # the current run of capitalised words
    run_words: list[str] = []
    entities = side.entities

    for info, initial in zip(infos, initials, strict=True):
        kind = info[0]
        if kind == "w":
            _kind, pieces, is_poss, shape, head, humps = info
            if case_ok and shape != _SHAPE_LOWER:
                if shape == _SHAPE_CAPS:
                    if head not in _STOP and head not in W.NEGATION_CUES:
                        idents.add(head)
                    run = _close_run(side, run, run_words)
                elif shape == _SHAPE_MIXED:                     # PyTorch, JavaScript
                    entities.add(head)
                    if len(humps) >= 2:
                        vocab.add(humps)
                        side.runs[head] = humps
                    run.append(head[0])
                    run_words.append(head)
                elif shape == _SHAPE_CAPITAL:
                    if not initial and head != "i":
                        entities.add(head)
                    run.append(head[0])
                    run_words.append(head)
                else:                                            # iPhone, eBay
                    entities.add(head)
                    run = _close_run(side, run, run_words)
            elif run and head not in _RUN_GLUE:
                run = _close_run(side, run, run_words)
            if initial:
                starts.add(len(words))
            last = len(pieces) - 1
            for k, piece in enumerate(pieces):
                words.append(piece)
                kinds.append("w")
                poss.append(is_poss and k == last)
            continue
        if run:
            run = _close_run(side, run, run_words)
        if kind == "n":
            low, facts = info[1], info[2]
            for key, value in facts:
                if key == "n":
                    side.numbers[value] += 1
                elif key == "u":
                    side.units[value] += 1
                else:
                    idents.add(value)
            words.append(low)
            kinds.append("n")
            poss.append(False)
        elif kind == "i":
            idents.add(info[1])
            words.append(info[1])
            kinds.append("i")
            poss.append(False)
    if run:
        _close_run(side, run, run_words)

    if entities:
        side.entities = {e for e in entities if e not in _COMMON and _base(e) not in _COMMON}
        side.roots = {_root(e) for e in side.entities}
    _features(side, words, kinds, poss, gaps, starts)
    return side


def _close_run(side: _Side, run: list[str], run_words: list[str]) -> list[str]:
    if len(run) >= 2:
        initials = "".join(run)
        side.vocab.add(initials)
        for w in run_words:
            side.runs.setdefault(w, initials)
    run_words.clear()
    return []


_DEMONYM_SUFFIXES = ("ians", "ian", "ans", "ese", "ish", "an", "ns", "is", "i", "s", "a", "y",
                     "e", "n")


def _root(e: str) -> str:
    """A named entity without its demonym or plural ending ("India", "Indians" -> "indi")."""
    for suffix in _DEMONYM_SUFFIXES:
        if e.endswith(suffix) and len(e) - len(suffix) >= 4:
            return e[: -len(suffix)]
    return e


def _number_facts(low: str) -> tuple[tuple[str, str], ...]:
    """What a number token says: ("n", number key), ("u", unit), ("i", identifier)."""
    out: list[tuple[str, str]] = []
    cur = _CURRENCY.get(low[0])
    if cur:
        out.append(("u", cur))
        low = low[1:]
        if not low:
            return tuple(out)
    m = _TIME_RE.match(low)
    if m:
        h = int(m.group(1)) % 12 + (12 if m.group(3) == "p" else 0)
        out.append(("n", f"t{h}:{m.group(2) or '00'}"))
        return tuple(out)
    m = _CLOCK_RE.match(low)
    if m:
        out.append(("n", f"t{int(m.group(1))}:{m.group(2)}"))
        return tuple(out)
    m = _ORD_RE.match(low)
    if m:
        out.append(("n", f"o{int(m.group(1))}"))
        return tuple(out)
    m = _NUM_RE.match(low.rstrip(","))
    if m:
        value = float(m.group(1).replace(",", "") + (m.group(2) or ""))
        suffix = m.group(3)
        scale = W.NUMBER_SCALES.get(suffix)
        if scale and suffix != "m":
            value *= scale
            suffix = ""
        out.append(("n", _num_str(value)))
        if suffix and suffix not in ("am", "pm"):
            unit = W.UNITS.get(suffix) or W.UNITS.get(suffix.rstrip("s"))
            out.append(("u", unit) if unit else ("i", low))
        return tuple(out)
    # dates like 2024-03-13, 13/03/2024, parcel numbers 7734-991, versions 2.10.0
    out.append(("n", "#" + low.rstrip(".,")))
    return tuple(out)


class _WordFacts:
    """Static facts about one lower-case word (memoised); ``plain`` words have none but a base."""

    __slots__ = ("base", "plain", "in_seq", "in_keys", "neg", "implicit", "article", "numtext",
                 "ordinal", "month", "weekday", "date", "time_unit", "unit", "unit_ambiguous",
                 "audience", "scope", "poss", "quant", "wh", "particle", "stop")

    def __init__(self, w: str) -> None:
        b = _base(w)
        self.base = b
        self.in_seq = w not in W.POLITENESS and w not in _FILLER
        self.in_keys = w not in W.POLITENESS and w not in ("a", "an", "the")
        self.neg = w in W.NEGATION_CUES and w not in W.NEGATION_UNCOUNTED
        self.implicit = w in W.IMPLICIT_NEGATORS
        self.article = w in _ARTICLES
        self.numtext = w in _NUMBER_TEXT and w not in _NOT_NUMBERS
        self.ordinal = W.ORDINAL_WORDS.get(w, 0)
        self.month = W.MONTHS.get(w, 0)
        self.weekday = W.WEEKDAYS.get(w)
        self.date = W.DATE_WORDS.get(w)
        self.time_unit = W.TIME_UNITS.get(w) or W.TIME_UNITS.get(b)
        self.unit = W.UNITS.get(w) or W.UNITS.get(b) or (
            W.UNITS.get(w[:-1]) if w.endswith("s") and len(w) > 3 else None)
        self.unit_ambiguous = w in W.AMBIGUOUS_UNITS or b in W.AMBIGUOUS_UNITS
        g = _AUDIENCE.get(w)
        self.audience = _AUDIENCE.get(b) if g is None else g
        self.scope = w in W.SCOPE_WORDS
        self.poss = (1 if w in W.POSSESSOR_SELF else 2 if w in _POSS_OTHER_DET
                     else 3 if w in _POSS_OTHER_PRON else 0)
        self.quant = next((code for code, group in _QUANT if w in group), "")
        self.wh = w in W.WH_DISTINCT or w == "how"
        self.particle = w in _PARTICLES
        self.stop = w in _STOP
        self.plain = not (self.neg or self.implicit or self.article or self.numtext
                          or self.ordinal or self.month or self.weekday or self.date
                          or self.time_unit or self.unit or self.audience is not None
                          or self.scope or self.poss or self.quant or self.wh or self.particle)


_WORD_FACTS: dict[str, _WordFacts] = {}


def _facts(w: str) -> _WordFacts:
    f = _WORD_FACTS.get(w)
    if f is None:
        if len(_WORD_FACTS) > 100_000:
            _WORD_FACTS.clear()
        f = _WORD_FACTS[w] = _WordFacts(w)
    return f


def _features(side: _Side, words: list[str], kinds: list[str], poss: list[bool],
              gaps: list[str], starts: set[int]) -> None:
    n = len(words)
    vocab = side.vocab
    bases = side.bases
    seq: list[str] = []
    seqw: list[str] = []
    keys: list[str] = []
    numbers = side.numbers
    nw = W.NUMBER_WORDS
    # "No, ..." / "No. ..." opening a text is an interjection, not a negation of the sentence.
    interjection = n > 1 and words[0] == "no" and len(gaps) > 1 and not _INTERJECTION_GAP.isdisjoint(
        gaps[1])
    tag = _tag_question(words, gaps) if n >= 4 else frozenset()
    i = 0
    prev = ""
    prev_kind = ""
    while i < n:
        w = words[i]
        kind = kinds[i]
        vocab.add(w)
        if kind != "w":
            bases.append(w)
            seq.append(_NUM if kind == "n" else w)
            seqw.append(w)
            keys.append(w)
            prev, prev_kind = w, kind
            i += 1
            continue
        f = _facts(w)
        b = f.base
        vocab.add(b)
        bases.append(b)
        if f.in_seq:
            seq.append(b)
            seqw.append(w)
        if i in starts and i + 1 < n:
            if w in _TAG_AUX:
                side.polar = side.polar or w
            elif w in _WHAT:
                side.what = True
        if f.in_keys:
            keys.append(b)
        if f.plain:
            prev, prev_kind = w, kind
            i += 1
            continue
        # negation
        if f.neg:
            if not (i == 0 and interjection) and not (w == "not" and (
                    (prev == "or" and (i + 1 == n or words[i + 1] in _STOP))
                    or (i + 1 < n and words[i + 1] == "only"))) and i not in tag:
                side.neg += 1
        elif f.implicit and (w != "too" or "to" in words[i + 2:i + 4]):
            side.implicit += 1
        elif f.article:
            side.articles += 1
        # spelled-out numbers and ordinals
        if f.numtext:
            if w == "one":
                if prev not in W.ONE_PRONOUN_BEFORE and not (
                        i + 1 < n and words[i + 1] in ("of", "another", "by", "day")):
                    side.ones += 1
                    seq[-1] = _NUM
            elif w in nw or prev in _ARTICLES:
                total, current, j = 0.0, 0.0, i
                while j < n and kinds[j] == "w" and (
                        words[j] in _NUMBER_TEXT and words[j] not in _NOT_NUMBERS
                        or (words[j] == "and" and j > i and j + 1 < n and words[j + 1] in nw)):
                    x = words[j]
                    if x in nw:
                        current += nw[x]
                    elif x != "and":
                        scale = W.NUMBER_SCALES[x]
                        current = max(current, 1) * scale
                        if scale >= 1000:
                            total += current
                            current = 0
                    vocab.add(x)
                    j += 1
                numbers[_num_str(total + current)] += 1
                seq[-1] = _NUM
                for x in words[i + 1:j]:
                    bx = _base(x)
                    bases.append(bx)
                    keys.append(bx)
                prev, prev_kind = words[j - 1], "w"
                i = j
                continue
        elif f.ordinal and (prev in W.DETERMINERS or prev_kind == "n"):
            if not (w == "second" and i + 1 < n and words[i + 1] in ("ago", "or", "later")):
                numbers[f"o{f.ordinal}"] += 1
        # dates and periods
        if f.month:
            if w not in W.AMBIGUOUS_MONTHS or _near_number(kinds, i, words) or (
                    w in side.entities):
                side.dates[f"m{f.month}"] += 1
                side.specific_dates += 1
        elif f.weekday:
            if w not in W.AMBIGUOUS_WEEKDAYS or w in side.entities:
                side.dates[f"d{f.weekday}"] += 1
                side.specific_dates += 1
        elif f.date:
            side.dates[f.date] += 1
            if w in ("today", "tonight", "tomorrow", "yesterday"):
                side.specific_dates += 1
        elif f.time_unit and (prev in W.PERIOD_ANCHORS or prev_kind == "n" or prev in nw
                              or prev in _ARTICLES):
            side.dates["p" + f.time_unit] += 1          # "last week", "3 days", "a day"
            if prev in W.PERIOD_ANCHORS:
                side.specific_dates += 1
        # units of measure
        if f.unit and (prev_kind == "n" or prev in nw or not f.unit_ambiguous):
            side.units[f.unit] += 1
            if f.in_seq:
                seq[-1] = "<" + f.unit + ">"
        # audience and scope
        if f.audience is not None:
            side.audience.add(f.audience)
        if f.scope:
            side.scope.add(w)
        # possessor
        if f.poss == 1:
            side.poss_self = True
        elif f.poss == 2:
            side.poss_other = True
        elif f.poss == 3 and (
                poss[i] or (i + 1 < n and poss[i + 1])
                or (i + 2 < n and poss[i + 2] and words[i + 1] == "else")):
            side.poss_other = True
        # quantifiers
        if f.quant and (w != "one" or prev not in W.ONE_PRONOUN_BEFORE):
            side.quant.add(f.quant)
        if f.wh and (i in starts or (i - 1 in starts and prev in _WH_LEAD)
                     or (prev == "and" and i >= 2 and words[i - 2] in _WH_ALL)):
            if w != "how":
                side.wh.add(w)
            elif not (i + 1 < n and words[i + 1] == "come"):
                side.how = True
            else:
                side.wh.add("why")              # "how come" asks why
        if f.particle and prev and prev_kind == "w":
            side.particles[(_base(prev), w)] += 1
        prev, prev_kind = w, kind
        i += 1
    # glued neighbours ("hugging face" ~ "huggingface")
    for i in range(n - 1):
        if kinds[i] != "n":
            vocab.add(words[i] + words[i + 1])
    for ident in side.idents:
        parts = _PARTS_RE.findall(ident)
        vocab.update(parts)
        vocab.add("".join(parts))
    # directional bindings: the first critical token after to/into/from/than
    for i, w in enumerate(words):
        d = _DIRECTIONAL.get(w)
        if d is None or kinds[i] != "w":
            continue
        for j in range(i + 1, min(n, i + 4)):
            x = words[j]
            if kinds[j] != "w" or x in side.entities or x in side.idents or _facts(x).unit:
                side.bindings.setdefault(d, set()).add(x if kinds[j] != "w" else _base(x))
                break
            if x not in _STOP:
                break
        # the (up to two) content words just before and just after, for plain words
        after = _content_near(words, kinds, range(i + 1, min(n, i + 4)))
        before = _content_near(words, kinds, range(i - 1, max(-1, i - 4), -1))
        if after and before:
            side.lbindings.setdefault(d, []).append((before, after))
    side.seq = tuple(seq)
    side.seqw = tuple(seqw)
    side.keys = tuple(keys)
    side.bag = frozenset(bases)


_INTERJECTION_GAP = frozenset(",.!;:")
_NUM = "<n>"                # a number in the word sequence (compared by the number rule)
_WH_LEAD = frozenset("from to in at for by of with and so but then".split())
_WH_ALL = frozenset("how when where who why what which".split())
_WHAT = frozenset(("what", "which"))
_TAG_AUX = frozenset("is are am was were do does did have has had can could will would should "
                     "shall must might may".split())
_TAG_PRONOUNS = frozenset("i you he she it we they there".split())


def _tag_question(words: list[str], gaps: list[str]) -> frozenset[int]:
    """Positions of a closing tag question (", aren't you?", ", is it?"): its negation mirrors
    the sentence and is not counted."""
    n = len(words)
    if n < 4 or words[-1] not in _TAG_PRONOUNS:
        return frozenset()
    if words[-2] == "not" and words[-3] in _TAG_AUX:
        start = n - 3
    elif words[-2] in _TAG_AUX:
        start = n - 2
    else:
        return frozenset()
    # the tag follows a comma (the tag's first word is one of the last three tokens)
    if not any("," in gap for gap in gaps[-3:]):
        return frozenset()
    return frozenset(range(start, n))


def _near_number(kinds: list[str], i: int, words: list[str]) -> bool:
    n = len(kinds)
    return (i > 0 and kinds[i - 1] == "n") or (i + 1 < n and kinds[i + 1] == "n") or (
        i > 1 and words[i - 1] == "of" and kinds[i - 2] == "n")


# ================================================================================================
# Comparison


def _present(token: str, other: _Side) -> bool:
    """Does ``token`` (an entity or identifier of one side) occur on the other side?"""
    vocab = other.vocab
    if token in vocab or _base(token) in vocab:
        return True
    parts = _PARTS_RE.findall(token)
    if not parts:
        return True
    compact = "".join(parts)
    if compact in vocab:
        return True
    if len(parts) > 1 and all(p in vocab for p in parts):
        return True
    syn = _SYNONYMS.get(token)
    if syn is not None:                     # "PC" ~ "computer"
        for w in vocab:
            other_syn = _SYNONYMS.get(w)
            if other_syn is not None and not syn.isdisjoint(other_syn):
                return True
    if not any(c.isdigit() for c in compact) and len(compact) >= 4:
        for ident in other.idents:
            c = _compact(ident)
            if c.endswith(compact) or c.startswith(compact):
                return True
        if len(compact) >= 8 and compact.isalpha():
            for w in vocab:
                if w[:1] == compact[0] and _within(compact, w, 1):
                    return True
    return False


def _root_present(ent: str, other: _Side) -> bool:
    r = _root(ent)
    if len(r) < 4:
        return False
    if r in other.roots:
        return True
    for w in other.vocab:
        if w.startswith(r) and len(w) - len(r) <= 4 and (w == r or _root(w) == r or w[:-1] == r
                                                         or _root(ent) == w):
            return True
    return False


def _numbers_differ(a: _Side, b: _Side) -> bool:
    da = a.numbers - b.numbers
    db = b.numbers - a.numbers
    # "one" spelled out: a number only against another number ("for one" vs "for two")
    for d, other in ((da, b), (db, a)):
        ones = d.get("1", 0)
        if ones:
            ones -= other.ones + other.articles
            if ones > 0:
                d["1"] = ones
            else:
                del d["1"]
    if da or db:
        return True
    if a.ones != b.ones and (a.numbers or b.numbers):
        return abs(a.ones - b.ones) > max(a.articles, b.articles)
    return False


def _compare(a: _Side, b: _Side, cached_a: str = "", cached_b: str = "",
             strict: bool = False) -> str | None:
    for x, y, other_text in ((a, b, cached_b), (b, a, cached_a)):
        if x.quoted:
            norm = y.text_norm or " " + _squash(other_text) + " "
            for q in x.quoted:
                if f" {q} " not in norm:
                    return "quoted"
    if (a.numbers or b.numbers or a.ones != b.ones) and _numbers_differ(a, b):
        return "number"
    if (a.units or b.units) and a.units.keys() != b.units.keys():
        return "unit"
    if (a.dates or b.dates) and a.dates.keys() != b.dates.keys():
        if (a.dates and b.dates) or a.specific_dates or b.specific_dates:
            return "date"
    for x, y in ((a, b), (b, a)):
        for ident in x.idents:
            if not _present(ident, y):
                return "identifier"
    for x, y in ((a, b), (b, a)):
        for ent in x.entities:
            if not _present(ent, y):
                run = x.runs.get(ent)
                if (run is None or run not in y.vocab) and not _root_present(ent, y):
                    return "entity"
    reason, explained = _polarity(a, b)
    if reason:
        return reason
    if a.audience != b.audience:
        only_a = a.audience - b.audience
        only_b = b.audience - a.audience
        if (only_a and only_b) or ((only_a | only_b) & _STRONG_AUDIENCE):
            return "scope"
    if a.scope != b.scope:
        return "scope"
    if (a.poss_other and not a.poss_self and b.poss_self and not b.poss_other) or (
            b.poss_other and not b.poss_self and a.poss_self and not a.poss_other):
        return "possessor"
    if a.quant != b.quant and a.quant and b.quant:
        for x, y in W.QUANT_CONFLICTS:
            if (x in a.quant and y in b.quant and x not in b.quant and y not in a.quant) or (
                    x in b.quant and y in a.quant and x not in a.quant and y not in b.quant):
                return "quantity"
    if a.bindings and b.bindings:
        for d, ta in a.bindings.items():
            tb = b.bindings.get(d)
            if tb is not None and ta != tb:
                xa, xb = ta - tb, tb - ta
                if xa and xb and all(x in b.vocab for x in xa) and all(x in a.vocab for x in xb):
                    return "order"
    if a.lbindings and b.lbindings:           # "convert A to B" vs "convert B to A"
        for d, ta in a.lbindings.items():
            tb = b.lbindings.get(d)
            if tb is not None and _swapped(ta, tb):
                return "order"
    if a.wh != b.wh:
        if (a.wh and b.wh and not (a.wh & b.wh)) or (
                a.wh and not a.how and not b.wh and b.how) or (
                b.wh and not b.how and not a.wh and a.how):
            return "question"
        if _wh_changed(a, b) or _wh_changed(b, a):
            return "question"
    if strict and (a.polar or b.polar) and not (a.polar and b.polar) and (
            _polar_changed(a, b) or _polar_changed(b, a)):
        return "question"
    if _one_slot_swap(a.seq, b.seq, explained):
        return "content_word"
    if _detail(a, b, explained, strict):
        return "detail"
    return None


def _content_near(words: list[str], kinds: list[str], span: range) -> frozenset[str]:
    """The first one or two content words (base forms) in ``span``, stopping at a stop word that
    follows a content word."""
    out: list[str] = []
    for j in span:
        if kinds[j] != "w":
            break
        if words[j] in _STOP:
            if out:
                break
            continue
        out.append(_base(words[j]))
        if len(out) == 2:
            break
    return frozenset(out)


def _swapped(ta: list[tuple[frozenset[str], frozenset[str]]],
             tb: list[tuple[frozenset[str], frozenset[str]]]) -> bool:
    """Words before a directional word on one side come after it on the other, and the other way
    round ("ethanol to acetic acid" vs "acetic acid to ethanol")."""
    for before_a, after_a in ta:
        for before_b, after_b in tb:
            x = before_a & after_b
            y = after_a & before_b
            if x and y and x.isdisjoint(before_b) and y.isdisjoint(after_b):
                return True
    return False


def _polarity(a: _Side, b: _Side) -> tuple[str | None, frozenset[str]]:
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
            if x in W.NEGATION_CUES or x in _PARTICLES:
                continue
            partner = _antonym_in(x, only_b, explained)
            if partner is not None and (
                    any(_same_word(x, y) for y in only_b if y != partner)
                    or any(_same_word(partner, y) for y in only_a if y != x)):
                partner = None          # x has a synonym on the other side: not a swap
            if partner is not None:
                explained.add(partner)
                explained.add(x)
                swaps += 1
    if (a.particles or b.particles) and a.particles != b.particles:
        pa = a.particles - b.particles
        pb = b.particles - a.particles
        for (head, particle) in pa:
            if (head, _PARTICLES[particle]) in pb:
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
        if y not in used and y not in _PARTICLES and y not in W.NEGATION_CUES and _antonyms(x, y):
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
    syn = _SYNONYM_WORDS.get(w, frozenset()) | {w}
    ants: set[str] = set()
    for p in syn:
        ants.update(_ANTONYMS.get(p, ()))
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
                out.add(_base(rest))
    if x.endswith("less") and len(x) > 6:
        stem = x[:-4]
        out.update((stem, stem + "ful", _base(stem)))
    elif x.endswith("ful") and len(x) > 5:
        out.add(x[:-3] + "less")
    return frozenset(out)


def _one_slot_swap(sa: tuple[str, ...], sb: tuple[str, ...], explained: frozenset[str]) -> bool:
    """The sequences are equal but for one slot of 1-3 words each, not the same words."""
    if explained:
        sa = tuple(w for w in sa if w not in explained)
        sb = tuple(w for w in sb if w not in explained)
    la, lb = len(sa), len(sb)
    p = 0
    while p < la and p < lb and _same_word(sa[p], sb[p]):
        p += 1
    if p == la and p == lb:
        return False
    s = 0
    while s < la - p and s < lb - p and _same_word(sa[la - 1 - s], sb[lb - 1 - s]):
        s += 1
    mid_a = sa[p:la - s]
    mid_b = sb[p:lb - s]
    if not mid_a or not mid_b or len(mid_a) > 3 or len(mid_b) > 3:
        return False
    if p + s < 2 and not (p + s == 1 and max(la, lb) <= 3):
        return False
    content_a = [w for w in mid_a if w not in _SOFT_BASES and w[0] != "<"]
    content_b = [w for w in mid_b if w not in _SOFT_BASES and w[0] != "<"]
    if not content_a and not content_b:
        return False
    # a slot of function words against a content word: "not sick" vs "not well"
    if not content_a:
        content_a = [w for w in mid_a if w not in _FUNCTION_BASES and w[0] != "<"]
    if not content_b:
        content_b = [w for w in mid_b if w not in _FUNCTION_BASES and w[0] != "<"]
    # "what time" vs "when", "which place" vs "where"
    for ca, cb in ((content_a, content_b), (content_b, content_a)):
        if len(cb) == 1 and cb[0] in _WH_LIKE and ca and all(x in _WH_LIKE[cb[0]] for x in ca):
            return False
    # "how long" vs "how many days"
    if (content_a == ["long"] and all(_facts(x).time_unit for x in content_b)) or (
            content_b == ["long"] and all(_facts(x).time_unit for x in content_a)):
        return False
    # a swap needs a word on each side that has no counterpart anywhere on the other side
    return any(not any(_same_word(x, y) for y in sb) for x in content_a) and any(
        not any(_same_word(y, x) for x in sa) for y in content_b)


# ================================================================================================
# Added detail

_DETAIL_PREPS = W.DETAIL_PREPOSITIONS
_DETAIL_NEUTRAL = W.DETAIL_NEUTRAL | W.NEGATION_CUES
#: Words that may stand between a preposition and the word it introduces ("in *the* workplace").
_NP_GLUE = (W.DETERMINERS | W.POSSESSOR_SELF | W.POSSESSOR_OTHER
            | frozenset("some any no which what whose this that these those".split()))
_COORD = frozenset(("and", "or", "&", "plus", "nor"))
#: Words after which a word is most likely a verb ("how do I *keep* ...", "to *eat*").
_VERB_SLOT = frozenset("""i you we they he she it one people someone to can could should would will
    shall do does did may might must not never also just then and or""".split())
#: Texts longer than this (in words, politeness and filler left out) on both sides are left to the
#: embedding: a reworded paragraph routinely adds or drops a phrase.
_DETAIL_MAX_WORDS = 12
_HERE = frozenset(("me", "us", "here", "home"))
#: Auxiliaries after which a word before a shared noun starts a noun phrase ("do *attack* dogs"),
#: not a verb.
_BE_DO = frozenset("is are was were do does did".split())
#: Up to this many words (the shorter side), a modifier is a detail at any similarity.
_DETAIL_SHORT = 8


def _extras(x: _Side, y: _Side, explained: frozenset[str]) -> tuple[list[int], bool]:
    """Positions in ``x.seq`` of content words with no counterpart on ``y`` (same word,
    inflection, derivation, listed synonym or typo), and whether a light word of ``x`` has none
    (see :data:`W.DETAIL_LIGHT`). Neutral words, evaluative words and the words of a cancelled
    antonym swap do not count."""
    out = []
    light = False
    ybag = y.bag
    for i, w in enumerate(x.seq):
        raw = x.seqw[i]
        if (w[0] == "<" or len(w) < 3 or not w.isalpha() or w in explained or w in ybag
                or w in _SOFT_BASES or w in _FUNCTION_BASES or w in _DETAIL_NEUTRAL
                or raw in _DETAIL_NEUTRAL or raw in y.vocab or raw in x.entities):
            continue
        if any(_same_word(w, v) for v in ybag):
            continue
        if raw in W.DETAIL_LIGHT or w in W.DETAIL_LIGHT:
            light = True
            continue
        out.append(i)
    return out, light


def _detail(a: _Side, b: _Side, explained: frozenset[str], strict: bool) -> bool:
    """One side carries a qualifier the other lacks; see the module docstring."""
    size = min(len(a.seq), len(b.seq))
    if size > _DETAIL_MAX_WORDS:
        return False
    short = size <= _DETAIL_SHORT
    ea, la = _extras(a, b, explained)
    eb, lb = _extras(b, a, explained)
    if not ea and not eb:
        return False
    for x, ex, ey, ly in ((a, ea, eb, lb), (b, eb, ea, la)):
        if not ex:
            continue
        words = x.seqw
        n = len(words)
        for i in ex:                        # "cheap", "for beginners", "abroad"
            if words[i] in W.DETAIL_QUALIFIERS and (i + 1 == n or words[i + 1] not in _PARTICLES):
                return True
        if ey or ly:                        # both sides reworded: left to the embedding
            continue
        for i in ex:
            if _after_preposition(x, i, ex) or (
                    words[i] in _DETAIL_PREPS and i + 1 < n and words[i + 1] in _HERE):
                return True                 # "... from abroad", "... near me"
            if (strict or short or (i and words[i - 1] in _COORD)) and _modifier(x, i, ex):
                return True                 # "attack dogs", "concentration and confidence"
        if strict:
            for i in ex:                    # any other content word, but adverbs and verbs
                if not words[i].endswith("ly") and not (i and words[i - 1] in _VERB_SLOT):
                    return True
    return False


def _after_preposition(x: _Side, i: int, ex: list[int]) -> bool:
    """The word at ``i`` is in a phrase opened by a qualifying preposition ("from abroad", "in a
    private school")."""
    for j in range(i - 1, max(-1, i - 4), -1):
        w = x.seqw[j]
        if w in _DETAIL_PREPS:
            return True
        if w in _NP_GLUE or j in ex:
            continue
        return False
    return False


def _modifier(x: _Side, i: int, ex: list[int]) -> bool:
    """The word at ``i`` modifies or is coordinated with a word the two sides share ("attack
    dogs", "tech news", "concentration and confidence")."""
    seq, seqw = x.seq, x.seqw
    prev = seqw[i - 1] if i else ""
    if prev in _COORD:
        return True
    if i + 1 < len(seq) and i + 1 not in ex:
        nxt = seq[i + 1]
        if (nxt[0] != "<" and nxt.isalpha() and nxt not in _FUNCTION_BASES
                and nxt not in _SOFT_BASES and nxt not in _DETAIL_NEUTRAL):
            return prev not in _VERB_SLOT or prev in _BE_DO
    return False


# ================================================================================================
# Question intent

#: Nouns and verbs that name what a question word asks for ("what time" ~ "when").
_WH_LIKE_WORDS = {
    "why": frozenset("reason cause purpose point motive motivation rationale explanation "
                     "make makes made causes caused lead leads led benefit benefits advantage "
                     "advantages importance use".split()),
    "when": frozenset("time date day year month hour age period moment season deadline "
                      "schedule soon long".split()),
    "where": frozenset("place location country city address area region site website store "
                       "shop source destination spot find located locate".split()),
    "who": frozenset("person people author company name inventor founder owner writer creator "
                     "responsible".split()),
}

_WH_LIKE = {k: v | frozenset(_base(w) for w in v) for k, v in _WH_LIKE_WORDS.items()}


def _wh_changed(x: _Side, y: _Side) -> bool:
    """``x`` asks when/where/who/why and ``y`` asks another question (opening with what, which,
    how or an auxiliary) without that question word or a noun that stands for it ("what time",
    "what is the reason")."""
    only = x.wh - y.wh
    if not only or not (y.what or y.how or y.polar or y.wh):
        return False
    for w in only:
        like = _WH_LIKE.get(w)
        if like is not None and not (like & y.bag):
            return True
    return False


#: Auxiliaries whose yes/no question asks for a way or a possibility, which a "how" answers
#: ("Can I pause my plan?" ~ "How do I pause my plan?").
_POLAR_ABILITY = frozenset(("can", "could"))
_POLAR_HOW = frozenset(("way", "ways", "possible", "possibly"))


def _polar_changed(x: _Side, y: _Side) -> bool:
    """(strict) ``x`` is a yes/no question ("Should I ...?", "Is X good?") and ``y`` asks what,
    how, when, ... instead, unless ``x`` asks whether something can be done ("Can I ...?", "Is
    there a way to ...?", "Is it possible to ...?")."""
    if not x.polar or y.polar or x.what or x.how or x.wh or not (y.what or y.how or y.wh):
        return False
    return not (x.polar in _POLAR_ABILITY or not _POLAR_HOW.isdisjoint(x.vocab))
