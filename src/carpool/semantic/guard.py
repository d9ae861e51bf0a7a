"""The guard: may a cached answer to one prompt be served for another?

The semantic cache finds candidates by embedding similarity; embeddings are blind to the edits
that flip an answer ("Is ibuprofen safe with alcohol?" / "...unsafe with alcohol?" score 0.99).
The guard decides each candidate pair (new request, cached entry) in two steps:

1. the exact rules (:mod:`carpool.semantic.rules`): numbers, units and dates, operators, quoted
   text and task inputs, identifiers, names, word order. The first that fires refuses the pair
   with its :class:`Reason`; no model is asked. A side longer than :data:`READ_CHARS` is not
   read at all (:attr:`Reason.LENGTH`: too long to check), and ``judge`` reads on a worker
   thread: a lookup never stalls the event loop, whatever a client sends.
2. the verifier (:mod:`carpool.semantic.verifier`), a cross-encoder that reads both prompts
   together: the pair is served only when its score is at or above the verifier's threshold
   (:attr:`Reason.MEANING` otherwise), or, for a near repeat (cosine similarity at or above
   :data:`NEAR_REPEAT_SIMILARITY`: case, punctuation, a greeting), at or above
   :data:`NEAR_REPEAT_SCORE`. All surviving candidates of one lookup are scored in one model
   call. A pair the verifier would not read whole (``Verifier.unread``: longer than it reads)
   is refused with :attr:`Reason.LENGTH` instead: it cannot vouch for what it did not read;
   nor can it for a difference it cannot see (:func:`unseen_difference`: case, accents,
   spacing, to an uncased model), refused with :attr:`Reason.MEANING` (:attr:`Reason.CONTEXT`
   in the earlier turns) unasked.

Contract
--------
:class:`Guard` (a protocol, what the cache is given): ``await judge(new, candidates,
similarities=None) -> list[Verdict]``, one per candidate, in order, for :class:`Side` values
(``similarities``: each candidate's cosine similarity to ``new``, for the near-repeat bar; a
context pair gets that bar when its words are :func:`close`). :class:`RulesThenVerifier`
(``verifier, rules=RULES, threshold=None``) is the one carpool builds; it also splits a judgement
into ``scored`` (the rules and the model, once) and ``decide`` (the thresholds), so that an
evaluation can sweep the threshold without asking the model again. A side is a text (the last user turn, or the
prompt) and its ``context`` (a conversation's earlier turns, ``verifier.render_context``; ""
for a single turn). Both the texts and the contexts must pass the rules and the verifier; a
text that is the same on both sides up to the case of plain words, sentence marks, quotes and
brackets at a word's edges, and spacing (:func:`retyped`: never a symbol, an emoji, an
acronym's case or a line's indentation), or a context that is identical, is not asked about;
contexts refused by the verifier give :attr:`Reason.CONTEXT`, and so do earlier turns on one
side only (never asked: the verifier scored an instruction against none 0.99). ``judge_now``
is the same, synchronous (offline evaluation). Symmetric: swapping ``new`` and a candidate
gives the same verdict.

The verifier is passed in, never imported here: the cache does not know which model it is.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .rules import RULES
from .verdict import Reason, Rule, Verdict
from .verifier import Verifier

__all__ = ["Guard", "Reason", "RulesThenVerifier", "Side", "Verdict"]


@dataclass(frozen=True, slots=True)
class Side:
    text: str
    context: str = ""


#: The most characters of a side the rules read: a longer text or context that differs from the
#: other side is refused (:attr:`Reason.LENGTH`) before any rule reads it. Over 16 characters a
#: token for the 256 tokens the verifier reads of a pair, so only a retyping that long loses a
#: hit; at this length every rule takes at most ~10 ms (measured, adversarial texts included).
READ_CHARS = 4096


def refusal(a: str, b: str, rules: Sequence[Rule] = RULES) -> Reason | None:
    """The reason of the first rule that fires on the pair, or None; :attr:`Reason.LENGTH` for a
    side longer than :data:`READ_CHARS` (identical sides are not read)."""
    if a == b:
        return None
    if len(a) > READ_CHARS or len(b) > READ_CHARS:
        return Reason.LENGTH
    for rule in rules:
        if rule.differs(a, b):
            return rule.reason
    return None


#: A near repeat's bar. Measured on the calibration lines (every 10th development pair, never
#: trained on): the verifier scores true retypings at 0.95-0.98, just under its threshold, and
#: pairs this similar are rarely traps the exact rules let through: served 47.8 % -> 50.1 %,
#: wrong 1.53 % -> 1.68 % (held-out half: 51.7 % -> 53.1 %, 1.54 % -> 1.63 %).
NEAR_REPEAT_SIMILARITY = 0.97
NEAR_REPEAT_SCORE = 0.90


_NOT_WORD = re.compile(r"[^\w]+")


def _plain_words(text: str) -> list[str]:
    """The words of ``text``, case-folded, punctuation and spacing dropped (for :func:`close`,
    which only picks a bar for the verifier, never serves by itself)."""
    return _NOT_WORD.sub(" ", text.casefold()).split()


@functools.lru_cache(maxsize=1024)
def _edge(ch: str) -> int:
    """Where ``ch`` may be added or dropped by retyping a word: 1 before it (an opening bracket or
    quote), 2 after it (a closing one, a sentence mark), 3 either, 0 nowhere. Only such marks:
    a "." before a word (".NET"), a "-" (``-a``, ``x--``), a "#" (``C#``), a symbol or an emoji
    are part of the word."""
    category = unicodedata.category(ch)
    if category in ("Ps", "Pi"):
        return 1
    if category in ("Pe", "Pf"):
        return 2
    if category != "Po":
        return 0
    name = unicodedata.name(ch, "")
    if "QUOTATION" in name or "APOSTROPHE" in name or "INVERTED" in name:
        return 3  # 'quoted', ¿...?
    return 2 if any(mark in name for mark in _SENTENCE_MARKS) else 0


_SENTENCE_MARKS = (
    "FULL STOP",
    "COMMA",
    "COLON",
    "SEMICOLON",
    "EXCLAMATION",
    "QUESTION",
    "ELLIPSIS",
)
#: A word whose case a retyping may change: letters and digits, joined by an apostrophe or a
#: hyphen ("What's", "Wi-Fi"); touching any other mark (``-A``), its case is kept.
_FOLDABLE = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")
_PARTS = re.compile(r"([^\W_]+)")


def _word(token: str, shouted: bool, initial: bool) -> str:
    """A whitespace-separated token as a retyping leaves it: edge marks dropped, and the case of
    its plain words folded, but for a single letter or an acronym ("IT", "A") in a text that is
    not shouted whole: the pronoun I and a sentence's first letter ("A dog...") excepted."""
    start, end = 0, len(token)
    while start < end and _edge(token[start]) & 1:
        start += 1
    while end > start and _edge(token[end - 1]) & 2:
        end -= 1
    word = token[start:end]
    if not _FOLDABLE.fullmatch(word):
        return word
    word = word.replace("’", "'")  # a phone's apostrophe
    if shouted or (initial and len(word) == 1):
        return word.casefold()
    return _PARTS.sub(_folded_part, word)


def _folded_part(match: re.Match[str]) -> str:
    part = match.group(1)
    if part in ("I", "i") or not (len(part) == 1 or part.isupper()):
        return part.casefold()
    return part


def _retyping(text: str) -> list[str]:
    """What a retyping keeps of ``text``: its words (:func:`_word`), each line's indentation
    (code: the ``return`` inside or after a loop) and the inside of a ``` fence verbatim. Line
    breaks, blank lines, runs of spaces inside a line and a one-line text's leading spaces go
    (prose reflowed, a question typed with a stray space)."""
    shouted = not any(ch.islower() for ch in text)
    initial = True  # at a sentence's first word
    tokens: list[str] = []
    for i, piece in enumerate(text.split("```")):
        if i % 2:  # inside a fence: code, every character kept
            tokens.append("```" + piece)
            continue
        lines = [line for line in piece.splitlines() if line.strip()]
        for n, line in enumerate(lines):
            indent = line[: len(line) - len(line.lstrip())]
            if indent and (n or i or len(lines) > 1):
                tokens.append("\n" + indent)
            for token in line.split():
                word = _word(token, shouted, initial)
                if word:
                    tokens.append(word)
                initial = token[-1] in ".!?"
    return tokens


def retyped(a: str, b: str) -> bool:
    """The same words, in the same order, up to the case of plain words, sentence marks, quotes
    and brackets at a word's edges, and spacing (:func:`_retyping`). Asked after the rules, so
    the model is not asked: it scored "Cancel it." / "cancel it" 0.45. Never across a symbol, an
    emoji, an acronym's or a single letter's case, a mark inside or before a word, code in a
    fence or a line's indentation: "👍" / "👎", "ls -a" / "ls -A", "C" / "C++" and "What is
    IT?" / "What is it?" were served so (everything but letters and digits dropped, case folded),
    the verifier never asked."""
    return a == b or _retyping(a) == _retyping(b)


def _unseen(text: str) -> str:
    """``text`` as an uncased model reads it (the packaged verifier's BERT normalisation):
    white space only between words, invisible characters dropped, accents stripped, lower
    case."""
    text = " ".join(text.split())
    if text.isascii():
        return text.lower()
    kept = "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf"))
    decomposed = unicodedata.normalize("NFD", kept)
    return "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn").lower()


def unseen_difference(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ somewhere a model cannot read: a difference that
    :func:`retyped` keeps (an acronym's or a flag's case, "⊂" / "⊄", "résumé" / "resume", a
    line's indentation) but
    that reads the same to an uncased model. It would vouch for what it never saw ("ls -a" /
    "ls -A" scored 0.98, "A ⊂ B" / "A ⊄ B" 0.99). (Quadratic at worst: asked only of pairs the
    verifier reads whole.)"""
    x, y = _retyping(a), _retyping(b)
    matcher = difflib.SequenceMatcher(None, x, y, autojunk=False)
    return any(
        tag != "equal" and _unseen(" ".join(x[i1:i2])) == _unseen(" ".join(y[j1:j2]))
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
    )


#: Contexts are not embedded (that would cost a second embedding per lookup); a context pair
#: whose words are this close (difflib's ratio over the words) gets the near-repeat bar instead.
CLOSE_CONTEXT = 0.9


def close(a: str, b: str) -> bool:
    """Nearly the same words in the same order: a context retyped with a word or two changed.
    (Quadratic at worst: asked only of pairs the verifier reads whole, 256 tokens at most.)"""
    return (
        difflib.SequenceMatcher(None, _plain_words(a), _plain_words(b), autojunk=False).ratio()
        >= CLOSE_CONTEXT
    )


class Guard(Protocol):
    async def judge(
        self, new: Side, candidates: Sequence[Side], similarities: Sequence[float] | None = None
    ) -> list[Verdict]: ...


@dataclass(frozen=True, slots=True)
class Scored:
    """What the model said of one ``(new, candidates)`` lookup, before any threshold."""

    refused: list[Verdict | None]  # a rule's verdict, or None: the verifier decides
    slots: list[tuple[int, int]]  # per candidate: its text and context pair in
    # ``scores``, -1 where not asked (retyped, identical)
    close_contexts: list[bool]  # per candidate: its context pair is ``close``
    scores: list[float]


class RulesThenVerifier:
    """``threshold``: the verifier's bar (``semantic.verifier_threshold``); None: the one
    calibrated with the model (``verifier.threshold``)."""

    def __init__(
        self, verifier: Verifier, rules: Sequence[Rule] = RULES, threshold: float | None = None
    ) -> None:
        self.verifier = verifier
        self.rules = tuple(rules)
        self.threshold = verifier.threshold if threshold is None else threshold

    def _plan(
        self,
        new: Side,
        candidates: Sequence[Side],
    ) -> tuple[list[Verdict | None], list[tuple[str, str]], list[tuple[int, int]]]:
        """Rule verdicts (None: ask the verifier), the pairs to score, and for each candidate the
        indexes of its text and context pairs among them (-1: retyped or identical, not asked).
        A candidate with a pair the verifier would not read whole is refused
        (:attr:`Reason.LENGTH`): what the model did not read, it cannot vouch for."""
        verdicts: list[Verdict | None] = []
        asked: list[tuple[tuple[str, str] | None, tuple[str, str] | None]] = []
        for cached in candidates:
            reason = refusal(new.text, cached.text, self.rules) or refusal(
                new.context, cached.context, self.rules
            )
            if reason is None and bool(new.context) != bool(cached.context):
                # Earlier turns on one side only (small talk aside: ``view.conversation``): an
                # instruction ("reply only with yes or no") against none. The verifier, asked
                # about a text against nothing, scored that 0.99.
                reason = Reason.CONTEXT
            verdicts.append(None if reason is None else Verdict.refused(reason))
            if reason is not None:
                asked.append((None, None))
                continue
            text = None if retyped(new.text, cached.text) else (new.text, cached.text)
            # Exact: retyping may move a turn's boundary.
            same = new.context == cached.context
            asked.append((text, None if same else (new.context, cached.context)))
        cut = iter(self.verifier.unread([p for both in asked for p in both if p is not None]))
        pairs: list[tuple[str, str]] = []
        slots: list[tuple[int, int]] = []
        for i, both in enumerate(asked):
            if any([next(cut) for p in both if p is not None]):
                verdicts[i] = Verdict.refused(Reason.LENGTH)
                slots.append((-1, -1))
                continue
            # (After the length check: only pairs the model reads whole, 256 tokens, are aligned.)
            blind = [p is not None and unseen_difference(*p) for p in both]
            if any(blind):
                verdicts[i] = Verdict.refused(Reason.MEANING if blind[0] else Reason.CONTEXT)
                slots.append((-1, -1))
                continue
            slot = [-1, -1]
            for k, pair in enumerate(both):
                if pair is not None:
                    slot[k] = len(pairs)
                    pairs.append(pair)
            slots.append((slot[0], slot[1]))
        return verdicts, pairs, slots

    def _prepared(
        self, new: Side, candidates: Sequence[Side]
    ) -> tuple[list[Verdict | None], list[tuple[str, str]], list[tuple[int, int]], list[bool]]:
        """``_plan``, and per candidate whether its context pair is ``close``."""
        refused, pairs, slots = self._plan(new, candidates)
        return refused, pairs, slots, [c >= 0 and close(*pairs[c]) for _, c in slots]

    async def scored(self, new: Side, candidates: Sequence[Side]) -> Scored:
        # The rules are Python on texts up to READ_CHARS: read on a worker thread, so that no
        # lookup holds up the event loop (another tenant's exact hit) while they run.
        refused, pairs, slots, close_contexts = await asyncio.to_thread(
            self._prepared, new, candidates
        )
        return Scored(refused, slots, close_contexts, await self.verifier.scores(pairs))

    def scored_now(self, new: Side, candidates: Sequence[Side]) -> Scored:
        """``scored``, synchronously (offline evaluation)."""
        refused, pairs, slots, close_contexts = self._prepared(new, candidates)
        return Scored(refused, slots, close_contexts, self.verifier.score(pairs))

    def decide(
        self,
        scored: Scored,
        similarities: Sequence[float] | None = None,
        threshold: float | None = None,
    ) -> list[Verdict]:
        """The verdicts at the guard's ``threshold`` (or ``threshold``, for a sweep)."""
        bar = self.threshold if threshold is None else threshold
        near_repeat_bar = min(bar, NEAR_REPEAT_SCORE)
        out = []
        for i, (verdict, (text, context)) in enumerate(
            zip(scored.refused, scored.slots, strict=True)
        ):
            if verdict is not None:
                out.append(verdict)
                continue
            near_repeat = similarities is not None and similarities[i] >= NEAR_REPEAT_SIMILARITY
            text_bar = near_repeat_bar if near_repeat else bar  # the texts' similarity
            context_bar = near_repeat_bar if scored.close_contexts[i] else bar
            text_score = scored.scores[text] if text >= 0 else 1.0
            context_score = scored.scores[context] if context >= 0 else 1.0
            score = min(text_score, context_score)
            if text_score < text_bar:
                out.append(Verdict.refused(Reason.MEANING, score))
            elif context_score < context_bar:
                out.append(Verdict.refused(Reason.CONTEXT, score))
            else:
                out.append(Verdict(True, None, score))
        return out

    async def judge(
        self, new: Side, candidates: Sequence[Side], similarities: Sequence[float] | None = None
    ) -> list[Verdict]:
        return self.decide(await self.scored(new, candidates), similarities)

    def judge_now(
        self, new: Side, candidates: Sequence[Side], similarities: Sequence[float] | None = None
    ) -> list[Verdict]:
        return self.decide(self.scored_now(new, candidates), similarities)
