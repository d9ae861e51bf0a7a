"""A request with an Idempotency-Key, run at most once: ``AtMostOnce.run``, around
``Gateway._answer``.

Contract:
- The record is scoped to the requester (``Fingerprint.owner``, then the raw key): records never
  cross tenants. Its fingerprint is the request's digest (``request_digest``), so the same key
  with another request is a 422 (``IdempotencyMismatch``), whatever the record's state.
- A request whose key is being processed gets a 409 (``IdempotencyConflict``), or, with
  ``idempotency.on_conflict: wait``, waits for it, up to ``coalesce.join_timeout_ms`` in all,
  then a 409: a run finished is replayed; a run dropped (a retryable answer) or released is
  begun again by one waiting retry, and the others wait for that one in turn.
- A retry waiting on a key whose run began in this process keeps that run going (its
  request's ``ClientRequest.keep``): the first client leaving (the usual reason for the retry)
  no longer cancels it, so the key is generated once and the retry gets that answer. Once no
  retry waits on it any more (each answered, timed out or gone), a run whose client left is
  cancelled as before (its call, with the flight's last client), and its record dropped. A run
  in another instance (Redis records) is not kept from here. With
  ``coalesce.finish_abandoned`` every run is kept going until its record settles, its client
  there or not (its answer kept, written to no one): a retry anywhere, later, replays it. So is
  a run the upstream goes on with when its client leaves (``Api.runs_detached``: a Responses
  ``background`` job), whatever the setting.
- A request whose record cannot be read although the shared records answer (every connection
  busy: ``IdempotencyUnavailable``) gets a 503 with ``Retry-After`` and is not run: running it
  without its record could run the key twice.
- A finished key is replayed (``replay_as``): its first answer in the retry's format, with
  ``idempotent-replayed: true`` and the ``hit`` outcome, and, as every hit, ``age``: the
  seconds since its answer was made (``StoredResponse.created``: the first reply's time on the
  gateway's clock, less the ``age`` that reply said; none for a record kept without it; at
  most RFC 9111's greatest, 2147483648),
  without calling upstream; a 422 (``IdempotencyFormatMismatch``) when it has no faithful
  form in that format. A list's item replayed from its record counts its age as well. A replay
  says what its answer's ``x-carpool-usage`` says (``apportioned``, ``missing``,
  ``other-prompt``), no other
  header but its content type (and, for a 5xx, ``x-should-retry: false``: a retry with the
  key gets it again): its record keeps no other (``records.replayable``); an answer of an API with streams is replayed with the usage
  the retry asks for, as a hit of it is served (``replay_as``): ``stream_options.include_usage``
  is outside the request's digest, so a retry may differ in it. A long answer's replay is
  parsed off the event loop (``_off_loop``), once for identical retries in progress
  (``_replay``, ``replays_joined``).
- A finished key whose record holds, in place of its response, that it ran and its response
  was not kept (a full Redis; a record in Redis that could not be read: ``_not_kept``) is
  answered that 507 in any format, in the retry's API's shape, with the message the record
  holds, which says why (``_why_not_kept``); it never runs again.
- Only a final answer is kept (``is_final``): after a retryable one the record is dropped and a
  retry runs again. A stream is kept once it ended (``_Recorded``), as a client that asked for
  the usage receives it: with the usage chunk its client may not have been sent
  (``Reply.with_usage``; a bypassed stream is asked for it: ``Request.recorded``), which a
  retry may ask for, or a JSON retry, whose body has it. One that ended with an error event,
  or whose client left, is dropped. The record is dropped too when the request fails or is
  cancelled before its answer (shielded: a cancelled task still drops it).
- What a key costs a stream: a flight's stream is judged by the answer the flight assembled as
  it came (``Reply.answered``), not parsed again by each keyed client, whose records hold the
  flight's frames joined once (``Relay.with_usage``); a replay parses its record once
  (``replayed``); a record longer than ``OFF_LOOP_BYTES`` is parsed on a worker thread, so
  the event loop serves the other requests meanwhile (``_off_loop``), its record still settled
  if its client leaves then.
- A list input (``list_items``) has one record for the list and one per item (the list's key +
  ``"\\n"`` + index): an item's record is finished only with a complete 2xx answer, and the
  list's only when every item has one; otherwise the list's record is released (``release``:
  kept with its fingerprint) if any item's record is kept, else dropped, and a retry
  recomputes just the items without an answer; another request under the key is a 422, never
  answered from this list's items. A 200 that is not an answer fails the list as the
  upstream's failure (502), never as the gateway's crash. A list of more than
  ``MAX_KEYED_ITEMS`` items (an upstream call and a record each) is refused with a 400 in
  OpenAI's error shape (``param``: the field), before any record or call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar, TypeVarTuple

import orjson

from .. import exact_json
from ..answer import Answer
from ..canonical import names_of
from ..clock import SYSTEM_CLOCK, Clock
from ..config import Config
from ..errors import RETRY_FIELDS, CarpoolError, RequestError, UpstreamError
from ..fingerprint import Fingerprint, fingerprint, request_digest
from ..identity import AcceptedCredentials, other_credentials
from ..metrics import Stats
from ..outcome import Outcome, list_outcome
from ..reply import JSON, NO_STORE, USAGE_MISSING, Reply, age_header, error_reply, refusal
from ..request import MAX_AGE, ClientRequest, Request, list_input, list_items, merge_items
from .errors import (
    IdempotencyConflict,
    IdempotencyFormatMismatch,
    IdempotencyMismatch,
    IdempotencyResponseNotKept,
    IdempotencyUnavailable,
)
from .final import answer_is_final, is_final, replay_as, replayed, saved_tokens
from .header import HEADER, HEADER_ALIAS, REPLAYED_HEADER
from .records import IdempotencyRecords, StoredResponse, replayable

# Items of a list input under an Idempotency-Key, at most (OpenAI's own limit for embeddings
# inputs): each is an upstream call and a record of its own.
MAX_KEYED_ITEMS = 2048

# ``Gateway._answer``: a request's reply, however it is answered (cache, flight, bypass).
Answering = Callable[[ClientRequest, Request, Fingerprint, str], Awaitable[Reply]]

# A stored answer longer than this is parsed on a worker thread (``_off_loop``: its verdict, its
# replay), not on the event loop, which every tenant's requests share: a long stream's chunks
# are parsed one by one (tens of microseconds each), about 10 ms for this many bytes of them.
OFF_LOOP_BYTES = 64 * 1024


def scope_of(key: Fingerprint, idempotency_key: str, request: Request, config: Config) -> str:
    """The record's scope: the requester's own tenant, then the raw key.

    A client may also present a credential the tenant does not read: a key in the query string
    (``?key=``), a cookie, a header named like one (``identity.other_credentials``). Those are
    in the scope too: two clients told apart only by them would otherwise meet on one record,
    one blocking the other with a 409 or 422, or replaying the other's answer. Nothing else is:
    a retry that differs in another header or query parameter is judged by its digest (a
    replay, or a 422), never run twice.
    """
    known = (*names_of(config.tenant), HEADER, HEADER_ALIAS)
    others = other_credentials(request.headers, request.query, known)
    if not others:
        return f"{key.owner}\n{idempotency_key}"
    return f"{key.owner}:{others}\n{idempotency_key}"


class AtMostOnce:
    """Runs requests with an Idempotency-Key through ``answer``, at most once per key."""

    def __init__(
        self,
        records: IdempotencyRecords,
        config: Config,
        accepted: AcceptedCredentials,
        stats: Stats,
        answer: Answering,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.records = records
        self.config = config
        self.accepted = accepted
        self.stats = stats
        self.answer = answer
        self.clock = clock  # (wall-clock: when answers were made, and replays' ages)
        self._join_timeout = config.coalesce.join_timeout_ms / 1000
        self._finish_abandoned = config.coalesce.finish_abandoned
        # The keys whose run began here and whose record is not settled yet, with the request
        # that runs it: what a retry waiting on the key keeps going (``_Keeping``).
        self._runs: dict[str, ClientRequest] = {}
        # The long replays being parsed, by what they parse (``_replay``), and how many
        # retries joined one in progress.
        self._replaying: dict[tuple[Any, ...], tuple[bytes, asyncio.Future[Any]]] = {}
        self.replays_joined = 0

    async def _replay(
        self, response: StoredResponse, kind: str, stream: bool, include_usage: bool
    ) -> tuple[StoredResponse | None, int | None]:
        """``replayed(response, ...)``, parsed off the loop if long (``_off_loop``), once for
        identical retries in progress: each parsed it (~70 ms for 4.6 MB of a stream, on one
        thread), and 40 retries of one key at once held every other long replay ~3 s. Shared
        only for the same bytes, headers, status and format: a pure function of them."""
        body = response.body
        if len(body) <= OFF_LOOP_BYTES:
            return replayed(response, kind, stream, include_usage)
        same = (
            kind,
            stream,
            include_usage,
            response.status,
            response.streamed,
            len(body),
            tuple(response.headers),
            hash(body),
        )
        running = self._replaying.get(same)
        if running is not None and (running[0] is body or running[0] == body):
            self.replays_joined += 1
            return await asyncio.shield(running[1])
        parse = asyncio.ensure_future(
            _off_loop(len(body), replayed, response, kind, stream, include_usage)
        )
        self._replaying[same] = (body, parse)

        def parsed(done: asyncio.Future[Any]) -> None:
            if self._replaying.get(same, (None, None))[1] is parse:
                del self._replaying[same]
            if not done.cancelled():
                done.exception()  # (its waiters' to raise; retrieved here should none wait)

        parse.add_done_callback(parsed)
        # (A parse whose retries all left runs on: one, bounded, its thread not to be stopped.)
        return await asyncio.shield(parse)

    async def run(
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
        listed = list_input(request)
        if listed is not None and len(listed[1]) > MAX_KEYED_ITEMS:
            # One upstream call and one record an item: bounded before any of them.
            name, values = listed
            return self._refused(
                RequestError(
                    f"'{name}' may hold at most {MAX_KEYED_ITEMS} items with an "
                    f"Idempotency-Key, not {len(values)}",
                    param=name,
                ),
                request,
            )
        records = self.records
        scoped, digest = (
            scope_of(key, idempotency_key, request, self.config),
            request_digest(request, key, self.config),
        )
        try:
            begin = await records.begin(scoped, digest)
            if begin.state == "processing" and self.config.idempotency.on_conflict == "wait":
                if client.on_wait is not None:
                    client.on_wait()
                # Up to the join timeout in all. A wait ends when the record changes: finished
                # (replayed), dropped or released (begun again: by this retry, or by another
                # waiting retry, which this one then waits for in turn).
                loop = asyncio.get_running_loop()
                deadline = loop.time() + self._join_timeout
                keeping = _Keeping()
                try:
                    while begin.state == "processing" and (left := deadline - loop.time()) > 0:
                        # (The run may change as it waits: dropped, then begun by another retry.)
                        keeping.keep(self._runs.get(scoped))
                        await records.wait(scoped, digest, left)
                        begin = await records.begin(scoped, digest)
                finally:
                    keeping.let_go()  # (a run whose client left is cancelled now, if unsettled)
        except IdempotencyUnavailable as error:  # nothing ran: a retry is safe
            return self._refused(error, request)
        if begin.state == "mismatch":
            return self._refused(IdempotencyMismatch(), request)
        if begin.state == "processing":
            return self._refused(IdempotencyConflict(), request)
        if begin.state == "done":
            assert begin.response is not None
            if _not_kept(begin.response):  # (in any format: no answer is replayed)
                return self._refused(_why_not_kept(begin.response), request)
            # (Its form for the retry and the tokens it saved, from one parse of its answer.)
            stored, tokens = await self._replay(
                begin.response, request.kind, request.stream, request.include_usage
            )
            if stored is None:
                return self._refused(IdempotencyFormatMismatch(begin.response.streamed), request)
            self._replayed(route, tokens)
            headers = [*stored.headers, Outcome.HIT.header, REPLAYED_HEADER]
            if stored.status >= 500:
                headers.append(_NOT_RETRIED)
            age = self._age(begin.response)
            if age is not None:
                headers.append(age_header(age))
            return Reply(stored.status, headers, stored.body, outcome=Outcome.HIT)
        token = begin.token
        assert token is not None
        self._runs[scoped] = client  # (until its record settles: ``_settled``)
        # ``finish_abandoned`` finishes a run whose client left (module doc): a flight's call
        # would be, but not this request, cancelled with its client, its record dropped (a
        # sampled one's call with it: its retry, on another worker or instance, a second
        # generation). A run the upstream goes on with anyway (a background response) is
        # finished whatever the setting: dropped, its retry started a second job.
        finish = self._finish_abandoned or request.api.runs_detached(request.body)
        let_go = client.keep() if finish and client.keep is not None else None
        settled = partial(self._settled, scoped, client, let_go)
        try:
            reply = await self._run(client, request, key, route, scoped, token, settled)
        except BaseException:
            settled()
            raise
        if reply.stream is None:  # (a stream's record settles as it ends: ``_Recorded``)
            settled()
        return reply

    def _settled(
        self, scoped: str, client: ClientRequest, let_go: Callable[[], None] | None
    ) -> None:
        """The record of ``client``'s run of ``scoped`` is settled: no retry keeps it now, nor
        ``finish_abandoned`` (``let_go``)."""
        if self._runs.get(scoped) is client:  # (not a run begun since, by a retry)
            del self._runs[scoped]
        if let_go is not None:
            let_go()

    async def _run(
        self,
        client: ClientRequest,
        request: Request,
        key: Fingerprint,
        route: str,
        scoped: str,
        token: str,
        settled: Callable[[], None],
    ) -> Reply:
        """The run of a key begun here (``run``): its answer, kept by its record."""
        records = self.records
        # Its answer is kept for retries that may ask for the usage it did not (``bypass``).
        request = replace(request, recorded=True)
        items = list_items(request)
        # A list not kept whole, some of whose items are (``_items``), stays this list's key
        # (released, with its fingerprint): another request under it is a 422, never answered
        # in part from this list's items; a retry of it computes the rest.
        items_kept: list[bool] = []
        try:
            if items is None:
                reply = await self.answer(client, request, key, route)
            else:
                reply = await self._items(client, items, scoped, route, items_kept)
                if request.stream and reply.status < 300:
                    reply = _streamed(reply, request)
        except BaseException:
            settle = records.release if any(items_kept) else records.abandon
            await _shielded(settle(scoped, token))
            raise
        # (Settled to the end even if the client leaves meanwhile: ``_settle``.)
        if items is not None and reply.status >= 300:
            settle = records.release if any(items_kept) else records.abandon
            await _settle(settle(scoped, token))
        elif reply.stream is None:
            kept = reply.with_usage() if reply.with_usage is not None else None
            stored = StoredResponse(
                reply.status,
                replayable(reply.headers),
                reply.body if kept is None else kept,
                request.stream,
                self._made(reply),
            )
            kept_final = await _settle(
                _kept(records, scoped, token, request.kind, stored, request.body, reply.answered)
            )
            if kept_final and reply.status >= 500:
                # The engine's failure, kept: every retry with the key gets it again, so the
                # SDKs are told not to retry (nor to wait the upstream's ``Retry-After`` first),
                # as its replays are.
                reply.headers = [
                    *(header for header in reply.headers if header[0].lower() not in RETRY_FIELDS),
                    _NOT_RETRIED,
                ]
        else:
            recorded = _Recorded(
                records,
                scoped,
                token,
                request.kind,
                StoredResponse(
                    reply.status,
                    replayable(reply.headers),
                    b"",
                    request.stream,
                    self._made(reply),  # (its head: a hit's age is known before its frames)
                ),
                request.body,
                reply.with_usage,
                reply.answered,
                settled,
            )
            reply.stream = _recorded(reply.stream, recorded)
            reply.on_close = partial(recorded.close, reply.on_close)
        return reply

    def _made(self, reply: Reply) -> float:
        """When ``reply``'s answer was made: now, less the ``age`` it says (a hit's)."""
        return self.clock.now() - (_said_age(reply.headers) or 0)

    def _age(self, response: StoredResponse) -> int | None:
        """The ``age`` of a replay of ``response``: None if it is not known when its answer
        was made."""
        if response.created is None:
            return None
        # (A made time something else wrote, aeons ago: RFC 9111's greatest age, 1.2.2.)
        return min(MAX_AGE, max(0, int(self.clock.now() - response.created)))

    def _refused(self, error: CarpoolError, request: Request) -> Reply:
        """The gateway's own refusal of a keyed request (409, 422, 503; 507: it ran, its
        response was not kept), counted as the other requests it refuses are (``rejected`` in
        /stats): nothing ran for it."""
        self.stats.rejected += 1
        return refusal(error, request.api)

    def _replayed(self, route: str, tokens: int | None) -> None:
        """A replay counted as the hit it is, with the tokens its answer's usage says it saved
        (``saved_tokens``: the retry's generation was not run again), as ``Gateway._saved``
        counts a hit's."""
        self.stats.count(route, Outcome.HIT)
        if tokens is not None:
            self.stats.tokens_saved += tokens
            self.stats.saved_without_usage += tokens == 0

    async def _items(
        self,
        client: ClientRequest,
        items: list[Request],
        scoped: str,
        route: str,
        kept: list[bool],
    ) -> Reply:
        """A list input under one Idempotency-Key: each item is a sub-request with its record.
        ``kept``: True added for each item whose record is kept (done: finished now or before),
        as it is."""
        records = self.records

        async def item(i: int, request: Request) -> tuple[StoredResponse, Outcome, int | None]:
            key = fingerprint(request, self.config, self.accepted)
            item_key = f"{scoped}\n{i}"
            try:
                begin = await records.begin(item_key, request_digest(request, key, self.config))
            except IdempotencyUnavailable as busy:  # this item not run: the list fails whole
                return (
                    StoredResponse(busy.status, error_reply(busy, None).headers, busy.body()),
                    Outcome.BYPASS,
                    None,
                )
            if begin.state == "done":
                assert begin.response is not None
                kept.append(True)
                if _not_kept(begin.response):  # (the list's answer: this item's, below)
                    self.stats.rejected += 1
                    return begin.response, Outcome.BYPASS, None
                self._replayed(route, saved_tokens(request.kind, begin.response))
                return begin.response, Outcome.HIT, self._age(begin.response)
            if begin.state != "new" or begin.token is None:
                error = (
                    IdempotencyMismatch() if begin.state == "mismatch" else IdempotencyConflict()
                )
                return (
                    StoredResponse(
                        error.status, replayable(error_reply(error, None).headers), error.body()
                    ),
                    Outcome.BYPASS,
                    None,
                )
            try:
                reply = await self.answer(client, request, key, route)
            except BaseException:
                await _shielded(records.abandon(item_key, begin.token))
                raise
            stored = StoredResponse(
                reply.status, replayable(reply.headers), reply.body, created=self._made(reply)
            )
            outcome = reply.outcome or Outcome.MISS
            age = _said_age(reply.headers)
            # Only a good answer is kept: whatever else the item got (an error, final or not,
            # or a 200 that is no answer) is computed again by a retry.
            if reply.status < 300 and is_final(request.kind, stored, request.body):
                if await _settle(records.finish(item_key, begin.token, stored)):
                    kept.append(True)
                return stored, outcome, age
            await _settle(records.abandon(item_key, begin.token))
            if reply.status < 300:
                # A 200 that is not an answer (an error body, no data, not JSON) fails the list
                # as the upstream's failure, never as the gateway's crash in merge_items.
                return _item_failed(i), outcome, age
            # The list's answer, with what the upstream said of when to retry (a 429's
            # Retry-After: the SDKs back off by it), as a request alone is answered; not kept.
            retry = [(name, value) for name, value in reply.headers if name.lower() in RETRY_FIELDS]
            return replace(stored, headers=[*stored.headers, *retry]), outcome, age

        results = await asyncio.gather(*(item(i, request) for i, request in enumerate(items)))
        kind = items[0].kind
        for stored, outcome, _ in results:
            if stored.status >= 300:
                return Reply(
                    stored.status, [*stored.headers, outcome.header], stored.body, outcome=outcome
                )
        outcome = list_outcome({outcome for _, outcome, _ in results})
        headers = [JSON, outcome.header]
        if any(NO_STORE in stored.headers for stored, _, _ in results):
            headers.append(NO_STORE)  # (an item the upstream said no cache may store: the list)
        ages = [age for _, _, age in results if age is not None]
        if outcome is Outcome.HIT and ages:
            headers.append(age_header(max(ages)))  # (the oldest answer in it)
        n = items[0].body.get("n", 1)
        try:
            body = merge_items(
                kind,
                [exact_json.loads(stored.body) for stored, _, _ in results],
                n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1,
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            # Complete answers of an odd shape (say, a choice index that is not a number), or
            # an item kept by an older gateway that did not check its answer.
            stored = _item_failed(None)
            return Reply(
                stored.status, [*stored.headers, outcome.header], stored.body, outcome=outcome
            )
        if not isinstance(body.get("usage"), dict):
            headers.append(USAGE_MISSING)  # (an item's engine reported none: said, as for one)
        return Reply(200, headers, orjson.dumps(body), outcome=outcome)


def _streamed(reply: Reply, request: Request) -> Reply:
    """A list's merged answer as the stream its client asked for (its items are asked whole:
    ``list_items``), the SSE a server could have sent for it; with its usage chunk for the
    record (``Reply.with_usage``) if the client did not ask for it."""
    assert reply.body is not None
    merged = StoredResponse(reply.status, [JSON], reply.body, False)
    sse = replay_as(merged, request.kind, True, request.include_usage)
    if sse is None:  # (a merged answer is complete: it converts)
        return reply
    # (What the stream says of its usage, its own: ``replay_as`` wrote it.)
    kept = [header for header in reply.headers if header[0] not in (JSON[0], USAGE_MISSING[0])]
    streamed = Reply(sse.status, [*sse.headers, *kept], sse.body, outcome=reply.outcome)
    if not request.include_usage:
        whole = replay_as(merged, request.kind, True, True)
        streamed.with_usage = None if whole is None else partial(bytes, whole.body)
    return streamed


def _said_age(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The ``age`` a reply says (a hit's), if any."""
    return next((int(v) for k, v in headers if k == b"age" and v.isdigit()), None)


# A replayed 5xx (the engine's failure, final: ``is_final``) is what every retry with its key
# gets: the SDKs, which retry a 5xx on their own, are told not to spend their retries on it.
_NOT_RETRIED = (b"x-should-retry", b"false")


class _Recorded:
    """The idempotency record of a stream being relayed (``_recorded``), settled once: finished
    with the stream whole, as a client that asked for the usage receives it (``with_usage``;
    else what the client received), if that is final (``is_final``; ``answer_is_final`` by the
    answer its flight assembled, where the reply has it: ``answered``), else dropped (the
    stream ended with an error event, or its client left), so that a retry runs again."""

    __slots__ = (
        "records",
        "key",
        "token",
        "kind",
        "head",
        "asked",
        "with_usage",
        "answered",
        "settled",
        "on_settled",
    )

    def __init__(
        self,
        records: IdempotencyRecords,
        key: str,
        token: str,
        kind: str,
        head: StoredResponse,
        asked: dict[str, Any],
        with_usage: Callable[[], bytes | None] | None = None,
        answered: Callable[[], Answer | None] | None = None,
        on_settled: Callable[[], None] | None = None,
    ) -> None:
        self.records, self.key, self.token, self.kind = records, key, token, kind
        self.head = head  # status, headers and format; the frames are the body
        self.asked = asked  # the request's body (how many choices make it whole)
        self.with_usage = with_usage  # (``Reply.with_usage``)
        self.answered = answered  # (``Reply.answered``)
        self.settled = False
        self.on_settled = on_settled  # (``AtMostOnce._settled``: no retry keeps the run now)

    def _settling(self) -> None:
        self.settled = True
        if self.on_settled is not None:
            self.on_settled()

    async def end(self, sent: list[bytes] | None) -> None:
        """The stream ended: its record is settled (``sent``: the frames its client was sent,
        kept only where the reply has no ``with_usage``), to its end even if the request is
        cancelled meanwhile (``_settle``), its verdict too (``_final``: a long stream's may be
        judged on a worker thread)."""
        self._settling()
        await _settle(self._keep(sent))

    async def _keep(self, sent: list[bytes] | None) -> None:
        head = self.head
        whole = self.with_usage() if self.with_usage is not None else b"".join(sent or ())
        if whole is None:  # (``with_usage``: the stream did not end whole, or failed)
            await self.records.abandon(self.key, self.token)
            return
        stored = StoredResponse(head.status, head.headers, whole, head.streamed, head.created)
        await _kept(
            self.records, self.key, self.token, self.kind, stored, self.asked, self.answered
        )

    async def drop(self) -> None:
        self._settling()
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


class _Keeping:
    """What a retry waiting on a key keeps going: the request running the key here, if any
    (``ClientRequest.keep``); the one it keeps changes as the run does."""

    __slots__ = ("run", "let_go_of")

    def __init__(self) -> None:
        self.run: ClientRequest | None = None
        self.let_go_of: Callable[[], None] | None = None

    def keep(self, run: ClientRequest | None) -> None:
        if run is self.run:
            return
        self.let_go()
        if run is not None and run.keep is not None:
            self.run, self.let_go_of = run, run.keep()

    def let_go(self) -> None:
        let_go_of, self.run, self.let_go_of = self.let_go_of, None, None
        if let_go_of is not None:
            let_go_of()


async def _recorded(frames: AsyncIterator[bytes], recorded: _Recorded) -> AsyncIterator[bytes]:
    """Relay a stream and keep it whole: the record stores it once it ended, if final. The
    frames are kept as they are sent only where the reply has no ``with_usage`` to give the
    stream whole at its end: a flight's relay gives its flight's, joined once for all its
    clients (``Relay.with_usage``), not copied by each keyed client as it goes."""
    sent: list[bytes] | None = [] if recorded.with_usage is None else None
    try:
        async for frame in frames:
            if sent is not None:
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
    return StoredResponse(error.status, replayable(error_reply(error, None).headers), error.body())


_Ts = TypeVarTuple("_Ts")
_T = TypeVar("_T")


# The thread of ``_off_loop``'s parses, one at a time: they hold the GIL, so more threads would
# finish none sooner, and each holds a whole stream's chunks parsed until it ends (twenty
# retries at once held twenty).
_PARSING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carpool-idempotency")


async def _off_loop(size: int, parse: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
    """``parse(*args)`` of a stored answer of ``size`` bytes: on a worker thread (``_PARSING``)
    when it is longer than ``OFF_LOOP_BYTES``, so that the event loop serves every other
    request meanwhile (the parse holds the GIL still, but by turns: the loop waits a switch
    interval at a time, not the whole parse); a short one here, where a thread costs more."""
    if size <= OFF_LOOP_BYTES:
        return parse(*args)
    return await asyncio.get_running_loop().run_in_executor(_PARSING, parse, *args)


async def _final(
    kind: str,
    stored: StoredResponse,
    asked: dict[str, Any],
    answered: Callable[[], Answer | None] | None,
) -> bool:
    """Whether ``stored`` is final (``is_final``): judged by the answer its stream made where
    its reply gives it (``Reply.answered``: assembled once for all its flight's clients as its
    chunks came), else by parsing it (off the event loop if it is long: ``_off_loop``)."""
    answer = answered() if answered is not None else None
    if answer is not None:
        return answer_is_final(kind, answer, asked)
    return await _off_loop(len(stored.body), is_final, kind, stored, asked)


async def _kept(
    records: IdempotencyRecords,
    key: str,
    token: str,
    kind: str,
    stored: StoredResponse,
    asked: dict[str, Any],
    answered: Callable[[], Answer | None] | None,
) -> bool:
    """``stored`` kept by the record of ``key`` if it is final (``_final``), else the record
    dropped: the answer is retryable, a retry runs again. Under ``_settle``: the request may be
    cancelled while a long answer is judged on a worker thread, and the record still settles.
    Whether it was kept: every retry with the key gets it then."""
    if await _final(kind, stored, asked, answered):
        return await records.finish(key, token, stored)
    await records.abandon(key, token)
    return False


async def _settle(work: Any) -> Any:
    """A record's update, run to its end even if the request is cancelled meanwhile (its client
    left as its answer was being kept: cancelled with it, the record stayed ``processing``, a
    retry got 409 until the lease ran out, then ran the generation again). The cancellation
    still reaches the request; the work's own failure too, when it is not cancelled. Its
    result, when it is not."""
    return await asyncio.shield(asyncio.ensure_future(work))


async def _shielded(work: Any) -> None:
    """``_settle``, for a task already failing or being cancelled: the work's own failure is not
    raised here (the caller raises what it is handling); a cancellation of the task that comes
    meanwhile is (suppressed with the rest, the task ended with its first error as if none had
    come)."""
    try:
        await _settle(work)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001, S110 - the record's failure: the caller's error stands
        pass


def _not_kept(response: StoredResponse) -> bool:
    """Whether a record holds, in place of its response, that the request ran and its response
    was not kept (``IdempotencyResponseNotKept``: a full Redis, or a record that could not be
    read, ``redis.idempotency``)."""
    return (
        response.status == IdempotencyResponseNotKept.status
        and IdempotencyResponseNotKept.code.encode() in response.body
    )


def _why_not_kept(response: StoredResponse) -> IdempotencyResponseNotKept:
    """The refusal a ``_not_kept`` record answers, saying what its problem details say (why:
    the shared store was full, or the record could not be read), in the retry's API's shape."""
    with contextlib.suppress(orjson.JSONDecodeError):
        problem = orjson.loads(response.body)
        if (
            isinstance(problem, dict)
            and problem.get("code") == IdempotencyResponseNotKept.code
            and isinstance(problem.get("detail"), str)
        ):
            return IdempotencyResponseNotKept(problem["detail"])
    return IdempotencyResponseNotKept()
