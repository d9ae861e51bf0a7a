"""What the guard says about a candidate pair: a :class:`Verdict` with a :class:`Reason`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    """Why a candidate was refused; the value is the metric label and the ``guard:`` verdict."""

    QUOTED = "quoted"  # a quoted string, code span or task input differs
    NUMBER = "number"  # numbers, units, currencies or relative dates differ
    OPERATOR = "operator"  # comparison or code operators differ
    IDENTIFIER = "identifier"  # a code or identifier on one side only
    ENTITY = "entity"  # a name on one side only
    ORDER = "order"  # the same words in another order (roles, direction)
    POLARITY = "polarity"  # a negation or an opposite on one side only
    SUBSTITUTION = "substitution"  # one thing named in place of another, the rest word for word
    RELATION = "relation"  # another relative reached through a possessive ("wife's brother")
    QUALIFIER = "qualifier"  # a small edit of how many, a condition, must / may, when, how much
    TONE = "tone"  # an emoticon on one side only, or another one (":)" / ":(")
    MEANING = "meaning"  # the verifier: not the same answer
    CONTEXT = "context"  # the verifier: the earlier turns differ in meaning
    JUDGE = "judge"  # the judge (semantic.judge): not the same answer, or no verdict
    LENGTH = "length"  # longer than the guard reads whole: too long to check
    AUDIT = "audit"  # an audit found this entry's answer wrong for this prompt (not asked again)


@dataclass(frozen=True, slots=True)
class Rule:
    """An exact rule: ``differs(a, b)`` is True when the prompts differ in what it reads."""

    reason: Reason
    differs: Callable[[str, str], bool]


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: Reason | None = None  # None when ok
    score: float | None = None  # the verifier's score, when it was asked

    @staticmethod
    def refused(reason: Reason, score: float | None = None) -> Verdict:
        return Verdict(False, reason, score)
