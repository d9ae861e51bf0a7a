"""The upstream replicas of one deployment: health, back-off, probing, failover and load.

``ReplicaSet.send(request, text)`` picks a replica with the routing policy among the eligible ones,
sends, and returns ``(response, replica, decision)`` (``chooses``: whether there is a choice at
all, and so whether ``text`` matters):

- Eligible: healthy replicas, plus downed ones whose back-off is over and that are not already
  being probed. One such request is the *probe*: success makes the replica healthy again, failure
  downs it for twice as long (``backoff_s * 2**(failures-1)``, at most ``backoff_max_s``;
  ``failures`` counts on for as long as it stays down, the exponent stops at 64). Only
  news counts: the failure of a call sent before the replica's last change of state (downed or
  healed) is counted in its ``errors``, not its ``failures``, and changes nothing else: the
  other calls in flight when the first failure of an incident came back, or the other calls
  sent to it while nothing was eligible, fail with the same news (they pushed the back-off to
  its maximum while the log said ``backoff_s``). When
  nothing is eligible, the replica whose back-off ends first is tried anyway (``Decision.PROBE``)
  rather than failing the request without trying. A single eligible replica is
  ``Decision.ONLY_HEALTHY``.
- ``holder`` (``send``, ``passthrough``): the name of the replica holding state the request
  continues (a stored response, ``routing.state``): chosen before the policy is asked,
  whatever its state (``Decision.STATE_HOLDER``; in back-off, ``PROBE``: asked anyway, a probe
  in flight or not, its failure news as any probe's); unknown, the policy chooses. Only it can
  answer: another replica's answer is a false, final 404 ("not found": the SDKs retry a 5xx,
  never a 404). So a request sent to it is never failed over (``send``): its failure is the
  request's, the holder's own 5xx relayed as it is, a refused connection's 502, a timeout's
  504, and the client's retry goes to it again. Asked in back-off rather than answered a 503
  with ``Retry-After`` until its back-off ends: a transient failure (one overloaded answer)
  then costs the client one retry, not the back-off (``backoff_s`` and up), and no request is
  failed untried (as when nothing is eligible, below); a dead holder's follow-ups each fail
  on it (a refused connection at once, a hung one after ``limits.upstream_timeout``): no
  other replica could answer them but with a 404.
- Failover: ``UpstreamUnreachable`` / ``UpstreamTimeout`` (one that cannot have run: nothing
  sent, or the request not read whole), or a 5xx answer before any byte was
  streamed (a complete 5xx body, or a stream request answered with a 5xx status), downs the replica
  and retries ONCE on another one (``Decision.FAILOVER``), but for a request sent to its
  state's holder (above). If no other replica exists the error is raised / the 5xx returned as
  it is. A call that waited past ``limits.upstream_queue_timeout`` for one of the replica's
  connections, all held by other calls (``UpstreamBusy``: nothing sent), is tried once on
  another replica too (but for its state's holder), the replica left as it is: busy, not
  failing (counted in ``overloaded`` as a ``GatewayOverloaded``). A stream that breaks part-way is not retried (bytes reached the client) and does not
  down the replica; nor does one that stalls (``UpstreamStreamStalled``: no event for
  ``limits.upstream_timeout``), a long generation being slow, but for one with nothing after
  its head on a replica silent to every call since that head: taken for hung, as one silent
  before its head is (below: a stuck engine whose HTTP layer still answers heads at once,
  vLLM's), it downs the replica, and is not retried either (the engine took it). A stuck
  replica's probe stream heals it at its head and its stall downs it again: one stream per
  back-off fails there. Nor is a whole answer cut after its head came
  (``UpstreamAnswerCut``: the engine took the call, which would run twice; it is counted, at its
  502 or 504, by ``observe``). A ``FunctionUpstream``'s function that raised
  (``FunctionFailed``) is a failed call too, counted as a 502 and downing the replica, and is
  not retried (the call may have run); a cancellation or any other exception is no verdict. A
  request sent whole and not answered (``UpstreamNoAnswer``: 504 in time, 502 when its
  connection dropped before a byte of answer; never sent again by the transport, whose
  resend of the keep-alive race is for a call the server cannot have read whole, and counts
  in ``calls``: ``upstream.wire``) is not retried either when the replica answered
  other calls meanwhile, a head or a stream's payloads (it is alive and may be running it: a
  long generation would run twice, its client waiting twice the timeout); silent to every call
  since, it is taken for hung (a frozen engine's socket takes a request's bytes all the same)
  and the call fails over. Either way it downs the replica. Every 5xx downs its replica (but
  501 and 505, about the call: an engine without the endpoint, as llama.cpp's embeddings when
  off, answers it on every replica), also one the engine returns for this input only: with
  several replicas that costs a retry and a back-off, not the request. So does a redirect (but
  304), a 1xx taken as final or a status past 599: no answer, the gateway's 502 (``exchange``),
  failed over as a 5xx is. A 5xx to the gateway's own calls about a client's text
  (``send(..., own=True)``: an embedding, a judge's question) downs nothing: returned as it
  is, no verdict, not tried elsewhere (one tenant's long prompts, past llama.cpp's batch,
  downed every replica for up to 60 s while they served its chats). 4xx answers count as
  healthy (the replica answered), and so does a 401/403 to the gateway's own key
  (``UpstreamKeyRefused``, raised as it is, not failed over) when every replica is called with
  the same key: as often about the request (a model the account may not use) as about the key,
  another replica would refuse it the same, and one client's request must not take replicas
  out of rotation. Those are logged (a warning, at most one per replica per
  ``log_interval``): a key the upstream refuses is the operator's to fix. With a key of its
  own per replica (``own_keys``: ``upstream.api_keys`` that are not all the same) a 401 is
  about that replica's key (revoked, mistyped) and nothing ran: it downs the replica and the
  call fails over, as for an unreachable one (a key several replicas share is found out on
  each). A 403 stays an answer there too: it says what the key may do (a model, an endpoint),
  and a client asking for what its account may not have must not take replicas out.
- Decisions: ``decided(decision)`` once per ``send``, however it ended (answered, raised,
  cancelled), with its last attempt's decision (``/stats`` ``routing``).
- In flight: counted from the send until the answer is complete: for a complete body, when
  ``send`` returns; for a stream, until the returned response's ``aclose()`` (the caller must close
  every streaming response, as ``Gateway`` does; ``aclose`` is safe to call twice); for a
  pass-through answer, until its body has been read to its end or the answer closed
  (``PassthroughResponse.aclose``, which the server's relay calls however it ends: the client
  gone before or during the body included). Counts are released on every path: success,
  error, cancellation. Pass-through calls are load like any (the policy weighs them: with no
  prompt text, cache-aware spreads them by calls, not by cache room).
- ``passthrough`` (other ``/v1/...`` calls): the method may not be idempotent, so a call is
  tried on another replica (once, ``Decision.FAILOVER``) only when nothing was sent: the
  connection refused or not made in time (``UpstreamUnreachable``, ``UpstreamTimeout``). Once
  its bytes may have reached the replica (``UpstreamNoAnswer``: no answer in time, the
  connection dropped) it never is, nor is a call on the state its holder keeps (no other
  replica has it). A transport failure downs the replica like any other (so does a refusal of
  its own key, ``own_keys``). An answer is relayed as it is, whatever its status; one that
  ``send`` counts as the replica answering (2xx, 4xx, 304, 501, 505) heals a downed replica,
  and any other (a 5xx; a 3xx without ``Location``, the one redirect relayed) is that
  replica's failure as on the cached endpoints (downed, or its back-off grown: a probe
  answered 503 made it healthy again while it failed every call), relayed all the same: not
  tried elsewhere, the call may have been acted on. An answer cut after its head (its body
  raising ``UpstreamAnswerCut``) is logged as such, a warning naming the replica without a
  traceback (held back as its failures are, below: one line per ``log_interval``), and
  raised on (the server cuts its client's connection); it leaves the replica
  in rotation, as a stream that broke part-way does (its head was counted by ``observe``,
  once, at its status).
- Operators see every failure: a warning on the ``carpool.routing`` logger naming the replica
  (``name``: never its credentials) and what happened, at most one per replica per
  ``log_interval`` seconds, recoveries in between or not (a replica that fails every other
  call is one warning per interval, not one per failure); the first failure after a quiet
  ``log_interval`` is always logged. A downed replica that answers again is logged at info
  when the failure that downed it was logged, and held back with it otherwise. Each line
  counts the failures and recoveries held back since the last line that counted them.
- ``health()`` (``/healthz``) and ``ready()`` (``/readyz``): per replica by its public ``label``;
  ready while some replica answered in the last ``READY_TRUST_S``, else once one answers the
  readiness probe: ``GET /models`` asked of the replicas concurrently, within ``timeout`` each
  (``routing.ready_timeout_s``), the first answer ending it (the other calls cancelled: no
  verdict on them). With a replica healthy, the eligible ones are asked; with none, every one,
  in back-off or not (a balancer sends an unready gateway no traffic: no request would find
  out that one is back before its back-off ends). A failed readiness probe downs a healthy
  replica as any failure does; of one already down it is no news (its ``errors``), never
  growing its back-off. A replica
  that answers the readiness probe at all, with a 401/403 to the gateway's key too (or a
  status pass-through does not relay: a redirect, a 101, a 999; or a head whose body is then
  cut or stalls), is reachable; but for a 401 to its own key (``own_keys``): none of its
  calls would be answered, it is downed (a 403 to ``/models``, a restricted key's, is
  reachable). Any other failure of the probe (no answer, or an ``UpstreamError`` none of these
  names) is that replica's failure: ``ready`` raises none of them.
  One readiness probe at a time per set (``/readyz`` is open to anyone: its calls must not be
  as many calls of the replicas with the gateway's key): concurrent callers await the one
  under way, shielded (a caller that leaves does not cancel it for the others); each
  replica's call within the first caller's ``timeout``. Each probe sent is an attempt like
  any (``calls``; ``observe``, with no decision: the engines were asked it, and bill it; one
  cancelled, another replica having answered first, in ``calls`` only: no status), so
  ``upstream_calls`` counts it; an in-process upstream without ``/models``
  (``PathNotAllowed``) was sent nothing and counts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from carpool.config.urls import urls_without_credentials
from carpool.errors import (
    GatewayOverloaded,
    PathNotAllowed,
    UpstreamAnswerCut,
    UpstreamBadStatus,
    UpstreamBusy,
    UpstreamError,
    UpstreamKeyRefused,
    UpstreamNoAnswer,
    UpstreamRedirected,
    UpstreamStreamStalled,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from carpool.logs import Throttle
from carpool.routing import Decision, RoutingPolicy
from carpool.upstream.base import (
    PassthroughResponse,
    RequestBody,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
)
from carpool.upstream.function import FunctionFailed

log = logging.getLogger("carpool.routing")

_RETRYABLE = (UpstreamUnreachable, UpstreamTimeout)


# The most times a back-off doubles (``_failed``): past the largest ``backoff_max_s`` /
# ``backoff_s`` ratio anyone sets (2**64), and far from a float's limit (2**1024).
_MAX_DOUBLINGS = 64


# Seconds ``ready`` trusts a replica's last answer before it asks it again.
READY_TRUST_S = 5.0

# Seconds a readiness probe waits for a replica's answer (``routing.ready_timeout_s``): under
# Kubernetes' default probe timeout (1 s), the gateway's own time included.
READY_TIMEOUT_S = 0.8


# 5xx answers about the call, not the replica: "not implemented" (an engine without the
# endpoint: llama.cpp's and Ollama's /v1/embeddings when embeddings are off) and "HTTP version
# not supported". Another replica of the same engine answers the same; the replica is up.
_NOT_THIS_CALL = frozenset({501, 505})


def _answered(status: int) -> bool:
    """Whether a final status is the replica answering (2xx, 4xx, 304, or a 5xx about the call
    only): a 5xx, a redirect (an engine moved behind http -> https, a path that moved), a 1xx
    taken as final or a status past 599 is no answer (the gateway's 502 for the last three):
    left in rotation, such a replica failed its share of the calls for good."""
    if status in _NOT_THIS_CALL or status == 304:  # (a conditional GET's pass-through answer)
        return True
    return 200 <= status < 300 or 400 <= status < 500


@dataclass(eq=False)
class ReplicaState:
    """One replica and what the gateway knows of it."""

    upstream: Upstream
    name: str = ""  # defaults to upstream.name (operators: /stats, metrics, logs)
    label: str = ""  # defaults to upstream.label, else name (clients: /healthz)
    in_flight: int = 0  # requests sent and not finished (streams: not yet closed)
    # Attempts sent, failed ones and failovers included (and its upstream's own, ``_calls``).
    calls: int = 0
    errors: int = 0  # attempts that failed (transport error or 5xx)
    failures: int = 0  # failures that downed it or grew its back-off (news); 0 once healthy
    # Changes of its state (downed, healed): a failed call sent before the last one is no news.
    verdicts: int = 0
    healthy: bool = True
    answered: bool = False  # it has answered since it last failed (reachable, proven)
    # Clock of its last news: an answer's head, or a stream's payloads (``ready`` trusts it a
    # while; a call it left unanswered meanwhile may be running, ``send``).
    answered_at: float = float("-inf")
    down_until: float = 0.0  # clock value when the back-off ends (meaningful when not healthy)
    probing: bool = field(default=False, repr=False)  # a probe request is in flight
    logged_at: float | None = field(default=None, repr=False)  # clock of the last warning
    # Whether the failure that downed it was warned of: then so is its recovery.
    down_logged: bool = field(default=False, repr=False)
    # Held back since the last line that counted them (at ``counted_at``): failures, and
    # recoveries of failures held back.
    unlogged: int = field(default=0, repr=False)
    unlogged_recoveries: int = field(default=0, repr=False)
    counted_at: float | None = field(default=None, repr=False)
    refusals: int = 0  # calls refused with the gateway's key (401/403: ``UpstreamKeyRefused``)
    refusal_logged_at: float | None = field(default=None, repr=False)  # (its last warning's)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = self.upstream.name
        if not self.label:
            self.label = getattr(self.upstream, "label", None) or self.name

    def eligible(self, now: float) -> bool:
        return self.healthy or (not self.probing and now >= self.down_until)


# (The decision is None for a call not routed: ``OwnCalls``.)
Observer = Callable[[ReplicaState, int, Decision | None], None]


class ReplicaSet:
    """Routes, sends, fails over, and keeps per-replica load and health."""

    def __init__(
        self,
        upstreams: Sequence[Upstream],
        policy: RoutingPolicy,
        *,
        backoff_s: float = 5.0,
        backoff_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        observe: Observer | None = None,
        decided: Callable[[Decision], None] | None = None,
        log_interval: float = 30.0,
        own_keys: bool = False,
    ) -> None:
        """``observe(replica, status, decision)`` is called once per attempt (status: the HTTP
        status answered, or the error's status, 502/504, for a transport failure), e.g. for the
        per-replica status counters of ``/stats``; ``decided(decision)`` once per ``send``,
        with its last attempt's decision, however it ended (``/stats`` ``routing``).
        ``log_interval``: seconds between two failure warnings about one replica.
        ``own_keys``: each replica is called with a key of its own (``upstream.api_keys``, not
        all the same): a refusal of it (``UpstreamKeyRefused``) is that replica's failure."""
        if not upstreams:
            raise ValueError("at least one upstream is needed")
        self.replicas = [ReplicaState(u) for u in upstreams]
        if len({r.name for r in self.replicas}) != len(self.replicas):
            raise ValueError("upstream names must be distinct")
        if len({r.label for r in self.replicas}) != len(self.replicas):
            for i, replica in enumerate(self.replicas):  # upstreams built without labels
                replica.label = f"replica-{i}"
        self.policy = policy
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.observe = observe
        self.decided = decided
        self.log_interval = log_interval
        # Calls this machine could not open a connection for (``GatewayOverloaded``): /stats'
        # ``overloaded``, never a verdict on a replica (``_overloaded``).
        self.overloaded = 0
        self._overload_log = Throttle(log_interval)
        self.own_keys = own_keys
        # The readiness probe under way, which concurrent ``ready`` calls share (module doc).
        self._readiness: asyncio.Task[bool] | None = None

    def __getitem__(self, name: str) -> ReplicaState:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(name)

    # -------------------------------------------------------------------------------------
    # Choosing

    @property
    def chooses(self) -> bool:
        """Whether a request's replica is chosen by the policy (and its prompt matters): with
        one replica, never (``choose``), and the prompt need not even be computed."""
        return len(self.replicas) > 1

    def choose(
        self,
        text: str,
        exclude: Sequence[ReplicaState] = (),
        holder: str | None = None,
        scope: bytes = b"",
    ) -> tuple[ReplicaState, Decision] | None:
        """The replica for the next attempt and why, or None when every replica is excluded.
        ``holder``: the replica holding the state the request continues, in back-off too;
        ``scope``: whose prompts ``text`` may share a prefix with (``RoutingPolicy``)."""
        if not exclude and len(self.replicas) == 1:  # (the rest below, in short)
            replica = self.replicas[0]
            return replica, Decision.ONLY_HEALTHY if replica.healthy else Decision.PROBE
        now = self.clock()
        pool = [r for r in self.replicas if r not in exclude]
        if not pool:
            return None
        held = next((r for r in pool if r.name == holder), None) if holder else None
        if held is not None:
            # Only it can answer for that state (another replica's answer is a false, final
            # 404): load and prefixes do not matter, nor its back-off (asked anyway: a probe).
            return held, Decision.STATE_HOLDER if held.healthy else Decision.PROBE
        eligible = [r for r in pool if r.eligible(now)]
        if not eligible:
            return min(pool, key=lambda r: r.down_until), Decision.PROBE
        if len(eligible) == 1:
            replica, decision = eligible[0], Decision.ONLY_HEALTHY
        else:
            replica, decision = self.policy.select(text, eligible, scope)
        if not replica.healthy:
            decision = Decision.PROBE
        return replica, decision

    # -------------------------------------------------------------------------------------
    # Sending

    def attempts(self) -> int:
        """Calls sent to the replicas so far, failed ones and failovers included."""
        return sum(_calls(r) for r in self.replicas)

    async def send(
        self,
        request: UpstreamRequest,
        text: str = "",
        holder: str | None = None,
        scope: bytes = b"",
        own: bool = False,
    ) -> tuple[UpstreamResponse, ReplicaState, Decision]:
        """Send ``request`` (prompt ``text``, in ``scope``: ``RoutingPolicy``) to a replica,
        failing over once; see the module doc. ``own``: the gateway's own call about a client's
        text (an embedding, a judge's question): a 5xx answer to it is no verdict on the
        replica (llama.cpp answers 500 to an input past its batch) and is not tried elsewhere.

        Raises the last ``UpstreamUnreachable`` / ``UpstreamTimeout`` when every attempt failed.
        """
        chosen = self.choose(text, holder=holder, scope=scope)
        assert chosen is not None
        replica, decision = chosen
        # Asked for the state it holds: no other replica has it, so its failure is the
        # request's, never failed over (another's answer would be a false, final 404).
        pinned = replica.name == holder
        tried: list[ReplicaState] = []

        def another() -> tuple[ReplicaState, Decision] | None:
            """The replica to try the call on once more, if any (once, and never pinned)."""
            return self.choose(text, tried, scope=scope) if len(tried) < 2 and not pinned else None

        try:
            while True:
                tried.append(replica)
                seen, sent_at = replica.verdicts, self.clock()
                try:
                    response = await self._attempt(replica, request, text, scope)
                except _RETRYABLE as error:
                    self._unanswered(replica, error, seen)
                    self._observe(replica, error.status, decision)
                    # Sent whole and not answered in time (``UpstreamNoAnswer``) by a replica that
                    # answered other calls meanwhile: alive, it may be running this one: not run
                    # again elsewhere. Silent to every call since it was sent (a frozen engine whose
                    # socket took the bytes), it is tried elsewhere like one never sent.
                    running = isinstance(error, UpstreamNoAnswer) and replica.answered_at >= sent_at
                    retry = None if running else another()
                    if retry is None:
                        raise
                    replica, decision = retry[0], Decision.FAILOVER
                    continue
                except UpstreamKeyRefused as error:
                    if not self._own_key_refused(error):
                        # An answer (the replica is up), and another replica would refuse the same
                        # call (the same key): not failed over, no replica left out.
                        replica.answered, replica.answered_at = True, self.clock()
                        self._succeeded(replica)
                        self._refused(replica, error)
                        self._observe(replica, error.upstream_status or error.status, decision)
                        raise
                    # Its own key refused (revoked, mistyped): nothing ran, and another replica,
                    # called with another key, may take the call. Left out like a failing one,
                    # or a share of the requests would fail for as long as its key is wrong.
                    replica.answered_at = self.clock()  # (it answered: alive)
                    self._failed(replica, _key_refused(error), seen)
                    self._observe(replica, error.upstream_status or error.status, decision)
                    retry = another()
                    if retry is None:
                        raise
                    replica, decision = retry[0], Decision.FAILOVER
                    continue
                except UpstreamBusy:
                    # Every connection to it held past ``limits.upstream_queue_timeout`` (long
                    # streams): nothing sent, and it is busy, not failing (no verdict, counted by
                    # ``_attempt``). Another replica's connections may be free.
                    replica.probing = False
                    retry = another()
                    if retry is None:
                        raise
                    replica, decision = retry[0], Decision.FAILOVER
                    continue
                except UpstreamAnswerCut as error:
                    # Answered, then cut: the engine took the call. Not run again on another
                    # replica, and this one is not left out (as for a stream that broke part-way).
                    replica.probing = False
                    self._observe(replica, error.status, decision)
                    raise
                except FunctionFailed as error:
                    # A ``FunctionUpstream``'s function raised: its clients get a 502, and so does
                    # the replica's record. Not failed over: the call may have run. (Any other
                    # exception is no verdict on the replica: a request the client library could
                    # not even build, say. The traceback is the flight's to log.)
                    # (What it raised or returned: "raised RuntimeError".)
                    self._failed(
                        replica, str(error).removeprefix(f"upstream {replica.name} "), seen
                    )
                    self._observe(replica, 502, decision)
                    raise
                except BaseException:
                    replica.probing = False  # cancelled, or not the replica's doing: no verdict
                    raise
                self._observe(replica, response.status, decision)
                if _answered(response.status):
                    self._succeeded(replica)
                    return response, replica, decision
                if own:
                    replica.probing = False  # (no verdict: the input's, as far as is known)
                    return response, replica, decision
                self._failed(replica, f"answered {response.status}", seen)
                retry = another()
                if retry is None:
                    return response, replica, decision
                await response.aclose()
                replica, decision = retry[0], Decision.FAILOVER
        finally:
            # Once a request, however it ended (answered, failed, cancelled): the decision of
            # its last attempt (``/stats`` ``routing``), a failed one's too.
            if self.decided is not None:
                self.decided(decision)

    async def _attempt(
        self, replica: ReplicaState, request: UpstreamRequest, text: str, scope: bytes
    ) -> UpstreamResponse:
        """One call, counted in flight until its answer is complete (or its stream closed)."""
        if not replica.healthy:
            replica.probing = True
        replica.in_flight += 1
        replica.calls += 1
        try:
            self.policy.on_sent(text, replica, scope)
            response = await replica.upstream.send(request)
        except BaseException as error:
            self._done(replica)
            if isinstance(error, GatewayOverloaded):
                self._overloaded(replica, error)
            raise
        replica.answered, replica.answered_at = True, self.clock()
        if not response.streaming:
            self._done(replica)
            return response
        release = self._release_once(replica)

        async def close() -> None:
            try:
                await response.aclose()
            finally:
                release()

        events = _Heard(response.events(), replica, self)
        return UpstreamResponse(response.status, response.headers, response.body, events, close)

    def _release_once(self, replica: ReplicaState) -> Callable[[], None]:
        """What takes a call off ``replica``'s count in flight (``_done``): the first time it
        is called only, however many of a stream's or a relay's ends call it."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._done(replica)

        return release

    def _done(self, replica: ReplicaState) -> None:
        """A call of ``replica`` is over (answered whole, failed, or its stream closed)."""
        replica.in_flight -= 1
        self.policy.on_done(replica)

    async def passthrough(
        self,
        method: str,
        path: str,
        query: bytes,
        headers: Mapping[str, str],
        body: RequestBody,
        holder: str | None = None,
    ) -> PassthroughResponse:
        """Another ``/v1/...`` call on one replica (``holder``'s, in back-off too), tried on another
        only when nothing was sent; see the module doc. The answer is counted in flight until
        its body is read or the answer closed (``PassthroughResponse.aclose``)."""
        chosen = self.choose("", holder=holder)
        assert chosen is not None
        replica, decision = chosen
        tried: list[ReplicaState] = []
        while True:
            tried.append(replica)
            seen = replica.verdicts
            if not replica.healthy:
                replica.probing = True
            replica.in_flight += 1
            replica.calls += 1  # (an attempt like any: what the engines were asked)
            try:
                self.policy.on_sent("", replica)
                response = await replica.upstream.passthrough(method, path, query, headers, body)
            except _RETRYABLE as error:
                self._done(replica)
                self._unanswered(replica, error, seen)
                self._observe(replica, error.status, decision)
                # Nothing sent (refused, no connection in time): any method may be tried once on
                # another replica. Sent, maybe in part (``UpstreamNoAnswer``), never: it may have
                # been acted on. Nor a call on the state its holder keeps: no other has it.
                retry = (
                    self.choose("", tried)
                    if len(tried) < 2
                    and not isinstance(error, UpstreamNoAnswer)
                    and replica.name != holder
                    else None
                )
                if retry is None:
                    raise
                replica, decision = retry[0], Decision.FAILOVER
                continue
            except UpstreamKeyRefused as error:  # (see ``send``)
                self._done(replica)
                self._observe(replica, error.upstream_status or error.status, decision)
                if self._own_key_refused(error):
                    replica.answered_at = self.clock()
                    self._failed(replica, _key_refused(error), seen)
                    raise
                replica.answered, replica.answered_at = True, self.clock()
                self._succeeded(replica)
                self._refused(replica, error)
                raise
            except BaseException as error:
                self._done(replica)
                replica.probing = False
                if isinstance(error, GatewayOverloaded):
                    self._overloaded(replica, error)
                raise
            break
        self._observe(replica, response.status, decision)
        replica.answered, replica.answered_at = True, self.clock()
        if _answered(response.status):
            self._succeeded(replica)
        else:
            # A 5xx (but 501, 505), or a 3xx without ``Location``, fails the replica as on the
            # cached endpoints; relayed as it is, not tried elsewhere: the call may have been
            # acted on before it failed. (Healed by it, a replica failing every call was back.)
            self._failed(replica, f"answered {response.status}", seen)
        release = self._release_once(replica)

        async def close() -> None:
            release()  # (first: nothing awaited below can keep the call counted)
            await response.aclose()  # (its upstream's: a body never read, its connection)

        return PassthroughResponse(
            response.status,
            response.headers,
            self._relayed(replica, response.body, release),
            replica.name,
            close,
        )

    async def _relayed(
        self, replica: ReplicaState, body: AsyncIterator[bytes], release: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        """A pass-through answer's body as it comes. Cut by its replica part-way (an
        ``UpstreamError`` now: ``UpstreamAnswerCut``), it is logged (``_cut``: a warning naming
        the replica, no traceback, at most one per ``log_interval``) and raised on for the
        server to cut its client's connection; the
        replica took the call and stays in rotation, as after a stream that broke part-way.
        However it ends (read whole, cut, closed part-way), the call is no longer in flight."""
        try:
            async for chunk in body:
                yield chunk
        except UpstreamError as error:
            self._cut(replica, error)
            raise
        finally:
            release()  # (first: synchronous, so that no cancellation of the close skips it)
            close = getattr(body, "aclose", None)
            if close is not None:  # (left part-way by its client: its connection let go now)
                await close()

    def _cut(self, replica: ReplicaState, error: UpstreamError) -> None:
        """A pass-through answer of ``replica`` was cut part-way: a warning, at most one per
        ``log_interval`` with its other failures' (a replica cutting every answer is no line
        per request), the next line counting those held back. No verdict: it took the call."""
        now = self.clock()
        if replica.logged_at is not None and now - replica.logged_at < self.log_interval:
            replica.unlogged += 1
            return
        log.warning(
            "upstream %s cut a pass-through answer part-way (its client's connection is cut "
            "too)%s: %s",
            self._called(replica),
            self._unlogged(replica),
            _what(error),
        )
        replica.logged_at = now
        self._counted(replica)

    def _succeeded(self, replica: ReplicaState) -> None:
        if not replica.healthy:
            replica.verdicts += 1
            if replica.down_logged:
                log.info(
                    "upstream %s answers again after %d failure(s)%s",
                    self._called(replica),
                    replica.failures,
                    self._unlogged(replica),
                )
                self._counted(replica)
            else:
                # Its failure was held back (a replica flapping within ``log_interval``): so
                # is the news that it is over, counted by the next line. ``logged_at`` stays:
                # a recovery does not make the next failure the first after a quiet period.
                replica.unlogged_recoveries += 1
        replica.healthy, replica.probing, replica.failures = True, False, 0

    def _unanswered(self, replica: ReplicaState, error: UpstreamError, seen: int) -> None:
        """A call of ``replica`` that got no answer (``_RETRYABLE``), a cached endpoint's or a
        pass-through's: failed; and with no connection at all (refused, reset: most likely
        restarted, its KV cache empty), forgotten by the policy, whose record of it would
        draw prefixes it lost."""
        self._failed(replica, _what(error), seen)
        if isinstance(error, UpstreamUnreachable):
            self.policy.on_lost(replica)

    def _failed(self, replica: ReplicaState, what: str, seen: int) -> None:
        """A call of ``replica`` failed, sent when its state was ``seen`` (``verdicts``)."""
        replica.errors += 1
        if seen != replica.verdicts:
            # Sent before its last change of state: no news (see the module doc). Left for the
            # next warning to count (one says what downed it already).
            replica.unlogged += 1
            return
        replica.verdicts += 1
        replica.failures += 1
        replica.healthy, replica.probing, replica.answered = False, False, False
        # The exponent capped: a replica dead for hours keeps counting its failures (probed
        # once every ``backoff_max_s``), and ``2 ** 1024`` overflows a float (OverflowError:
        # every request sent to it then raised, none failed over, its back-off never moved).
        doublings = min(replica.failures - 1, _MAX_DOUBLINGS)
        backoff = min(self.backoff_s * 2.0**doublings, self.backoff_max_s)
        now = self.clock()
        replica.down_until = now + backoff
        if replica.logged_at is not None and now - replica.logged_at < self.log_interval:
            replica.unlogged += 1
            if replica.failures == 1:
                # It downed a healthy replica, unsaid: its recovery goes unsaid too. (A failed
                # probe of a replica whose downing was logged leaves its recovery to be told.)
                replica.down_logged = False
            return
        log.warning(
            "upstream %s failed, left out for %.3g s%s: %s",
            self._called(replica),
            backoff,
            self._unlogged(replica),
            what,
        )
        replica.logged_at, replica.down_logged = now, True
        self._counted(replica)

    def _overloaded(self, replica: ReplicaState, error: GatewayOverloaded) -> None:
        """A call this machine could not open a connection for (``GatewayOverloaded``):
        counted, no verdict on its replica; logged once per ``log_interval`` at most, with how
        many came since the last line (a burst that took every descriptor fails them all)."""
        self.overloaded += 1
        more = self._overload_log.due(self.clock())
        if more is None:
            return
        log.warning(
            "could not open a connection to upstream %s: %s (its clients get 503%s; %s)",
            self._called(replica),
            error.said(),
            f", {more} more calls since the last such line" if more else "",
            error.advice,
        )

    def _stalled(self, replica: ReplicaState, head_at: float, error: UpstreamStreamStalled) -> None:
        """A stream of ``replica`` stalled (``limits.upstream_timeout``) with nothing after its
        head, which came at ``head_at``. Silent to every call since, the replica is taken for
        hung (a stuck engine whose HTTP layer still sends heads: vLLM's), as one silent before a
        head is (``send``): failed. Having answered meanwhile, it is alive and the stream merely
        slow (a long generation): nothing. Never sent again either way (the engine took it)."""
        if replica.answered_at > head_at:
            return
        what = f"{_what(error)} (nothing after its head, and no other call answered since)"
        # Still in rotation, it is in the state its head left it in (healed, if it was a probe:
        # any change since would have come with news); left out since, by another call's
        # failure, this is no news (counted in its ``errors``, as for a call sent before).
        self._failed(replica, what, replica.verdicts if replica.healthy else -1)

    def _own_key_refused(self, error: UpstreamKeyRefused) -> bool:
        """A refusal about the replica's own key, not the call: a 401 (the key unknown,
        revoked) with keys that differ from replica to replica. A 403 is about what the key
        may do (a model, an endpoint: a restricted key refused ``/models``), as often the
        request's: an answer, as with one key for all."""
        return self.own_keys and error.upstream_status == 401

    def _refused(self, replica: ReplicaState, error: UpstreamKeyRefused) -> None:
        """A call refused with the gateway's key: a warning, at most one per ``log_interval``
        (a client asking again for a model the account may not use is no news)."""
        replica.refusals += 1
        now = self.clock()
        last = replica.refusal_logged_at
        if last is not None and now - last < self.log_interval:
            return
        replica.refusal_logged_at = now
        log.warning(
            "upstream %s refused a call made with the gateway's key (%s; %d refusal(s) in "
            "all): the key, or that request (a model the account may not use)",
            self._called(replica),
            error.upstream_status or "401/403",
            replica.refusals,
        )

    def _called(self, replica: ReplicaState) -> str:
        # Both names: clients quote the label (error bodies), operators know the name.
        return (
            replica.name if replica.label == replica.name else f"{replica.label} ({replica.name})"
        )

    def _unlogged(self, replica: ReplicaState) -> str:
        """What a line about ``replica`` says of the failures and recoveries held back since
        the last line that counted them."""
        if replica.counted_at is None or not (replica.unlogged or replica.unlogged_recoveries):
            return ""
        held = [f"{replica.unlogged} more failure(s)"] if replica.unlogged else []
        if replica.unlogged_recoveries:
            held.append(f"{replica.unlogged_recoveries} recoveries")
        return (
            f" ({' and '.join(held)} not logged in the last "
            f"{self.clock() - replica.counted_at:.0f} s)"
        )

    def _counted(self, replica: ReplicaState) -> None:
        """A line about ``replica`` said what was held back (``_unlogged``): counted afresh."""
        replica.unlogged = replica.unlogged_recoveries = 0
        replica.counted_at = self.clock()

    def _observe(self, replica: ReplicaState, status: int, decision: Decision | None) -> None:
        if self.observe is not None:
            self.observe(replica, status, decision)

    # -------------------------------------------------------------------------------------
    # Introspection

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.replicas)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per replica, for ``/stats``: load and state (healthy | probing | down)."""
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for r in self.replicas:
            if r.healthy:
                state = "healthy"
            elif r.probing or now >= r.down_until:
                state = "probing"  # back-off over: the next request probes it
            else:
                state = "down"
            out[r.name] = {
                "state": state,
                "in_flight": r.in_flight,
                "calls": _calls(r),
                "errors": r.errors,
                "failures": r.failures,
                "down_until": None if r.healthy else r.down_until,
                "down_for_s": 0.0 if r.healthy else round(max(0.0, r.down_until - now), 3),
            }
        return out

    def health(self) -> dict[str, dict[str, Any]]:
        """Per replica, by public label, for ``/healthz``: nothing an operator keeps private."""
        states = self.snapshot()
        return {
            r.label: {
                "healthy": r.healthy,
                "state": states[r.name]["state"],
                "failures": r.failures,
            }
            for r in self.replicas
        }

    async def ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """For ``/readyz``: whether some replica is reachable. One that has answered and not
        failed since is; otherwise replicas are asked ``GET /models`` now, all at once (any
        HTTP answer proves one reachable; see ``_probe``), so that a dead upstream is not ready
        before any request has failed on it, nor an upstream back from an outage unready until
        a request finds it out. An answer is trusted for ``READY_TRUST_S``: an upstream that
        died since, with no request to find it out, is asked again (it was ready for ever, a
        balancer sending it traffic). A probe under way is awaited, not sent again
        (``timeout``: its calls', the first caller's)."""
        now = self.clock()
        if any(
            r.healthy and r.answered and now - r.answered_at < READY_TRUST_S for r in self.replicas
        ):
            return True
        probe = self._readiness
        # (One of another event loop, a library user's earlier ``asyncio.run``, is none of ours.)
        if probe is None or probe.get_loop() is not asyncio.get_running_loop():
            probe = self._readiness = asyncio.ensure_future(self._probe(timeout))
            probe.add_done_callback(self._probed)
        # Shielded: a caller that leaves (its client gone) must not cancel the others' probe.
        return await asyncio.shield(probe)

    def _probed(self, probe: asyncio.Task[bool]) -> None:
        if self._readiness is probe:  # (the next ``ready`` that trusts no answer asks again)
            self._readiness = None

    async def _probe(self, timeout: float) -> bool:
        """The readiness probe (``ready``): the replicas asked ``GET /models`` concurrently,
        within ``timeout``, the first answer ending it (the other calls cancelled, no verdict
        on them): one hung replica must not hold /readyz past a balancer's probe timeout
        (Kubernetes': 1 s) while another answers. With a replica healthy, those eligible are
        asked; with none, every one, in back-off or not: a balancer sends an unready gateway
        no traffic, so no request would find out that an upstream is back before its back-off
        ends (up to ``backoff_max_s``). The calls are as many as the /readyz probes (one at a
        time, ``ready``), never more than one per replica each."""
        now = self.clock()
        if any(r.healthy for r in self.replicas):
            asked = [r for r in self.replicas if r.eligible(now)]
        else:
            asked = list(self.replicas)
        calls = [asyncio.ensure_future(self._ask(replica, timeout)) for replica in asked]
        try:
            for call in asyncio.as_completed(calls):
                if await call:
                    return True
            return False
        finally:
            for call in calls:
                call.cancel()  # (once one answered: the others are not waited for)
            await asyncio.wait(calls)

    async def _ask(self, replica: ReplicaState, timeout: float) -> bool:
        """``replica`` asked ``GET /models`` for the readiness probe, within ``timeout``:
        whether it answered (then healed, if it was down). Its failure downs a healthy replica
        (news, as any call's); of one already down it is no news (counted in its ``errors``):
        a readiness probe never grows a back-off, asked as often as /readyz is."""
        seen = replica.verdicts if replica.healthy else -1
        try:
            async with asyncio.timeout(timeout) as within:
                response = await replica.upstream.passthrough("GET", "/models", b"", {}, b"")
        except PathNotAllowed:
            pass  # an in-process upstream: no /models (nothing was sent), but up
        except GatewayOverloaded as error:
            # This machine could not open the connection (no descriptor left): no verdict on
            # the replica; the gateway is not ready to serve all the same.
            self._overloaded(replica, error)
            return False
        except (UpstreamRedirected, UpstreamBadStatus) as error:
            self._probe_sent(replica, error.status)  # an answer, if none to relay: reachable
        except UpstreamKeyRefused as error:
            self._probe_sent(replica, error.upstream_status or error.status)
            if self._own_key_refused(error):  # (no call of it would be answered)
                self._failed(replica, f"readiness probe: {_key_refused(error)}", seen)
                return False
            self._refused(replica, error)  # an answer: reachable
        except (UpstreamError, TimeoutError, OSError) as error:
            # No answer (unreachable, timed out), or a failure no branch above names: this
            # replica failed (never a 500 for /readyz).
            if isinstance(error, UpstreamError):
                self._probe_sent(replica, error.status)
            else:
                self._probe_sent(replica, 504 if isinstance(error, TimeoutError) else 502)
            what = (
                f"no answer in {timeout:g} s" if isinstance(error, TimeoutError) else _what(error)
            )
            self._failed(replica, f"readiness probe: {what}", seen)
            return False
        except asyncio.CancelledError:
            replica.calls += 1  # (sent, as far as anyone knows: an attempt, with no status)
            raise
        else:
            self._probe_sent(replica, response.status)
            await _drained(response.body, within.when())
        replica.answered, replica.answered_at = True, self.clock()
        if not replica.healthy:
            self._succeeded(replica)
        return True

    def _probe_sent(self, replica: ReplicaState, status: int) -> None:
        """A readiness probe sent to ``replica``, answered ``status`` (or failed with it): an
        attempt like any in ``calls`` and ``observe`` (no decision: not routed), as
        ``OwnCalls``' are."""
        replica.calls += 1
        self._observe(replica, status, None)

    async def aclose(self) -> None:
        """Close every replica's upstream (a readiness probe under way cancelled first)."""
        probe, self._readiness = self._readiness, None
        if probe is not None and probe.get_loop() is asyncio.get_running_loop():
            probe.cancel()
            await asyncio.wait([probe])  # (its callers get the cancellation; not this one)
        for replica in self.replicas:
            await replica.upstream.aclose()


class _Heard:
    """A stream's payloads as they come, each read (a list of them) noted as news from its
    replica (``answered_at``): a replica streaming to other calls is alive, and a call it has
    not answered in time may be running there (``UpstreamNoAnswer``: not run again elsewhere).
    A stall before its first payload is judged by ``ReplicaSet._stalled``. An iterator, not an
    async generator: see ``upstream.wire._Pieces``."""

    __slots__ = ("events", "replica", "replicas", "head_at", "heard")

    def __init__(
        self, events: AsyncIterator[list[bytes]], replica: ReplicaState, replicas: ReplicaSet
    ) -> None:
        self.events, self.replica, self.replicas = events, replica, replicas
        self.head_at = replica.answered_at  # (its head's news, noted as it came)
        self.heard = False  # whether a payload has come

    def __aiter__(self) -> _Heard:
        return self

    async def __anext__(self) -> list[bytes]:
        try:
            payloads = await self.events.__anext__()
        except UpstreamStreamStalled as error:
            if not self.heard:
                self.replicas._stalled(self.replica, self.head_at, error)
            raise
        self.heard = True
        self.replica.answered_at = self.replicas.clock()
        return payloads


async def _drained(body: AsyncIterator[bytes], deadline: float | None) -> None:
    """A readiness answer's body read to its end (its connection then goes back to the pool),
    by ``deadline`` (the loop's time). Cut or stalled, its head came all the same: the replica
    is reachable (a whole answer cut after its head is no failure of its replica on any path:
    ``UpstreamAnswerCut``)."""
    with contextlib.suppress(UpstreamError, TimeoutError):
        async with asyncio.timeout_at(deadline):
            async for _ in body:
                pass


def _calls(replica: ReplicaState) -> int:
    """Its calls (``calls``), and those its upstream sent a second time itself (``resent``:
    ``upstream.wire``'s keep-alive race): each an attempt the engine was asked."""
    return replica.calls + getattr(replica.upstream, "resent", 0)


def _key_refused(error: UpstreamKeyRefused) -> str:
    """A refusal of a replica's own key, for the failure's warning."""
    return f"{error}: its key (upstream.api_keys), or that request (a model it may not use)"


def _what(error: BaseException) -> str:
    """A failure for the log: the client's message, plus the cause's type and text (operators
    only), any URL in it without user, password or query (aiohttp quotes the URL it failed on:
    an upstream's ``api-key`` query, a pass-through client's ``?key=``). A cause whose text
    the message says already (``upstream.wire``'s ``WireError``: its reason) is passed for
    the one below it: OpenSSL's own words for a certificate it refused (which names the host
    a client is never told) were one level down, and the log said no more than the client's
    "TLS certificate not trusted"."""
    cause = error.__cause__
    message = str(error)
    while (
        cause is not None and cause.__cause__ is not None and str(cause) and str(cause) in message
    ):
        cause = cause.__cause__
    if cause is None:
        return message
    detail = urls_without_credentials(str(cause))
    return f"{error} [{type(cause).__name__}" + (f": {detail[:300]}]" if detail else "]")


class OwnCalls:
    """Replica ``index`` of ``replicas`` called by the gateway itself, not routed: an
    embeddings list probe (``batching.lists``) must ask that very replica. Each call is
    counted as an attempt like any (``calls``; ``observe``, with no decision: the engines were
    asked it, and bill it), and leaves the replica's health as it is (the probe judges its
    answers itself: a refused list is no failure of the replica)."""

    def __init__(self, replicas: ReplicaSet, index: int) -> None:
        self.owner = replicas
        self.replica = replicas.replicas[index]
        self.observe = replicas._observe

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        replica = self.replica
        replica.calls += 1
        try:
            response = await replica.upstream.send(request)
        except GatewayOverloaded as error:
            self.owner._overloaded(
                replica, error
            )  # (this machine's want: no status of the replica's)
            raise
        except UpstreamKeyRefused as error:
            self.observe(replica, error.upstream_status or error.status, None)
            raise
        except UpstreamError as error:
            self.observe(replica, error.status, None)
            raise
        self.observe(replica, response.status, None)
        return response
