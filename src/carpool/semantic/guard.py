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

Normalisation, never a change of meaning (case, punctuation, politeness, articles, contractions,
hyphens, spelling, inflection, derivation, listed synonyms, typos), happens once per text in
:mod:`carpool.semantic.analysis`, whose docstring details it; a token on its own is read by
:mod:`carpool.semantic.surface`, and one word by :mod:`carpool.semantic.lexicon`, which also says
when two words are one word. The rules below compare the two analyses; ``negation`` /
``antonym`` is :mod:`carpool.semantic.polarity`.

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
    rest is left to the embedding; *(strict)* except a qualifying phrase added on its own: with
    the two word sequences aligned, a run of words inserted between shared words (replacing
    nothing) that opens with a qualifying preposition and holds two or more content words the
    other side lacks ("restore my subscription" vs "recover my subscription from the web
    dashboard"; a one-word phrase, often idiomatic, "on hold", is left alone). Light words
    (:data:`~carpool.semantic.guard_words.DETAIL_LIGHT`: use, make, get, process, order, size,
    ...) are never a detail but, left unmatched, mark their side as reworded. Texts of more
    than 12 words on both sides (filler left out) are left alone: a reworded paragraph routinely
    adds or drops a phrase.

Known limits: no syntax (negation scope is the whole prompt, so two negations in different clauses
cancel), no world knowledge (a lower-case name is an ordinary word; an unlisted synonym in a
one-slot rewording is rejected; a paraphrase that turns a word into its negated antonym without a
listed pair, "it expired" vs "it no longer works", is rejected as a negation; an added word
that restates the other side without a listed synonym, "change my flight" vs "change my flight
booking", is a detail in strict mode; a detail added inside a rewording, with other words
changed on both sides, is left to the embedding unless it is a restrictive word or, in strict
mode, a phrase of two content words or more). A reworded frame around a swapped verb ("How do I
delete my password?" vs "What is the best way to reset my password?", 0.74) is left to the
embedding too: on the development pairs, a rule for it (or for a swapped verb plus any added
word) rejected more true rewordings with an unlisted synonym ("thaw" / "defrost", "earn" / "make
money") than different questions, and single-word embeddings do not tell the two apart either.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

from carpool.semantic import guard_words as W
from carpool.semantic.analysis import (
    PARTS_RE,
    Analysis,
    analyse,
    compact_form,
    entity_root,
    squash,
)
from carpool.semantic.lexicon import (
    AUDIENCE,
    FUNCTION_BASES,
    PARTICLES,
    SOFT_BASES,
    SYNONYMS,
    base_form,
    same_word,
    within_edits,
    word_facts,
)
from carpool.semantic.polarity import polarity

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
    a = analyse(new)
    b = analyse(cached)
    if a.keys == b.keys:
        return _OK
    reason = _compare(a, b, new, cached, strict)
    return _OK if reason is None else _VERDICTS[reason]


# ================================================================================================
# Comparison


def _present(token: str, other: Analysis) -> bool:
    """Does ``token`` (an entity or identifier of one side) occur on the other side?"""
    vocab = other.vocab
    if token in vocab or base_form(token) in vocab:
        return True
    parts = PARTS_RE.findall(token)
    if not parts:
        return True
    compact = "".join(parts)
    if compact in vocab:
        return True
    if len(parts) > 1 and all(p in vocab for p in parts):
        return True
    syn = SYNONYMS.get(token)
    if syn is not None:                     # "PC" ~ "computer"
        for w in vocab:
            other_syn = SYNONYMS.get(w)
            if other_syn is not None and not syn.isdisjoint(other_syn):
                return True
    if not any(c.isdigit() for c in compact) and len(compact) >= 4:
        for ident in other.idents:
            c = compact_form(ident)
            if c.endswith(compact) or c.startswith(compact):
                return True
        if len(compact) >= 8 and compact.isalpha():
            for w in vocab:
                if w[:1] == compact[0] and within_edits(compact, w, 1):
                    return True
    return False


def _root_present(ent: str, other: Analysis) -> bool:
    r = entity_root(ent)
    if len(r) < 4:
        return False
    if r in other.roots:
        return True
    for w in other.vocab:
        if w.startswith(r) and len(w) - len(r) <= 4 and (
                w == r or entity_root(w) == r or w[:-1] == r or entity_root(ent) == w):
            return True
    return False


def _numbers_differ(a: Analysis, b: Analysis) -> bool:
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


#: Audience groups that change the answer even when named on one side only.
_STRONG_AUDIENCE = frozenset(
    AUDIENCE[w] for w in ("child", "baby", "teen", "adult", "senior", "man", "woman", "boy",
                          "girl", "male", "female", "pregnant", "dog", "cat", "horse", "bird",
                          "rabbit", "pet", "diabetic", "smoker", "vegetarian", "veteran",
                          "pregnancy", "son", "daughter", "brother", "sister", "parent",
                          "grandparent", "grandchild")
)


def _compare(a: Analysis, b: Analysis, cached_a: str = "", cached_b: str = "",
             strict: bool = False) -> str | None:
    for x, y, other_text in ((a, b, cached_b), (b, a, cached_a)):
        if x.quoted:
            norm = y.text_norm or " " + squash(other_text) + " "
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
    reason, explained = polarity(a, b)
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


def _one_slot_swap(sa: tuple[str, ...], sb: tuple[str, ...], explained: frozenset[str]) -> bool:
    """The sequences are equal but for one slot of 1-3 words each, not the same words."""
    if explained:
        sa = tuple(w for w in sa if w not in explained)
        sb = tuple(w for w in sb if w not in explained)
    la, lb = len(sa), len(sb)
    p = 0
    while p < la and p < lb and same_word(sa[p], sb[p]):
        p += 1
    if p == la and p == lb:
        return False
    s = 0
    while s < la - p and s < lb - p and same_word(sa[la - 1 - s], sb[lb - 1 - s]):
        s += 1
    mid_a = sa[p:la - s]
    mid_b = sb[p:lb - s]
    if not mid_a or not mid_b or len(mid_a) > 3 or len(mid_b) > 3:
        return False
    if p + s < 2 and not (p + s == 1 and max(la, lb) <= 3):
        return False
    content_a = [w for w in mid_a if w not in SOFT_BASES and w[0] != "<"]
    content_b = [w for w in mid_b if w not in SOFT_BASES and w[0] != "<"]
    if not content_a and not content_b:
        return False
    # a slot of function words against a content word: "not sick" vs "not well"
    if not content_a:
        content_a = [w for w in mid_a if w not in FUNCTION_BASES and w[0] != "<"]
    if not content_b:
        content_b = [w for w in mid_b if w not in FUNCTION_BASES and w[0] != "<"]
    # "what time" vs "when", "which place" vs "where"
    for ca, cb in ((content_a, content_b), (content_b, content_a)):
        if len(cb) == 1 and cb[0] in _WH_LIKE and ca and all(x in _WH_LIKE[cb[0]] for x in ca):
            return False
    # "how long" vs "how many days"
    if (content_a == ["long"] and all(word_facts(x).time_unit for x in content_b)) or (
            content_b == ["long"] and all(word_facts(x).time_unit for x in content_a)):
        return False
    # a swap needs a word on each side that has no counterpart anywhere on the other side
    return any(not any(same_word(x, y) for y in sb) for x in content_a) and any(
        not any(same_word(y, x) for x in sa) for y in content_b)


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
#: Content words an added qualifying phrase needs to be a detail inside a rewording.
_PHRASE_MIN_EXTRAS = 2


def _extras(x: Analysis, y: Analysis, explained: frozenset[str]) -> tuple[list[int], bool]:
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
                or w in SOFT_BASES or w in FUNCTION_BASES or w in _DETAIL_NEUTRAL
                or raw in _DETAIL_NEUTRAL or raw in y.vocab or raw in x.entities):
            continue
        if any(same_word(w, v) for v in ybag):
            continue
        if raw in W.DETAIL_LIGHT or w in W.DETAIL_LIGHT:
            light = True
            continue
        out.append(i)
    return out, light


def _detail(a: Analysis, b: Analysis, explained: frozenset[str], strict: bool) -> bool:
    """One side carries a qualifier the other lacks; see the module docstring."""
    size = min(len(a.seq), len(b.seq))
    if size > _DETAIL_MAX_WORDS:
        return False
    short = size <= _DETAIL_SHORT
    ea, la = _extras(a, b, explained)
    eb, lb = _extras(b, a, explained)
    if not ea and not eb:
        return False
    added: tuple[list[range], list[range]] | None = None
    for side, (x, ex, ey, ly) in enumerate(((a, ea, eb, lb), (b, eb, ea, la))):
        if not ex:
            continue
        words = x.seqw
        n = len(words)
        for i in ex:                        # "cheap", "for beginners", "abroad"
            if words[i] in W.DETAIL_QUALIFIERS and (i + 1 == n or words[i + 1] not in PARTICLES):
                return True
        if ey or ly:                        # both sides reworded: left to the embedding,
            if strict:                      # but for a qualifying phrase added on its own
                if added is None:
                    added = _additions(a.seq, b.seq)
                if _qualifying_addition(x, ex, added[side]):
                    return True             # "restore X" / "recover X on the mobile app"
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


def _additions(sa: tuple[str, ...], sb: tuple[str, ...]) -> tuple[list[range], list[range]]:
    """The pure additions of each side when the two word sequences are aligned (runs of words
    inserted between shared words, replacing nothing): positions in ``sa``, then in ``sb``. One
    alignment for both orders of the pair, so that the verdict stays symmetric."""
    flip = sb < sa
    first, second = (sb, sa) if flip else (sa, sb)
    only_first: list[range] = []
    only_second: list[range] = []
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, first, second,
                                               autojunk=False).get_opcodes():
        if tag == "delete":
            only_first.append(range(i1, i2))
        elif tag == "insert":
            only_second.append(range(j1, j2))
    return (only_second, only_first) if flip else (only_first, only_second)


def _qualifying_addition(x: Analysis, ex: list[int], additions: list[range]) -> bool:
    """(strict) One of ``x``'s pure additions is a qualifying phrase: it opens with a qualifying
    preposition and holds at least ``_PHRASE_MIN_EXTRAS`` content words that the other side lacks
    ("on the mobile app", "from the web dashboard", "for a team account"). A reworded verb
    elsewhere does not make the added setting part of the same question. A one-word phrase is
    often idiomatic ("on hold", "in bulk", "at once") and is left alone."""
    extras = set(ex)
    for span in additions:
        if x.seqw[span.start] in _DETAIL_PREPS and sum(
                i in extras for i in span) >= _PHRASE_MIN_EXTRAS:
            return True
    return False


def _after_preposition(x: Analysis, i: int, ex: list[int]) -> bool:
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


def _modifier(x: Analysis, i: int, ex: list[int]) -> bool:
    """The word at ``i`` modifies or is coordinated with a word the two sides share ("attack
    dogs", "tech news", "concentration and confidence")."""
    seq, seqw = x.seq, x.seqw
    prev = seqw[i - 1] if i else ""
    if prev in _COORD:
        return True
    if i + 1 < len(seq) and i + 1 not in ex:
        nxt = seq[i + 1]
        if (nxt[0] != "<" and nxt.isalpha() and nxt not in FUNCTION_BASES
                and nxt not in SOFT_BASES and nxt not in _DETAIL_NEUTRAL):
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

_WH_LIKE = {k: v | frozenset(base_form(w) for w in v) for k, v in _WH_LIKE_WORDS.items()}


def _wh_changed(x: Analysis, y: Analysis) -> bool:
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


def _polar_changed(x: Analysis, y: Analysis) -> bool:
    """(strict) ``x`` is a yes/no question ("Should I ...?", "Is X good?") and ``y`` asks what,
    how, when, ... instead, unless ``x`` asks whether something can be done ("Can I ...?", "Is
    there a way to ...?", "Is it possible to ...?")."""
    if not x.polar or y.polar or x.what or x.how or x.wh or not (y.what or y.how or y.wh):
        return False
    return not (x.polar in _POLAR_ABILITY or not _POLAR_HOW.isdisjoint(x.vocab))
