"""A flight's own task: the upstream call into the flight's broadcast, then the answer stored.

Contract:
- ``Leader.lead`` is a flight's lead (``FlightGroup.acquire``): it runs in the flight's own task,
  never in a client's. The upstream call (``Exchange.fetch``) streams into the flight's
  broadcast; a complete answer is stored before the flight ends, so a request that no longer
  finds the flight finds the answer in the cache (read-your-writes).
- With ``redis``, identical requests on different instances share one call too: the lead of
  each instance's flight leads it for all of them or relays it from the instance that does
  (``redis/flights.py``); whatever Redis does, the flight still gets its answer. ``alone``: the
  call is made here, whatever the other instances do (a joiner that timed out, a takeover).
- Without ``redis``, among the workers of ``carpool serve --workers N`` (``carpool.peers``): the
  call of a key another worker owns is asked of that worker (``Exchange.fetch``'s ``owner``),
  its answer relayed into the flight's broadcast and stored here like any answer; ``alone``
  (a peer's own request, a joiner that timed out): made here.
- With an in-process store (``Store.get_now``) and no semantic entry to insert, the flight's
  clients are woken with the answer first and it is stored right after they reply, in the same
  turn of the event loop: no request that follows a reply can be read in between, and one that
  comes meanwhile joins the flight, still running. Otherwise it is stored, then they are woken.
- An answer is stored with its request's tags and the gateway's own
  (``store.base.state_tag``), in the requester's tenant: each file its request's input names
  (``apis.base.named_files``, every API, state kept or not; walked once, on a miss:
  ``Request.files``) and, for a request that keeps state
  upstream (Responses; a chat completion with ``store: true``: ``Api.keeps_state``), the
  stored response it continues and the one it is, in the exact and the semantic cache alike;
  its keys and semantic entry are indexed under those tags (``state_index``: what a ``DELETE``
  of any of them drops). The call is indexed under them while it runs too
  (``StateIndex.fly``): under the files it names and the response it continues from its
  start, under the one it makes as soon as the
  upstream names it (``Exchange.fetch``'s ``made``: before any client reads the id; a call
  followed or replayed from another instance, whose stream named it there: by its whole
  answer, before this flight's clients have its end), with the key its flight is led under
  (``flying``), so that a ``DELETE`` of any shuts the flight,
  which no request joins from then on; once it ends, indexed no more unless its answer
  lingers (``StateIndex.landed``). One whose file or response (continued or made) was deleted
  while its call ran is not stored (``StateIndex.deleted``, asked before it is stored and again
  once it is: one deleted meanwhile is taken back).
- A cached answer is read, whoever stored it, only while it is younger than its request's
  ``read_age``: its ``max-age`` bounded by its type's TTL in this instance's config (0: not at
  all). A shared flight's claim that finds an answer stored (``redis/flights.py``'s ``load``)
  reads it so too, as the pipeline's reads of the exact and semantic caches do.
- Nothing broken is stored (``_store``): only storable answers (``Answer.storable``: complete,
  and not one the upstream's ``Cache-Control`` keeps out of shared caches, ``no-store`` or
  ``private``: relayed to its flight's clients, joiners included, and kept by an idempotency
  record, but in no cache, exact or semantic, nor lingering in the window), with
  ttl > 0 and not past it (an answer back-dated by its ``age``), without ``no-store``, not
  asked without the usage other shapes of the request get (``exchange.without_usage``: a
  later hit of another shape would lack it), and only if no invalidation came after the call
  began (the flights' ``epoch``; for its semantic entry, the semantic cache's ``generation``
  too, which another instance's invalidation may move first: ``redis/semantic.py``): the
  answer may predate what was invalidated. With ``redis``, whatever
  path the call took (led for all, alone, without shared flights), Redis's count of
  invalidations is read before the call and again once its answer is stored: one by any
  instance in between takes it back (``RedisStore.put``), so an invalidation that answered
  leaves no answer of a call begun before it, even one whose store was on its way.
- With the semantic cache, the prompt is embedded while the upstream answers (unless the probe
  did already), so that its entry too is in before the flight ends (read-your-writes).
  The clients wait for an embedding begun with the call no longer than the embedder's own
  bound (``semantic.embed_timeout_ms``, from the call's start): a hung embedder delays no reply
  past it, and a prompt it failed to embed in time (a timeout is a failure) gets no entry
  (counted in ``embed_failures``), its clients their answer all the same.
  Semantic entries are shared with ``redis`` too (``redis/semantic.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import orjson

from .answer import Answer
from .apis import Api
from .apis.base import named_files
from .apis.openai import answer_repeats_prompt
from .broadcast import Broadcast
from .canonical import collapses, normalize_text
from .exchange import flight_key, without_usage
from .fingerprint import Fingerprint, SemanticView, semantic_view
from .reply import unstreamable
from .request import Request
from .state_index import Held
from .store import Entry
from .store.base import PROMPT_PREFIX_CHARS, Store, StoreUnavailable, prompt_text, state_tag

if TYPE_CHECKING:
    from .config import Config
    from .layers import Layers
    from .semantic.cache import Probe

log = logging.getLogger("carpool.lead")


def read_age(config: Config, request: Request) -> float | None:
    """The oldest cached answer ``request`` accepts (0: none at all; None: any): its
    ``max-age``, bounded by its type's TTL in this instance's config, whoever stored the
    answer (another instance with a longer TTL, or this one before its TTL was lowered). The
    one rule of every read of a cache: the exact cache, the semantic cache's candidates, a
    shared flight's claim that finds an answer stored."""
    ttl = config.ttl_for(request.controls.request_type)
    max_age = request.controls.max_age
    return ttl if max_age is None or ttl < max_age else max_age


class Leader:
    """Leads the flights of one gateway: ``fetch`` makes the call (``Exchange.fetch``)."""

    def __init__(self, layers: Layers, fetch: Callable[..., Awaitable[Answer]]) -> None:
        self.config = layers.config
        self.store = layers.store
        self.flights = layers.flights
        self.semantic = layers.semantic
        self.shared_flights = layers.shared_flights
        self.shared_store = layers.shared_store  # (``store`` itself, with ``redis``)
        self.peers = layers.peers
        self.invalidations = layers.invalidations
        self.states = layers.states  # (what a stored response's DELETE drops: ``state_index``)
        self.fetch = fetch
        self.clock = layers.clock
        # An in-process store (``Store.get_now``) stores without waiting: a flight's clients
        # may reply before its answer is stored, in the same turn of the loop (``lead``).
        self.stored_at_once = getattr(self.store, "get_now", None) is not None

    async def lead(
        self,
        request: Request,
        key: Fingerprint,
        view: SemanticView | None,
        probe: Probe | None,
        broadcast: Broadcast,
        *,
        epoch: int,
        alone: bool = False,
        flying: str | None = None,
    ) -> Answer:
        """The flight's answer: runs in the flight's own task, never in a client's.

        The upstream call streams into ``broadcast``; a complete answer is stored before the
        flight ends. With shared flights (``redis``) the call is made by the one instance that
        leads it for all, and followed by the others (``redis/flights.py``); ``alone``: here.
        With the semantic cache, the prompt is embedded while the upstream answers (unless the
        probe did already), so that its entry too is in before the flight ends. ``flying``: the
        key the flight is led under (None: ``flight_key``'s), which a ``DELETE`` of a file the
        call names, or of the response it continues or makes, shuts (``state_index``).
        """
        embedding = None
        if (
            view is not None
            and self.semantic is not None
            and (probe is None or (probe.vector is None and not probe.failed))
        ):
            embedding = asyncio.get_running_loop().create_task(self.semantic.vector(view))
        # Without redis, among the workers of one run: the key's owner makes the call for all.
        # Chosen from the shared key where there is one (a shared namespace's requester not yet
        # accepted here): each worker keys such a request by what the upstream accepted there,
        # and two keys' owners could be each other, each flight waiting on the other's.
        owner = (
            self.peers.owner_of(key.shared_key or key.key)
            if self.peers is not None and not alone and key.key is not None
            else None
        )
        begun = _Begun()
        if self.semantic is not None:  # (the semantic layer's count of invalidations, now)
            begun.semantic = self.semantic.generation
        controls = request.controls
        # (A no-store leader's answer may be stored for a joiner: ``_keep_for_joiner``.)
        storable = self.config.ttl_for(controls.request_type) > 0 and not without_usage(
            request, self.config
        )
        shared_store = self.shared_store if key.key is not None and storable else None
        oldest = read_age(self.config, request)

        # Indexed while it runs, under the files it names and the response it continues from
        # its start and under the one it makes as soon as the upstream names it (before a
        # client can see the id): a DELETE of any shuts the flight, which no request joins
        # from then on (``StateIndex.fly``); indexed no more once it ends, unless its answer
        # lingers.
        flown: list[tuple[str, Held]] = []
        made: Callable[[str], None] | None = None
        led = ""
        keeps_state = key.key is not None and request.api.keeps_state(request.body)
        runs_under = list(_file_tags(request, key.owner)) if key.key is not None else []
        if keeps_state and (continued := request.api.state_continued(request.body)) is not None:
            runs_under.append(state_tag(key.owner, continued))
        if key.key is not None and (keeps_state or runs_under):
            led = flying if flying is not None else flight_key(key.key, request, self.config)
            if runs_under:
                flown += self.states.fly(runs_under, led)
        if keeps_state:

            def made(state: str) -> None:
                tag = state_tag(key.owner, state)
                if self.states.deleted((tag,)):
                    # Named only after its DELETE (a call followed from another instance,
                    # named at its end here): joined by no request from now on, nor lingering.
                    self.flights.shut(led)
                else:
                    flown.extend(self.states.fly((tag,), led))

        async def call(broadcast: Broadcast) -> Answer:
            if shared_store is not None:  # (Redis's count of invalidations, before the call)
                begun.generation = await shared_store.generation()
            return await self.fetch(request, broadcast, owner=owner, made=made)

        store: Callable[[Answer], Awaitable[str]] = partial(
            self._store,
            request,
            key,
            view=view,
            probe=probe,
            epoch=epoch,
            embedding=embedding,
            begun=begun,
        )
        if controls.no_store:
            store = partial(self._keep_for_joiner, broadcast, epoch=epoch, begun=begun)
        if self.invalidations is not None:  # (lazily, without the server)
            self.invalidations.start()
        answer: Answer | None = None
        try:
            if self.shared_flights is None or alone or key.key is None:
                answer = await call(broadcast)
                if view is None and self.stored_at_once:
                    # The clients first: woken now, they reply in the loop's next turn, and
                    # the answer is stored in the same turn right after them (an in-process
                    # store does not wait), before any request that follows a reply is read.
                    # Until then the flight runs still: an identical request joins it.
                    broadcast.finish(answer)
                    await asyncio.sleep(0)
                self._label(broadcast, request, key, bool(await store(answer)))
                return answer
            stored: list[str] = []  # (what ``store`` returned, if it ran here)

            async def keep(answer: Answer) -> str:
                stored.append(await store(answer))
                return stored[-1]

            flying = flight_key(key.key, request, self.config)
            answer = await self.shared_flights.run(
                # (Apart, as here, for a call asked without its usage: ``flight_key``.)
                flying,
                broadcast,
                call,
                keep,
                max_age=controls.max_age if controls.may_read else 0,
                # Another instance's finished call is joined within this instance's window, as
                # its own are: the window it gives the key, for a call of no duration (the
                # replayed call's is not known here; the longest any call of the key gets).
                window=self.flights.windows.window(flying, self.clock.monotonic(), 0.0),
                linger=not controls.no_store,
                forget=self.store.forget,
                # (Asked only of a request that takes any cached answer: its TTL bounds it.)
                load=partial(self._stored, key.key, oldest, request) if oldest != 0 else None,
                kind=request.kind,
            )
            # Followed, replayed or loaded: the instance that led it stored it as this one
            # would have (a loaded answer is the stored one).
            kept = bool(stored[-1]) if stored else storable or broadcast.cached
            if made is not None and not stored:
                # Its stream named the response on the instance that led it; here, by its
                # whole answer, before this flight's clients have its end: indexed so, while
                # it lingers here, a DELETE of it shuts it (``state_index``).
                named = _state_made(request, answer)
                if named is not None:
                    made(named)
            self._label(broadcast, request, key, kept)
            return answer
        finally:
            if embedding is not None:  # not stored (a failure, a follower)
                _discard(embedding)
            if flown:
                # (Lingering, as ``FlightGroup._fly`` judges: joinable still, so indexed.)
                lingers = answer is not None and answer.storable and not controls.no_store
                self.states.landed(flown, led, lingers)

    def _label(self, broadcast: Broadcast, request: Request, key: Fingerprint, kept: bool) -> None:
        """What an invalidation names the answer by and whether a cache keeps it, for its
        flight while it lingers in the window (``FlightGroup.invalidate``): the labels its
        cache entry has (``_store``). Not read where nothing lingers (no window, ``no-store``)."""
        if request.controls.no_store or self.flights.windows.longest <= 0:
            return
        prefix = prompt_prefix(request, self.config)
        broadcast.labels, broadcast.kept = (request.controls.tags, key.namespace, prefix), kept

    async def _stored(self, key: str, max_age: float | None, request: Request) -> Answer | None:
        """The exact cache's answer for ``key``, if younger than ``max_age`` (``read_age``), for
        the flight of ``request`` (the key's) and whoever joins it: none (and it is dropped)
        if it is one of which ``whole`` could not make a stream, as any of them may ask one
        (``unservable``; a race's path, a call that ended after this one missed: the body of an
        answer without frames is parsed here, its frames kept for a streaming client)."""
        entry = await self.store.get(key, request.kind)
        if entry is None or (max_age is not None and entry.answer.age(self.clock.now()) >= max_age):
            return None
        if await unservable(self.store, key, entry.answer, request.include_usage):
            return None
        return entry.answer

    async def _keep_for_joiner(
        self, broadcast: Broadcast, answer: Answer, *, epoch: int, begun: _Begun
    ) -> str:
        """A ``no-store`` leader's answer, stored for the first joiner that would store it
        (``Broadcast.kept_for``: ``no-store`` binds only the request that sends it), under that
        joiner's request; none: not stored. Its prompt gets no semantic entry (the leader made
        no view of it)."""
        if broadcast.kept_for is None:
            return ""
        request, key = broadcast.kept_for
        return await self._store(request, key, answer, None, None, epoch, begun=begun)

    async def _store(
        self,
        request: Request,
        key: Fingerprint,
        answer: Answer,
        view: SemanticView | None,
        probe: Probe | None,
        epoch: int,
        embedding: asyncio.Task[Any] | None = None,
        begun: _Begun | None = None,
    ) -> str:
        """Store a complete answer (unless its request or its type's ttl says not to, or an
        invalidation came after its call began: it may predate what was invalidated), in the
        exact cache and, with its prompt's embedding (the probe's, or ``embedding``, begun with
        the call), in the semantic index: both before the flight ends (read-your-writes).
        Returns the exact cache's key it was put under ("": none), for a shared flight to take
        it back (``redis/flights.py``)."""
        controls = request.controls
        ttl = self.config.ttl_for(controls.request_type)
        if (
            not answer.storable  # (incomplete, or the upstream's ``no-store``/``private``)
            or controls.no_store
            or ttl <= 0
            or key.key is None
            or epoch != self.flights.epoch
            # Asked without the usage (``upstream.stream_usage: false``): a hit of another
            # shape (a non-streaming client, a stream asking for usage) would lack it.
            or without_usage(request, self.config)
        ):
            return ""
        led = key.key  # (the key its flight was led under, the answer's until shared)
        if key.shared_key is not None:
            # A shared namespace's requester the upstream had not accepted yet: it just did, so
            # the answer is stored where the others read it.
            key = dataclasses.replace(key, key=key.shared_key, tenant="*", shared_key=None)
            # (The embedding stays right: it is of the text, whatever the scope.)
            view = semantic_view(request, key, self.config) if view is not None else None
        expires, prefix = answer.created + ttl, prompt_prefix(request, self.config)
        if (gone := _gone_upstream_at(request.api, answer)) is not None:
            expires = min(expires, gone)  # (no hit names what the upstream no longer keeps)
        if expires <= self.clock.now():
            return ""  # back-dated past its TTL by its ``age``: expired already, in no layer
        assert key.key is not None  # (checked above; a shared key is one too)
        tags = controls.tags
        state: tuple[str, ...] = ()
        # (Tagged with the files it names and the state it is or continues.)
        if state := _state_tags(request, key.owner, answer):
            if self.states.deleted(state):
                # It names a file, or is or continues a response, deleted while its call ran:
                # not stored, and its flight is joined by no request from now on (nor lingers,
                # done).
                self.flights.forget(led)
                return ""
            tags = (*tags, *state)
            # Known before it is stored: a DELETE from now on drops it (``state_index``).
            self.states.add(state, dict.fromkeys((key.key, led)))
        entry = Entry(answer, expires, tags, key.namespace, prefix)
        since = begun.generation if begun is not None else None
        if self.shared_store is not None and since is not None:
            # Taken back from Redis if an invalidation by any instance came since the call
            # began (its pub/sub message may reach this one after the epoch was read).
            if not await self.shared_store.keep(key.key, entry, since=since):
                # Taken back: an invalidation came since the call began (its message may
                # reach this instance after the semantic entry would be in): outdated, kept in
                # no layer, the semantic one included.
                return ""
        else:
            await self.store.put(key.key, entry)
        if state and self.states.deleted(state):
            # Deleted while it was being stored (Redis): the DELETE's own drop may have come
            # before the put; taken back.
            await self.store.forget(key.key)
            self.flights.forget(led)
            return ""
        if view is None or self.semantic is None or (probe is not None and probe.failed):
            return key.key  # (its embedder failed on the lookup: not asked again)
        if answer_repeats_prompt(answer.body):
            return key.key  # (its prompt inside: a paraphrase must never be handed it)
        vector = probe.vector if probe is not None else None
        if vector is None and embedding is not None:
            try:
                # Mostly done: the upstream took longer. Else bounded by the embedder's own
                # timeout, from the call's start (``semantic.embed_timeout_ms``).
                vector = await embedding
            except Exception as error:
                self.semantic.embed_failed(error)
                return key.key
            if vector is None:  # (none made: ``semantic.max_pending`` busy, ``entries_shed``)
                return key.key
        try:
            await self._insert_semantic(
                view,
                vector,  # (the probe's or the call's: ``embedding`` is always begun without it)
                answer,
                expires,
                tags,
                key.namespace,
                prefix,
                key.key,
                epoch,
                state,
                since=begun.semantic if begun is not None else None,
                tenant=key.tenant,
            )
        except Exception:
            log.exception("semantic insert failed")
        return key.key

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
        state: tuple[str, ...] = (),
        *,
        since: int | None = None,
        tenant: str,
    ) -> None:
        """``since``: the semantic cache's ``generation`` as the call began (None: not read);
        ``tenant``: the scope's, whose error budget the entry's hits count in."""
        assert self.semantic is not None
        if vector is None:
            try:
                vector = await self.semantic.vector(view)
            except Exception as error:  # (the cache's failure, counted: no entry)
                self.semantic.embed_failed(error)
                return
            if vector is None:  # (none made: ``semantic.max_pending`` busy, ``entries_shed``)
                return
        # Checked again once the prompt is embedded: an invalidation (or a DELETE of the
        # response it is or continues) may have come meanwhile. Another instance's reaches
        # the semantic layer on its stream, the flights' epoch by pub/sub: either may come
        # first (or alone, the other lost), so each is asked.
        if (
            epoch == self.flights.epoch
            and (since is None or since == self.semantic.generation)
            and not (state and self.states.deleted(state))
        ):
            entry = await self.semantic.insert(
                view, vector, answer, expires, tags, namespace, prefix, key=key, tenant=tenant
            )
            if entry is not None and state:
                self.states.add(state, entry=entry)


class _Begun:
    """What a flight's call saw as it began: the shared store's generation, the semantic
    cache's (None: not read)."""

    __slots__ = ("generation", "semantic")

    def __init__(self) -> None:
        self.generation: int | None = None
        self.semantic: int | None = None


async def unservable(store: Store, key: str | None, answer: Answer, include_usage: bool) -> bool:
    """Whether ``answer``, stored under ``key`` (None: in no store), is one of which ``whole``
    cannot make a stream for a streaming client (``reply.unstreamable``: something else wrote
    its body, which a hit does not parse): if so, it is logged and dropped, as a value in Redis
    that is no entry is (``redis.store``), so that it costs one miss, not a 500 to every
    streaming client until its TTL."""
    why = unstreamable(answer, include_usage)
    if why is None:
        return False
    where = "a semantic entry" if key is None else key
    log.warning("dropping a stored answer of which no stream can be made (%s): %s", where, why)
    if key is not None:
        try:
            await store.forget(key)
        except StoreUnavailable:  # (a shared store reports its own failures, raising none)
            pass  # (it stays: the next streaming hit drops it)
    return True


def _discard(task: asyncio.Task[Any]) -> None:
    """Drop a helper task whose result nobody needs: cancel it, or read its error (so that it is
    not reported as never retrieved)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def _state_tags(request: Request, owner: str, answer: Answer) -> tuple[str, ...]:
    """The gateway's own tags of an answer (``state_tag``), each in the requester's tenant
    (``owner``), whose ``DELETE`` of any drops it: the files its request names
    (``_file_tags``) and, for a request that keeps state upstream, the stored response it
    continues (``Api.state_continued``) and the one it is (``Api.state_made``)."""
    tags = _file_tags(request, owner)
    if not request.api.keeps_state(request.body):
        return tags
    named = [request.api.state_continued(request.body), _state_made(request, answer)]
    made = (state_tag(owner, state) for state in dict.fromkeys(named) if state)
    return tuple(dict.fromkeys((*tags, *made)))


def _file_tags(request: Request, owner: str) -> tuple[str, ...]:
    """The tags of the files ``request``'s input names (``named_files``, walked once a
    request: ``Request.files``), in ``owner``'s tenant: a file is its uploader's, whose 2xx
    ``DELETE /files/{id}`` drops the answers naming it (``state_index``)."""
    files = request.files
    if files is None:
        files = request.files = tuple(named_files(request.body))
    return tuple(state_tag(owner, file_id) for file_id in files)


def _state_made(request: Request, answer: Answer) -> str | None:
    """The stored response (or chat completion) ``answer`` is (``Api.state_made``), if any."""
    try:
        body = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return None
    return request.api.state_made(body) if isinstance(body, dict) else None


def prompt_prefix(request: Request, config: Config) -> str:
    """The start of the prompt, for invalidation by prompt prefix: collapsed as the key
    collapsed it (``fingerprint.normalize_whitespace``), so that a prefix names every prompt
    the answer is served to (``admin.invalidate`` matches the collapsed prefix too). The
    semantic lookup reads the requester's too (``SemanticCache.probe``)."""
    text = " ".join(request.api.input_texts(request.body))
    if collapses(request, config):  # (cut first: the start is all it keeps)
        text = normalize_text(text[: 16 * PROMPT_PREFIX_CHARS], True)
    return prompt_text(text)


def _gone_upstream_at(api: Api, answer: Answer) -> float | None:
    """When what ``answer`` names upstream goes (``Api.expires_at``), read only from a body
    that says ``expires_at`` at all (most never do: no parse for them)."""
    if answer.body.find(b'"expires_at"') == -1:
        return None
    try:
        parsed = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return None
    return api.expires_at(parsed) if isinstance(parsed, dict) else None
