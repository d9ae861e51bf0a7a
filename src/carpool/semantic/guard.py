"""The guard: may a cached answer to one prompt be served for another?

The semantic cache finds candidates by embedding similarity; embeddings are blind to the edits
that flip an answer ("Is ibuprofen safe with alcohol?" / "...unsafe with alcohol?" score 0.99).
The guard decides each candidate pair (new request, cached entry) in two steps:

1. the exact rules (:mod:`carpool.semantic.rules`): numbers, units and dates, operators, quoted
   text and task inputs, identifiers, names, word order. The first that fires refuses the pair
   with its :class:`Reason`; no model is asked.
2. the verifier (:mod:`carpool.semantic.verifier`), a cross-encoder that reads both prompts
   together: the pair is served only when its score is at or above the verifier's threshold
   (:attr:`Reason.MEANING` otherwise). All surviving candidates of one lookup are scored in one
   model call.

Contract
--------
``Guard(verifier, rules=RULES)``; ``await judge(new, candidates) -> list[Verdict]``, one per
candidate, in order, for :class:`Side` values. A side is a text (the last user turn, or the
prompt) and its ``context`` (a conversation's earlier turns, ``verifier.render_context``; ""
for a single turn). Both the texts and the contexts must pass the rules and the verifier; a
context that is identical on both sides is not asked about, nor is an identical text; contexts
refused by the verifier give :attr:`Reason.CONTEXT`. ``judge_now`` is the same, synchronous (offline
evaluation). Symmetric: swapping ``new`` and a candidate gives the same verdict.

The verifier is passed in, never imported here: the cache does not know which model it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .rules import RULES
from .verdict import Reason, Rule, Verdict
from .verifier import Verifier

__all__ = ["Guard", "Reason", "Side", "Verdict"]


@dataclass(frozen=True, slots=True)
class Side:
    text: str
    context: str = ""


def refusal(a: str, b: str, rules: Sequence[Rule] = RULES) -> Reason | None:
    """The reason of the first rule that fires on the pair, or None."""
    if a == b:
        return None
    for rule in rules:
        if rule.differs(a, b):
            return rule.reason
    return None


class Guard:
    def __init__(self, verifier: Verifier, rules: Sequence[Rule] = RULES) -> None:
        self.verifier = verifier
        self.rules = tuple(rules)

    def _plan(self, new: Side, candidates: Sequence[Side],
              ) -> tuple[list[Verdict | None], list[tuple[str, str]], list[tuple[int, int]]]:
        """Rule verdicts (None: ask the verifier), the pairs to score, and for each candidate the
        indexes of its text and context pairs among them (-1: identical, not asked)."""
        verdicts: list[Verdict | None] = []
        pairs: list[tuple[str, str]] = []
        slots: list[tuple[int, int]] = []
        for cached in candidates:
            reason = (refusal(new.text, cached.text, self.rules)
                      or refusal(new.context, cached.context, self.rules))
            if reason is not None:
                verdicts.append(Verdict.refused(reason))
                slots.append((-1, -1))
                continue
            verdicts.append(None)
            text = context = -1
            if new.text != cached.text:
                text = len(pairs)
                pairs.append((new.text, cached.text))
            if new.context != cached.context:
                context = len(pairs)
                pairs.append((new.context, cached.context))
            slots.append((text, context))
        return verdicts, pairs, slots

    def _verdicts(self, planned: list[Verdict | None], scores: Sequence[float],
                  slots: list[tuple[int, int]]) -> list[Verdict]:
        threshold = self.verifier.threshold
        out = []
        for verdict, (text, context) in zip(planned, slots, strict=True):
            if verdict is not None:
                out.append(verdict)
                continue
            text_score = scores[text] if text >= 0 else 1.0
            context_score = scores[context] if context >= 0 else 1.0
            score = min(text_score, context_score)
            if text_score < threshold:
                out.append(Verdict.refused(Reason.MEANING, score))
            elif context_score < threshold:
                out.append(Verdict.refused(Reason.CONTEXT, score))
            else:
                out.append(Verdict(True, None, score))
        return out

    async def judge(self, new: Side, candidates: Sequence[Side]) -> list[Verdict]:
        planned, pairs, slots = self._plan(new, candidates)
        return self._verdicts(planned, await self.verifier.scores(pairs), slots)

    def judge_now(self, new: Side, candidates: Sequence[Side]) -> list[Verdict]:
        planned, pairs, slots = self._plan(new, candidates)
        return self._verdicts(planned, self.verifier.score(pairs), slots)
