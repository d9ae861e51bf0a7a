"""The request's path through the layers, in order, as one function: ``Gateway.handle``.

    parse -> fingerprint -> exact cache -> single-flight (lead or join) -> upstream -> store

Contract:
- ``handle`` never raises for a client's request: every outcome, bad input and upstream failure
  included, is a ``Reply`` with a status, headers (``x-carpool`` on every cached endpoint) and a
  body or an SSE stream. Only cancellation (the client left) propagates.
- A streaming ``Reply`` holds the request's place in its flight until ``Reply.close()``; the
  transport calls it when the stream ends or the client goes (which may cancel the upstream call).
- The upstream call of a flight runs in the flight's own task (``Leader.lead``, ``lead.py``),
  never in a client's: it streams into the flight's broadcast, then stores a complete answer
  before the flight ends, so a request that no longer finds the flight finds the answer in the
  cache.
- Every API's own knowledge (validation, sharing, framing, judging, assembling, synthesizing,
  error shapes) is its ``carpool.apis.Api`` (``request.api``): chat, completions, embeddings,
  OpenAI's Responses API and Anthropic's Messages API go through this same path.
- Nothing broken is stored: only complete 2xx answers, with ttl > 0, without ``no-store``, not
  asked without the usage other shapes get (``upstream.stream_usage: false``: such a call is
  a flight of its own shape, ``exchange.flight_key``, which no other shape joins).
  Complete: a chat/completions stream that ended with ``[DONE]`` and a finish for every choice
  asked for (``n`` per prompt: ``sse.expected_choices``), a typed stream (Responses, Messages)
  that ended with its last event and completed (``Api.judge_stream``). A stream that stopped
  short fails the flight (``exchange._consume``: an SSE error event for streaming clients, a
  502 for the others). A whole JSON body with fewer choices, or a typed answer that ended
  without completing (Responses ``incomplete``), is served as the upstream sent it, but not
  stored.
- Errors do not multiply calls: a flight whose stream failed, even before its first chunk (an
  engine's empty 200 stream), ends a streaming client's reply as a 200 SSE stream with an error
  event, and a non-streaming client's as a 502 with ``x-should-retry: false``: a retried 5xx
  would make one client call several engine calls. An error the engine reported keeps its
  status and body (before the stream) or its error object (in the stream), for its own
  requester (``_shown``): a client that joined another request's call (another ``user``,
  metadata, tenant) gets its status, type and code, not its words. So does an error reported
  in a 2xx body (an incomplete answer: ``Answer.for_others``), as a JSON body or a stream's
  error event, on this instance or relayed from another's call. Unreachable (502) and
  timed-out (504) upstreams keep their statuses, for every client.
- A 4xx the upstream answered to another body than a client's (``_refused_its_body``: the key
  leaves out ``metadata``, ``user``...) is not that client's answer: it makes its own call,
  shared only with requests of its body. A refusal of the requester or of the moment (401,
  402, 403, 404, 407, 429, 408) is everyone's, but in a shared namespace another tenant's
  (``_refused_another``).
- An answer served whole (JSON, or SSE to a client that asked for usage) whose body has no
  ``usage`` because the engine reported none carries ``x-carpool-usage: missing``; nothing is
  invented. One whose ``usage`` is its share of a merged embeddings call's carries
  ``x-carpool-usage: apportioned`` (``Answer.usage_apportioned``). ``tokens_saved`` counts what the engine reported for the answers of hits and
  joiners (streaming joiners once their stream ended whole; not a semantic hit whose audit asks
  the engine again); ``saved_without_usage`` counts the others.
- With ``redis``, identical requests on different instances share one call too: the lead of each
  instance's flight leads it for all of them or relays it from the instance that does
  (``redis/flights.py``); whatever Redis does, the flight still gets its answer. A client
  whose flight lost that other instance's leader (``LeaderLost``) before its reply began,
  streaming or not, got nothing of the call: it is answered by the stored answer or a takeover
  call (``_follow``); a streaming joiner of a flight relaying such a call takes no frame until
  the call shows life since it came (``_wait``), so a leader's death before then leaves it
  nothing of the dead call. Semantic
  entries are shared too (``redis/semantic.py``): each instance's index is fed by the others'.
- Without ``redis``, the workers of ``carpool serve --workers N`` share the same way
  (``carpool.peers``): a key's upstream calls are made by the worker that owns it, which the
  others ask instead of the upstream (``lead.py``), keeping its answer in their own caches (an
  answer the owner served from its cache is a ``hit`` here, with the ``age`` the owner said,
  streamed or whole); a request with an Idempotency-Key runs on the worker that owns its
  record. A flight's call asked by another worker (``ClientRequest.peer``, no Idempotency-Key)
  is led where it arrived, and skips the semantic probe its worker made; a keyed request passed
  on whole is answered as any other (probed, its flight's call asked of the key's owner).
- The HTTP server (``server.py``) and the library API (``Gateway.request``) share this path,
  and both time each request to its reply's end (``Gateway.observe``: the latency metrics).
  ``Gateway.request`` raises (``ValueError``, ``TypeError``) for arguments no HTTP request could
  carry: a path that is no cached endpoint, a header that is not text, a query no URL holds.
  A gateway runs on the event loop of its first use (its app's start-up, or a library call,
  which starts its layers): ``request`` or ``passthrough`` on another raises ``RuntimeError``.
  A header value it forwards upstream goes as an HTTP client's does (``http_syntax.value_bytes``:
  a character a byte, latin-1), or, with a character beyond latin-1, as its UTF-8.
- ``passthrough``: any other ``/v1/...`` call, forwarded as it came and never cached, nor run
  at most once: its ``Idempotency-Key`` is refused when invalid, as on the cached endpoints
  (400, problem+json, nothing sent), and a valid one is kept by no record (a retry runs the
  call again), only forwarded, for the upstream to honour, unless the gateway holds the
  upstream's credential (``upstream.http``: then it is dropped); a 401 or
  403 it gets takes back its tenant's every acceptance (``identity.py``), as one to a cached
  endpoint's call does (a key revoked upstream is caught by its next refused call). One on a
  stored response (``/responses/{id}...``) or chat completion (``/chat/completions/{id}...``)
  goes to the replica that made it (``routing.state``). A ``DELETE /responses/{id}``,
  ``DELETE /chat/completions/{id}`` or ``DELETE /files/{id}`` the upstream answers 2xx first
  drops, in the deleter's tenant, the answers that are or continue that object, or whose
  request names that file (their ``state_tag``), by key: those this
  process stored under it (``state_index``: its keys, their lingering flights, their semantic
  entries) and the flights whose calls run under it (shut: no request joins them), then each other worker's (``Peers.forget_state``) and instance's (the Redis
  invalidation channel's ``publish_state``), then is relayed. Not an invalidation: no other
  flight is forgotten, no epoch moved, no layer scanned. Redis failing, the shared ones stay
  to their TTL (logged: the upstream deleted it all the same). Its answer is the caller's to
  read to its end or close (``PassthroughResponse.aclose``, as the server's relay does however
  it ends): the call counts in its replica's load until then.
- Every layer is injected (``Layers``, built by ``wiring.build_gateway``); the path's own parts
  are ``exchange.py`` (the upstream call and its stream), ``lead.py`` (a flight's task: the call,
  then the answer stored), ``idempotency/once.py`` (a request with an Idempotency-Key, run at
  most once around ``_answer``) and ``reply.py`` (the replies). Starting and closing the layers
  (``layers.py``) and the admin surfaces (``admin.py``) are not on the path.
- ``begin_draining()``, by whoever stops the gateway gracefully, as its shutdown begins (the
  drain, or the grace period where there is none): ``draining`` (``/readyz`` 503), and the
  requests waiting in an embeddings batch sent at once (``EmbeddingBatcher.flush``), later
  ones within a turn of the event loop: a batch's delay may be longer than the grace period.
  Safe to call again.
- ``aclose`` settles first (``settle``): the flights' calls still running go on until
  ``stop_by`` (the server's grace period; other instances' followers may wait on them), those
  left are cancelled (their followers elsewhere take them over: leader gone, not an upstream
  failure), and the cancelled calls' and cut requests' cleanup runs, then the layers close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from . import admin, http_syntax
from .answer import Answer
from .apis import BY_PATH
from .auditor import Auditor
from .broadcast import Broadcast
from .canonical import IDEMPOTENCY_HEADERS
from .errors import (
    CarpoolError,
    LeaderLost,
    RequestError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamStreamBroken,
)
from .exchange import Exchange, Relay, flight_key
from .fingerprint import Fingerprint, fingerprint, requester, semantic_view
from .flight import JoinTimeout, Ticket
from .idempotency import IdempotencyError, parse_key
from .idempotency.once import AtMostOnce, scope_of
from .lead import Leader, prompt_prefix, read_age, unservable
from .metrics import COUNTED_ELSEWHERE, Counted, counted_elsewhere
from .outcome import Outcome
from .repeat_memo import Repeat
from .reply import (
    SSE_HEADERS,
    Reply,
    age_header,
    error_reply,
    nearest,
    refusal,
    similarity,
    unstreamable,
    whole,
)
from .request import (
    ClientRequest,
    Request,
    body_digest,
    check_query,
    parse,
    requester_digest,
)
from .routing.state import answer_names, learning, path_changed, path_state, posted_state
from .semantic.audit import BACKED_OFF, BACKED_OFF_SIMILARITY, MARK, SERVING, Budget
from .state_index import Held
from .store.base import Entry, StoreUnavailable, state_tag
from .upstream.base import PassthroughResponse, RequestBody

if TYPE_CHECKING:
    from .layers import Layers
    from .tracing import Tracer

__all__ = ["Gateway", "Reply"]

log = logging.getLogger("carpool.pipeline")


class Gateway:
    """carpool's request path, transport-free, on injected layers (``wiring.build_gateway``
    builds both). Close it with ``aclose``."""

    def __init__(self, layers: Layers) -> None:
        self.layers = layers
        # The layers the path reads (the very objects of ``layers``).
        self.config = layers.config
        self.upstreams = layers.upstreams
        self.replicas = layers.replicas
        self.store = layers.store
        self.flights = layers.flights
        self.shared_flights = layers.shared_flights
        self.peers = layers.peers
        self.closed = False  # (``aclose``)
        self._loop: asyncio.AbstractEventLoop | None = None  # (the one it runs on: ``bind``)
        self.invalidations = layers.invalidations
        self.semantic = layers.semantic
        self.idempotency = layers.idempotency
        self.accepted = layers.accepted
        self.repeats = layers.repeats
        self.batcher = layers.batcher
        self.stats = layers.stats
        self.metrics = layers.metrics
        self.clock = layers.clock
        self.draining = False  # for whoever stops the gateway gracefully: /readyz says 503
        # When the server's grace period ends (``time.monotonic()``), set by whoever stops it
        # gracefully (``carpool serve``): ``aclose`` lets the calls still running end until then.
        self.stop_by: float | None = None
        # The requests being served (``GatewayApp.serve``): ``aclose`` lets a cut one's cleanup
        # run before the layers close.
        self.serving: set[asyncio.Task[Any]] = set()
        self._join_timeout = self.config.coalesce.join_timeout_ms / 1000
        # The parts of the path: the upstream call, a flight's lead, a key's record.
        self.exchange = Exchange(layers)
        self.leader = Leader(layers, self.exchange.fetch)
        self.once = AtMostOnce(
            layers.idempotency, self.config, self.accepted, self.stats, self._answer, layers.clock
        )
        self.auditor = Auditor(layers)  # semantic hits checked against fresh answers
        # A deleted response's answers, by key (``state_index``): those a tag pushed out of the
        # index held; those of another instance's DELETE (Redis).
        layers.states.evicted = self._forget_held
        if self.invalidations is not None:
            self.invalidations.on_state = self.forget_state
            self.invalidations.on_refusal = self.accepted.refused_elsewhere
        # A key refused here is refused on every instance and worker (each accepts by itself),
        # where acceptance opens anything: the shared namespaces.
        if self.config.tenant.shared_namespaces:
            if self.invalidations is not None:
                self.accepted.on_refused = self.invalidations.tell_refused
            elif self.peers is not None:
                self.accepted.on_refused = self.peers.tell_refused

    @property
    def tracer(self) -> Tracer:
        """The one tracer of the whole path, the upstream call's spans included: replacing it
        here replaces it there too."""
        return self.layers.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer) -> None:
        self.layers.tracer = tracer

    # ---------------------------------------------------------------------------------------
    # The request's path

    async def handle(self, client: ClientRequest) -> Reply:
        """One request to a cached endpoint, from its raw bytes to the reply (see ``_handle``)."""
        tracer = self.layers.tracer
        if not tracer.enabled:
            return await self._handle(client)  # (nobody traces: not even a no-op span)
        with tracer.span("carpool.request", **{"carpool.route": client.path}) as span:
            reply = await self._handle(client)
            # A refusal says ``bypass`` to its client, but is counted in ``rejected``: so is its
            # span.
            said = "rejected" if reply.rejected else reply.outcome.value if reply.outcome else ""
            span.set_attribute("carpool.outcome", said)
            return reply

    async def _handle(self, client: ClientRequest) -> Reply:
        route = client.path
        # A byte-identical repeat of a request parsed before goes straight to the exact cache:
        # the same bytes, query and headers (controls, credentials, forwarded ones) always make
        # the same fingerprint; in a shared namespace, only while the requester is accepted.
        memo_key = client.memo_key if client.keyed else self.repeats.key_of(client)
        repeat = self._repeat(memo_key)
        if repeat is not None:
            answer = await self._cached(
                repeat.key, repeat.max_age, BY_PATH[route].kind, repeat.stream, repeat.include_usage
            )
            if answer is not None:
                return self._served(route, Outcome.HIT, answer, repeat.stream, repeat.include_usage)
        try:
            limits = self.config.limits
            request = parse(
                client, limits.max_body_bytes, limits.max_json_depth, limits.max_json_containers
            )
            idempotency_key = parse_key(client.headers)
        except (RequestError, IdempotencyError) as error:
            self.stats.rejected += 1
            return refusal(error, BY_PATH[route])
        if idempotency_key is None or self.peers is None:
            # Parsed, the client's bytes are read again only by a keyed request passed on whole
            # to its record's owner among the workers (``Peers.run_on``): let go of them now,
            # not at the end of the call (a copy of a megabyte prompt less while it runs; the
            # repeat memo's key keeps the small bodies it remembers).
            client.body = b""
        key = fingerprint(request, self.config, self.accepted)
        remember = (
            partial(self.repeats.remember, memo_key, request, key, self._read_age(request))
            if memo_key is not None
            else None
        )
        if idempotency_key is not None:
            if remember is not None:
                remember()
            # Among workers (``carpool.peers``), a key's record lives with the worker that owns
            # its scope: the request runs there, whole, wherever its retries land.
            owner = (
                self.peers.owner_of(scope_of(key, idempotency_key, request, self.config))
                if self.peers is not None and not client.peer
                else None
            )
            if owner is not None and self.peers is not None:
                _waiting(client)
                reply = await self.peers.run_on(owner, client)
                if reply is not None:
                    if reply.rejected:  # this worker's own refusal (the owner out of reach)
                        self.stats.rejected += 1
                    else:  # counted where it ran, which alone sees what it saved or refused
                        counted_elsewhere()
                    return reply
            if client.peer:  # (passed on whole by another worker: counted here, where it runs)
                COUNTED_ELSEWHERE.set(False)
            return await self.once.run(client, request, key, idempotency_key, route)
        return await self._answer(client, request, key, route, remember)

    async def _answer(
        self,
        client: ClientRequest,
        request: Request,
        key: Fingerprint,
        route: str,
        remember: Callable[[], None] | None = None,
    ) -> Reply:
        """Bypass, or: exact cache -> a flight in progress -> semantic cache -> lead a flight.
        ``remember``: the repeat memo's note of the request, taken once it has a reply or
        a flight (a bypass has no key to remember)."""
        # A flight's call another worker asked of this one (``Peers.ask``, which sends no
        # Idempotency-Key) is led here, alone, without the lookup that worker made. A keyed
        # request passed on whole to its record's owner (``Peers.run_on``) is answered as any
        # request arriving here: its worker looked up nothing, and its key's owner may hold
        # the answer (asked, not called again upstream).
        asked = client.peer and parse_key(client.headers) is None
        if key.key is None:
            _waiting(client)
            return await self.exchange.bypass(request, route)
        controls = request.controls
        read_age = self._read_age(request)
        if controls.may_read and read_age != 0:
            hit = await self._exact_hit(route, request, key.key, read_age, remember)
            if hit is not None:
                return hit
        join_age = controls.max_age if controls.may_read else 0
        # (Apart for a call asked without its usage, which no other shape may share.)
        flying = flight_key(key.key, request, self.config)
        view = (
            semantic_view(request, key, self.config)
            if self.semantic is not None and not controls.no_store
            else None
        )
        probe = None
        unserved = None  # a match not served (its audit, if drawn, reads this request's flight)
        if (
            view is not None
            and controls.may_read
            and read_age != 0
            and not asked  # (its worker probed its own index: an exact answer is asked)
            and not self.flights.joinable(flying, join_age)
        ):
            assert self.semantic is not None  # (a view is made only with a semantic cache)
            _waiting(client)
            with self.tracer.span("carpool.semantic") as span:
                # (The requester's prompt prefix: an entry made before a prefix invalidation
                # that names it is not served to it, whatever the entry's own prompt.)
                # (An identical request's lookup in progress is joined: ``key``.)
                probe = await self.semantic.probe(
                    view, read_age, partial(prompt_prefix, request, self.config), key=key.key
                )
                if probe.match is not None:
                    span.set_attribute("carpool.similarity", probe.match.similarity)
            match = probe.match
            if (
                match is not None
                and match.answer is not None
                and request.stream
                and self.config.semantic.mode == "serve"
                and await unservable(
                    self.store, match.entry.ref, match.answer, request.include_usage
                )
            ):
                # Not served, nor kept: this copy at once, another instance's reference by its
                # exact entry, dropped (each copy goes on its next read).
                self.semantic.forget_entry(match.entry.id)
                match = None
            if match is not None:
                assert match.answer is not None
                # The scope's error budget (``semantic/audit.py``: its tenant's in its namespace,
                # one for a shared namespace) may hold hits back; its audits go on either way,
                # on the answer served or the one that would have been.
                budget = Budget(key.tenant, key.namespace)
                state = self.layers.audits.state(budget) if self.layers.audits else SERVING
                near = match.similarity >= BACKED_OFF_SIMILARITY  # (served even backed off)
                # (two samples may differ)
                audited = request.api.deterministic(request.body, self.config.upstream.engine)
                if self.config.semantic.mode == "serve" and (
                    state == SERVING or (state == BACKED_OFF and near)
                ):
                    # (An audit asks the engine for the answer again: its tokens are not saved.)
                    recomputed = audited and self.auditor.maybe(request, budget, match, view, near)
                    self.metrics.similarity.observe(match.similarity)
                    if remember is not None:
                        remember()
                    return self._served(
                        route,
                        Outcome.SEMANTIC_HIT,
                        match.answer,
                        request.stream,
                        request.include_usage,
                        similarity(match),
                        recomputed=recomputed,
                    )
                if audited:
                    unserved = budget, match, near
        if probe is not None and probe.waited:
            # The lookup waited for the embedder and the verifier (seconds, behind a burst of
            # lookups; an embedder's timeout): an identical request's answer may have been
            # stored meanwhile and its flight's window closed. Served, not asked for again.
            # (One that embedded nothing, its scope empty or the lookup shed, waited for
            # nothing: not read twice. With shared flights too: a call's claim reads the stored
            # answer only for a request that takes any, under its flight's key, with Redis
            # usable, and a local flight joined reads nothing.)
            hit = await self._exact_hit(route, request, key.key, read_age, remember)
            if hit is not None:
                return hit
        # The epoch of invalidations this call begins in: its answer is stored only if no
        # invalidation came before it ended (``Leader._store``).
        # A peer's request is led here, never passed on again: its worker chose this one.
        lead = partial(
            self.leader.lead,
            request,
            key,
            view,
            probe,
            epoch=self.flights.epoch,
            alone=asked,
            flying=flying,
        )
        ticket = self.flights.acquire(
            flying, lead, max_age=join_age, linger=not controls.no_store, owner=key.owner
        )
        if unserved is not None:
            # Not served, the request goes upstream all the same (its own call, or one it
            # joined): its audit compares that answer with the match, no call of its own.
            assert view is not None  # (a match is found only through a view)
            budget, match, near = unserved
            self.auditor.maybe(request, budget, match, view, near, ticket.broadcast)
        if not ticket.leader and not controls.no_store and ticket.broadcast.kept_for is None:
            # Should its leader be a no-store request, the answer is still stored for this one.
            ticket.broadcast.kept_for = (request, key)
        if remember is not None:
            if ticket.leader:
                # After the flight's first step (its task, made first, runs first), which
                # sends its call: noted while the upstream answers, not before it is asked.
                asyncio.get_running_loop().call_soon(remember)
            else:
                remember()
        # (Watched from now on, not before: the flight's task, made first, runs first, and its
        # call goes out a turn of the loop sooner.)
        _waiting(client)
        # A joiner that timed out leads a fresh call of its own, not another wait elsewhere.
        reply = await self._follow(
            route, ticket, request, key, partial(lead, alone=True), takeover=lead
        )
        # Named only where the cache serves nothing by design: semantic.mode: mark, or a
        # namespace its error budget marked. A serve-mode miss does not name what it was near.
        if probe is not None and probe.nearest is not None and self._marking(key):
            reply.headers.extend(nearest(probe.nearest))
        return reply

    def _marking(self, key: Fingerprint) -> bool:
        """Whether a miss names the nearest entry (``reply.nearest``)."""
        audits = self.layers.audits
        return self.config.semantic.mode == "mark" or (
            audits is not None and audits.state(Budget(key.tenant, key.namespace)) == MARK
        )

    def _read_age(self, request: Request) -> float | None:
        """The oldest cached answer ``request`` accepts (``lead.read_age``: the reader's TTL
        holds whoever wrote the answer); 0: none at all."""
        return read_age(self.config, request)

    def repeat_now(self, client: ClientRequest) -> Reply | None:
        """The path's first step (``_handle``) taken without waiting on anything, for a transport
        that can answer before it makes a task for the request (``http_protocol.py``): a
        byte-identical repeat's stored answer, when the store answers in-process
        (``Store.get_now``). None: take the whole path (``handle``), which takes this step again
        with any store. Not taken while spans are recorded: every request gets its spans."""
        get_now = getattr(self.store, "get_now", None)
        if get_now is None or self.tracer.enabled:
            return None
        client.memo_key, client.keyed = self.repeats.key_of(client), True
        repeat = self._repeat(client.memo_key)
        if repeat is None:
            return None
        answer = self._fresh(get_now(repeat.key), repeat.max_age)
        if answer is None or (repeat.stream and unstreamable(answer, repeat.include_usage)):
            return None  # (an answer of which no stream can be made: ``_cached`` drops it)
        return self._served(client.path, Outcome.HIT, answer, repeat.stream, repeat.include_usage)

    def _repeat(self, memo_key: tuple[Any, ...] | None) -> Repeat | None:
        """What the repeat memo knows of a request with this memo key; in a shared namespace,
        only while its requester is accepted (``repeat_memo.py``)."""
        repeat = self.repeats.get(memo_key) if memo_key is not None else None
        if repeat is not None and (repeat.shared_by is None or repeat.shared_by in self.accepted):
            return repeat
        return None

    async def _exact_hit(
        self,
        route: str,
        request: Request,
        key: str,
        read_age: float | None,
        remember: Callable[[], None] | None,
    ) -> Reply | None:
        """The exact cache's answer for ``key`` served as a hit, if it has one (``_cached``)."""
        answer = await self._cached(key, read_age, *_shape(request))
        if answer is None:
            return None
        if remember is not None:
            remember()
        return self._served(route, Outcome.HIT, answer, request.stream, request.include_usage)

    async def _cached(
        self, key: str, max_age: float | None, kind: str, stream: bool, include_usage: bool
    ) -> Answer | None:
        """The exact cache's answer for ``key``, if it has one younger than ``max_age``, for a
        request of API ``kind`` (``Store.get``) asking it as a stream (``stream``, with the
        usage chunk: ``include_usage``) or as JSON: none (and it is dropped) if it is one of
        which no stream can be made for a streaming client (``lead.unservable``)."""
        with self.tracer.span("carpool.exact"):
            entry = await self.store.get(key, kind)
        answer = self._fresh(entry, max_age)
        if (
            answer is not None
            and stream
            and await unservable(self.store, key, answer, include_usage)
        ):
            return None
        return answer

    def _fresh(self, entry: Entry | None, max_age: float | None) -> Answer | None:
        if entry is None or (max_age is not None and entry.answer.age(self.clock.now()) >= max_age):
            return None
        return entry.answer

    async def _follow(
        self,
        route: str,
        ticket: Ticket,
        request: Request,
        key: Fingerprint,
        lead: partial[Any],  # (``Leader.lead``'s: a flight of another key is led ``flying``)
        takeover: Callable[[Broadcast], Any] | None = None,
    ) -> Reply:
        """Wait on a flight as its leader or a joiner, then reply from its broadcast."""
        try:
            with self.tracer.span(
                "carpool.flight", **{"carpool.role": "leader" if ticket.leader else "joiner"}
            ):
                try:
                    await self._wait(ticket, request, self._join_timeout)
                except JoinTimeout:
                    if not ticket.broadcast.lead_times_out:
                        ticket = ticket.retake(lead, key.owner)
                    # (Else its lead, following another instance's call, gives that up at the
                    # join timeout from its own start, before this joiner's, and makes the
                    # fresh call in this flight: the one its joiners that time out share.)
                    await self._wait(ticket, request, None)
                if takeover is not None and isinstance(ticket.broadcast.error, LeaderLost):
                    # Another instance's call was lost after part of it was relayed here: this
                    # client got none of it (its reply is not made yet; a streaming joiner held
                    # the frames there were: ``_wait``). Its leader may have finished and stored
                    # it (only the relay broke): then that answer; else it takes the call over,
                    # once (its identical neighbours here join the same new flight; other
                    # instances, through Redis).
                    stored = (
                        await self._cached(key.key, self._read_age(request), *_shape(request))
                        if key.key is not None and request.controls.may_read
                        else None
                    )
                    if stored is not None:
                        ticket.release()
                        return self._served(
                            route, Outcome.HIT, stored, request.stream, request.include_usage
                        )
                    ticket = ticket.retake(takeover, key.owner)
                    await self._wait(ticket, request, None)
                controls = request.controls
                if (
                    not ticket.leader
                    and ticket.broadcast.cached
                    and (not controls.may_read or controls.max_age is not None)
                ):
                    # The flight's leader took another worker's cached answer, of an age this
                    # joiner did not accept (no-cache, max-age): its own call, asked with its
                    # own headers (``carpool.peers``).
                    ticket = ticket.retake(lead, key.owner)
                    await self._wait(ticket, request, None)
                elif not ticket.leader and self._too_old(ticket, request):
                    # The flight it joined while it ran was replaying a call another instance
                    # had finished before (``Broadcast.replayed``), longer ago than this joiner
                    # accepts (no-cache: any; max-age): a fresh call, as in one process, where
                    # it would have found that call finished (``FlightGroup.acquire``).
                    ticket = ticket.retake(takeover or lead, key.owner)
                    await self._wait(ticket, request, None)
                if _refused_another(ticket, key):
                    # Its own call, on a flight only its own tenant can join: another refused
                    # tenant's fresh call is not joined either.
                    ticket.release()
                    flying = flight_key(f"{key.key}\n{key.owner}", request, self.config)
                    ticket = self.flights.acquire(
                        flying,
                        partial(lead, flying=flying),  # (indexed under it: ``state_index``)
                        max_age=0,
                        linger=False,
                        owner=key.owner,
                    )
                    await self._wait(ticket, request, None)
                own = _refused_its_body(ticket, request)
                if own is not None:
                    # The upstream refused a body other than this one's (the key leaves out
                    # metadata, user...; 10 and 10.0 are one key): its own call, on a flight
                    # shared only with the same body.
                    ticket.release()
                    flying = flight_key(f"{key.key}\nbody {own}", request, self.config)
                    ticket = self.flights.acquire(
                        flying,
                        partial(lead, flying=flying),  # (indexed under it: ``state_index``)
                        max_age=0,
                        linger=False,
                        owner=key.owner,
                    )
                    await self._wait(ticket, request, None)
        except BaseException:
            ticket.release()
            raise
        broadcast = ticket.broadcast
        # A flight led here but relayed from another instance's call is shared, not a miss; one
        # that another worker answered from its cache is a hit (``carpool.peers``).
        outcome = (
            Outcome.HIT
            if broadcast.cached
            else Outcome.MISS
            if ticket.leader and not broadcast.remote
            else Outcome.COALESCED
        )
        if request.stream and (
            broadcast.frames or isinstance(broadcast.error, UpstreamStreamBroken)
        ):
            # A live stream: relay it; the ticket is released when this client's stream ends.
            # A stream that failed before its first chunk (an engine's empty 200 stream, e.g.
            # a prompt over its context) ends the same way, as an SSE error event after a 200:
            # a 502 would be retried by the SDKs, one client call making three engine calls.
            self.stats.count(route, outcome)
            saved = partial(self._saved, outcome) if outcome.saved else None
            shown = partial(_shown, ticket, request, key)
            headers = [*SSE_HEADERS, outcome.header]
            if outcome is Outcome.HIT and broadcast.created is not None:
                # Another worker's cached answer: as old as the owner said (``Exchange.fetch``).
                headers.append(age_header(self.clock.now() - broadcast.created))
            relay = Relay(request.api, broadcast, request.include_usage, saved, shown)
            return Reply(
                200,
                headers,
                stream=relay,
                outcome=outcome,
                on_close=ticket.release,
                # (To a client that asked for the usage too: the stream it is sent, which an
                # idempotency record keeps, joined once for the flight, not copied as it goes.)
                with_usage=relay.with_usage,
                answered=relay.answered,
            )
        ticket.release()
        if broadcast.error is not None:
            self.stats.count(route, outcome)
            return error_reply(_shown(ticket, request, key, broadcast.error), outcome, request.api)
        answer = broadcast.answer
        assert answer is not None
        if not answer.complete and not _own_call(ticket, request, key, answer.requester):
            # An incomplete 2xx body may report the upstream's error, quoting the request whose
            # call it was, as an error status's may (``_shown``): told without its words.
            answer = answer.for_others()
        return self._served(route, outcome, answer, request.stream, request.include_usage)

    def _too_old(self, ticket: Ticket, request: Request) -> bool:
        """Whether ``ticket``'s flight replayed a finished call (``Broadcast.replayed``; it
        finished when that call did) longer ago than ``request`` accepts: ``acquire``'s rule
        for a finished flight, its join age 0 with no-cache."""
        finished_at = ticket.flight.finished_at
        if ticket.broadcast.replayed is None or finished_at is None:
            return False
        controls = request.controls
        max_age = controls.max_age if controls.may_read else 0
        return max_age is not None and self.flights.clock.monotonic() - finished_at >= max_age

    @staticmethod
    async def _wait(ticket: Ticket, request: Request, timeout: float | None) -> None:
        # The join timeout bounds the wait for the flight's first sign of life (a frame, or the
        # whole answer): a leader that is streaming is not stuck, however long its answer.
        if not request.stream and (ticket.leader or timeout is None):
            await ticket.wait_done(None)  # (the same, in one wait: nothing bounds it)
            return
        broadcast = ticket.broadcast
        # A streaming joiner of a call another instance leads takes none of its frames until
        # that call shows life since it came (``Broadcast.leader_elsewhere``): its leader may
        # have died unseen, and then this client gets nothing of the dead call, and a takeover
        # answers it whole (``_follow``), as the relay holds the frames it found at its start.
        joiner = request.stream and not ticket.leader
        held = broadcast.hold() if joiner and broadcast.leader_elsewhere else 0
        await ticket.wait_started(timeout)
        if not request.stream:
            await ticket.wait_done(None)
        elif held:
            await broadcast.wait_alive(held)

    def _served(
        self,
        route: str,
        outcome: Outcome,
        answer: Answer,
        stream: bool,
        include_usage: bool,
        extra: Sequence[tuple[bytes, bytes]] = (),
        *,
        recomputed: bool = False,
    ) -> Reply:
        """A reply carrying a whole answer (``reply.whole``), counted; ``recomputed``: the
        engine is asked for it all the same (an audit), its tokens not saved."""
        self.stats.count(route, outcome)
        if outcome.saved and not recomputed:
            self._saved(outcome, answer)
        return whole(outcome, answer, stream, include_usage, extra, now=self.clock.now())

    def _saved(self, outcome: Outcome, answer: Answer) -> None:
        """A request answered without a call of its own: the tokens the engine reported for the
        answer were not recomputed. An answer it reported none for is counted apart, so that
        ``tokens_saved`` reads as what it is, a lower bound."""
        if COUNTED_ELSEWHERE.get():  # (by another worker: ``metrics``' contract)
            return
        self.stats.tokens_saved += answer.tokens
        if answer.usage_missing:
            self.stats.saved_without_usage += 1

    # ---------------------------------------------------------------------------------------
    # Library API; and the library's handle on the layers (their work: ``layers.py``, ``admin.py``)

    async def request(
        self,
        path: str,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str] | None = None,
        query: str = "",
    ) -> Reply:
        """Run one request through the pipeline without HTTP; a stream is read to the end.
        ``query``: the query string (forwarded upstream and part of the key), without ``?``.

        A bad body or header value is answered as over HTTP: a 400 in the API's error shape,
        counted as rejected. Arguments that no HTTP request to a cached endpoint could carry
        raise instead, before anything is counted: ``ValueError`` for a ``path`` that is not a
        cached endpoint (the message names them; one trailing ``/`` is the endpoint's, as over
        HTTP; any other ``/v1`` path: ``passthrough``), a header name that is no token, or a
        ``query`` a URL cannot hold (not ASCII: percent-encode it); ``TypeError`` for a header
        name or value, or a ``query``,
        that is not a ``str``; ``RuntimeError`` once the gateway is closed (``aclose``: its
        upstream connections would be opened again, and nothing would close them), or on
        another event loop than the one it was first used on (``bind``)."""
        self.bind()
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        client = ClientRequest(_endpoint(path), raw, _lowered(headers or {}), _query_of(query))
        started = time.monotonic()
        broken = next(
            (
                name
                for name, value in client.headers.items()
                if http_syntax.CONTROL.search(value) and name not in IDEMPOTENCY_HEADERS
            ),
            None,
        )
        if broken is not None:
            # A value HTTP cannot carry (the upstream client refused to build the call): a
            # bad header value, answered as the others are. (Not the idempotency key's: never
            # sent upstream, its own check answers it, in its own shape.)
            self.stats.rejected += 1
            why = f"{broken}: a header value cannot hold a control character (but a tab)"
            reply = refusal(RequestError(why, "invalid_header"), BY_PATH[client.path])
        else:
            reply = await self.handle(client)
        try:
            if reply.stream is not None:
                reply.body = b"".join([chunk async for chunk in reply.stream])
                reply.stream = None
        finally:
            reply.close()
            self.observe(reply, time.monotonic() - started)  # (to its end, as the server does)
        # A miss's clients are woken before its answer is stored, which follows in the same
        # turn of the loop (``Leader.lead``): a caller asking again at once, without the turn
        # any transport takes in between, would join the flight rather than hit its answer.
        await asyncio.sleep(0)
        return reply

    def observe(self, reply: Reply, seconds: float) -> None:
        """A request's latency, from its arrival to its reply's end, in ``latency_ms`` and
        ``carpool_request_duration_seconds`` under its outcome (``request``, and the HTTP
        server for the requests it serves: it never calls ``request``). Only a request counted
        under its outcome: not one the gateway refused (``rejected``), so that the histogram
        counts what ``carpool_requests_total`` does (but for a keyed list, whose items are
        counted each and which is timed once); nor one another worker passed on
        (``COUNTED_ELSEWHERE``: timed where it is counted)."""
        if reply.outcome is not None and not reply.rejected and not COUNTED_ELSEWHERE.get():
            self.metrics.observe(reply.outcome, seconds)

    def observe_unanswered(self, counted: Counted, seconds: float) -> None:
        """``observe``, for a request served over HTTP whose reply never came back to be timed:
        cancelled (its client gone, or the shutdown) after its outcome was counted here (as
        its idempotency record was being kept). Timed under that outcome all the same, so
        that each request counted under an outcome is timed under it."""
        outcome = counted.outcome
        if outcome is not None:
            self.metrics.observe(outcome, seconds)

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: RequestBody
    ) -> PassthroughResponse:
        """Any other ``/v1/...`` call, forwarded unchanged to a replica and never cached.
        ``path`` is relative to the upstream's /v1 and already confined (``carpool.paths``);
        a transport failure downs the replica (``ReplicaSet.passthrough``). A 401 or 403 it
        answers takes back its tenant's acceptance (``AcceptedCredentials.refuse``), as on the
        cached endpoints. A call on a stored response or chat completion
        (``/responses/{id}...``, ``/chat/completions/{id}...``), a file or a batch
        (``/files/{id}...``, ``/batches/{id}...``, a ``POST /batches`` of a file) goes to the
        replica that keeps it (``routing.state``), which an upload's or a batch's answer tells
        (``learning``). The answer is the caller's to read to its end or close
        (``PassthroughResponse.aclose``): the call is counted in flight on its replica until then.
        An ``Idempotency-Key`` (``X-Idempotency-Key``) is held to the cached endpoints' rule
        (``parse_key``): an invalid one raises ``IdempotencyKeyInvalid`` (400, problem+json),
        nothing sent. A valid one is no record's: the call runs each time it comes, its key
        forwarded for the upstream to honour (or not), but with a credential the gateway holds
        (``upstream.http``).
        ``RuntimeError`` once the gateway is closed, or on another event loop, as ``request``."""
        self.bind()
        # The key is checked as on the cached endpoints (a client that sent a malformed one
        # hears so wherever it sent it) but not recorded: the gateway keeps no record of a call
        # it does not understand (a body of any size and type, a stream, a file), so it cannot
        # replay one; the upstream may.
        parse_key(headers)
        holder: str | None = None
        tenant: str | None = None
        learns = False
        if self.replicas.chooses:
            stored = path_state(path) or posted_state(method, path, body)
            learns = answer_names(method, path)
            if stored is not None or learns:
                tenant = requester(headers, self.config)
                holder = self.layers.holders.holder(tenant, stored)
        response = await self.replicas.passthrough(method, path, query, headers, body, holder)
        if response.status in (401, 403):
            # The upstream refused the requester's credentials, whatever the call: every
            # acceptance of its tenant is taken back, as a cached endpoint's refusal takes it
            # (``Exchange._refused``), or a key revoked upstream read the shared namespaces
            # until ``tenant.accepted_ttl``. (A refusal of the gateway's own key never comes
            # here: ``UpstreamKeyRefused``, which says nothing of the client's.)
            self.accepted.refuse(tenant if tenant is not None else requester(headers, self.config))
        if learns and tenant is not None and 200 <= response.status < 300:
            # (A file uploaded, a batch made or looked at: where it and its files are kept.)
            remember = partial(self.layers.holders.remember, tenant, replica=response.replica)
            response.body = learning(response.body, remember)
        if 200 <= response.status < 300 and (changed := path_changed(method, path)) is not None:
            # Gone (or changed) upstream: the answers that are or continue it, or name it (a
            # file), go too, before the client hears so (their ids name nothing now, or what
            # their request did not ask for; what it deleted is not served again).
            try:
                await self._forget_state(requester(headers, self.config), changed)
            except BaseException:
                await response.aclose()  # (never relayed: its replica's call is over)
                raise
        return response

    async def _forget_state(self, tenant: str, state_id: str) -> None:
        """Drop the answers tagged as being, continuing or naming ``state_id`` (a response, a
        chat completion, a file: ``state_tag``) in ``tenant``, the deleter's, by key: what this process stored under the tag
        (``forget_state``), then what each other worker (``Peers.forget_state``) and instance
        (``InvalidationChannel.publish_state``) did. No flight is forgotten, no epoch moved,
        no layer scanned: a client's DELETE costs its own answers' keys, nothing of the other
        tenants'. Redis failing, what it holds stays until its TTL (logged): the upstream
        deleted it all the same, and a retried DELETE would be a 404."""
        tag = state_tag(tenant, state_id)
        await self.forget_state(tag)
        if self.peers is not None:
            await self.peers.forget_state(tag)
        if self.invalidations is not None:
            await self.invalidations.publish_state(tag)

    async def forget_state(self, tag: str) -> int:
        """Here only: drop what this process stored under ``tag`` (a deleted response's or
        file's ``state_tag``: ``StateIndex.take``), and store no answer carrying it from now on; how
        many answers went."""
        return await self._forget_held(self.layers.states.take(tag))

    async def _forget_held(self, held: Held) -> int:
        """``held``'s answers dropped: each key's lingering flight (here and in Redis:
        ``SharedFlights.forget``), its entry (here and in Redis: ``SharedStore.forget``), its
        semantic entries (this process's copies; another instance's reference to the key dies
        with it); and the flights whose calls run under
        it shut (``StateIndex.fly``): no request joins them from now on, and their answers,
        which are or continue it, are not stored (``Leader._store`` asks)."""
        dropped = 0
        for key in held.flying:
            self.flights.shut(key)
        for key in held.keys:
            self.flights.shut(key)
            try:
                dropped += await self.store.forget(key)
            except StoreUnavailable as error:
                log.warning("an answer of a deleted response stays until its TTL: %s", error)
        if self.semantic is not None:
            for entry in held.entries:
                dropped += self.semantic.forget_entry(entry)
        if self.shared_flights is not None:
            # Their calls kept joinable in Redis (lingering in the window, or running) are
            # replayed or followed by no instance from now on, this one included: the entries
            # are gone, and a replay would hand the deleted response out again. (Not counted:
            # the answers are.)
            await self.shared_flights.forget(dict.fromkeys((*held.keys, *held.flying)))
        return dropped

    async def invalidate(self, spec: Any, *, everywhere: bool = True) -> int:
        """Drop the answers matching ``{"tag"|"namespace"|"prefix": str}`` or ``{"all": true}``
        (``admin.invalidate``), here and, ``everywhere``, on this run's other workers
        (``carpool.peers``; not when a peer passed it on)."""
        dropped = await admin.invalidate(self.layers, spec)
        if everywhere and self.peers is not None:
            dropped += await self.peers.invalidate(spec)
            # Again, here and everywhere: while the workers took it one by one, one that had
            # may have asked one that had not yet (a key's owner) and kept its old answer.
            # Once every worker has dropped its own, none holds an old answer to give; this
            # pass drops what was kept meanwhile, and moves every worker's epoch on again, so
            # that a call begun before it (with an old answer on its way) is not stored.
            dropped += await admin.invalidate(self.layers, spec)
            dropped += await self.peers.invalidate(spec)
        return dropped

    def snapshot(self) -> dict[str, Any]:
        """The /stats document (``admin.snapshot``)."""
        return admin.snapshot(self.layers)

    async def refresh_figures(self) -> None:
        """Before a report (``snapshot``, ``metrics``): the figures read from Redis brought up
        to date when they are older than its stats interval (``admin.refresh``)."""
        await admin.refresh(self.layers)

    def redis_health(self) -> dict[str, Any]:
        """``{"state": "off" | "up" | "degraded", ...}`` for /stats (``admin.redis_health``)."""
        return admin.redis_health(self.layers)

    def redis_state(self) -> dict[str, Any]:
        """Whether Redis is up, for /healthz: no traffic counter (``admin.redis_state``)."""
        return admin.redis_state(self.layers)

    def start(self) -> None:
        """Start the layers' background work (``Layers.start``); ``RuntimeError`` once the
        gateway is closed: served again after its app's shutdown (a second ``TestClient``, a
        server restarted in the process) it answered misses on an upstream pool reopened, and
        every other request with a 500."""
        if self.closed:
            raise RuntimeError("this gateway is closed (aclose): build another")
        with contextlib.suppress(RuntimeError):  # (no loop running: bound by its first request)
            self._loop = asyncio.get_running_loop()
        self.layers.start()

    @property
    def started(self) -> bool:
        """Whether the gateway is bound to its event loop (``start`` there, or ``bind``)."""
        return self._loop is not None

    def bind(self) -> None:
        """A library call (``request``, ``passthrough``), or an HTTP request to an app mounted
        without its lifespan (``GatewayApp``), on the gateway's event loop: the first binds it
        and starts its layers (``start``: a host that mounts the app without its lifespan, or
        never serves it, had its tracer never looked up); a call on another loop
        is refused (``asyncio.run`` a request: the upstream connections, Redis's and the
        timers belong to the first loop: a 502 blamed on the upstream, then ``aclose`` failed)."""
        if self.closed:
            raise RuntimeError("this gateway is closed (aclose): build another")
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            raise RuntimeError(
                "this gateway runs on the event loop it was first used on (its connections "
                "belong to it): build one gateway per event loop"
            )
        self.start()

    def begin_draining(self) -> None:
        """The gateway is stopping (see the module docstring)."""
        self.draining = True
        self.batcher.flush()
        if self.peers is not None:  # (a keyed request waiting for a dead owner waits no more)
            self.peers.stopping = True

    async def aclose(self) -> None:
        """Close the layers (``Layers.aclose``), the audits still running first; ``request``
        refuses to run from then on."""
        self.closed = True
        await self.settle()
        await self.auditor.aclose()
        await self.layers.aclose()

    async def settle(self) -> None:
        """Before the layers close (the upstream clients, Redis): the flights' calls still
        running (nothing here waits on them any more once the server stopped its requests; other
        instances' followers may) go on until ``stop_by``, the end of the grace period. Those
        left then are cancelled, as a call whose clients all left, not cut by their client's
        closing under them: followers elsewhere take the call over (its leader ``gone``), none
        is told the upstream failed, no replica is downed; a client still waiting on one here
        (another worker's, which asked this one, its key's owner) is told it is shutting down,
        and that worker makes the call itself. Then, for at most ``SETTLE_S``, the
        cleanup of those calls and of the requests the server cut runs (a key's record given
        up, a flight's lock released), while Redis is still open."""
        calls = list(self.flights.calls)
        if calls and self.stop_by is not None and (left := self.stop_by - time.monotonic()) > 0:
            await asyncio.wait(calls, timeout=left)
        self.flights.settling = True
        for call in calls:
            call.cancel()
        ending = [*calls, *(task for task in self.serving if task is not asyncio.current_task())]
        if ending:
            await asyncio.wait(ending, timeout=SETTLE_S)


# How long a closing gateway lets the cut requests' and cancelled calls' cleanup run (a few
# Redis round trips each, bounded by ``distributed.timeout``).
SETTLE_S = 2.0


def _endpoint(path: str) -> str:
    """``path`` as the cached endpoint it names (``Gateway.request``); ``ValueError`` if none."""
    endpoint = path[:-1] if path.endswith("/") else path  # (as the HTTP server takes it)
    if endpoint not in BY_PATH:
        raise ValueError(
            f"Gateway.request serves the cached endpoints {', '.join(BY_PATH)}, not {path!r} "
            "(any other /v1 path: Gateway.passthrough)"
        )
    return endpoint


def _lowered(headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` with lower-case names (as ASGI gives them); ``TypeError`` for one not text,
    ``ValueError`` for a name that is no RFC 9110 token (the upstream client refused it, and
    the replica was downed)."""
    lowered = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            wrong = value if isinstance(name, str) else name
            raise TypeError(
                f"header {name!r}: names and values must be str, not {type(wrong).__name__}"
            )
        if not http_syntax.TOKEN.fullmatch(name):
            raise ValueError(f"header {name!r}: no HTTP request could carry this name")
        lowered[name.lower()] = value
    return lowered


def _query_of(query: str) -> bytes:
    """``query`` as the bytes an HTTP request would bring; ``ValueError`` for one that no URL
    could carry (``request.check_query``'s rule, which answers a 400 over HTTP)."""
    if not isinstance(query, str):
        raise TypeError(f"query must be str (without '?'), not {type(query).__name__}")
    try:
        return check_query(query.encode("utf-8")).encode("ascii")
    except RequestError as error:
        raise ValueError(f"query {query!r}: {error.message}") from None


# What an upstream answers about the requester rather than the request: its key refused, out of
# credit, not allowed the model (OpenAI says 404 model_not_found), rate-limited.
_CREDENTIAL_ERRORS = frozenset({401, 402, 403, 404, 407, 429})


def _shape(request: Request) -> tuple[str, bool, bool]:
    """How ``request`` reads a cached answer (``Gateway._cached``): its API's kind, as a stream
    or not, with the usage chunk or not."""
    return request.kind, request.stream, request.include_usage


def _refused_another(ticket: Ticket, key: Fingerprint) -> bool:
    """Whether the flight ended with a refusal of someone else's credentials, or their rate
    limit: in a shared namespace, a call led by another tenant (here, or on another instance).
    That is not this request's answer, which makes its own call."""
    error = ticket.broadcast.error
    return (
        key.tenant == "*"
        and isinstance(error, UpstreamStatusError)
        and error.status in _CREDENTIAL_ERRORS
        and (ticket.broadcast.remote or ticket.flight.owner != key.owner)
    )


def _own_call(ticket: Ticket, request: Request, key: Fingerprint, requester: str | None) -> bool:
    """Whether the flight's call, made for ``requester`` (``requester_digest`` of the body it
    sent; None: not known), was for ``request``: the same body but for its delivery, and the
    same tenant (in a shared namespace, a call led here by it). What the upstream said of a
    call may quote its request (its ``user``, its metadata, its key): only that request's
    client is told it in the upstream's words."""
    return (
        requester is not None
        and requester == requester_digest(request.body)
        and (
            key.tenant != "*" or (not ticket.broadcast.remote and ticket.flight.owner == key.owner)
        )
    )


def _shown(ticket: Ticket, request: Request, key: Fingerprint, error: CarpoolError) -> CarpoolError:
    """The flight's ``error`` as ``request``'s client may see it: as it came for the request
    whose call it was (``_own_call``), else without the upstream's words
    (``UpstreamError.for_others``). (An error reported in a 2xx body, an incomplete answer, is
    told likewise: ``Answer.for_others``.)"""
    if not isinstance(error, UpstreamError) or _own_call(ticket, request, key, error.requester):
        return error
    return error.for_others()


def _refused_its_body(ticket: Ticket, request: Request) -> str | None:
    """The digest of ``request``'s body (``body_digest``) when the flight ended with a 4xx
    answered to another body: a request with the same key may differ in what the key leaves
    out (``metadata``, ``user``, ``stream_options``...) or in spelling (``10.0`` for ``10``),
    which the upstream may refuse where it accepts this one. None: the flight's answer is this
    request's. Not for what an upstream answers about the requester or the moment (a
    credential refused, a rate limit, 408: ``_refused_another`` takes the first two), which
    another body would not change. Never stored either way: only 2xx answers are."""
    error = ticket.broadcast.error
    if (
        not isinstance(error, UpstreamStatusError)
        or not 400 <= error.status < 500
        or error.status in _CREDENTIAL_ERRORS
        or error.status == 408
    ):
        return None
    own = body_digest(request.body)
    # (A relayed error that says no body, from an older instance: this one's may differ.)
    return None if error.asked == own else own


def _waiting(client: ClientRequest) -> None:
    if client.on_wait is not None:
        client.on_wait()
