"""Analysis of one text, for the meaning-change guard (:mod:`carpool.semantic.guard`).

:func:`analyse` reads a prompt once into everything the guard's rules compare (an
:class:`Analysis`) and memoises it: a cached prompt meets many new ones, and analysing is most of
the cost of :func:`~carpool.semantic.guard.check`. Nothing here compares two texts: the rules are
in :mod:`carpool.semantic.guard` and :mod:`carpool.semantic.polarity`. What one token is on its
own is :mod:`carpool.semantic.surface`; what one word is (its base form, when two words are one),
:mod:`carpool.semantic.lexicon`.

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

What is read from a text: its word sequence (base forms, politeness and filler left out) and its
comparison key (two texts with equal keys are the same prompt); quoted strings; numbers (digits,
spelled out, ordinals, times, versions, codes) and units or currencies; calendar words;
identifiers (code spans, URLs, e-mails, paths, words with digits, snake_case, dotted names,
acronyms); named entities by case, with the initials of capitalised runs and the entities'
roots; negation cues and implicit negators; audience nouns and scope words; possessors;
quantifiers; the question word or auxiliary opening a sentence; verb particles ("turn *up*");
and the words around each to/from/than.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from functools import lru_cache

from carpool.semantic import guard_words as W
from carpool.semantic.lexicon import (
    ARTICLES,
    COMMON,
    NOT_NUMBERS,
    NUMBER_TEXT,
    STOP,
    base_form,
    word_facts,
)
from carpool.semantic.surface import (
    SHAPE_CAPITAL,
    SHAPE_CAPS,
    SHAPE_LOWER,
    SHAPE_MIXED,
    number_key,
    token_facts,
)

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
#: Runs of lower-case letters and digits: names and identifiers compared without punctuation.
PARTS_RE = re.compile(r"[a-z0-9]+")
_DIRECTIONAL = {"to": "to", "into": "to", "towards": "to", "toward": "to", "from": "from",
                "than": "than"}
_RUN_GLUE = frozenset(("of", "and", "the", "for", "de", "la", "von", "van"))


def compact_form(s: str) -> str:
    """The lower-case letters and digits of ``s``, glued ("scikit-learn" -> "scikitlearn")."""
    return "".join(PARTS_RE.findall(s))


class Analysis:
    """What the guard's rules compare about one text (one side of a pair); see :func:`analyse`."""

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


def squash(s: str) -> str:
    """The lower-case letters and digits of ``s`` as space-separated words: the form a quoted
    string is looked for in the other text."""
    return " ".join(PARTS_RE.findall(s.lower()))


@lru_cache(maxsize=8192)
def analyse(text: str) -> Analysis:
    """Read ``text`` into an :class:`Analysis`; memoised, so a cached prompt is read once."""
    side = Analysis()
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
        side.text_norm = " " + squash(t) + " "
        for m in _QUOTE_RE.finditer(t):
            q = squash(m.group(2))
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

    infos = [token_facts(tok) for tok in toks]
    # Is case informative on this side (not a Title Case headline, not shouting)?
    n_alpha = caps = 0
    for info, ini in zip(infos, initials, strict=True):
        if info[0] == "w" and not ini:
            n_alpha += 1
            if info[3] in (SHAPE_CAPITAL, SHAPE_CAPS, SHAPE_MIXED):
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
            if case_ok and shape != SHAPE_LOWER:
                if shape == SHAPE_CAPS:
                    if head not in STOP and head not in W.NEGATION_CUES:
                        idents.add(head)
                    run = _close_run(side, run, run_words)
                elif shape == SHAPE_MIXED:                     # PyTorch, JavaScript
                    entities.add(head)
                    if len(humps) >= 2:
                        vocab.add(humps)
                        side.runs[head] = humps
                    run.append(head[0])
                    run_words.append(head)
                elif shape == SHAPE_CAPITAL:
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
        side.entities = {e for e in entities if e not in COMMON and base_form(e) not in COMMON}
        side.roots = {entity_root(e) for e in side.entities}
    _features(side, words, kinds, poss, gaps, starts)
    return side


def _close_run(side: Analysis, run: list[str], run_words: list[str]) -> list[str]:
    if len(run) >= 2:
        initials = "".join(run)
        side.vocab.add(initials)
        for w in run_words:
            side.runs.setdefault(w, initials)
    run_words.clear()
    return []


_DEMONYM_SUFFIXES = ("ians", "ian", "ans", "ese", "ish", "an", "ns", "is", "i", "s", "a", "y",
                     "e", "n")


def entity_root(e: str) -> str:
    """A named entity without its demonym or plural ending ("India", "Indians" -> "indi")."""
    for suffix in _DEMONYM_SUFFIXES:
        if e.endswith(suffix) and len(e) - len(suffix) >= 4:
            return e[: -len(suffix)]
    return e


def _features(side: Analysis, words: list[str], kinds: list[str], poss: list[bool],
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
        f = word_facts(w)
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
                    (prev == "or" and (i + 1 == n or words[i + 1] in STOP))
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
            elif w in nw or prev in ARTICLES:
                total, current, j = 0.0, 0.0, i
                while j < n and kinds[j] == "w" and (
                        words[j] in NUMBER_TEXT and words[j] not in NOT_NUMBERS
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
                numbers[number_key(total + current)] += 1
                seq[-1] = _NUM
                for x in words[i + 1:j]:
                    bx = base_form(x)
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
                              or prev in ARTICLES):
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
            side.particles[(base_form(prev), w)] += 1
        prev, prev_kind = w, kind
        i += 1
    # glued neighbours ("hugging face" ~ "huggingface")
    for i in range(n - 1):
        if kinds[i] != "n":
            vocab.add(words[i] + words[i + 1])
    for ident in side.idents:
        parts = PARTS_RE.findall(ident)
        vocab.update(parts)
        vocab.add("".join(parts))
    # directional bindings: the first critical token after to/into/from/than
    for i, w in enumerate(words):
        d = _DIRECTIONAL.get(w)
        if d is None or kinds[i] != "w":
            continue
        for j in range(i + 1, min(n, i + 4)):
            x = words[j]
            if kinds[j] != "w" or x in side.entities or x in side.idents or word_facts(x).unit:
                side.bindings.setdefault(d, set()).add(x if kinds[j] != "w" else base_form(x))
                break
            if x not in STOP:
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


def _content_near(words: list[str], kinds: list[str], span: range) -> frozenset[str]:
    """The first one or two content words (base forms) in ``span``, stopping at a stop word that
    follows a content word."""
    out: list[str] = []
    for j in span:
        if kinds[j] != "w":
            break
        if words[j] in STOP:
            if out:
                break
            continue
        out.append(base_form(words[j]))
        if len(out) == 2:
            break
    return frozenset(out)
