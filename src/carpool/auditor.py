"""The audits of semantic hits, run: a fresh upstream answer compared with the one served.

Contract (the estimate and the budget are ``semantic/audit.py``'s):
- ``Auditor(layers).maybe(request, budget, match, view, near, flight=None)``: when the draw
  says so (``Audits.sampled``), a background task (never the client's: it already has its
  answer) gets a fresh answer to the request and compares its text with the match's (the
  semantic cache's ``Candidate``, found for ``view``): by the judge when there is one
  (``Judge.answers_agree``), else by the semantic cache's guard over the two texts (its exact
  rules, and its verifier at the calibrated bar even when ``semantic.verifier_threshold``
  loosens the cache's; two answers longer than it reads whole are not judged: no verdict). The
  fresh answer: for a match served, the request sent upstream once, not streamed (an upstream
  call, ``/stats`` ``upstream_calls``, counted in ``Audits.calls`` too); for a match not
  served (``semantic.mode: mark``, a budget held back), the request went upstream all the
  same: the answer of its ``flight`` (``Broadcast``), no call of its own. A disagreement is a
  wrong hit in ``budget`` (the scope's tenant and namespace; ``near``: of a near repeat too,
  ``Audits.record``), and the pair is refused from then on (``SemanticCache.refuse``: that
  entry is no longer served for that prompt, here). The fresh answer is never stored by the
  audit, never shared, never written over the entry. An upstream error, a timeout, a non-2xx
  answer, a flight that failed or a judge without a verdict counts nothing (``Audits.failed``).
  Only deterministic requests are audited (two samples may differ), and at most
  ``MAX_RUNNING`` audits run at once, of them at most ``MAX_RUNNING_PER_BUDGET`` of one
  budget and ``MAX_RUNNING_PER_TENANT`` of one tenant, whatever namespaces it names (a draw
  beyond any is skipped: one budget's slow audits leave room for the others' draws, one
  tenant's for other tenants'). Returns whether an audit
  began: a match served whose audit asks the upstream is no answer the engine did not compute
  (its tokens are not in ``tokens_saved``).
- ``feedback(public_id)``: a client's or operator's report that the semantic hit it got
  (``x-carpool-entry``) was wrong: the entry is dropped and a wrong hit counts in its budget
  (its tenant's, ``SemanticEntry.tenant``, in its namespace; at every bar: which match was
  served is not known). Returns that budget, or None for an entry this instance does not hold.
- ``settle`` waits for the audits running now; ``aclose`` cancels them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, TypeVar

import orjson

from .background import Background
from .exchange import send
from .semantic.audit import Budget, answer_text
from .semantic.guard import Reason, RulesThenVerifier, Side
from .upstream.base import UpstreamRequest, unstreamed

if TYPE_CHECKING:
    from .broadcast import Broadcast
    from .fingerprint import SemanticView
    from .layers import Layers
    from .request import Request
    from .semantic.cache import Candidate

log = logging.getLogger("carpool.semantic")

_K = TypeVar("_K")

MAX_RUNNING = 64  # audits in flight at once: each is an upstream call
# Of them, one budget's at most: a tenant whose engine answers its hits slowly would otherwise
# hold every place, and the hits of every other budget drawn meanwhile would be skipped (their
# budgets never audited, never backing off). A quarter: a budget alone still gets most of them.
MAX_RUNNING_PER_BUDGET = MAX_RUNNING // 4
# And of one tenant, whatever its namespaces: a budget's namespace is the client's to name
# (x-carpool-namespace), so a tenant spreading its slow hits over four held every place again.
# A half: its own namespaces still share more than one budget's share.
MAX_RUNNING_PER_TENANT = MAX_RUNNING // 2


class Auditor:
    """Audits and feedback on the layers (the contract is the module's)."""

    def __init__(self, layers: Layers) -> None:
        self.layers = layers
        self._running = Background("audit", log)  # (an audit's own failure is counted, not raised)
        self._per_budget: dict[Budget, int] = {}  # the audits running, by budget (none: absent)
        self._per_tenant: dict[str, int] = {}  # and by tenant, its namespaces together
        self._strict: RulesThenVerifier | None = None

    def maybe(
        self,
        request: Request,
        budget: Budget,
        match: Candidate,
        view: SemanticView,
        near: bool,
        flight: Broadcast | None = None,
    ) -> bool:
        audits = self.layers.audits
        if (
            audits is None
            or len(self._running) >= MAX_RUNNING
            or self._per_budget.get(budget, 0) >= MAX_RUNNING_PER_BUDGET
            or self._per_tenant.get(budget.tenant, 0) >= MAX_RUNNING_PER_TENANT
            or not audits.sampled()
        ):
            return False
        task = self._running.spawn(self._audit(request, budget, match, view, near, flight))
        _count(self._per_budget, budget, 1)
        _count(self._per_tenant, budget.tenant, 1)
        task.add_done_callback(lambda _: self._ended(budget))
        return True

    def _ended(self, budget: Budget) -> None:
        _count(self._per_budget, budget, -1)
        _count(self._per_tenant, budget.tenant, -1)

    async def _audit(
        self,
        request: Request,
        budget: Budget,
        match: Candidate,
        view: SemanticView,
        near: bool,
        flight: Broadcast | None,
    ) -> None:
        audits = self.layers.audits
        assert audits is not None
        assert match.answer is not None  # (a match has its answer)
        try:
            fresh = await (self._fresh(request) if flight is None else _flown(flight))
            served = _text(match.answer.body)
            agree = None if fresh is None else await self._agree(served, fresh, view.scope)
        except Exception as error:  # noqa: BLE001 - an audit that broke judges nothing
            audits.failed += 1
            log.warning("an audit failed (%s)", type(error).__name__)
            return
        if agree is None:  # no fresh answer, or the judge gave no verdict: nothing learned
            audits.failed += 1
            return
        audits.record(budget, not agree, near)
        semantic = self.layers.semantic
        if not agree and semantic is not None:
            # Served again, this pair would be wrong again (audit after audit saying so).
            semantic.refuse(match.entry, view)

    async def _fresh(self, request: Request) -> str | None:
        """The upstream's answer to ``request`` now, whole, as text; None when it has none."""
        audits = self.layers.audits
        assert audits is not None
        body = unstreamed(request.body)
        audits.calls += 1
        try:
            response = await send(
                self.layers,
                UpstreamRequest(
                    request.upstream_path,
                    body,
                    request.headers,
                    False,
                    request.query,
                    serves=request.client_ids,
                ),
                "",
            )
        except Exception as error:  # noqa: BLE001 - an audit that failed judges nothing
            log.debug("an audit's upstream call failed (%s)", type(error).__name__)
            return None
        try:
            if not 200 <= response.status < 300:
                return None
            return _text(response.body)
        finally:
            await response.aclose()

    async def _agree(self, served: str, fresh: str, scope: str) -> bool | None:
        judge, semantic = self.layers.judge, self.layers.semantic
        if judge is not None:
            return await judge.answers_agree(served, fresh, scope)
        assert semantic is not None  # (audits run only for semantic hits)
        guard = semantic.guard
        if isinstance(guard, RulesThenVerifier) and guard.threshold != guard.verifier.threshold:
            # At the verifier's calibrated bar: an audit must not be as loose as the cache may
            # be set (it would then agree with every hit it served).
            guard = self._strict = self._strict or RulesThenVerifier(guard.verifier, guard.rules)
        (verdict,) = await guard.judge(Side(served), [Side(fresh)])
        if verdict.reason is Reason.LENGTH:
            return None  # not read whole: no verdict (a "no" would count every long answer)
        return verdict.ok

    def feedback(self, public_id: str) -> Budget | None:
        semantic, audits = self.layers.semantic, self.layers.audits
        if semantic is None or audits is None:
            return None
        entry = semantic.forget(public_id)
        if entry is None:
            return None
        budget = Budget(entry.tenant, entry.namespace)
        audits.record(budget, True, near=True)  # (a report counts against every bar)
        return budget

    async def settle(self) -> None:
        """Wait for the audits running now (for whoever needs their verdicts: benchmarks)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def aclose(self) -> None:
        await self._running.drain(0)  # (cancelled: the layers they ask are closing)


async def _flown(flight: Broadcast) -> str | None:
    """The answer of the request's own flight, once it has one, as text; None when it failed
    (only a 2xx answer ends a broadcast with ``finish``)."""
    await flight.wait_done()
    return None if flight.answer is None else _text(flight.answer.body)


def _text(body: bytes) -> str:
    try:
        return answer_text(orjson.loads(body))
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")


def _count(running: dict[_K, int], key: _K, change: int) -> None:
    """``running[key]`` changed by ``change``; a key none runs for is dropped (budgets and
    tenants are many: only those with an audit running are held)."""
    left = running.get(key, 0) + change
    if left:
        running[key] = left
    else:
        del running[key]
