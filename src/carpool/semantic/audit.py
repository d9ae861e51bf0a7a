"""Audits of served semantic hits, the wrong-hit estimate per namespace, and the error budget.

A semantic cache that serves on similarity cannot say how often it is wrong. Here a sampled
fraction of the hits it serves (``semantic.audit_rate``) is also sent upstream, in the
background, after the client got its answer; the fresh answer is compared with the one served
(the judge, when there is one: "do these answers agree?"; else the guard over the two answers).
Operators' reports of wrong hits (``POST /admin/semantic/feedback``) count the same way.

Contract:
- ``Audits(rate, window, budget, sample=random.random)``: ``sampled()`` draws whether a hit is
  audited (``sample() < rate``). ``record(namespace, wrong, near)`` counts one audit (or report)
  of a match at the cache's usual bar; ``near``: the match is also a near repeat (similarity >=
  ``BACKED_OFF_SIMILARITY``), one a backed-off namespace still serves. Per namespace:
  ``audited`` and ``wrong`` in all, and two windows of the latest ``window`` audits: every audit
  (the usual bar's wrong-hit rate) and the near repeats' only (the backed-off bar's), each with
  its 95% Wilson interval (:func:`wilson`).
- Error budget (``budget``, None: none): each namespace is ``serving`` (the cache's usual bar),
  ``backed-off`` (only near repeats are served) or ``mark`` (nothing served; the match is only
  named). Audits go on in every state, of the match served or the one that would have been, so
  each state is judged on the bar it serves at and the bar above it: after each audit,
  ``serving`` backs off when the usual bar's interval lies over the budget (its lower bound
  above it); ``backed-off`` moves to ``mark`` when the near repeats' lies over it, and back to
  ``serving`` when the usual bar's lies under it (its upper bound below); ``mark`` comes back to
  ``backed-off`` when the near repeats' lies under it. Each move starts fresh windows and is
  logged once. (A namespace is not marked for the usual bar's wrong hits while its near repeats
  are right: those it keeps serving.)
- ``state(namespace)``; ``snapshot()``: ``{namespace: {"audited", "wrong", "estimate", "low",
  "high", "state"}}`` (``/stats`` ``semantic_audit``), the estimate of the bar the namespace
  serves at (``serving``: the usual bar's; ``backed-off``, ``mark``: the near repeats'); ``reset(namespace=None)``: one namespace
  (or all) back to ``serving`` with no audits. At most ``MAX_NAMESPACES`` are tracked (least
  recently audited out).
- ``totals()``: ``{namespace: (audited, wrong)}`` since the namespace was first tracked, for the
  Prometheus counters (``carpool_semantic_audits_total``), which must never go down: kept apart
  from what ``reset`` forgets, and least recently audited out at ``MAX_NAMESPACES`` as well (a
  namespace tracked again after that starts a new series, as after a restart).
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from ..lru import LRU

__all__ = [
    "BACKED_OFF",
    "BACKED_OFF_SIMILARITY",
    "MARK",
    "SERVING",
    "Audits",
    "answer_text",
    "wilson",
]

log = logging.getLogger("carpool.semantic")

State = Literal["serving", "backed-off", "mark"]
SERVING: State = "serving"
BACKED_OFF: State = "backed-off"
MARK: State = "mark"

#: What a backed-off namespace still serves: near repeats (case, punctuation, a greeting).
BACKED_OFF_SIMILARITY = 0.97
MAX_NAMESPACES = 10_000
_Z = 1.959964  # the normal quantile of a two-sided 95% interval


def wilson(wrong: int, n: int, z: float = _Z) -> tuple[float, float, float]:
    """(estimate, low, high): the wrong-hit rate ``wrong/n`` and its Wilson score interval; no
    audits: (0, 0, 1), nothing known."""
    if n == 0:
        return 0.0, 0.0, 1.0
    p = wrong / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # The interval holds the estimate exactly: at 0 or n wrong, rounding would put a bound a
    # hair past it (0 wrong of 249: low 8.7e-19).
    return p, max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


@dataclass(slots=True)
class _Window:
    """The latest audits of one bar, and how many of them were wrong (kept, not summed on every
    read)."""

    audits: deque[bool]
    wrong: int = 0

    def add(self, wrong: bool) -> None:
        if len(self.audits) == self.audits.maxlen:
            self.wrong -= self.audits[0]  # (the oldest leaves as this one comes)
        self.audits.append(wrong)
        self.wrong += wrong

    def interval(self) -> tuple[float, float, float]:
        return wilson(self.wrong, len(self.audits))

    def clear(self) -> None:
        self.audits.clear()
        self.wrong = 0


@dataclass(slots=True)
class _Namespace:
    usual: _Window  # every audit: the cache's usual bar
    near: _Window  # near repeats only: the backed-off bar
    audited: int = 0
    wrong: int = 0
    state: State = SERVING

    def serves_at(self) -> _Window:
        return self.usual if self.state == SERVING else self.near


@dataclass(slots=True)
class _Totals:
    """A namespace's audits in all, never reset (``Audits.totals``)."""

    audited: int = 0
    wrong: int = 0


class Audits:
    """The audits of every namespace (the contract is the module's)."""

    def __init__(
        self,
        rate: float,
        window: int = 500,
        budget: float | None = None,
        sample: Callable[[], float] = random.random,
    ) -> None:
        self.rate = rate
        self.window = window
        self.budget = budget
        self._sample = sample
        self._namespaces: LRU[str, _Namespace] = LRU(max_entries=MAX_NAMESPACES)
        self._totals: LRU[str, _Totals] = LRU(max_entries=MAX_NAMESPACES)
        self.calls = 0  # upstream calls the audits made
        self.failed = 0  # audits that got no fresh answer to compare with

    def sampled(self) -> bool:
        return self.rate > 0 and self._sample() < self.rate

    def state(self, namespace: str) -> State:
        found = self._namespaces.peek(namespace)
        return found.state if found is not None else SERVING

    def record(self, namespace: str, wrong: bool, near: bool = False) -> None:
        total = self._totals.get(namespace)
        if total is None:
            total = _Totals()
            self._totals.put(namespace, total)
        total.audited += 1
        total.wrong += wrong
        found = self._namespaces.get(namespace)
        if found is None:
            found = _Namespace(
                _Window(deque(maxlen=self.window)), _Window(deque(maxlen=self.window))
            )
            self._namespaces.put(namespace, found)
        found.audited += 1
        found.wrong += wrong
        found.usual.add(wrong)
        if near:
            found.near.add(wrong)
        if self.budget is None:
            return
        _, usual_low, usual_high = found.usual.interval()
        _, near_low, near_high = found.near.interval()
        if found.state == SERVING and usual_low > self.budget:
            self._move(namespace, found, BACKED_OFF, usual_low)
        elif found.state == BACKED_OFF and near_low > self.budget:
            self._move(namespace, found, MARK, near_low)
        elif found.state == BACKED_OFF and usual_high < self.budget:
            self._move(namespace, found, SERVING, usual_high)
        elif found.state == MARK and near_high < self.budget:
            self._move(namespace, found, BACKED_OFF, near_high)

    def _move(self, namespace: str, found: _Namespace, to: State, bound: float) -> None:
        log.warning(
            "semantic namespace %r: %s -> %s (wrong-hit rate bound %.3f, budget %.3f)",
            namespace,
            found.state,
            to,
            bound,
            self.budget,
        )
        found.state = to
        found.usual.clear()
        found.near.clear()

    def reset(self, namespace: str | None = None) -> int:
        """Forget the audits of ``namespace`` (None: of all); how many namespaces were reset."""
        if namespace is None:
            count = len(self._namespaces)
            self._namespaces.clear()
            return count
        return 0 if self._namespaces.pop(namespace) is None else 1

    def totals(self) -> dict[str, tuple[int, int]]:
        """``{namespace: (audited, wrong)}`` in all: what ``reset`` leaves (see the contract)."""
        return {namespace: (t.audited, t.wrong) for namespace, t in self._totals.items()}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        report = {}
        for namespace, found in self._namespaces.items():
            estimate, low, high = found.serves_at().interval()
            report[namespace] = {
                "audited": found.audited,
                "wrong": found.wrong,
                "estimate": round(estimate, 6),
                "low": round(low, 6),
                "high": round(high, 6),
                "state": found.state,
            }
        return report


# What differs between two answers that say the same: their ids, times and counts.
_VOLATILE = frozenset(
    {"id", "created", "created_at", "completed_at", "usage", "system_fingerprint", "service_tier"}
)


def answer_text(body: Any) -> str:
    """What an answer body says (chat, completion, Responses, Messages), for comparing two
    answers: its text, and its tool calls as ``name arguments`` (the arguments as canonical
    JSON, without their ids); the body without its ids, times and usage when it is none of
    those. (A tool call was compared as the whole body, ids and times included: every audit
    of one was "wrong", and the error budget then stopped the namespace serving.)"""
    if isinstance(body, dict):
        said: list[str] = []
        choices = body.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            first = choices[0]
            message = first.get("message")
            if isinstance(message, dict):
                if isinstance(message.get("content"), str):
                    said.append(message["content"])
                for call in message.get("tool_calls") or ():
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict):
                        said.append(_call(function.get("name"), function.get("arguments")))
            elif isinstance(first.get("text"), str):
                said.append(first["text"])
        parts = body.get("output") or body.get("content")
        if isinstance(parts, list):
            for part in parts:
                if not isinstance(part, dict):
                    continue
                if isinstance(part.get("text"), str):
                    said.append(part["text"])
                if part.get("type") in ("function_call", "tool_use"):
                    said.append(_call(part.get("name"), part.get("arguments", part.get("input"))))
                for inner in part.get("content") or ():
                    if isinstance(inner, dict) and isinstance(inner.get("text"), str):
                        said.append(inner["text"])
        if said:
            return "\n".join(said)
        return _canonical_json({k: v for k, v in body.items() if k not in _VOLATILE})
    return str(body)


def _call(name: Any, arguments: Any) -> str:
    """A tool call as ``name arguments``: arguments sent as a JSON string read, so that their
    spacing and key order do not tell two calls apart."""
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return f"{name} {arguments}"
    return f"{name} {_canonical_json(arguments)}"


def _canonical_json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return str(value)
