"""The guard: may a cached answer to one prompt be served for another?

The semantic cache finds candidates by embedding similarity; embeddings are blind to the edits
that flip an answer ("Is ibuprofen safe with alcohol?" / "...unsafe with alcohol?" score 0.99).
The guard decides each candidate pair (new request, cached entry) in two steps:

1. the exact rules (:mod:`carpool.semantic.rules`): numbers, units and dates, operators, quoted
   text and task inputs, identifiers, names, word order, the opposites, negations and exclusions
   the verifier misses, one thing named in place of another, another relative reached through a
   possessive, a small edit of a qualifier (how many, a condition, must or may, when, how much,
   in what form), emoticons. The first that fires refuses the
   pair with its :class:`Reason`; no model is asked. A side longer than :data:`READ_CHARS` is not
   read at all (:attr:`Reason.LENGTH`: too long to check), and ``judge`` reads on a worker
   thread: a lookup never stalls the event loop, whatever a client sends.
2. the verifier (:mod:`carpool.semantic.verifier`), a cross-encoder that reads both prompts
   together: the pair is served only when its score is at or above the verifier's threshold
   (:attr:`Reason.MEANING` otherwise), or, for a near repeat (cosine similarity at or above
   :data:`NEAR_REPEAT_SIMILARITY`: case, punctuation, a greeting; never texts that say a negator
   a different number of times, "we approve" / "we do not approve"), at or above
   :data:`NEAR_REPEAT_SCORE`. All surviving candidates of one lookup are scored in one verifier
   call (a model run a pair: each scores what it does alone), as :func:`read` gives them
   (without the marks the packaged verifier misread: :mod:`.rules.tone`). A pair the verifier
   would not read whole (``Verifier.unread``) is refused with :attr:`Reason.LENGTH`: it cannot
   vouch for what it did not read; nor for a difference it cannot see
   (:func:`.retyping.unseen_difference`: case, accents, spacing, to an uncased model),
   refused with :attr:`Reason.MEANING` (:attr:`Reason.CONTEXT` in the earlier turns) unasked.

Contract
--------
:class:`Guard` (a protocol, what the cache is given): ``await judge(new, candidates,
similarities=None) -> list[Verdict]``, one per candidate, in order, for :class:`Side` values
(``similarities``: each candidate's cosine similarity to ``new``, for the near-repeat bar; a
context pair gets that bar when its words are :func:`close`: only function words, case or a
word's form changed; a text pair never when its negators differ in number).
:class:`RulesThenVerifier` (``verifier, rules=RULES, threshold=None``) is the one carpool
builds; it also splits a judgement into ``scored`` (the rules and the model, once) and
``decide`` (the thresholds), so that an evaluation can sweep the threshold without asking the
model again. A side is a text (the last user turn, or the prompt) and its ``context`` (a
conversation's earlier turns, ``verifier.render_context``; "" for a single turn). Both the
texts and the contexts must pass the rules and the verifier (the contexts turn by turn, as
many of the same roles, ``frame.turns``, and saying as many negators); a text the same on both sides
up to the case of plain words, sentence marks, quotes and brackets at a word's edges, and
spacing (:func:`.retyping.retyped`: never a symbol, an emoji, an acronym's case or a line's
indentation), or a context that is identical, is not asked about; contexts refused by the
verifier give :attr:`Reason.CONTEXT`, and so do earlier turns on one side only (never asked:
the verifier scored an instruction against none 0.99). ``judge_now`` is the same, synchronous
(offline evaluation). Symmetric: swapping ``new`` and a candidate gives the same verdict.

The verifier is passed in, never imported here: the cache does not know which model it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .frame import turns
from .retyping import close, retyped, unseen_difference
from .rules import RULES
from .rules.polarity import negators
from .rules.tone import reading
from .verdict import Reason, Rule, Verdict
from .verifier import Verifier

__all__ = ["Guard", "Lookup", "Reason", "RulesThenVerifier", "Side", "Verdict"]


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


def read(a: str, b: str) -> tuple[str, str]:
    """The pair as the verifier is given it (:func:`.rules.tone.reading`: the texts the packaged one
    learned from had no emoticons, no "!!", no chat filler), when both sides left out the same (the
    same filler, as many repeated sentences) and still differ; as sent else: what was left out is
    part of what they differ in ("Say please" / "Say thanks", "Is it rude to reply ok" / "... to
    respond thanks", "...expansion for: lol" / "...for: rofl"), for the model to read (the rules
    refuse filler of other kinds, or other words when that is all: ``rules.tone``)."""
    x, y = reading(a), reading(b)
    if (x.words, x.repeats) != (y.words, y.repeats) or retyped(x.text, y.text):
        return a, b
    return x.text, y.text


#: A near repeat's bar. Measured on the calibration lines (every 10th development pair, never
#: trained on): the verifier scores true retypings at 0.95-0.98, just under its threshold, and
#: pairs this similar are rarely traps the exact rules let through: served 47.8 % -> 50.1 %,
#: wrong 1.53 % -> 1.68 % (held-out half: 51.7 % -> 53.1 %, 1.54 % -> 1.63 %).
NEAR_REPEAT_SIMILARITY = 0.97
NEAR_REPEAT_SCORE = 0.90


class Lookup:
    """What the guard's calls for one lookup share (the cache judges the nearest candidate, then
    the others): the deadline of the judge's verdicts (the event loop's time), set by the first
    call that asks the judge (``judge.JudgedGuard``), and the ``scope`` they are remembered in."""

    __slots__ = ("deadline", "scope")

    def __init__(self, scope: str = "") -> None:
        self.deadline: float | None = None
        self.scope = scope


class Guard(Protocol):
    async def judge(
        self,
        new: Side,
        candidates: Sequence[Side],
        similarities: Sequence[float] | None = None,
        lookup: Lookup | None = None,
    ) -> list[Verdict]: ...


#: A candidate's pairs: its text pair's index among those scored (-1: not asked, retyped or
#: identical) and its context pairs' (``frame.turns``; none where identical).
Slot = tuple[int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class Scored:
    """What the model said of one ``(new, candidates)`` lookup, before any threshold."""

    refused: list[Verdict | None]  # a rule's verdict, or None: the verifier decides
    slots: list[Slot]  # per candidate
    close_contexts: list[tuple[bool, ...]]  # per candidate: each context pair is ``close``
    scores: list[float]
    # per candidate: its texts say a negator ("not", "no"...) a different number of times
    negation_differs: list[bool]


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
    ) -> tuple[list[Verdict | None], list[tuple[str, str]], list[Slot]]:
        """Rule verdicts (None: ask the verifier), the pairs to score and their indexes
        (``Scored.slots``); a pair the verifier would not read whole refuses (``LENGTH``)."""
        verdicts: list[Verdict | None] = []
        asked: list[list[tuple[str, str] | None]] = []  # (the text pair, then the contexts')
        for cached in candidates:
            reason = refusal(new.text, cached.text, self.rules) or refusal(
                new.context, cached.context, self.rules
            )
            # (Exact: retyping may move a turn's boundary. None: too many differ. Refused: unread.)
            same = reason is not None or new.context == cached.context
            split = [] if same else turns(new.context, cached.context)
            if reason is None and (
                # Earlier turns on one side only (small talk aside: ``view.conversation``):
                # "reply only with yes or no" against none, asked of the verifier, scored 0.99.
                bool(new.context) != bool(cached.context)
                or split is None
                or negators(new.context) != negators(cached.context)  # (``frame``: drowned)
            ):
                reason = Reason.CONTEXT
            verdicts.append(None if reason is None else Verdict.refused(reason))
            if reason is not None or split is None:
                asked.append([None])
                continue
            text = None if retyped(new.text, cached.text) else read(new.text, cached.text)
            asked.append([text, *(read(*p) for p in split)])
        cut = iter(self.verifier.unread([p for both in asked for p in both if p is not None]))
        pairs: list[tuple[str, str]] = []
        slots: list[Slot] = []
        for i, all_pairs in enumerate(asked):
            if any([next(cut) for p in all_pairs if p is not None]):
                verdicts[i] = Verdict.refused(Reason.LENGTH)
                slots.append((-1, ()))
                continue
            # (After the length check: only pairs the model reads whole, 256 tokens, are aligned.)
            blind = [p is not None and unseen_difference(*p) for p in all_pairs]
            if any(blind):
                verdicts[i] = Verdict.refused(Reason.MEANING if blind[0] else Reason.CONTEXT)
                slots.append((-1, ()))
                continue
            at = [-1] * len(all_pairs)
            for k, pair in enumerate(all_pairs):
                if pair is not None:
                    at[k] = len(pairs)
                    pairs.append(pair)
            slots.append((at[0], tuple(at[1:])))
        return verdicts, pairs, slots

    def _prepared(
        self, new: Side, candidates: Sequence[Side]
    ) -> tuple[
        list[Verdict | None], list[tuple[str, str]], list[Slot], list[tuple[bool, ...]], list[bool]
    ]:
        """``_plan``, and per candidate whether each of its context pairs is ``close`` and
        whether its texts say a negator a different number of times (asked texts only: the
        rules read them)."""
        refused, pairs, slots = self._plan(new, candidates)
        close_contexts = [tuple(close(*pairs[c]) for c in cs) for _, cs in slots]
        negation_differs = [
            t >= 0 and negators(pairs[t][0]) != negators(pairs[t][1]) for t, _ in slots
        ]
        return refused, pairs, slots, close_contexts, negation_differs

    async def scored(self, new: Side, candidates: Sequence[Side]) -> Scored:
        # The rules are Python on texts up to READ_CHARS: read on a worker thread, so that no
        # lookup holds up the event loop (another tenant's exact hit) while they run.
        refused, pairs, slots, close_contexts, negation_differs = await asyncio.to_thread(
            self._prepared, new, candidates
        )
        scores = await self.verifier.scores(pairs)
        return Scored(refused, slots, close_contexts, scores, negation_differs)

    def scored_now(self, new: Side, candidates: Sequence[Side]) -> Scored:
        """``scored``, synchronously (offline evaluation)."""
        refused, pairs, slots, close_contexts, negation_differs = self._prepared(new, candidates)
        scores = self.verifier.score(pairs)
        return Scored(refused, slots, close_contexts, scores, negation_differs)

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
        for i, (verdict, (text, contexts)) in enumerate(
            zip(scored.refused, scored.slots, strict=True)
        ):
            if verdict is not None:
                out.append(verdict)
                continue
            # A separate "not" is left to the verifier by the rules (polarity): at its full bar.
            # The near-repeat bar served "we approve" / "we do not approve" (0.977 similar,
            # scored 0.96-0.97) in a long prompt's last sentence.
            near_repeat = (
                similarities is not None
                and similarities[i] >= NEAR_REPEAT_SIMILARITY
                and not scored.negation_differs[i]
            )
            text_bar = near_repeat_bar if near_repeat else bar  # the texts' similarity
            text_score = scored.scores[text] if text >= 0 else 1.0
            context_scores = [scored.scores[c] for c in contexts]
            score = min([text_score, *context_scores])
            if text_score < text_bar:
                out.append(Verdict.refused(Reason.MEANING, score))
            elif any(
                got < (near_repeat_bar if near else bar)
                for got, near in zip(context_scores, scored.close_contexts[i], strict=True)
            ):
                out.append(Verdict.refused(Reason.CONTEXT, score))
            else:
                out.append(Verdict(True, None, score))
        return out

    async def judge(
        self,
        new: Side,
        candidates: Sequence[Side],
        similarities: Sequence[float] | None = None,
        lookup: Lookup | None = None,  # (no judge here: nothing to share)
    ) -> list[Verdict]:
        return self.decide(await self.scored(new, candidates), similarities)

    def judge_now(
        self, new: Side, candidates: Sequence[Side], similarities: Sequence[float] | None = None
    ) -> list[Verdict]:
        return self.decide(self.scored_now(new, candidates), similarities)
