"""The exchange with the upstream: one call, shaped for the upstream and read back.

Contract:
- ``send``: one upstream call, routed by the prompt (``ReplicaSet``: cache-aware by default,
  where there are replicas to choose among: the prompt is not even read otherwise) and failed
  over once if need be; counted (its routing decision, by ``ReplicaSet``, a failed call's too;
  ``upstream_calls`` counts its attempts) and traced
  (``carpool.upstream``). A final status that is neither 2xx nor 4xx/5xx (a 3xx, a 1xx taken
  as final, 600-999) is no answer of the cached endpoints: it raises the gateway's own 502
  (``UpstreamRedirected`` for a 3xx, as pass-through answers a redirect; else
  ``UpstreamBadStatus``), so a flight fails with it and a bypass answers it; never relayed. Embeddings go through the batcher, which calls ``send`` itself. A
  client's request that keeps state upstream (a Responses call, a chat completion with ``store:
  true``: ``Api.keeps_state``) goes to the replica that made the stored response it continues,
  and what its 2xx answer makes is remembered with its replica before the answer is read
  further (a whole body's id; a stream's, at its first payload naming it, ``Api.state_field``:
  a Responses lifecycle event, a chat chunk, before that payload is passed on), in
  ``layers.holders`` (``routing.state``): where there are replicas to choose among only.
  The prompt routes within its ``routing_scope`` (its tenant, or its shared namespace; its
  model; its ``cache_salt``): no tenant's prefix steers another tenant's request.
- ``Exchange.fetch``: a flight's call. A non-streaming request is asked of the upstream as a
  stream when ``upstream.stream_flights`` says so (and its API streams, and nothing in it
  changes when streamed: a completion's ``best_of``/``echo``), so that streaming clients joining
  the call get it live; with the usage the clients may not have asked for
  (``upstream.stream_usage``; without it, a streaming request that does not ask for it is
  asked without it: its call is shared only with requests of its shape, ``flight_key``, and
  its answer never stored, ``without_usage``). A stream is published into the flight's
  ``Broadcast`` as it comes, the frames of one read together (``_consume``; its API's
  ``Collector`` gathers it), a whole body read at once (``_complete``); either comes back as an
  ``Answer``, ``complete`` only when its API judges it so, and ``storable`` only if complete
  and, a whole answer, its ``Cache-Control`` says neither ``no-store`` nor ``private``
  (``Answer.no_store``; a stream's head's is not read: SSE servers say ``no-store`` on every
  event stream, of the live feed, sse-starlette's by default; an owner worker's is: it says
  ``no-store`` only of such an answer). A status other than 2xx
  raises ``UpstreamStatusError`` with the upstream's body; a stream that stopped short, or sent
  an error event, raises ``UpstreamStreamBroken`` (the engine's error object kept as it came):
  the flight fails, and nothing is stored. ``made`` (a request that keeps state upstream) is
  told the response a 2xx answer makes as ``layers.holders`` is, before any client can read
  its id (``_Remembering``): ``Leader.lead`` indexes the flight under it (``state_index``).
- With ``owner`` (a worker of ``carpool serve --workers N`` without ``redis``, ``carpool.peers``),
  ``fetch`` asks that worker instead of the upstream and reads its answer as an upstream's: the
  owner counts the upstream call, this worker a peer call. An answer the owner served from its
  cache keeps its age (``age``), so no copy outlives the original's TTL. The owner not
  answering, the upstream is called here.
- ``Exchange.bypass``: a request that shares nothing: sent as it came and relayed as it comes
  (``_pipe``), never stored; but judged as a flight's call is where its client would otherwise
  get what no flight gives: a whole 2xx body that is not a JSON object (cut short: a
  close-delimited body its server dropped midway; an array) gets the miss path's 502
  (``NOT_JSON``, ``NOT_OBJECT``), never a 200 its client cannot parse; a 2xx stream that
  breaks, carries the upstream's error event or no event at all ends with an error event; each
  such failure counts in ``upstream_errors``; a refusal keeps the upstream's retry headers; a
  whole answer to a client that asked for a stream (a function upstream's) is sent as SSE
  (``reply.whole``); an answer without usage says so (``x-carpool-usage: missing``); and a
  stream an idempotency record keeps (``Request.recorded``) is asked for its usage as a flight
  is (``upstream.stream_usage``), its usage chunk hidden from a client that did not ask and
  kept for the record (``Reply.with_usage``).
- What the upstream's answer says of the requester's credentials is told to
  ``AcceptedCredentials`` on every call (``identity.py``): a 401/403 refuses, from its head; a
  2xx accepts once its answer is read and judged an answer (``accepts``: a stream that ended
  whole, a body that reports no error and has the answer's field), never a 2xx body that
  reports an error (a proxy refusing a made-up key with a 200) or lacks the answer, nor a 2xx
  of a call sent before a refusal of its tenant (``AcceptedCredentials.begun``).
- ``Relay``: a flight's stream for one client, framed as its API frames streams, ending with the
  API's error event if the flight failed; it says when it gave its last piece (``ended``), for a
  writer to end the response with it, and, once it ended whole, the stream with the usage chunk
  its client may not have asked for (``with_usage``: joined once for all the flight's clients)
  and the answer the flight assembled of it (``answered``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from . import exact_json
from .answer import Answer
from .apis import Api, api_of
from .apis.base import Collector
from .broadcast import Broadcast
from .chunks import MALFORMED_CHUNK
from .errors import (
    CarpoolError,
    LeaderLost,
    UpstreamAnswerUnreadable,
    UpstreamBadStatus,
    UpstreamError,
    UpstreamRedirected,
    UpstreamStatusError,
    UpstreamStreamBroken,
    retry_headers,
)
from .fingerprint import grant_of, names_of, neutral_of, requester
from .http_syntax import shared_cache_may_store
from .identity import tenant_of
from .outcome import Outcome
from .prefix import root_of
from .reply import NO_STORE, SSE_HEADERS, USAGE_MISSING, Reply, error_reply, failure_of, whole
from .request import Request, body_digest, requester_digest
from .upstream.base import UpstreamRequest, UpstreamResponse

if TYPE_CHECKING:
    from .config import Config
    from .layers import Layers
    from .metrics import Stats
    from .routing import RoutingPolicy
    from .routing.replicas import ReplicaState

# The end of the key of a flight whose call is asked without its usage (``flight_key``).
WITHOUT_USAGE = "\nwithout usage"


def without_usage(request: Request, config: Config) -> bool:
    """Whether ``request``'s own call is asked of the upstream without its usage: with
    ``upstream.stream_usage: false``, a streaming request that does not ask for it itself, of
    an API whose streams carry it only when asked (``Api.usage_asked``). Its answer lacks the
    usage the request's other shapes get (a non-streaming client's body has it, a stream that
    asks for it ends with it): it is shared only with requests of its shape (``flight_key``),
    which would get the same from the upstream, and never stored (``Leader._store``)."""
    return (
        not config.upstream.stream_usage
        and request.stream
        and not request.include_usage
        and request.api.usage_asked
    )


def flight_key(key: str, request: Request, config: Config) -> str:
    """The key of the flight ``request`` leads or joins: its fingerprint's, but apart for a
    call asked without its usage (``without_usage``): no request of another shape joins it."""
    return key + WITHOUT_USAGE if without_usage(request, config) else key


async def send(
    layers: Layers, upstream_request: UpstreamRequest, text: str, request: Request | None = None
) -> UpstreamResponse:
    """One upstream call: routed by ``text`` (the prompt), failed over once if need be. With the
    client's ``request``: to the replica holding the state it continues, and the state its
    answer makes remembered (see the module doc)."""
    replicas = layers.replicas
    holder = tenant = None
    if request is not None and replicas.chooses and request.api.keeps_state(request.body):
        tenant = requester(request.headers, layers.config)
        holder = layers.holders.holder(tenant, request.api.state_continued(request.body))
    # (``text`` only where there is a choice: ``Exchange._routing_text``.)
    scope = routing_scope(request, layers.config) if request is not None and text else b""
    if not layers.tracer.enabled:
        response, replica, decision = await replicas.send(upstream_request, text, holder, scope)
    else:
        with layers.tracer.span("carpool.upstream") as span:
            response, replica, decision = await replicas.send(upstream_request, text, holder, scope)
            span.set_attribute("carpool.replica", replica.name)
            span.set_attribute("carpool.decision", decision.value)
    status = response.status
    if not (200 <= status < 300 or 400 <= status < 600):
        # No answer of these endpoints: a 3xx (a 304 has no body to relay, a redirect is not
        # followed), a 1xx taken as final, 600-999. Relayed, the client's connection was
        # broken (see ``UpstreamRedirected``, ``UpstreamBadStatus``): the gateway's own 502,
        # stored nowhere. (Routing has judged the replica by it already.)
        await response.aclose()
        if 300 <= status < 400:
            raise UpstreamRedirected(f"upstream {replica.label} answered a redirect ({status})")
        raise UpstreamBadStatus(
            f"upstream {replica.label} answered with status {status}, which no answer has"
        )
    if tenant is not None and request is not None and 200 <= status < 300:
        remember = partial(layers.holders.remember, tenant, replica=replica.name)
        response = _remembering(response, request.api, remember)
    if text and request is not None and 200 <= status < 300 and replicas.policy.learns_answers:
        response.answered = partial(_answered, replicas.policy, request.api, text, replica, scope)
    return response


def _answered(
    policy: RoutingPolicy,
    api: Api,
    text: str,
    replica: ReplicaState,
    scope: bytes,
    answer: dict[str, Any],
) -> None:
    """``replica``'s answer to the prompt ``text``, told to the routing policy as the next
    turn's prompt will begin: the prompt, then the answer's text (``Api.answer_texts``)."""
    texts = api.answer_texts(answer)
    if texts:
        policy.on_answered(
            text + ("" if api.prompt_goes_on else "\n") + "\n".join(texts), replica, scope
        )


def _remembering(
    response: UpstreamResponse, api: Api, remember: Callable[[str], None]
) -> UpstreamResponse:
    """``response``, the state its answer made remembered (``remember(id)``): a whole body's at
    once, a stream's as its events come (``_Remembering``)."""
    if not response.streaming:
        try:
            answer = orjson.loads(response.body)
        except orjson.JSONDecodeError:
            return response  # (judged where it is read)
        made = api.state_made(answer) if isinstance(answer, dict) else None
        if made is not None:
            remember(made)
        return response
    events = _Remembering(response.events(), api, remember)
    return UpstreamResponse(
        response.status, response.headers, response.body, events, response.aclose
    )


class _Remembering:
    """A stream's payloads as they come, the state the first event that names one names
    remembered before that event is passed on: a client may ask for it the moment it sees it."""

    __slots__ = ("events", "api", "remember")

    def __init__(
        self, events: AsyncIterator[list[bytes]], api: Api, remember: Callable[[str], None]
    ) -> None:
        self.events, self.api = events, api
        self.remember: Callable[[str], None] | None = remember

    def __aiter__(self) -> _Remembering:
        return self

    async def __anext__(self) -> list[bytes]:
        payloads = await self.events.__anext__()
        if self.remember is not None:
            for payload in payloads:
                # Only a payload naming the state has this key (text in a string has its
                # quotes escaped); ``find``: see ``Api.frame``.
                if payload.find(self.api.state_field) == -1:
                    continue
                try:
                    chunk = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue  # (judged where it is read)
                made = self.api.state_made(chunk) if isinstance(chunk, dict) else None
                if made is not None:
                    self.remember(made)
                    self.remember = None  # the rest is passed on as it comes
                    break
        return payloads


class Exchange:
    """A flight's upstream call and a bypass's, on the ``layers`` (read at call time: their
    tracer may be replaced while the gateway runs)."""

    def __init__(self, layers: Layers) -> None:
        self.layers = layers
        self.config = layers.config

    async def fetch(
        self,
        request: Request,
        broadcast: Broadcast,
        owner: int | None = None,
        made: Callable[[str], None] | None = None,
    ) -> Answer:
        """The upstream call: streamed into ``broadcast`` frame by frame, then assembled.
        ``owner``: the worker that leads this key's calls (``carpool.peers``), asked instead
        (the upstream still, if it does not answer). ``made``: told the state a 2xx answer
        makes (``Api.state_made``) before any client can read it: a whole body's at once, a
        stream's at its first payload naming it (``_Remembering``)."""
        api, body, stream = request.api, request.body, request.stream
        # Streamed anyway when the config says so (``_streams``), so that streaming clients
        # joining this call get it live; with the usage the clients may not have asked for
        # (always for a leader that did not ask for a stream: its whole answer has one; a
        # stream asked without it is shared only with its shape: ``without_usage``).
        if stream or self._streams(request):
            usage = self.config.upstream.stream_usage or not request.stream
            body, stream = api.streamed(body, usage and not request.include_usage), True
        upstream_request = UpstreamRequest(
            request.upstream_path,
            body,
            request.headers,
            stream,
            request.query,
            api.last_event,
            request.client_ids,
        )
        begun = self.layers.accepted.begun()  # (a refusal while it runs: its 2xx accepts none)
        peers = self.layers.peers
        response, said = None, None
        if owner is not None and peers is not None:
            response = await peers.ask(owner, request, upstream_request)
            if response is not None:
                # Shared, unless the owner called the upstream for this very request; a hit
                # if it answered from its cache.
                said = response.headers.get("x-carpool")
                broadcast.remote, broadcast.cached = said != Outcome.MISS, said == Outcome.HIT
        if response is None and request.kind == "embedding":
            response = await self.layers.batcher.embed(upstream_request)
        elif response is None:
            response = await send(
                self.layers, upstream_request, self._routing_text(request), request
            )
        if made is not None and 200 <= response.status < 300:
            response = _remembering(response, api, made)
        created: float | None = None
        if response.headers.get("age", "").isdigit():
            # From a cache (the owner's): as old as it was there (an upper bound: the header
            # counts whole seconds), so that no copy outlives the original's TTL. Known from
            # the head, before the frames: a streaming client's hit says its age too.
            created = self.layers.clock.now() - int(response.headers["age"]) - 1
            broadcast.created = created
        # (An owner's hit or shared call says nothing of this requester's credentials: the
        # upstream did not see them.)
        judges = said is None or said == Outcome.MISS
        if judges:
            self._refused(request, response.status)
        try:
            if not 200 <= response.status < 300:
                error = UpstreamStatusError(
                    response.status,
                    response.body,
                    response.headers.get("content-type"),  # (none: relayed without one)
                    retry_headers(response.headers),
                )
                # Which body it refused: a joiner of the flight that sent another may not be.
                error.asked = body_digest(request.body)
                error.requester = requester_digest(request.body)
                raise error
            if response.streaming:
                answer = await _consume(request.kind, response, broadcast, body, response.answered)
            else:
                try:
                    answer = _complete(request.kind, response.body, body, response.answered)
                except UpstreamError:
                    # A 2xx that is no answer (a maintenance page, a JSON array): the attempt
                    # was counted by its status, the call failed all the same (as below).
                    if said is None:
                        self.layers.stats.upstream_errors += 1
                    raise
        except LeaderLost:
            if owner is None or broadcast.frames:
                raise  # (frames sent cannot be taken back: ``Gateway._follow`` takes it over)
            # The owner died before its first frame: nobody saw any of it, the call is made here.
            broadcast.remote = broadcast.cached = False
            broadcast.created = None
            return await self.fetch(request, broadcast, made=made)
        except UpstreamStreamBroken as error:
            # Its head said 2xx, as the attempt was counted: the call failed all the same, for
            # this requester (its error event may quote the request: ``for_others``). (After
            # LeaderLost, one of its kind: another instance's leader lost is not ours.) Counted
            # where the upstream was called, not where an owner's stream was relayed.
            error.requester = requester_digest(request.body)
            if said is None:
                self.layers.stats.upstream_errors += 1
            raise
        finally:
            await response.aclose()
        if judges and accepts(answer):
            self._accepted(request, begun)
        if not answer.complete:
            # Whose call it was: a body reporting an error may quote this request, which a
            # client of another is told without its words (``Answer.for_others``).
            answer.requester = requester_digest(request.body)
        # Produced now by the gateway's clock, which its stores' expiry and ages read (not the
        # system's: a test's clock may be moved, and both must move together).
        answer.created = self.layers.clock.now()
        # The upstream said no shared cache may store it (``no-store``, ``private``): its
        # clients get it, no cache keeps it (``Answer.storable``). A whole answer's only: SSE
        # servers say ``no-store`` on every event stream by default (sse-starlette, hence
        # llama-cpp-python's server), which keeps proxies from buffering or keeping the live
        # feed and says nothing of the answer assembled from it. An owner worker's stream says
        # it of the answer (``reply.whole``: a stream of a whole answer it was told so of).
        if not response.streaming or said is not None:
            answer.no_store = not shared_cache_may_store(response.headers.get("cache-control", ""))
        if created is not None:
            answer.created = created
        elif said == Outcome.COALESCED:
            # Joined at the owner, perhaps after its call ended (a finished flight stays
            # joinable for the coalescing window, and says no age): at most that old.
            answer.created -= self.layers.flights.windows.longest
        return answer

    def _streams(self, request: Request) -> bool:
        """Whether a non-streaming request's shared call is asked of the upstream as a stream."""
        if not self.config.upstream.stream_flights or not request.api.streams:
            return False
        body = request.body
        # A completion's best_of picks among candidates at the end, and echo repeats the prompt:
        # engines refuse or change them when streamed. vLLM refuses ``prompt_logprobs`` (chat
        # and completions) with ``stream: true`` ("not available when `stream=True`"; all but
        # 0), and only its whole answer carries the prompt's logprobs: such a call goes whole,
        # as its client asked, whatever the value.
        if body.get("prompt_logprobs") is not None:
            return False
        # Stream options without a stream the engines refuse (400): asked as the client asked,
        # not as a stream they would take.
        if body.get("stream_options"):
            return False
        return not (request.kind == "completion" and (body.get("best_of") or body.get("echo")))

    async def bypass(self, request: Request, route: str) -> Reply:
        """A request that shares nothing, sent as it came and relayed as it comes (but a whole
        answer to a client that asked for a stream, which SSE carries as a flight's does).
        Counted once the upstream answered (or failed): a client that leaves before is
        ``abandoned``.

        But a stream an idempotency record keeps (``Request.recorded``) that did not ask for
        its usage is asked with it (``upstream.stream_usage``), as a flight is: its retries
        may ask for it, or for JSON, which has it. Its client is not sent the usage chunk; the
        record keeps it (``Reply.with_usage``)."""
        header = Outcome.BYPASS.header
        api = request.api
        body = request.body
        kept: list[bytes] | None = None
        if (
            request.recorded
            and request.stream
            and not request.include_usage
            and api.usage_asked
            and self.config.upstream.stream_usage
        ):
            body, kept = api.streamed(body, True), []
        begun = self.layers.accepted.begun()  # (a refusal while it runs: its 2xx accepts none)
        try:
            response = await send(
                self.layers,
                UpstreamRequest(
                    request.upstream_path,
                    body,
                    request.headers,
                    request.stream,
                    request.query,
                    api.last_event,
                    request.client_ids,
                ),
                self._routing_text(request),
                request,
            )
        except CarpoolError as error:
            self.layers.stats.count(route, Outcome.BYPASS)
            return error_reply(error, Outcome.BYPASS, api)
        self.layers.stats.count(route, Outcome.BYPASS)
        self._refused(request, response.status)
        ok = 200 <= response.status < 300
        # A refusal keeps what its upstream said of when to retry (``retry_headers``), as a
        # flight's does (``UpstreamStatusError``): its SDK waits, or does not retry at all.
        said = [] if ok else [(n.encode(), v.encode()) for n, v in retry_headers(response.headers)]
        if response.streaming:
            # (Its credential accepted once the stream ended whole, as a flight's call; a 2xx
            # stream that failed on the way is a failed call, as a flight's: ``_pipe``.)
            accepted = partial(self._accepted, request, begun) if ok else None
            return Reply(
                response.status,
                [*SSE_HEADERS, header, *said],
                stream=_pipe(
                    api,
                    response,
                    accepted,
                    kept,
                    self.layers.stats if ok else None,
                    response.answered,
                ),
                outcome=Outcome.BYPASS,
                with_usage=None if kept is None else partial(b"".join, kept),
            )
        if ok:
            try:
                parsed = _parsed(response.body)
            except UpstreamError as failed:
                # Cut short (a close-delimited body its server dropped midway), not JSON at all
                # or no object: no answer, as the miss path judges it (``_complete``), never a
                # 200 a client cannot parse; a failed call, counted as a flight's is.
                self.layers.stats.upstream_errors += 1
                return error_reply(failed, Outcome.BYPASS, api)
            if failure_of(api, parsed) is None:
                self._accepted(request, begun)
            if response.answered is not None:
                response.answered(parsed)
            if request.stream:
                # A whole answer to a client that asked for a stream (a function upstream,
                # never asked to stream; an engine that ignored ``stream``): sent as SSE, as a
                # flight's whole answer is (``reply.whole``), not JSON its SDK cannot read.
                answer = Answer.from_body(
                    request.kind, parsed, response.body, api.complete(parsed, body)
                )
                answer.no_store = not shared_cache_may_store(
                    response.headers.get("cache-control", "")
                )
                now = self.layers.clock.now()
                return whole(Outcome.BYPASS, answer, True, request.include_usage, now=now)
        ctype = response.headers.get("content-type")
        # (The upstream's, or none if it named none: never an empty one.)
        headers = [(b"content-type", ctype.encode("latin-1")), header] if ctype else [header]
        if ok and not shared_cache_may_store(response.headers.get("cache-control", "")):
            headers.append(NO_STORE)  # (as ``reply.whole`` says it: for the caches past this one)
        if ok and not isinstance(parsed.get("usage"), dict):
            headers.append(USAGE_MISSING)  # (as ``reply.usage_said`` says it of a whole answer)
        headers.extend(said)
        return Reply(response.status, headers, response.body, outcome=Outcome.BYPASS)

    def _refused(self, request: Request, status: int) -> None:
        """A 401 or 403 refuses the requester's credentials (``identity.py``), from its head."""
        if status in (401, 403):
            self.layers.accepted.refuse(requester(request.headers, self.config))

    def _accepted(self, request: Request, begun: int) -> None:
        """The upstream answered the requester (``accepts``) on a call sent when ``begun``
        (``AcceptedCredentials.begun``): its credentials are accepted for the request's grant
        (``identity.py``), unless refused since."""
        names = names_of(self.config.tenant)
        grant = grant_of(request, names, neutral_of(self.config.fingerprint))
        self.layers.accepted.accept(tenant_of(request.headers, names), grant, begun)

    def _routing_text(self, request: Request) -> str:
        """The prompt for routing, where there is a choice to make (``ReplicaSet.chooses``)."""
        return _routing_text(request) if self.layers.replicas.chooses else ""


NOT_JSON = "the upstream answered with a body that is not JSON"  # (a 2xx's: 502)
NOT_OBJECT = "the upstream answered with a body that is not a JSON object"


def accepts(answer: Answer) -> bool:
    """Whether a 2xx call's ``answer`` says the upstream accepted its requester's credentials:
    a complete answer, or an incomplete one that is an answer still (fewer choices, a response
    cut by its token limit). Not a body that reports an error (some servers and proxies refuse
    a key with a 200 and ``{"error": {"code": "invalid_api_key"}}``), lacks the answer's
    field or holds a malformed one (``reply.failure_of``): a made-up key refused so would read
    a shared namespace (``identity.py``)."""
    return answer.complete or _whole_answer(api_of(answer.kind), answer.body)


def _whole_answer(api: Api, raw: bytes) -> bool:
    """Whether a 2xx body is an answer (``reply.failure_of`` finds none of an error in it)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and failure_of(api, body) is None


async def _consume(
    kind: str,
    response: UpstreamResponse,
    broadcast: Broadcast,
    asked: dict[str, Any],
    answered: Callable[[dict[str, Any]], None] | None = None,
) -> Answer:
    """Publish an upstream stream as it comes (the frames of one read at once, the very first
    frame alone); judge and assemble it once it ends.

    Only a stream that ended whole comes back (``[DONE]``, or a typed stream's last event:
    ``response.events()`` raises ``UpstreamStreamBroken`` otherwise, and so does an error event),
    judged by its API (``Api.judge_stream``): a chat or completions stream must have finished
    every choice in it, or it raises too (one with fewer choices than ``asked``, the request
    body sent, asked for is the upstream's own answer: served, not stored); a typed
    stream that ended without completing (Responses ``incomplete``/``failed``, a message with no
    ``stop_reason``) is the upstream's own answer, served as it came and not stored; so is a
    chat or completions stream with more than one usage-only chunk. A raise
    fails the flight: every client gets an error (streaming ones an SSE error event) and
    nothing is stored. ``answered``: told the assembled body (``UpstreamResponse.answered``).
    """
    api = api_of(kind)
    collector = api.collector()
    first = True
    usages = 0
    async for payloads in response.events():
        if first:
            # The first frame goes out at once, not after the frames that came in the same
            # read: a turn of the loop for its clients (the time to their first byte).
            first = False
            usages += _publish(api, payloads[:1], collector, broadcast)
            await asyncio.sleep(0)
            payloads = payloads[1:]
        usages += _publish(api, payloads, collector, broadcast)
    body, complete = collector.judge(asked)
    if answered is not None:
        answered(body)
    return Answer(
        kind,
        orjson.dumps(body),
        # Clients not asking for usage are kept from one usage-only chunk, the last: with
        # another mid-way (no engine asked sends one), their hits would replay it, stale.
        complete and usages <= 1,
        api.usage_tokens(body),
        frames=broadcast.frames,
        usage_frame=broadcast.usage_frame,
    )


def _publish(api: Api, payloads: list[bytes], collector: Collector, broadcast: Broadcast) -> int:
    """Payloads that came together, judged into ``collector`` and framed into ``broadcast`` at
    once: how many were usage-only chunks. A payload that is not a JSON object, is the engine's
    error, or is a chunk the assembly cannot read (``chunks.MALFORMED_CHUNK``: ``tool_calls:
    5``...), raises ``UpstreamStreamBroken`` once the frames before it are published."""
    if not payloads:
        return 0
    failure, frame, usage_only = api.failure, api.frame, api.usage_only
    add, add_texts = collector.add, collector.add_texts
    frames: list[bytes] = []
    usage = None
    usages = 0
    at, end = 0, len(payloads)
    try:
        while at < end:
            taken = add_texts(payloads, at)
            if taken:
                # Text chunks like one judged before, but for their text: judged as that one
                # was (no error, not the usage), each payload one line (``chunks.Assembly``).
                frames += api.one_line_frames(payloads[at : at + taken])
                at += taken
                if at == end:
                    break
            # (Not taken, if the ones before it were: it is parsed.)
            payload = payloads[at]
            at += 1
            try:
                chunk = exact_json.loads(payload)
            except orjson.JSONDecodeError:
                raise UpstreamStreamBroken("the upstream sent a malformed stream chunk") from None
            if type(chunk) is not dict:
                raise UpstreamStreamBroken("the upstream sent a stream chunk that is not an object")
            error = failure(chunk)
            if error is not None:
                # The engine's own error object reaches the clients as it is (its message,
                # type and code), not a paraphrase.
                raise UpstreamStreamBroken(
                    f"the upstream stream failed: {error.get('message')}", error
                )
            try:
                add(chunk, payload)
            except MALFORMED_CHUNK:
                # A chunk of the wrong shape where the assembly reads it (a choice index that
                # is a list, ``tool_calls: 5``, a ``function`` that is a string): the
                # upstream's fault, told as such, not the gateway's failure.
                raise UpstreamStreamBroken("the upstream sent a malformed stream chunk") from None
            if usage_only(chunk):
                usage = len(frames)
                usages += 1
            frames.append(frame(payload, chunk))
    finally:
        if frames:
            broadcast.publish_many(frames, usage)
    return usages


def _complete(
    kind: str,
    raw: bytes,
    asked: dict[str, Any],
    answered: Callable[[dict[str, Any]], None] | None = None,
) -> Answer:
    """A whole upstream body as an ``Answer``: ``complete`` (storable) only when its API judges
    it so (``Api.complete``: for chat and completions, every choice that ``asked`` (the request
    body sent) asked for is there and finished). An incomplete one is still the upstream's own
    2xx answer: its clients get it as it came; it is never stored. ``answered``: told the
    parsed body (``UpstreamResponse.answered``)."""
    parsed = _parsed(raw)
    if answered is not None:
        answered(parsed)
    return Answer.from_body(kind, parsed, raw, api_of(kind).complete(parsed, asked))


def _parsed(raw: bytes) -> dict[str, Any]:
    """A whole 2xx body as the JSON object every answer is; ``UpstreamAnswerUnreadable`` (a
    502 the SDKs do not retry) when it is not JSON (``NOT_JSON``) or not an object
    (``NOT_OBJECT``)."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamAnswerUnreadable(NOT_JSON) from None
    if not isinstance(parsed, dict):
        raise UpstreamAnswerUnreadable(NOT_OBJECT)
    return parsed


class Relay:
    """A flight's stream for one client, an async iterator of pieces: the frames there are at
    each turn joined into one (``Broadcast.take``), the stream's end (or its error event)
    joined to the last. ``ended`` turns true as the last piece is given: a writer may end its
    response with it (the chunked body's end in the same write). ``saved`` (a joiner's) is told
    the answer it got as that last piece of a stream that ended whole is given."""

    __slots__ = ("api", "broadcast", "include_usage", "saved", "shown", "sent", "ended")

    def __init__(
        self,
        api: Api,
        broadcast: Broadcast,
        include_usage: bool,
        saved: Callable[[Answer], None] | None = None,
        shown: Callable[[CarpoolError], CarpoolError] | None = None,
    ) -> None:
        self.api, self.broadcast, self.include_usage = api, broadcast, include_usage
        self.saved = saved
        self.shown = shown
        self.sent = 0
        self.ended = False

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        if self.ended:
            raise StopAsyncIteration
        broadcast = self.broadcast
        while True:
            done = broadcast.done  # (read first: a frame published after it would be missed)
            piece, self.sent = broadcast.take(self.sent, self.include_usage)
            if done and self.sent == len(broadcast.frames):
                break
            if piece:
                return piece
            await broadcast.wait_changed()
        self.ended = True
        if broadcast.error is not None:
            error = broadcast.error if self.shown is None else self.shown(broadcast.error)
            return piece + self.api.error_event(error, self.sent)
        if self.saved is not None and broadcast.answer is not None:
            self.saved(broadcast.answer)
        if piece or self.api.stream_end:
            return piece + self.api.stream_end
        raise StopAsyncIteration

    def with_usage(self) -> bytes | None:
        """The flight's stream with its usage chunk, as a client that asked for it receives it
        (``Reply.with_usage``), once it ended whole; None if it has not, or failed. Joined once
        for all the flight's clients (``Broadcast.whole``): the records of its keyed clients
        hold one copy of it, not one each."""
        if self.answered() is None:
            return None
        broadcast = self.broadcast
        if broadcast.whole is None:
            broadcast.whole = b"".join(broadcast.frames) + self.api.stream_end
        return broadcast.whole

    def answered(self) -> Answer | None:
        """The answer the flight's stream made (``Reply.answered``), once it ended whole; None
        if it has not, or failed."""
        broadcast = self.broadcast
        return broadcast.answer if broadcast.error is None else None


async def _pipe(
    api: Api,
    response: UpstreamResponse,
    accepted: Callable[[], None] | None = None,
    kept: list[bytes] | None = None,
    stats: Stats | None = None,
    answered: Callable[[dict[str, Any]], None] | None = None,
) -> AsyncIterator[bytes]:
    """A bypassed stream, relayed as it comes (framed as its API frames it); a failure part-way
    (a stream that stops without ``[DONE]`` or its last event included) ends it with an error
    event. It is not judged further: nothing stores it, and a client of its own gets what the
    upstream sent; but with ``kept`` (``Exchange.bypass``: asked with the usage its client did
    not ask for), the usage chunk is left out of what the client is sent, and every frame, that
    one too, is added to ``kept``, then the stream's end if it ended whole. ``accepted`` is
    called once it ended whole, without an error event; a failure is counted in ``stats``'
    ``upstream_errors`` (a 2xx stream's: a refusal's status was counted as it came).
    ``answered`` (``UpstreamResponse.answered``, routing's): told the stream assembled, once it
    ended whole (its chunks read as they pass: ``_Assembled``)."""
    sent = 0  # events its client was sent (an error event is numbered after them)
    seen = False  # whether the upstream sent any event
    assembled = _Assembled(api) if answered is not None else None
    try:
        async for payloads in response.events():
            seen = seen or bool(payloads)
            frames: list[bytes] = []
            for payload in payloads:
                # (``find``: see ``Api.frame``.)
                error = _error_in(api, payload) if payload.find(b'"error"') != -1 else None
                if error is not None:
                    # The upstream's own error ends it, framed as its API frames errors (a
                    # typed stream's SDK ignores an event without its name): no second one.
                    if stats is not None:
                        stats.upstream_errors += 1
                    yield b"".join(frames) + api.error_event(
                        UpstreamStreamBroken(
                            f"the upstream stream failed: {error.get('message')}", error
                        ),
                        sent + len(frames),
                    )
                    return
                if assembled is not None:
                    assembled.add(payload)
                framed = api.frame(payload)
                if kept is not None:
                    kept.append(framed)
                    # (Parsed only if it names the usage: with it asked, OpenAI's chunks all
                    # do, ``"usage": null`` but in the last.)
                    if payload.find(b'"usage"') != -1 and _usage_only(api, payload):
                        continue
                frames.append(framed)
            sent += len(frames)
            yield b"".join(frames)
        if not seen:
            # Ended (``[DONE]``) with no event at all: no answer, as a flight judges it; its
            # key accepted for nothing (in a shared namespace it would read the others').
            raise UpstreamStreamBroken("the upstream stream ended without an answer")
        if assembled is not None and answered is not None and (whole := assembled.body()):
            answered(whole)
        if accepted is not None:
            accepted()
        if kept is not None:
            kept.append(api.stream_end)
        if api.stream_end:
            yield api.stream_end
    except UpstreamError as error:
        if stats is not None:
            stats.upstream_errors += 1
        yield api.error_event(error, sent)
    finally:
        await response.aclose()


class _Assembled:
    """A bypassed stream's chunks, read as they pass and assembled once it ended (its API's
    ``Collector``), for routing to record the answer (``_pipe``); one it cannot read makes no
    answer: nothing is recorded, the stream goes on as it came."""

    __slots__ = ("collector",)

    def __init__(self, api: Api) -> None:
        self.collector: Collector | None = api.collector()

    def add(self, payload: bytes) -> None:
        if self.collector is None:
            return
        try:
            chunk = orjson.loads(payload)
            if isinstance(chunk, dict):
                self.collector.add(chunk, payload)
        except (orjson.JSONDecodeError, *MALFORMED_CHUNK):
            self.collector = None

    def body(self) -> dict[str, Any] | None:
        if self.collector is None:
            return None
        try:
            return self.collector.judge(None)[0]
        except (UpstreamError, *MALFORMED_CHUNK):
            return None


def _usage_only(api: Api, payload: bytes) -> bool:
    """Whether a stream payload is the chunk that carries only the usage (``Api.usage_only``)."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and api.usage_only(parsed)


def _error_in(api: Api, payload: bytes) -> dict[str, Any] | None:
    """The error object of a stream payload that is an error event (``Api.failure``)."""
    try:
        parsed = exact_json.loads(payload)  # (written again, in the client's error event)
    except orjson.JSONDecodeError:
        return None
    return api.failure(parsed) if isinstance(parsed, dict) else None


def _routing_text(request: Request) -> str:
    """The prompt as the engine sees it, system prompt first: what its prefix cache holds."""
    return "\n".join(request.api.input_texts(request.body))


def routing_scope(request: Request, config: Config) -> bytes:
    """Whose prompts ``request``'s may share a prefix with in routing (a chain root,
    ``routing.cache_aware``): its tenant's, or in a shared namespace (``tenant.shared_namespaces``,
    unless it names state of its tenant's, ``Api.tenant_bound``) every tenant's there, whose
    answers are shared already; of its model (another model's cache is none of its); of its
    ``cache_salt`` (vLLM's: a prefix cached under another salt is no hit)."""
    body = request.body
    namespace = request.controls.namespace
    if (
        namespace
        and namespace in config.tenant.shared_namespaces
        and not request.api.tenant_bound(body)
    ):
        whose = ["*", namespace]
    else:
        whose = [requester(request.headers, config), ""]
    return root_of([*whose, _scope_part(body.get("model")), _scope_part(body.get("cache_salt"))])


def _scope_part(value: Any) -> str:
    """A body field as a part of a routing scope: a string as it is, else its JSON."""
    return value if isinstance(value, str) else orjson.dumps(value).decode()
