"""Audits of served semantic hits, the wrong-hit estimate, and the error budget of each scope.

A semantic cache that serves on similarity cannot say how often it is wrong. Here a sampled
fraction of the hits it serves (``semantic.audit_rate``) is also sent upstream, in the
background, after the client got its answer; the fresh answer is compared with the one served
(the judge, when there is one: "do these answers agree?"; else the guard over the two answers).
Operators' reports of wrong hits (``POST /admin/semantic/feedback``) count the same way.

Contract:
- A :class:`Budget` is whose audits count together: the semantic scope's tenant
  (``Fingerprint.tenant``: ``*``, :data:`SHARED`, for a tenant accepted in a namespace of
  ``tenant.shared_namespaces``; else the requester's own) and its namespace. So one tenant's
  hits, right or wrong, never move another tenant's budget, and a shared namespace's is one.
- ``Audits(rate, window, budget, sample=..., label_key=None)``: ``sampled()`` draws
  whether a hit is audited (``sample() < rate``; by default from the OS's random generator:
  the process's is one a client can learn, and which hits are audited is not its to know). ``record(budget, wrong, near)`` counts one
  audit (or report) of a match at the cache's usual bar; ``near``: the match is also a near
  repeat (similarity >= ``BACKED_OFF_SIMILARITY``), one a backed-off budget still serves. Per
  budget: ``audited`` and ``wrong`` in all, and two windows of the latest ``window`` audits:
  every audit (the usual bar's wrong-hit rate) and the near repeats' only (the backed-off
  bar's), each with its 95% Wilson interval (:func:`wilson`).
- Error budget (``budget``, None: none): each :class:`Budget` is ``serving`` (the cache's usual
  bar), ``backed-off`` (only near repeats are served) or ``mark`` (nothing served; the match is
  only named). Audits go on in every state, of the match served or the one that would have
  been, so each state is judged on the bar it serves at and the bar above it: after each audit,
  ``serving`` backs off when the usual bar's interval lies over the budget (its lower bound
  above it); ``backed-off`` moves to ``mark`` when the near repeats' lies over it, and back to
  ``serving`` when the usual bar's lies under it (its upper bound below); ``mark`` comes back to
  ``backed-off`` when the near repeats' lies under it. A window moves nothing before it holds
  ``MIN_AUDITS`` audits (docs/semantic.md: checked after every audit, a 95% bound is crossed
  by chance far more often than one time in 40, most easily on the first few: one wrong audit
  of one has a lower bound of 0.21). Each move starts fresh windows and is logged once. (A
  budget is not marked for the usual bar's wrong hits while its near repeats are right: those
  it keeps serving.) :func:`smallest_window`: the shortest window in which a budget can come
  back (the config refuses a shorter one).
- ``state(budget)``; ``snapshot(tenants=False)``: ``{namespace: {"audited", "wrong",
  "estimate", "low", "high", "state", "budgets"}}`` (``/stats`` ``semantic_audit``, which
  keeps those ``/metrics`` labels: ``admin.audited_namespaces``), each
  namespace's budgets together: ``audited`` and ``wrong`` summed, the estimate over the windows
  of the bar each serves at (``serving``: the usual bar's; ``backed-off``, ``mark``: the near
  repeats'), ``state`` the furthest from serving of theirs and ``budgets`` how many are in each
  state. ``tenants=True`` (``GET /admin/semantic/audit``, the admin token's) adds ``tenants``:
  each budget's own figures by its tenant's label (:meth:`Audits.label`: ``*`` for the shared
  one, else a digest of the tenant id keyed with ``label_key``, which the gateway derives from
  its admin token: the same on every worker and instance that shares the token, never the id
  itself, which whoever holds a credential can compute). ``reset(namespace=None, tenant=None)``:
  the budgets of a namespace, of a tenant's label, of both, or all, back to ``serving`` with no
  audits; how many.
- At most ``MAX_BUDGETS`` serving budgets are tracked, least recently audited out (one comes
  back serving, as it was, with fresh windows), and apart from them at most ``MAX_HELD`` budgets
  not serving: clients name namespaces (and tenants), so auditing many new ones must not push a
  backed-off budget out and back to serving. Past ``MAX_HELD`` the least recently audited goes
  all the same, logged.
- ``totals()``: ``{namespace: (audited, wrong)}`` since the namespace was first tracked, for the
  Prometheus counters (``carpool_semantic_audits_total``), which must never go down: kept apart
  from what ``reset`` forgets, and least recently audited out at ``MAX_BUDGETS`` as well (a
  namespace tracked again after that starts a new series, as after a restart).
- The budgets are this process's: with ``--workers N`` each worker has its own, and with
  ``redis`` each instance (the admin endpoints pass a reset and a report on to the other
  workers, ``admin_http``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import secrets
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import orjson

from ..lru import LRU

__all__ = [
    "BACKED_OFF",
    "BACKED_OFF_SIMILARITY",
    "MARK",
    "MAX_WINDOW",
    "MIN_AUDITS",
    "SERVING",
    "SHARED",
    "Audits",
    "Budget",
    "answer_text",
    "label_key",
    "smallest_window",
    "wilson",
]

log = logging.getLogger("carpool.semantic")

State = Literal["serving", "backed-off", "mark"]
SERVING: State = "serving"
BACKED_OFF: State = "backed-off"
MARK: State = "mark"
_STATES: tuple[State, ...] = (SERVING, BACKED_OFF, MARK)  # (the further from serving, the later)

#: What a backed-off budget still serves: near repeats (case, punctuation, a greeting).
BACKED_OFF_SIMILARITY = 0.97
#: Audits a window holds before it may move a budget's state (the contract; docs/semantic.md).
MIN_AUDITS = 30
# The most audits a window may hold (``semantic.audit_window``'s bound): a deque of that many
# per budget is 8 MB; it shows a budget down to ~3.8e-6 met. A smaller budget needs a window
# no config may give (``smallest_window`` says MAX_WINDOW + 1 for it, without counting on).
MAX_WINDOW = 1_000_000
MAX_BUDGETS = 10_000  # serving budgets tracked (and namespaces' totals)
MAX_HELD = 10_000  # budgets not serving, tracked apart (the contract)
#: The tenant of a budget shared by the tenants of a shared namespace (``Fingerprint.tenant``).
SHARED = "*"
_Z = 1.959964  # the normal quantile of a two-sided 95% interval
_UNSEEN = random.SystemRandom()  # (``Audits``' draws: the contract)


class Budget(NamedTuple):
    """Whose audits count together: the semantic scope's tenant and namespace (the contract)."""

    tenant: str
    namespace: str


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


def smallest_window(budget: float) -> int:
    """The fewest audits a window must hold for a budget of ``budget`` to be shown met: with
    none of them wrong, the interval's upper bound (z^2 / (n + z^2)) is under it only from
    there on (at least ``MIN_AUDITS``). A shorter window never lets a backed-off budget come
    back."""
    if budget <= 0:
        raise ValueError("no window shows a wrong-hit rate under 0")
    estimate = _Z * _Z * (1 - budget) / budget
    if estimate >= MAX_WINDOW:
        # (Counting on from there took minutes, for ever past 2**53 where n + 1 rounds to n,
        # or overflowed a float for a budget of 1e-300: more than any window may hold.)
        return MAX_WINDOW + 1
    n = max(MIN_AUDITS, math.floor(estimate) + 1)
    while wilson(0, n)[2] >= budget:  # (the bound as ``record`` computes it, rounding and all)
        n += 1
    return n


def label_key(admin_token: str | None) -> bytes | None:
    """The key of the tenants' labels (``Audits.label``), derived from the admin token: every
    worker and instance that shares it labels a tenant alike, so a reset that names a label
    reaches its budget on each. None without a token (no admin view, no reset): a random key
    of this process's, for the logs. Derived by scrypt (``LABEL_KDF``), once a gateway: a
    tenant computes its own id from its credential, so with a fast hash one log line with its
    label let it test guesses of the admin token offline, millions a second."""
    if admin_token is None:
        return None
    return hashlib.scrypt(admin_token.encode(), **LABEL_KDF)


# scrypt's parameters (RFC 7914's interactive ones: 16 MiB, ~60 ms on this machine's cores).
LABEL_KDF: dict[str, Any] = {"salt": b"carpool-budget", "n": 2**14, "r": 8, "p": 1, "dklen": 32}


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
class _Budget:
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
    """The audits of every budget (the contract is the module's)."""

    def __init__(
        self,
        rate: float,
        window: int = 500,
        budget: float | None = None,
        sample: Callable[[], float] = _UNSEEN.random,
        label_key: bytes | None = None,
    ) -> None:
        self.rate = rate
        self.window = window
        self.budget = budget
        self._sample = sample
        self._label_key = label_key or secrets.token_bytes(32)
        # Serving budgets, and apart those not serving: many budgets audited anew push out
        # only serving ones (the contract).
        self._serving: LRU[Budget, _Budget] = LRU(max_entries=MAX_BUDGETS)
        self._held: LRU[Budget, _Budget] = LRU(max_entries=MAX_HELD, on_evict=self._forgotten)
        self._totals: LRU[str, _Totals] = LRU(max_entries=MAX_BUDGETS)
        self.calls = 0  # upstream calls the audits made
        self.failed = 0  # audits that got no fresh answer to compare with

    def sampled(self) -> bool:
        return self.rate > 0 and self._sample() < self.rate

    def label(self, tenant: str) -> str:
        """What the admin view, the reset and the logs call ``tenant`` (the contract)."""
        if tenant == SHARED:
            return SHARED
        return hashlib.blake2b(tenant.encode(), key=self._label_key, digest_size=8).hexdigest()

    def state(self, budget: Budget) -> State:
        found = self._held.peek(budget) or self._serving.peek(budget)
        return found.state if found is not None else SERVING

    def record(self, budget: Budget, wrong: bool, near: bool = False) -> None:
        total = self._totals.get(budget.namespace)
        if total is None:
            total = _Totals()
            self._totals.put(budget.namespace, total)
        total.audited += 1
        total.wrong += wrong
        found = self._held.get(budget) or self._serving.get(budget)
        if found is None:
            found = _Budget(_Window(deque(maxlen=self.window)), _Window(deque(maxlen=self.window)))
            self._serving.put(budget, found)
        found.audited += 1
        found.wrong += wrong
        found.usual.add(wrong)
        if near:
            found.near.add(wrong)
        if self.budget is None:
            return
        # A window too short to say anything moves nothing: its interval is taken as (0, 1),
        # under no budget and over none.
        _, usual_low, usual_high = self._judged(found.usual)
        _, near_low, near_high = self._judged(found.near)
        if found.state == SERVING and usual_low > self.budget:
            self._move(budget, found, BACKED_OFF, usual_low)
        elif found.state == BACKED_OFF and near_low > self.budget:
            self._move(budget, found, MARK, near_low)
        elif found.state == BACKED_OFF and usual_high < self.budget:
            self._move(budget, found, SERVING, usual_high)
        elif found.state == MARK and near_high < self.budget:
            self._move(budget, found, BACKED_OFF, near_high)

    @staticmethod
    def _judged(window: _Window) -> tuple[float, float, float]:
        """The window's interval, or nothing known (0, 0, 1) before ``MIN_AUDITS``."""
        return window.interval() if len(window.audits) >= MIN_AUDITS else (0.0, 0.0, 1.0)

    def _move(self, budget: Budget, found: _Budget, to: State, bound: float) -> None:
        log.warning(
            "semantic error budget of %s: %s -> %s (wrong-hit rate bound %.3f, budget %.3f)",
            self._named(budget),
            found.state,
            to,
            bound,
            self.budget,
        )
        if (found.state == SERVING) != (to == SERVING):  # (into the other map)
            (self._serving if found.state == SERVING else self._held).pop(budget)
            (self._serving if to == SERVING else self._held).put(budget, found)
        found.state = to
        found.usual.clear()
        found.near.clear()

    def _forgotten(self, budget: Budget, found: _Budget) -> None:
        log.warning(
            "semantic error budget of %s forgotten while %s: over %d budgets are not serving "
            "(it serves again)",
            self._named(budget),
            found.state,
            MAX_HELD,
        )

    def _named(self, budget: Budget) -> str:
        """A budget as the logs name it: its namespace, and its tenant's label (the contract)."""
        return f"namespace {budget.namespace!r}, tenant {self.label(budget.tenant)}"

    def reset(self, namespace: str | None = None, tenant: str | None = None) -> int:
        """Forget the audits of the budgets of ``namespace`` and of the tenant labelled
        ``tenant`` (None: of any); how many budgets were reset."""

        def doomed(budget: Budget, _: _Budget) -> bool:
            return (namespace is None or budget.namespace == namespace) and (
                tenant is None or self.label(budget.tenant) == tenant
            )

        return len(self._serving.remove_if(doomed)) + len(self._held.remove_if(doomed))

    def totals(self) -> dict[str, tuple[int, int]]:
        """``{namespace: (audited, wrong)}`` in all: what ``reset`` leaves (see the contract)."""
        return {namespace: (t.audited, t.wrong) for namespace, t in self._totals.items()}

    def snapshot(self, tenants: bool = False) -> dict[str, dict[str, Any]]:
        """Each namespace's budgets together; ``tenants``: each one's too (the contract)."""
        by_namespace: dict[str, list[tuple[Budget, _Budget]]] = {}
        for budget, found in (*self._held.items(), *self._serving.items()):
            by_namespace.setdefault(budget.namespace, []).append((budget, found))
        report: dict[str, dict[str, Any]] = {}
        for namespace, budgets in by_namespace.items():
            windows = [each.serves_at() for _, each in budgets]
            states = Counter(each.state for _, each in budgets)
            report[namespace] = {
                "audited": sum(each.audited for _, each in budgets),
                "wrong": sum(each.wrong for _, each in budgets),
                **_interval(sum(w.wrong for w in windows), sum(len(w.audits) for w in windows)),
                "state": max(states, key=_STATES.index),
                "budgets": {state: states[state] for state in _STATES if state in states},
            }
            if tenants:
                report[namespace]["tenants"] = {
                    self.label(budget.tenant): {
                        "audited": each.audited,
                        "wrong": each.wrong,
                        **_interval(each.serves_at().wrong, len(each.serves_at().audits)),
                        "state": each.state,
                    }
                    for budget, each in budgets
                }
        return report


def _interval(wrong: int, n: int) -> dict[str, float]:
    estimate, low, high = wilson(wrong, n)
    return {"estimate": round(estimate, 6), "low": round(low, 6), "high": round(high, 6)}


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
