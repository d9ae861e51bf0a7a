"""A negation, an exclusion or an opposite on one side only.

The verifier reads most negations, but not all: measured on held-out pairs it served "Is aspirin
safe with coffee?" / "...unsafe with coffee?" and "List the advantages of remote work." / "...the
disadvantages..." at 0.98, and a review found it serving "Which is bigger, the Sun or the Earth?"
/ "...smaller...", "Is Pluto still a planet?" / "...no longer a planet?" and "List the countries
that use the euro." / "...except those that use the euro.". What it misses is the one-word kind,
which is exactly what a short list can read:

- a word on one side and its negative prefix form on the other (un-, in-, im-, il-, ir-, dis-,
  non-, a-: "safe" / "unsafe", "advantages" / "disadvantages", "legal" / "illegal"; the word
  without its prefix at least three letters long), and "over-" against "under-" ("overvalued" /
  "undervalued", "overestimate" / "underestimate"), and "over" / "under" themselves, a pair
  of :data:`OPPOSITES` ("under the threshold" / "over the threshold", served at 0.99);
- a pair of :data:`OPPOSITES` (each direction; a word may have several: "old" / "new", "old" /
  "young"), one word said more often on each side (counted: "Is it open?" answered "it is
  closed" / "it is open" says "open" on both sides, "closed" on one); a :data:`GRADED` word is read in its comparative and
  superlative forms too ("bigger", "biggest", "easier", "wider", "hottest" are "big", "big",
  "easy", "wide", "hot"), so "bigger" / "smaller" and "longest" / "shortest" are opposites;
- "exceed" on one side and "fall short (of)" on the other (the phrase read as one word, as
  "no longer" is); "prior" / "subsequent", "predate" / "postdate";
- "still" on one side and "no longer" (or "not ... anymore", "not ... any longer") on the other;
- "no longer" (or "not ... anymore") said on one side more often than on the other, before a
  word the other side says, the other negators as many: "...mention that the meeting is
  happening as planned" / "...is no longer happening as planned" (a review found the verifier
  serving it at 0.96 in a long prompt). "My reset link expired" / "The link no longer works
  because it expired" passes: what is no longer so is said otherwise on the other side (two
  true rewordings of the held-out pairs were refused without that condition);
- an exclusion ("except", "excepting", "excluding", "other than", "besides") on one side more
  often than on the other: "the countries that use the euro" / "the countries except those
  that use the euro". Not "apart from" and "aside from": as often "in addition to" ("Apart
  from metrics, there are other tools" was a true rewording of "In addition to metrics...").

Only when both sides have as many negators ("not", "no", "never", "n't", "without"...; Chinese
不, 没, 别, 无, 非, 未): "not fast" / "slow" says the same thing twice over, and a negation by a
separate word ("safe" / "not safe") is the verifier's, which reads it (semantoneg's held-out
negations: 0.1 % served). Counting negators here refused four in five true rewordings of the
"not likely" / "unlikely" kind. The "no" of "no longer" and the "not" of "not ... anymore" are
not counted: they are read with "still" and against each other. One "no" is read whatever
the negators: each clause's reply, yes ("yes", "yeah", "yep", "yup", "sure", "ok") or no
("no", "nope", "nah"), a yes on one side where the other says no (clause by clause when both
reply as often): "yes, go ahead" / "no, go ahead" was served (0.983); "No problem, ..." is no
reply (:data:`_FIRST_REPLY`, :data:`_LATER_REPLY`); nor is a reported one other: "she answered
sure" / "...no way" (:data:`_REPORTED`).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from itertools import pairwise

from ..verdict import Reason, Rule
from .text import lower_words, memo, norm

NEGATORS = frozenset(
    {
        "not",
        "no",
        "never",
        "without",
        "none",
        "nothing",
        "nobody",
        "neither",
        "nor",
        "cannot",
        "nowhere",
    }
)
_CN_NEGATORS = re.compile(r"不|没|别|无|非|未")

_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "a")

#: Opposites, "a/b" each; read both ways. Plurals and verb forms are listed where they are
#: asked about ("beginners" / "experts"); the -er/-est forms of :data:`GRADED` words are read.
#: "no_longer" is the word "no longer" (read from the phrase: :data:`_NO_LONGER`).
_PAIRS = """
over/under fast/slow quickly/slowly fast/slowly good/bad better/worse best/worst benefits/risks
benefits/dangers pros/cons advantages/drawbacks increase/decrease increase/reduce
increasing/decreasing increased/decreased more/less more/fewer most/least high/low higher/lower
cheap/expensive cheap/pricey cheaper/pricier cheapest/priciest early/late before/after
first/last start/stop start/end begin/end beginning/end open/close open/closed opens/closes
enable/disable keep/change keep/discard keep/delete keep/remove odd/even
upgrade/downgrade import/export upload/download add/remove buy/sell win/lose winner/loser
pass/fail succeed/fail success/failure accept/reject accept/decline allow/block allow/prohibit
allow/forbid include/exclude including/excluding inside/outside up/down in/out on/off hot/cold
warm/cool big/small large/small long/short tall/short heavy/light easy/hard easy/difficult
safe/dangerous safe/risky true/false right/wrong left/right always/never all/none love/hate
like/dislike max/min maximum/minimum maximize/minimize positive/negative rise/fall gain/lose
gain/loss profit/loss strong/weak rich/poor old/new young/old delete/restore delete/recover
lock/unlock show/hide encrypt/decrypt encode/decode compress/decompress activate/deactivate
serialize/deserialize increment/decrement ascending/descending ascend/descend raise/lower
raise/reduce upper/lower uppercase/lowercase top/bottom above/below north/south east/west
northern/southern eastern/western wide/narrow deep/shallow thick/thin loud/quiet tight/loose
tighten/loosen wet/dry dark/light dark/bright clean/dirty happy/sad input/output push/pull
send/receive borrow/lend expand/collapse inflate/deflate attract/repel arrive/depart
arrival/departure internal/external incoming/outgoing inbound/outbound beginner/expert
beginners/experts novice/expert novices/experts beginner/advanced basic/advanced asleep/awake
still/no_longer prior/subsequent predate/postdate predates/postdates predated/postdated
exceed/fall_short exceeds/fall_short exceeded/fall_short exceeding/fall_short
hi/bye hi/goodbye hello/bye hello/goodbye hey/bye hey/goodbye read/write reading/writing
load/save copy/paste cut/paste insert/delete pause/resume undo/redo grant/revoke approve/reject
attach/detach promote/demote saving/loading saved/loaded copying/pasting inserting/deleting
approved/rejected granted/revoked read/wrote
好处/坏处 优点/缺点 增加/减少 删除/恢复 上/下 开/关 买/卖 快/慢 高/低 大/小
"""


def _both_ways(pairs: str) -> dict[str, frozenset[str]]:
    """Each word's opposites: all of them ("old": "new" and "young"; a dict of pairs kept only
    the last, so "old" / "new" was read one way only)."""
    opposites: dict[str, set[str]] = {}
    for pair in pairs.split():
        a, b = pair.replace("_", " ").split("/")
        opposites.setdefault(a, set()).add(b)
        opposites.setdefault(b, set()).add(a)
    return {word: frozenset(them) for word, them in opposites.items()}


OPPOSITES = _both_ways(_PAIRS)

#: Words read in their -er and -est forms too (-ier/-iest for a final y, a final consonant
#: doubled: "bigger", "easiest"). Adjectives only: an -er noun ("offer", "upper") is no
#: comparative of a particle.
GRADED = frozenset(
    """fast slow big small large long short tall heavy light easy hard safe risky hot cold
    warm cool strong weak rich poor old young new high low cheap early late wide narrow deep
    shallow thick thin loud quiet tight loose wet dry dark bright clean dirty happy sad""".split()
)

#: "no longer", and "not ... anymore" / "any longer" within a few words: the word "no longer"
#: (one word, never written so), its negator read with it.
_NO_LONGER = re.compile(
    r"\bno longer\b|\b(?:not|never|\w+n't)\b(?: \S+){0,6}? (?:anymore|any longer)\b"
)
#: "fall short (of)" in any tense: the word "fall short", the opposite of "exceed".
_FALL_SHORT = re.compile(r"\b(?:fall|falls|fell|falling|fallen) short\b")
#: Words between "no longer" (or "not") and what is no longer so: "no longer *a* planet".
_FILLER = frozenset({"no", "longer", "not", "never", "a", "an", "the", "be", "been", "being"})
#: What leaves something out: one side more than the other is another question.
_EXCLUSION = re.compile(r"\b(?:except|excepting|excluding|besides|other than)\b")


@functools.lru_cache(maxsize=8192)
def _forms(word: str) -> frozenset[str]:
    """``word``, and the :data:`GRADED` word it is the comparative or superlative of."""
    forms = {word}
    for suffix in ("er", "est"):
        stem = word[: -len(suffix)]
        if word.endswith(suffix) and len(stem) >= 3:
            bases = {stem, stem + "e", stem[:-1] + "y" if stem[-1] == "i" else stem}
            if stem[-1] == stem[-2]:
                bases.add(stem[:-1])  # "bigg" -> "big"
            forms |= bases & GRADED
    return frozenset(forms)


@memo
def _read(text: str) -> tuple[int, int, tuple[str, ...], Counter[str]]:
    """(negators, exclusions, what each "no longer" is said of, words and how often each is said)
    of ``text``; CJK text adds its listed one- and two-character words, and "no longer" is one
    word. (Counted: "open" asked on both sides and answered "closed" on one is still "closed"
    against "open"; a set lost it.)"""
    words = lower_words(text)
    flat = norm(text)
    said = " ".join(words)
    no_longer_of = []
    for match in _NO_LONGER.finditer(said):
        after = said[match.start() :].split()[1:]
        no_longer_of.append(next((w for w in after if w not in _FILLER), ""))
    no_longer = len(no_longer_of)
    negators = sum(w in NEGATORS or w.endswith("n't") for w in words) - no_longer
    negators += len(_CN_NEGATORS.findall(flat))
    cjk = {flat[i : i + 2] for i in range(len(flat) - 1)} | set(flat)
    # (CJK only: "in" inside "win" or "China" is no word; counted, it refused "in" / "out".)
    read = Counter(words) + Counter(w for w in cjk if w in OPPOSITES and not w.isascii())
    # "Keep only X" is "remove what is not X": a filter, not the opposite of removing
    # ("keep only unique rows" / "remove duplicate rows" ask one thing).
    read["keep"] -= sum(a == "keep" and b in ("only", "just") for a, b in pairwise(words))
    read["no longer"] = no_longer
    read["fall short"] = len(_FALL_SHORT.findall(said))
    exclusions = len(_EXCLUSION.findall(said))
    return negators, exclusions, tuple(no_longer_of), +read


def negators(text: str) -> int:
    """How many negators ``text`` says ("not", "no", "n't"..., Chinese 不...; not the "no" of "no
    longer"): the guard gives no near-repeat bar to a pair that says them a different number of
    times ("we approve" / "we do not approve" is 0.977 similar)."""
    return _read(text)[0]


def _prefixed(w: str, other: Counter[str]) -> bool:
    """``w`` is another word of ``other`` with a negative prefix, or the other way round."""
    for prefix in _PREFIXES:
        if len(w) > 2 and prefix + w in other:
            return True
        base = w[len(prefix) :]
        if w.startswith(prefix) and len(base) > 2 and base in other:
            return True
    return False


def _over_under(w: str, other: Counter[str]) -> bool:
    """``w`` is over-something and ``other`` says under-something, or the other way round
    ("overvalued" / "undervalued", "overestimate" / "underestimate")."""
    for this, that in (("over", "under"), ("under", "over")):
        base = w[len(this) :]
        if w.startswith(this) and len(base) > 2 and that + base in other:
            return True
    return False


def _opposed(x: Counter[str], y: Counter[str]) -> bool:
    only_x, only_y = x - y, y - x  # (counts: what one side says more often)
    # Lookups, not a scan of only_y per word (that was quadratic).
    y_forms = frozenset().union(*map(_forms, only_y))
    for w in only_x:
        if (
            any(OPPOSITES.get(f, frozenset()) & y_forms for f in _forms(w))
            or _prefixed(w, only_y)
            or _over_under(w, only_y)
        ):
            return True
    return False


#: A reply's yes or no: a clause's first word but filler ("hmm", "well", "so", "thanks"...,
#: eight at most; the last of a run: "Ok, no, ..." is no), not the start of a phrase ("No
#: problem, ...", "no one", "Yes or no: ..."). The text's first clause may go on after it
#: ("No go ahead"); a later clause's is a clause of its own ("Good question. No, go ahead";
#: not "... No jargon."). "yes, go ahead" / "no, go ahead" scored 0.983 (a negator said once
#: more is the verifier's, which read past it), and so did "Hmm, no, ..." / "Hmm, yes, ...",
#: "Right, no, ..." / "Right, yes, ...", "Sure, one more thing. Yes, ..." / "... No, ...".
_OPENER = (
    r"[^\w.,!?;:\n。？！，]*+"  # (no mark: a run of them is read from its end, once)
    r"(?:(?:hmm+|um+|uh+|well|so|oh|ah|thanks|thank you|please|lol|ok|okay)\b\W*+){0,8}"
)
_WORD_SAID = r"(?P<word>yes|yeah|yep|yup|sure|ok|okay|no|nope|nah)\b(?!['’-])"
_NO_PHRASE = r"(?!\s*+(?:problems?|worr(?:y|ies)|one|way|doubt|matter|more|longer|less|or)\b)"
_FIRST_REPLY = re.compile(_OPENER + _WORD_SAID + _NO_PHRASE, re.I)
_LATER_REPLY = re.compile(
    r"(?<=[.,!?;:\n。？！，])(?![.,!?;:\n。？！，])"  # (a clause's start, after its marks)
    + _OPENER
    + _WORD_SAID
    + r"(?=\s*+(?:(?:please|thanks|thank you)\b\s*+)?(?:[,.!;:?。？！，]|$))",
    re.I,
)
_NO = frozenset("no nope nah".split())
#: A reply reported: "she answered sure" / "she answered no way" (served, 0.984).
_REPORTED = re.compile(
    r"\b(?:said|says|answered|replied|texted|wrote|responded|told (?:me|us))\s++['\"“]?"
    r"(?P<word>yes|yeah|yep|yup|sure|ok|okay|no|nope|nah)\b(?!['’-])"
    + _NO_PHRASE.replace("way|", ""),  # ("no way" is a no; "no problem" is none)
    re.I,
)


@memo
def _replies(text: str) -> tuple[str, ...]:
    """What the clauses' replies say, yes or no, in order (the module's contract)."""
    flat = norm(text)
    first = _FIRST_REPLY.match(flat)
    said = [m.group("word") for m in _LATER_REPLY.finditer(flat, first.end() if first else 0)]
    if first is not None:
        said.insert(0, first.group("word"))
    said += [m.group("word") for m in _REPORTED.finditer(flat)]
    return tuple("no" if word.lower() in _NO else "yes" for word in said)


def _answered_otherwise(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """A yes on one side where the other says no: clause by clause when both reply as often
    ("...? Yes. ...? No." / "...? No. ...? Yes." is another case), else in all."""
    if len(a) == len(b):
        return a != b
    ca, cb = Counter(a), Counter(b)
    return (ca["no"] > cb["no"] and cb["yes"] > ca["yes"]) or (
        cb["no"] > ca["no"] and ca["yes"] > cb["yes"]
    )


def differs(a: str, b: str) -> bool:
    if _answered_otherwise(_replies(a), _replies(b)):
        return True
    (na, ea, la, wa), (nb, eb, lb, wb) = _read(a), _read(b)
    return na == nb and (
        ea != eb or _no_longer(la, lb, wb) or _no_longer(lb, la, wa) or _opposed(wa, wb)
    )


def _no_longer(of: tuple[str, ...], other_of: tuple[str, ...], other: Counter[str]) -> bool:
    """More "no longer"s on this side, one said of a word the other side says plainly."""
    return len(of) > len(other_of) and any(w in other for w in of)


RULE = Rule(Reason.POLARITY, differs)
