"""The request's path through the layers, in order, as one function: ``Gateway.handle``.

    parse -> fingerprint -> exact cache -> single-flight (lead or join) -> upstream -> store

Contract:
- ``handle`` never raises for a client's request: every outcome, bad input and upstream failure
  included, is a ``Reply`` with a status, headers (``x-carpool`` on every cached endpoint) and a
  body or an SSE stream. Only cancellation (the client left) propagates.
- A streaming ``Reply`` holds the request's place in its flight until ``Reply.close()``; the
  transport calls it when the stream ends or the client goes (which may cancel the upstream call).
- The upstream call of a flight runs in the flight's own task (``_lead``), never in a client's:
  it streams into the flight's broadcast, then stores a complete answer before the flight ends,
  so a request that no longer finds the flight finds the answer in the cache.
- Every API's own knowledge (validation, sharing, framing, judging, assembling, synthesizing,
  error shapes) is its ``carpool.apis.Api`` (``request.api``): chat, completions, embeddings,
  OpenAI's Responses API and Anthropic's Messages API go through this same path.
- Nothing broken is stored: only complete 2xx answers, with ttl > 0, without ``no-store``.
  Complete: a chat/completions stream that ended with ``[DONE]`` and a finish for every choice
  asked for (``n`` per prompt: ``sse.expected_choices``), a typed stream (Responses, Messages)
  that ended with its last event and completed (``Api.judge_stream``). A stream that stopped
  short fails the flight (``_consume``: an SSE error event for streaming clients, a 502 for the
  others). A whole JSON body with fewer choices, or a typed answer that ended without
  completing (Responses ``incomplete``), is served as the upstream sent it, but not stored.
- Errors do not multiply calls: a flight whose stream failed, even before its first chunk (an
  engine's empty 200 stream), ends a streaming client's reply as a 200 SSE stream with an error
  event, and a non-streaming client's as a 502 with ``x-should-retry: false``: a retried 5xx
  would make one client call several engine calls. An error the engine reported keeps its
  status and body (before the stream) or its error object (in the stream). Unreachable (502)
  and timed-out (504) upstreams keep their statuses, for every client.
- An answer served whole (JSON, or SSE to a client that asked for usage) whose body has no
  ``usage`` because the engine reported none carries ``x-carpool-usage: missing``; nothing is
  invented. ``tokens_saved`` counts what the engine reported for the answers of hits and
  joiners (streaming joiners once their stream ended whole); ``saved_without_usage`` counts the
  others.
- With ``redis``, identical requests on different instances share one call too: the lead of each
  instance's flight leads it for all of them or relays it from the instance that does
  (``redis/flights.py``); whatever Redis does, the flight still gets its answer. Semantic
  entries are shared too (``redis/semantic.py``): each instance's index is fed by the others'.
- The HTTP server (``server.py``) and the library API (``Gateway.request``) share this path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from .answer import Answer
from .apis import BY_PATH, Api, api_of
from .batching import EmbeddingBatcher, ListCheck
from .broadcast import Broadcast
from .config import Config
from .errors import (
    CarpoolError,
    LeaderLost,
    RequestError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamStreamBroken,
)
from .fingerprint import (
    Fingerprint,
    RepeatMemo,
    SemanticView,
    fingerprint,
    grant_of,
    names_of,
    request_digest,
    requester,
    semantic_view,
)
from .flight import FlightGroup, JoinTimeout, Ticket
from .idempotency import (
    REPLAYED_HEADER,
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyFormatMismatch,
    IdempotencyMismatch,
    IdempotencyRecords,
    StoredResponse,
    is_final,
    parse_key,
    replay_as,
)
from .identity import AcceptedCredentials
from .metrics import Metrics, Stats
from .outcome import Outcome
from .request import ClientRequest, Request, list_items, merge_items, parse
from .store import Entry, Store
from .tracing import Tracer
from .upstream.base import PassthroughResponse, Upstream, UpstreamRequest, UpstreamResponse
from .wiring import (
    build_idempotency,
    build_invalidations,
    build_replicas,
    build_semantic,
    build_shared_flights,
    build_store,
    window_policy,
)

if TYPE_CHECKING:
    from .redis.flights import SharedFlights
    from .redis.invalidation import InvalidationChannel
    from .semantic.cache import Candidate, Probe, SemanticCache

log = logging.getLogger("carpool")

JSON = (b"content-type", b"application/json")
SSE = (b"content-type", b"text/event-stream")
SSE_HEADERS = [SSE, (b"cache-control", b"no-cache")]
# On an answer whose body has no usage because the engine reported none (README, Streaming).
USAGE_MISSING = (b"x-carpool-usage", b"missing")
PROMPT_PREFIX_CHARS = 1024


@dataclass(slots=True)
class Reply:
    """What the transport sends back: a complete body, or an SSE stream of frames."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    outcome: Outcome | None = None
    on_close: Callable[[], None] | None = field(default=None, repr=False)

    def close(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()

    def json(self) -> Any:
        return orjson.loads(self.body)


class Gateway:
    """carpool's pipeline, transport-free. Build one per process; close it with ``aclose``."""

    def __init__(
        self,
        config: Config | None = None,
        upstreams: Sequence[Upstream] = (),
        store: Store | None = None,
        semantic: SemanticCache | None = None,
    ) -> None:
        self.config = config or Config()
        if not upstreams:
            from .upstream import build_upstreams

            upstreams = build_upstreams(self.config)
        self.upstreams = list(upstreams)
        self.store: Store = store or build_store(self.config)
        self.shared_flights: SharedFlights | None = build_shared_flights(self.config, self.store)
        coalesce = self.config.coalesce
        self.flights = FlightGroup(
            window=window_policy(coalesce), finish_abandoned=coalesce.finish_abandoned
        )
        # With redis: an invalidation anywhere forgets the flights on every instance, running
        # ones included (their answers are no longer stored).
        self.invalidations: InvalidationChannel | None = build_invalidations(
            self.config, self.store, self.flights.forget_all
        )
        # The tenants the upstream answered recently: only they read a shared namespace.
        tenant = self.config.tenant
        self.accepted = AcceptedCredentials(tenant.accepted_ttl, tenant.accepted_max_entries)
        self.stats = Stats()
        self.tracer = Tracer(self.config.tracing)
        self.repeats = RepeatMemo(
            names_of(self.config.tenant),
            self.config.fingerprint.repeat_memo_bytes,
            min(64 * 1024, self.config.limits.max_body_bytes),
        )
        self.metrics = Metrics(self.stats, self.gauges)
        self.replicas = build_replicas(self.config, self.upstreams, self._observe_attempt)
        # Single embeddings are merged into list calls (identical ones were coalesced before),
        # but only where every replica is known to answer a list as it answers each item alone
        # (batching.embeddings; ``ListCheck``): merging must not change an answer.
        batching = self.config.batching
        self.batcher = EmbeddingBatcher(
            lambda upstream_request: self._call(upstream_request, ""),
            max_batch_size=batching.max_batch_size,
            max_batch_delay_s=batching.max_batch_delay_ms / 1000,
            max_batch_tokens=batching.max_batch_tokens,
            observe_wait=self.metrics.batch_wait.observe,
            observe_size=self.metrics.batch_size.observe,
            key_headers=names_of(self.config.tenant),
            lists=ListCheck(
                batching.embeddings, self.upstreams, retry_s=batching.embeddings_probe_retry
            ),
        )
        self._join_timeout = self.config.coalesce.join_timeout_ms / 1000
        self.semantic: SemanticCache | None = (
            semantic
            if semantic is not None
            else build_semantic(self.config, self.upstreams, self.store)
        )
        self._background: set[asyncio.Task[Any]] = set()
        self.idempotency: IdempotencyRecords = build_idempotency(self.config, self.store)

    # ---------------------------------------------------------------------------------------
    # The request's path

    async def handle(self, client: ClientRequest) -> Reply:
        """One request to a cached endpoint, from its raw bytes to the reply (see ``_handle``)."""
        with self.tracer.span("carpool.request", **{"carpool.route": client.path}) as span:
            reply = await self._handle(client)
            span.set_attribute("carpool.outcome", reply.outcome.value if reply.outcome else "")
            return reply

    async def _handle(self, client: ClientRequest) -> Reply:
        route = client.path
        # A byte-identical repeat of a request parsed before goes straight to the exact cache:
        # the same bytes, query and headers (controls, credentials, forwarded ones) always make
        # the same fingerprint; in a shared namespace, only while the requester is accepted.
        memo_key = self.repeats.key_of(client)
        repeat = self.repeats.get(memo_key) if memo_key is not None else None
        if repeat is not None and (repeat.shared_by is None or repeat.shared_by in self.accepted):
            answer = await self._cached(repeat.key, repeat.max_age)
            if answer is not None:
                return self._served(route, Outcome.HIT, answer, repeat.stream, repeat.include_usage)
        try:
            request = parse(
                client, self.config.limits.max_body_bytes, self.config.limits.max_json_depth
            )
            idempotency_key = parse_key(client.headers)
        except (RequestError, IdempotencyError) as error:
            self.stats.rejected += 1
            # Every answer of a cached endpoint says what it was; a rejected one was not shared.
            return _error_reply(error, Outcome.BYPASS, BY_PATH[route])
        key = fingerprint(request, self.config, self.accepted)
        if memo_key is not None:
            self.repeats.remember(memo_key, request, key, self._read_age(request))
        if idempotency_key is not None:
            return await self._idempotent(client, request, key, idempotency_key, route)
        return await self._answer(client, request, key, route)

    async def _answer(
        self, client: ClientRequest, request: Request, key: Fingerprint, route: str
    ) -> Reply:
        """Bypass, or: exact cache -> a flight in progress -> semantic cache -> lead a flight."""
        if key.key is None:
            _waiting(client)
            return await self._bypass(request, route)
        controls = request.controls
        read_age = self._read_age(request)
        if controls.may_read and read_age != 0:
            answer = await self._cached(key.key, read_age)
            if answer is not None:
                return self._served(
                    route, Outcome.HIT, answer, request.stream, request.include_usage
                )
        _waiting(client)
        join_age = controls.max_age if controls.may_read else 0
        view = (
            semantic_view(request, key, self.config)
            if self.semantic is not None and not controls.no_store
            else None
        )
        probe = None
        if (
            view is not None
            and controls.may_read
            and read_age != 0
            and not self.flights.joinable(key.key, join_age)
        ):
            assert self.semantic is not None  # (a view is made only with a semantic cache)
            with self.tracer.span("carpool.semantic") as span:
                probe = await self.semantic.probe(view, read_age)
                if probe.match is not None:
                    span.set_attribute("carpool.similarity", probe.match.similarity)
            if probe.match is not None and self.config.semantic.mode == "serve":
                assert probe.match.answer is not None
                self.metrics.similarity.observe(probe.match.similarity)
                return self._served(
                    route,
                    Outcome.SEMANTIC_HIT,
                    probe.match.answer,
                    request.stream,
                    request.include_usage,
                    _similarity(probe.match),
                )
        # The epoch of invalidations this call begins in: its answer is stored only if no
        # invalidation came before it ended (``_store``).
        lead = partial(self._lead, request, key, view, probe, epoch=self.flights.epoch)
        ticket = self.flights.acquire(
            key.key, lead, max_age=join_age, linger=not controls.no_store, owner=key.owner
        )
        # A joiner that timed out leads a fresh call of its own, not another wait elsewhere.
        reply = await self._follow(
            route, ticket, request, key, partial(lead, alone=True), takeover=lead
        )
        if probe is not None and probe.nearest is not None:  # semantic.mode: mark
            reply.headers.extend(_nearest(probe.nearest))
        return reply

    def _read_age(self, request: Request) -> float | None:
        """The oldest cached answer ``request`` accepts: its ``max-age``, bounded by its type's TTL
        (the reader's policy holds whoever wrote the answer); 0: none at all."""
        ttl = self.config.ttl_for(request.controls.request_type)
        max_age = request.controls.max_age
        return ttl if max_age is None or ttl < max_age else max_age

    async def _cached(self, key: str, max_age: float | None) -> Answer | None:
        """The exact cache's answer for ``key``, if it has one younger than ``max_age``."""
        with self.tracer.span("carpool.exact"):
            entry = await self.store.get(key)
        if entry is None or (max_age is not None and entry.answer.age() >= max_age):
            return None
        return entry.answer

    async def _idempotent(
        self,
        client: ClientRequest,
        request: Request,
        key: Fingerprint,
        idempotency_key: str,
        route: str,
    ) -> Reply:
        """A request with an Idempotency-Key runs at most once; retries get its first answer.

        Only a final answer is kept (``idempotency.is_final``): after a retryable one (not
        executed, not a complete answer, a stream that failed) the record is dropped and a
        retry runs again. A replay comes in the retry's format, or is a 422 (``replay_as``).
        """
        records = self.idempotency
        scoped, digest = (
            f"{key.owner}\n{idempotency_key}",
            request_digest(request, key, self.config),
        )
        begin = await records.begin(scoped, digest)
        if begin.state == "processing" and self.config.idempotency.on_conflict == "wait":
            _waiting(client)
            await records.wait(scoped, digest, self._join_timeout)
            begin = await records.begin(scoped, digest)
        if begin.state == "mismatch":
            return _error_reply(IdempotencyMismatch(), Outcome.BYPASS, request.api)
        if begin.state == "processing":
            return _error_reply(IdempotencyConflict(), Outcome.BYPASS, request.api)
        if begin.state == "done":
            assert begin.response is not None
            stored = replay_as(begin.response, request.kind, request.stream, request.include_usage)
            if stored is None:
                return _error_reply(
                    IdempotencyFormatMismatch(begin.response.streamed), Outcome.BYPASS, request.api
                )
            self.stats.count(route, Outcome.HIT)
            return Reply(
                stored.status,
                [*stored.headers, Outcome.HIT.header, REPLAYED_HEADER],
                stored.body,
                outcome=Outcome.HIT,
            )
        token = begin.token
        assert token is not None
        items = list_items(request)
        try:
            if items is None:
                reply = await self._answer(client, request, key, route)
            else:
                reply = await self._items(client, items, scoped, route)
        except BaseException:
            await _shielded(records.abandon(scoped, token))
            raise
        if items is not None and reply.status >= 300:
            # Not kept whole: its items that succeeded are kept, so a retry computes the rest.
            await records.abandon(scoped, token)
        elif reply.stream is None:
            stored = StoredResponse(
                reply.status, _replayable(reply.headers), reply.body, request.stream
            )
            if is_final(request.kind, stored):
                await records.finish(scoped, token, stored)
            else:
                await records.abandon(scoped, token)  # retryable: a retry runs again
        else:
            recorded = _Recorded(
                records,
                scoped,
                token,
                request.kind,
                StoredResponse(reply.status, _replayable(reply.headers), b"", request.stream),
            )
            reply.stream = _recorded(reply.stream, recorded)
            reply.on_close = partial(recorded.close, reply.on_close)
        return reply

    async def _items(
        self, client: ClientRequest, items: list[Request], scoped: str, route: str
    ) -> Reply:
        """A list input under one Idempotency-Key: each item is a sub-request with its record."""
        records = self.idempotency

        async def item(i: int, request: Request) -> tuple[StoredResponse, Outcome]:
            key = fingerprint(request, self.config, self.accepted)
            item_key = f"{scoped}\n{i}"
            begin = await records.begin(item_key, request_digest(request, key, self.config))
            if begin.state == "done":
                assert begin.response is not None
                return begin.response, Outcome.HIT
            if begin.state != "new" or begin.token is None:
                error = (
                    IdempotencyMismatch() if begin.state == "mismatch" else IdempotencyConflict()
                )
                return StoredResponse(
                    error.status, _replayable(_error_reply(error, None).headers), error.body()
                ), Outcome.BYPASS
            try:
                reply = await self._answer(client, request, key, route)
            except BaseException:
                await _shielded(records.abandon(item_key, begin.token))
                raise
            stored = StoredResponse(reply.status, _replayable(reply.headers), reply.body)
            outcome = reply.outcome or Outcome.MISS
            # Only a good answer is kept: whatever else the item got (an error, final or not,
            # or a 200 that is no answer) is computed again by a retry.
            if reply.status < 300 and is_final(request.kind, stored):
                await records.finish(item_key, begin.token, stored)
                return stored, outcome
            await records.abandon(item_key, begin.token)
            if reply.status < 300:
                # A 200 that is not an answer (an error body, no data, not JSON) fails the list
                # as the upstream's failure, never as the gateway's crash in merge_items.
                return _item_failed(i), outcome
            return stored, outcome

        results = await asyncio.gather(*(item(i, request) for i, request in enumerate(items)))
        kind = items[0].kind
        for stored, outcome in results:
            if stored.status >= 300:
                return Reply(
                    stored.status, [*stored.headers, outcome.header], stored.body, outcome=outcome
                )
        outcomes = {outcome for _, outcome in results}
        outcome = (
            Outcome.MISS
            if Outcome.MISS in outcomes
            else Outcome.HIT
            if outcomes == {Outcome.HIT}
            else Outcome.COALESCED
        )
        try:
            body = merge_items(kind, [orjson.loads(stored.body) for stored, _ in results])
        except (KeyError, TypeError, ValueError, AttributeError):
            # Complete answers of an odd shape (say, a choice index that is not a number), or
            # an item kept by an older gateway that did not check its answer.
            stored = _item_failed(None)
            return Reply(
                stored.status, [*stored.headers, outcome.header], stored.body, outcome=outcome
            )
        return Reply(200, [JSON, outcome.header], orjson.dumps(body), outcome=outcome)

    async def _follow(
        self,
        route: str,
        ticket: Ticket,
        request: Request,
        key: Fingerprint,
        lead: Callable[[Broadcast], Any],
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
                    ticket = ticket.retake(lead, key.owner)
                    await self._wait(ticket, request, None)
                if (
                    takeover is not None
                    and not request.stream
                    and isinstance(ticket.broadcast.error, LeaderLost)
                ):
                    # Another instance's call was lost after part of it was relayed here: this
                    # client got none of it. Its leader may have finished and stored it (only
                    # the relay broke): then that answer; else it takes the call over, once (its
                    # identical neighbours here join the same new flight; other instances,
                    # through Redis).
                    stored = (
                        await self._cached(key.key, self._read_age(request))
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
                if _refused_another(ticket, key):
                    # Its own call, on a flight only its own tenant can join: another refused
                    # tenant's fresh call is not joined either.
                    ticket.release()
                    ticket = self.flights.acquire(
                        f"{key.key}\n{key.owner}", lead, max_age=0, linger=False, owner=key.owner
                    )
                    await self._wait(ticket, request, None)
        except BaseException:
            ticket.release()
            raise
        broadcast = ticket.broadcast
        # A flight led here but relayed from another instance's call is shared, not a miss.
        outcome = Outcome.MISS if ticket.leader and not broadcast.remote else Outcome.COALESCED
        if request.stream and (
            broadcast.frames or isinstance(broadcast.error, UpstreamStreamBroken)
        ):
            # A live stream: relay it; the ticket is released when this client's stream ends.
            # A stream that failed before its first chunk (an engine's empty 200 stream, e.g.
            # a prompt over its context) ends the same way, as an SSE error event after a 200:
            # a 502 would be retried by the SDKs, one client call making three engine calls.
            self.stats.count(route, outcome)
            saved = partial(self._saved, outcome) if outcome.saved else None
            return Reply(
                200,
                [*SSE_HEADERS, outcome.header],
                stream=_relay(request.api, broadcast, request.include_usage, saved),
                outcome=outcome,
                on_close=ticket.release,
            )
        ticket.release()
        if broadcast.error is not None:
            self.stats.count(route, outcome)
            return _error_reply(broadcast.error, outcome, request.api)
        assert broadcast.answer is not None
        return self._served(route, outcome, broadcast.answer, request.stream, request.include_usage)

    @staticmethod
    async def _wait(ticket: Ticket, request: Request, timeout: float | None) -> None:
        # The join timeout bounds the wait for the flight's first sign of life (a frame, or the
        # whole answer): a leader that is streaming is not stuck, however long its answer.
        await ticket.wait_started(timeout)
        if not request.stream:
            await ticket.wait_done(None)

    async def _lead(
        self,
        request: Request,
        key: Fingerprint,
        view: SemanticView | None,
        probe: Probe | None,
        broadcast: Broadcast,
        *,
        epoch: int,
        alone: bool = False,
    ) -> Answer:
        """The flight's answer: runs in the flight's own task, never in a client's.

        The upstream call streams into ``broadcast``; a complete answer is stored before the
        flight ends. With shared flights (``redis``) the call is made by the one instance that
        leads it for all, and followed by the others (``redis/flights.py``); ``alone``: here.
        With the semantic cache, the prompt is embedded while the upstream answers (unless the
        probe did already), so that its entry too is in before the flight ends.
        """
        embedding = None
        if (
            view is not None
            and self.semantic is not None
            and (probe is None or probe.vector is None)
        ):
            embedding = asyncio.get_running_loop().create_task(self.semantic.vector(view))
        call = partial(self._call_upstream, request)
        store = partial(
            self._store, request, key, view=view, probe=probe, epoch=epoch, embedding=embedding
        )
        if self.invalidations is not None:  # (lazily, without the server)
            self.invalidations.start()
        try:
            if self.shared_flights is None or alone or key.key is None:
                answer = await call(broadcast)
                await store(answer)
                return answer
            controls = request.controls
            return await self.shared_flights.run(
                key.key,
                broadcast,
                call,
                store,
                max_age=controls.max_age if controls.may_read else 0,
                linger=not controls.no_store,
            )
        finally:
            if embedding is not None:  # not stored (a failure, a follower)
                _discard(embedding)

    async def _call_upstream(self, request: Request, broadcast: Broadcast) -> Answer:
        """The upstream call: streamed into ``broadcast`` frame by frame, then assembled."""
        api, body, stream = request.api, request.body, request.stream
        # Streamed anyway when the config says so (``_streams``), so that streaming clients
        # joining this call get it live; with the usage the clients may not have asked for.
        if stream or self._streams(request):
            body, stream = (
                api.streamed(body, self.config.upstream.stream_usage and not request.include_usage),
                True,
            )
        upstream_request = UpstreamRequest(
            request.upstream_path, body, request.headers, stream, request.query, api.last_event
        )
        if request.kind == "embedding":
            response = await self.batcher.embed(upstream_request)
        else:
            response = await self._call(upstream_request, _routing_text(request))
        self._judged(request, response.status)
        try:
            if not 200 <= response.status < 300:
                raise UpstreamStatusError(
                    response.status,
                    response.body,
                    response.headers.get("content-type", "application/json"),
                )
            if response.streaming:
                answer = await _consume(request.kind, response, broadcast, body)
            else:
                answer = _complete(request.kind, response.body, body)
        finally:
            await response.aclose()
        return answer

    def _streams(self, request: Request) -> bool:
        """Whether a non-streaming request's shared call is asked of the upstream as a stream."""
        if not self.config.upstream.stream_flights or not request.api.streams:
            return False
        body = request.body
        # A completion's best_of picks among candidates at the end, and echo repeats the prompt:
        # engines refuse or change them when streamed.
        return not (request.kind == "completion" and (body.get("best_of") or body.get("echo")))

    async def _store(
        self,
        request: Request,
        key: Fingerprint,
        answer: Answer,
        view: SemanticView | None,
        probe: Probe | None,
        epoch: int,
        embedding: asyncio.Task[Any] | None = None,
    ) -> None:
        """Store a complete answer (unless its request or its type's ttl says not to, or an
        invalidation came after its call began: it may predate what was invalidated), in the
        exact cache and, with its prompt's embedding (the probe's, or ``embedding``, begun with
        the call), in the semantic index: both before the flight ends (read-your-writes)."""
        controls = request.controls
        ttl = self.config.ttl_for(controls.request_type)
        if (
            not answer.complete
            or controls.no_store
            or ttl <= 0
            or key.key is None
            or epoch != self.flights.epoch
        ):
            return
        if key.shared_key is not None:
            # A shared namespace's requester the upstream had not accepted yet: it just did, so
            # the answer is stored where the others read it.
            key = dataclasses.replace(key, key=key.shared_key, tenant="*", shared_key=None)
            # (The embedding stays right: it is of the text, whatever the scope.)
            view = semantic_view(request, key, self.config) if view is not None else None
        expires, prefix = answer.created + ttl, _prompt_prefix(request)
        assert key.key is not None  # (checked above; a shared key is one too)
        await self.store.put(key.key, Entry(answer, expires, controls.tags, key.namespace, prefix))
        if view is None or self.semantic is None:
            return
        vector = probe.vector if probe is not None else None
        if vector is None and embedding is not None:
            try:
                vector = await embedding  # mostly done: the upstream took longer
            except Exception:
                log.exception("embedding a prompt for the semantic cache failed")
                return
        insert = self._insert_semantic(
            view, vector, answer, expires, controls.tags, key.namespace, prefix, key.key, epoch
        )
        if vector is not None:
            try:
                await insert
            except Exception:
                log.exception("semantic insert failed")
            return
        # No embedding yet (none was begun): off the flight's path, not to delay its clients.
        task = asyncio.get_running_loop().create_task(insert)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    async def _insert_semantic(
        self,
        view: SemanticView,
        vector: Any,
        answer: Answer,
        expires: float,
        tags: tuple[str, ...],
        namespace: str,
        prefix: str,
        key: str,
        epoch: int,
    ) -> None:
        assert self.semantic is not None
        if vector is None:
            vector = await self.semantic.vector(view)
        # Checked again once the prompt is embedded: an invalidation may have come meanwhile.
        if epoch == self.flights.epoch:
            await self.semantic.insert(
                view, vector, answer, expires, tags, namespace, prefix, key=key
            )

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("semantic insert failed", exc_info=task.exception())

    async def _bypass(self, request: Request, route: str) -> Reply:
        self.stats.count(route, Outcome.BYPASS)
        header = Outcome.BYPASS.header
        api = request.api
        try:
            response = await self._call(
                UpstreamRequest(
                    request.upstream_path,
                    request.body,
                    request.headers,
                    request.stream,
                    request.query,
                    api.last_event,
                ),
                _routing_text(request),
            )
        except CarpoolError as error:
            return _error_reply(error, Outcome.BYPASS, api)
        self._judged(request, response.status)
        if response.streaming:
            return Reply(
                response.status,
                [*SSE_HEADERS, header],
                stream=_pipe(api, response),
                outcome=Outcome.BYPASS,
            )
        ctype = response.headers.get("content-type", "application/json").encode("latin-1")
        return Reply(
            response.status,
            [(b"content-type", ctype), header],
            response.body,
            outcome=Outcome.BYPASS,
        )

    def _judged(self, request: Request, status: int) -> None:
        """What the upstream's answer says of the requester's credentials (``identity.py``)."""
        if 200 <= status < 300:
            self.accepted.accept(
                requester(request.headers, self.config),
                grant_of(request, names_of(self.config.tenant)),
            )
        elif status in (401, 403):
            self.accepted.refuse(requester(request.headers, self.config))

    async def _call(self, upstream_request: UpstreamRequest, text: str) -> UpstreamResponse:
        """One upstream call: routed by ``text`` (the prompt), failed over once if need be."""
        self.stats.upstream_calls += 1
        with self.tracer.span("carpool.upstream") as span:
            response, replica, decision = await self.replicas.send(upstream_request, text)
            span.set_attribute("carpool.replica", replica.name)
            span.set_attribute("carpool.decision", decision.value)
        self.stats.routing[decision.value] += 1
        return response

    def _observe_attempt(self, replica: Any, status: int, decision: Any) -> None:
        """Every attempt on a replica (failed-over ones too), for /stats and /metrics."""
        self.stats.upstream_status[(replica.name, str(status))] += 1
        if status >= 400:
            self.stats.upstream_errors += 1

    def _served(
        self,
        route: str,
        outcome: Outcome,
        answer: Answer,
        stream: bool,
        include_usage: bool,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> Reply:
        """A reply carrying a whole answer, as JSON or (for a streaming client, ``stream``) as
        SSE, with the final usage chunk if it asked for it (``include_usage``)."""
        self.stats.count(route, outcome)
        if outcome.saved:
            self._saved(outcome, answer)
        headers = [JSON, outcome.header, *extra]
        if outcome is Outcome.HIT or outcome is Outcome.SEMANTIC_HIT:
            headers.append((b"age", str(int(answer.age())).encode()))
        if (not stream or include_usage) and answer.usage_missing:
            # The engine reported no usage for this answer (it ignored include_usage on the
            # stream it was assembled from): said so, rather than dropped silently or invented.
            headers.append(USAGE_MISSING)
        if not stream:
            return Reply(200, headers, answer.body, outcome=outcome)
        headers[0] = SSE
        return Reply(
            200,
            headers,
            b"".join(answer.sse(include_usage)) + api_of(answer.kind).stream_end,
            outcome=outcome,
        )

    def _saved(self, outcome: Outcome, answer: Answer) -> None:
        """A request answered without a call of its own: the tokens the engine reported for the
        answer were not recomputed. An answer it reported none for is counted apart, so that
        ``tokens_saved`` reads as what it is, a lower bound."""
        self.stats.tokens_saved += answer.tokens
        if answer.usage_missing:
            self.stats.saved_without_usage += 1

    # ---------------------------------------------------------------------------------------
    # Library API and introspection

    async def request(
        self,
        path: str,
        body: Mapping[str, Any] | bytes,
        headers: Mapping[str, str] | None = None,
        query: str = "",
    ) -> Reply:
        """Run one request through the pipeline without HTTP; a stream is read to the end.
        ``query``: the query string (forwarded upstream and part of the key), without ``?``."""
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        lowered = {k.lower(): v for k, v in (headers or {}).items()}
        reply = await self.handle(ClientRequest(path, raw, lowered, query.encode("latin-1")))
        if reply.stream is not None:
            try:
                reply.body = b"".join([chunk async for chunk in reply.stream])
                reply.stream = None
            finally:
                reply.close()
        return reply

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        """Any other ``/v1/...`` call, forwarded unchanged to a replica and never cached.
        ``path`` is relative to the upstream's /v1 and already confined (``carpool.paths``);
        a transport failure downs the replica (``ReplicaSet.passthrough``)."""
        return await self.replicas.passthrough(method, path, query, headers, body)

    async def invalidate(self, spec: Any) -> int:
        """Drop the answers matching ``{"tag"|"namespace"|"prefix": str}`` or ``{"all": true}``."""
        if not isinstance(spec, dict) or len(spec) != 1:
            raise RequestError('give exactly one of "tag", "namespace", "prefix" or "all"')
        ((name, value),) = spec.items()
        if name == "all" and value is True:
            selector: dict[str, Any] = {"everything": True}
        elif name in ("tag", "namespace", "prefix") and isinstance(value, str) and value:
            selector = {name: value}
        else:
            selector = {}
        if selector:
            # Flights are a layer too, running ones included: no request joins a call begun
            # before the invalidation, and that call's answer is not stored. Flights do not
            # know their tags, so all go (at worst one extra upstream call per key).
            self.flights.forget_all()
            if self.shared_flights is not None:  # and those of every instance
                await self.shared_flights.forget_all()
            dropped = await self.store.invalidate(**selector)
            if self.semantic is not None:
                dropped += await self.semantic.invalidate(**selector)
            if self.invalidations is not None:  # last: the other instances' windows
                await self.invalidations.publish()
            return dropped
        raise RequestError(
            f'invalid selector {name!r}: use "tag", "namespace", "prefix" '
            '(a non-empty string) or "all": true'
        )

    def gauges(self) -> dict[str, Any]:
        return {
            "flights": len(self.flights),
            "waiters": self.flights.waiters,
            "layers": {
                "exact": {"entries": self.store.entries, "bytes": self.store.bytes},
                **(
                    {"semantic": {"entries": self.semantic.entries, "bytes": self.semantic.bytes}}
                    if self.semantic
                    else {}
                ),
            },
            "replicas": {name: r["in_flight"] for name, r in self.replicas.snapshot().items()},
            "redis_errors": {
                "store": getattr(self.store, "errors", 0),
                **(
                    {"flights": self.shared_flights.counts["errors"]}
                    if self.shared_flights is not None
                    else {}
                ),
                **(
                    {"invalidations": self.invalidations.counts["errors"]}
                    if self.invalidations is not None
                    else {}
                ),
            },
            "redis_pool_exhausted": getattr(self.store, "pool_exhausted", 0),
        }

    def snapshot(self) -> dict[str, Any]:
        """The /stats document."""
        g = self.gauges()
        return {
            **self.stats.snapshot(),
            "pid": os.getpid(),
            "flights": g["flights"],
            "waiters": g["waiters"],
            "layers": g["layers"],
            "replicas": self.replicas.snapshot(),
            "routing": dict(self.stats.routing),
            "batching": self.batcher.stats(),
            "redis": self.redis_health(),
        }

    def redis_health(self) -> dict[str, Any]:
        """``{"state": "off" | "up" | "degraded", ...}`` for /stats and /healthz."""
        health = getattr(self.store, "health", None)
        report = health() if health is not None else {"state": "off"}
        if self.shared_flights is not None:
            report = {**report, "flights": self.shared_flights.snapshot()}
        if self.invalidations is not None:
            report = {**report, "invalidations": self.invalidations.snapshot()}
        shared_semantic = getattr(self.semantic, "snapshot", None)
        if shared_semantic is not None:
            report = {**report, "semantic": shared_semantic()}
        return report

    def start(self) -> None:
        """Start background work that needs the event loop (the server calls it at startup;
        it also starts lazily on first use)."""
        self.tracer.refresh()
        start = getattr(self.semantic, "start", None)
        if start is not None:
            start()
        if self.invalidations is not None:
            self.invalidations.start()

    async def aclose(self) -> None:
        await self.batcher.aclose()  # its probes use the upstreams closed below
        if self.invalidations is not None:
            await self.invalidations.aclose()
        if self.semantic is not None:
            await self.semantic.aclose()
        if self.shared_flights is not None:
            await self.shared_flights.aclose()
        for upstream in self.upstreams:
            await upstream.aclose()
        await self.store.aclose()
        await self.idempotency.aclose()


# What an upstream answers about the requester rather than the request: its key refused, out of
# credit, not allowed the model (OpenAI says 404 model_not_found), rate-limited.
_CREDENTIAL_ERRORS = frozenset({401, 402, 403, 404, 407, 429})


def _discard(task: asyncio.Task[Any]) -> None:
    """Drop a helper task whose result nobody needs: cancel it, or read its error (so that it is
    not reported as never retrieved)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


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


async def _consume(
    kind: str, response: UpstreamResponse, broadcast: Broadcast, asked: dict[str, Any]
) -> Answer:
    """Publish an upstream stream frame by frame; judge and assemble it once it ends.

    Only a stream that ended whole comes back (``[DONE]``, or a typed stream's last event:
    ``response.events()`` raises ``UpstreamStreamBroken`` otherwise, and so does an error event),
    judged by its API (``Api.judge_stream``): a chat or completions stream must have finished
    every choice that ``asked`` (the request body sent) asked for, or it raises too; a typed
    stream that ended without completing (Responses ``incomplete``/``failed``, a message with no
    ``stop_reason``) is the upstream's own answer, served as it came and not stored. A raise
    fails the flight: every client gets an error (streaming ones an SSE error event) and
    nothing is stored.
    """
    api = api_of(kind)
    chunks: list[dict[str, Any]] = []
    async for payload in response.events():
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamStreamBroken("the upstream sent a malformed stream chunk") from None
        if not isinstance(chunk, dict):
            raise UpstreamStreamBroken("the upstream sent a stream chunk that is not an object")
        error = api.failure(chunk)
        if error is not None:
            # The engine's own error object reaches the clients as it is (its message, type
            # and code), not a paraphrase.
            raise UpstreamStreamBroken(f"the upstream stream failed: {error.get('message')}", error)
        chunks.append(chunk)
        broadcast.publish(api.frame(payload, chunk), usage_only=api.usage_only(chunk))
    body, complete = api.judge_stream(chunks, asked)
    return Answer(
        kind,
        orjson.dumps(body),
        complete,
        api.usage_tokens(body),
        frames=broadcast.frames,
        usage_frame=broadcast.usage_frame,
    )


def _complete(kind: str, raw: bytes, asked: dict[str, Any]) -> Answer:
    """A whole upstream body as an ``Answer``: ``complete`` (storable) only when its API judges
    it so (``Api.complete``: for chat and completions, every choice that ``asked`` (the request
    body sent) asked for is there and finished). An incomplete one is still the upstream's own
    2xx answer: its clients get it as it came; it is never stored."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamError("the upstream answered with a body that is not JSON") from None
    if not isinstance(parsed, dict):
        raise UpstreamError("the upstream answered with a body that is not a JSON object")
    return Answer.from_body(kind, parsed, raw, api_of(kind).complete(parsed, asked))


async def _relay(
    api: Api,
    broadcast: Broadcast,
    include_usage: bool,
    saved: Callable[[Answer], None] | None = None,
) -> AsyncIterator[bytes]:
    """A flight's stream for one client; ``saved`` (a joiner's) is told the answer it got."""
    async for chunk in broadcast.follow(include_usage):
        yield chunk
    if broadcast.error is not None:
        yield api.error_event(broadcast.error)
    else:
        if saved is not None and broadcast.answer is not None:
            saved(broadcast.answer)
        if api.stream_end:
            yield api.stream_end


async def _pipe(api: Api, response: UpstreamResponse) -> AsyncIterator[bytes]:
    """A bypassed stream, relayed as it comes (framed as its API frames it); a failure part-way
    (a stream that stops without ``[DONE]`` or its last event included) ends it with an error
    event. It is not judged further: nothing stores it, and a client of its own gets what the
    upstream sent."""
    try:
        async for payload in response.events():
            error = _error_in(api, payload) if b'"error"' in payload else None
            if error is not None:
                # The upstream's own error ends it, framed as its API frames errors (a typed
                # stream's SDK ignores an event without its name): no second one.
                yield api.error_event(
                    UpstreamStreamBroken(
                        f"the upstream stream failed: {error.get('message')}", error
                    )
                )
                return
            yield api.frame(payload)
        if api.stream_end:
            yield api.stream_end
    except UpstreamError as error:
        yield api.error_event(error)
    finally:
        await response.aclose()


def _error_in(api: Api, payload: bytes) -> dict[str, Any] | None:
    """The error object of a stream payload that is an error event (``Api.failure``)."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return api.failure(parsed) if isinstance(parsed, dict) else None


def _similarity(candidate: Candidate) -> list[tuple[bytes, bytes]]:
    """A semantic hit's own headers: its score and the opaque id of the entry it was served from
    (``SemanticEntry.public_id``; never the entry's text, which another request sent)."""
    return [
        (b"x-carpool-similarity", f"{candidate.similarity:.4f}".encode()),
        (b"x-carpool-entry", candidate.entry.public_id.encode()),
    ]


def _nearest(candidate: Candidate) -> list[tuple[bytes, bytes]]:
    """``semantic.mode: mark``: what would have been served, and why not if it would not.

    The nearest entry is named by its opaque id only: its text is another request's prompt
    (another tenant's, in a shared namespace), so it goes to the debug log, never to the client.
    """
    verdict = "serve" if candidate.verdict.ok else f"guard:{candidate.verdict.reason}"
    nearest = candidate.entry.public_id
    log.debug(
        "semantic mark: nearest entry %s (similarity %.4f, %s): %r",
        nearest,
        candidate.similarity,
        verdict,
        candidate.entry.text[:200],
    )
    return [
        (b"x-carpool-similarity", f"{candidate.similarity:.4f}".encode()),
        (b"x-carpool-semantic-nearest", nearest.encode()),
        (b"x-carpool-semantic-verdict", verdict.encode()),
    ]


def _replayable(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """What a replay repeats of the first answer's headers: its content type, not its outcome."""
    return [(name, value) for name, value in headers if name == b"content-type"]


class _Recorded:
    """The idempotency record of a stream being relayed (``_recorded``), settled once: finished
    with what the client received if that is final (``is_final``), else dropped (the stream
    ended with an error event, or its client left), so that a retry runs again."""

    __slots__ = ("records", "key", "token", "kind", "head", "settled")

    def __init__(
        self, records: IdempotencyRecords, key: str, token: str, kind: str, head: StoredResponse
    ) -> None:
        self.records, self.key, self.token, self.kind = records, key, token, kind
        self.head = head  # status, headers and format; the frames are the body
        self.settled = False

    async def end(self, frames: list[bytes]) -> None:
        self.settled = True
        head = self.head
        stored = StoredResponse(head.status, head.headers, b"".join(frames), head.streamed)
        if is_final(self.kind, stored):
            await self.records.finish(self.key, self.token, stored)
        else:
            await self.records.abandon(self.key, self.token)

    async def drop(self) -> None:
        self.settled = True
        with contextlib.suppress(Exception):
            await self.records.abandon(self.key, self.token)

    def close(self, on_close: Callable[[], None] | None) -> None:
        """``Reply.close``: a stream closed before its end was not received whole. A client that
        left while its stream waited to send a frame (or before the first) leaves ``_recorded``
        suspended or never started: the record is dropped now, not when (or if) the generator is
        collected, and not when its lease runs out."""
        if on_close is not None:
            on_close()
        if not self.settled:
            try:
                task = asyncio.get_running_loop().create_task(self.drop())
            except RuntimeError:  # closed outside a loop: the lease will run out instead
                return
            _DROPPING.add(task)
            task.add_done_callback(_DROPPING.discard)


_DROPPING: set[asyncio.Task[None]] = set()  # strong references to the drops under way


async def _recorded(frames: AsyncIterator[bytes], recorded: _Recorded) -> AsyncIterator[bytes]:
    """Relay a stream and keep it whole: the record stores what the client received, if final."""
    sent: list[bytes] = []
    try:
        async for frame in frames:
            sent.append(frame)
            yield frame
    except BaseException:
        await _shielded(recorded.drop())
        raise
    await recorded.end(sent)


def _item_failed(index: int | None) -> StoredResponse:
    """What a list request answers when the upstream's 200 for an item is not an answer."""
    which = f"item {index}" if index is not None else "an item"
    error = UpstreamError(f"the upstream's answer to {which} of the list is not a complete answer")
    return StoredResponse(
        error.status, _replayable(_error_reply(error, None).headers), error.body()
    )


async def _shielded(work: Any) -> None:
    """Run a record update to its end even though the task around it is being cancelled."""
    task = asyncio.ensure_future(work)
    with contextlib.suppress(BaseException):
        await asyncio.shield(task)


def _waiting(client: ClientRequest) -> None:
    if client.on_wait is not None:
        client.on_wait()


def _error_reply(error: CarpoolError, outcome: Outcome | None, api: Api | None = None) -> Reply:
    """An error as its API shapes it (Anthropic's for Messages; OpenAI's otherwise)."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in error.headers().items()]
    if outcome is not None:
        headers.append(outcome.header)
    body = api.error_body(error) if api is not None else error.body()
    return Reply(error.status, headers, body, outcome=outcome)


def _routing_text(request: Request) -> str:
    """The prompt as the engine sees it, system prompt first: what its prefix cache holds."""
    return "\n".join(request.api.input_texts(request.body))


def _prompt_prefix(request: Request) -> str:
    """The start of the prompt, for invalidation by prompt prefix."""
    return " ".join(request.api.input_texts(request.body))[:PROMPT_PREFIX_CHARS]
