"""The judge: an LLM asked whether two requests have the same answer (``semantic.judge``).

The verifier is a small cross-encoder: cheap enough for every lookup, unsure on the pairs that
are close but not retypings. For those, a platform team may buy precision with a model call.

Contract:
- ``Judge(ask, model=, timeout=, max_tokens=, cache_entries=)``: ``await same_answer(a, b)`` and
  ``await answers_agree(a, b)`` send ``ask`` an OpenAI chat-completions body (the judge's
  ``model``, temperature 0, ``max_tokens``) whose one user message holds both texts verbatim (a
  conversation's earlier turns too: :class:`~carpool.semantic.guard.Side`). ``ask`` returns the
  judge's reply text. The verdict is yes only when the reply's first word is "yes" (any case,
  punctuation ignored); any other reply, an error or no reply within ``timeout`` is no, so a
  failing judge never serves. Verdicts are remembered per pair, either order (an LRU of
  ``cache_entries``); ``calls`` counts the questions asked of the model (not those answered from
  memory: ``remembered``), ``failures`` those that errored or timed out. Judge calls are never
  upstream calls saved.
- ``JudgedGuard(inner, judge, band, overrules=(), verifier_band=(0, 1))`` is a
  :class:`~carpool.semantic.guard.Guard`:
  the inner guard judges every candidate first; a candidate an exact rule refused stays refused,
  unless its reason is in ``overrules`` (``semantic.judge.overrules``); one whose cosine
  similarity lies within ``band`` (inclusive) and that only the verifier judged (or an
  overruled rule refused) is served when the judge says yes, else refused with
  :attr:`Reason.JUDGE`; outside the band the inner verdict stands, and so does a verifier's
  verdict whose score lies outside ``verifier_band`` (the verifier sure enough). Candidates in
  the band are asked about concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import orjson

from ..lru import LRU
from ..upstream.base import UpstreamRequest, UpstreamResponse
from .audit import answer_text
from .guard import Guard, Side
from .verdict import Reason, Verdict

__all__ = ["JudgedGuard", "Judge", "asking", "is_yes"]

log = logging.getLogger("carpool.semantic")

Ask = Callable[[dict[str, Any]], Awaitable[str]]

SAME_ANSWER = (
    "You decide whether a cached answer may be reused. Would one correct answer serve both "
    "requests below exactly as well (same facts, same numbers, same entities, same intent)? "
    "Reply with one word: yes or no.\n\nRequest A:\n{a}\n\nRequest B:\n{b}"
)
ANSWERS_AGREE = (
    "Two answers were given to the same request. Do they agree (the same facts, numbers and "
    "conclusion, whatever the wording)? Reply with one word: yes or no.\n\n"
    "Answer A:\n{a}\n\nAnswer B:\n{b}"
)

_FIRST_WORD = re.compile(r"[^\w]*(\w+)")

#: The verifier's reasons: the only refusals the judge may overrule (a rule's never).
_MODEL_REASONS = (Reason.MEANING, Reason.CONTEXT)


def is_yes(reply: str) -> bool:
    """Whether the judge's reply says yes: its first word, any case, punctuation ignored."""
    first = _FIRST_WORD.match(reply)
    return first is not None and first.group(1).casefold() == "yes"


def asking(
    send: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]], api_key: str | None = None
) -> Ask:
    """An ``ask`` over an OpenAI-compatible ``/chat/completions`` (``send``: the gateway's
    replicas, or the judge's own server): the reply's text; a non-2xx status raises."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def ask(body: dict[str, Any]) -> str:
        response = await send(UpstreamRequest("/chat/completions", body, headers))
        try:
            if not 200 <= response.status < 300:
                raise RuntimeError(f"the judge answered {response.status}")
            return answer_text(orjson.loads(response.body))
        finally:
            await response.aclose()

    return ask


def _render(side: Side) -> str:
    if not side.context:
        return side.text
    return f"(earlier in the conversation)\n{side.context}\n(last message)\n{side.text}"


class Judge:
    """Yes/no questions to an LLM, remembered per pair (the contract is the module's)."""

    def __init__(
        self,
        ask: Ask,
        *,
        model: str,
        timeout: float = 2.0,
        max_tokens: int = 4,
        cache_entries: int = 10_000,
        closing: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._ask = ask
        self._closing = closing  # (the judge's own server, when it has one)
        self.model = model
        self.timeout = timeout
        self.max_tokens = max_tokens
        self._verdicts: LRU[tuple[str, str, str], bool] = LRU(max_entries=cache_entries)
        self.calls = 0
        self.remembered = 0
        self.failures = 0

    async def same_answer(self, a: Side, b: Side) -> bool:
        return await self._verdict(SAME_ANSWER, _render(a), _render(b)) is True  # (None: a miss)

    async def answers_agree(self, a: str, b: str) -> bool | None:
        """Whether two answers agree; None when the judge gave no verdict (an error, a timeout):
        an audit then counts nothing."""
        return await self._verdict(ANSWERS_AGREE, a, b)

    async def _verdict(self, question: str, a: str, b: str) -> bool | None:
        first, second = sorted((a, b))  # (either order: one verdict)
        key = (question, first, second)
        known = self._verdicts.get(key)
        if known is not None:
            self.remembered += 1
            return known
        self.calls += 1
        body = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": question.format(a=a, b=b)}],
        }
        try:
            async with asyncio.timeout(self.timeout):
                reply = await self._ask(body)
        except Exception as error:  # noqa: BLE001 - any failure of the judge is a "no"
            self.failures += 1
            log.debug("the judge failed (%s): no verdict", type(error).__name__)
            return None  # (not remembered: the next lookup asks again)
        verdict = is_yes(reply)
        self._verdicts.put(key, verdict)
        return verdict

    async def aclose(self) -> None:
        if self._closing is not None:
            await self._closing()

    def snapshot(self) -> dict[str, int]:
        return {"calls": self.calls, "remembered": self.remembered, "failures": self.failures}


class JudgedGuard:
    """The inner guard, with the judge deciding the candidates in the uncertain band."""

    def __init__(
        self,
        inner: Guard,
        judge: Judge,
        band: tuple[float, float],
        overrules: Iterable[Reason | str] = (),
        verifier_band: tuple[float, float] = (0.0, 1.0),
    ) -> None:
        self.inner = inner
        self.llm = judge
        self.low, self.high = band
        self.unsure = verifier_band
        self.decided = frozenset({*_MODEL_REASONS, *(Reason(r) for r in overrules)})

    async def judge(
        self, new: Side, candidates: Sequence[Side], similarities: Sequence[float] | None = None
    ) -> list[Verdict]:
        verdicts = await self.inner.judge(new, candidates, similarities)
        if similarities is None:
            return verdicts
        asked = [
            i
            for i, (verdict, similarity) in enumerate(zip(verdicts, similarities, strict=True))
            if self.low <= similarity <= self.high
            and (verdict.ok or verdict.reason in self.decided)
            and self._unsure(verdict)
        ]
        answers = await asyncio.gather(*(self.llm.same_answer(new, candidates[i]) for i in asked))
        for i, yes in zip(asked, answers, strict=True):
            score = verdicts[i].score
            verdicts[i] = (
                Verdict(True, None, score) if yes else Verdict.refused(Reason.JUDGE, score)
            )
        return verdicts

    def _unsure(self, verdict: Verdict) -> bool:
        """Whether the verdict is one to ask the judge about: a rule's the judge overrules, or
        the verifier's with a score within ``verifier_band`` (a retyping scores 1.0)."""
        if verdict.reason is not None and verdict.reason not in _MODEL_REASONS:
            return True  # (an overruled rule: the verifier was not asked)
        score = verdict.score
        return score is None or self.unsure[0] <= score <= self.unsure[1]
