"""This worker's peers: who owns a key, and asking the owner (``Peers``).

Contract:
- ``owner_of(key)``: the worker that leads the upstream calls of ``key`` (a fingerprint, or an
  idempotency record's scope): BLAKE2b(key) mod N, the same in every worker (Python's ``hash``
  is salted per process); None when it is this one. A flight's is its shared key where it has
  one (``lead.py``: a shared namespace's key, which every worker computes alike, whatever the
  upstream accepted there).
- ``ask(owner, request, call)``: a flight's call, asked of the owner instead of the upstream
  (``Exchange.fetch``): the body the upstream would get (``call``), under the gateway path of
  its API, with the client's own headers (its credentials and controls: the owner computes the
  same tenant and fingerprint) less the hop-by-hop ones and any Idempotency-Key (the key's
  record is not the flight's), plus the run's secret. The owner's own path answers it (its
  cache, its flight, its upstream call: one per key); what comes back is read as an upstream's
  answer, its ``x-carpool``, ``age`` and ``Cache-Control`` headers kept (the owner says
  ``no-store`` of an answer its upstream said no cache may store: stored here neither). None: the owner did not answer (down,
  restarting, or gone before its answer was whole): the caller calls the upstream itself. An
  owner's stream cut short raises ``LeaderLost``, as a Redis follower's does, saying so
  (``LOST``: "lost the stream of the worker leading this call", the Redis path's code), not
  that the upstream broke it; how the stream ended is logged.
- A connection to an owner this worker could not open for want of its own resources (no file
  descriptor, no buffer or memory: ``upstream.wire.local_reason``, as for an upstream call) is
  no sign of the owner's: it is the gateway's own want, as an upstream call's is
  (``GatewayOverloaded``: a 503 ``gateway_overloaded`` with ``Retry-After``, counted in
  ``overloaded``, logged once per ``routing.log_interval`` at most). ``ask`` raises it (the
  flight fails: no call here, which would be a second one for the key while the owner lives);
  ``run_on`` answers it, in the request's API's shape: nothing run here (its record would be
  where the retries, reaching the owner, do not look: the generation ran twice), nothing
  waited, the owner not counted ``unreachable`` nor held for gone.
- The asks have connections of their own (``ASKS``: a pool per owner apart from the requests
  ``run_on`` sends, each at most ``limits.upstream_max_connections``): a keyed request run on
  its record's owner holds a connection there while its flight asks the key's owner, which may
  be the worker it came from; sharing one pool, two workers' pools full of such requests each
  waited for the other's until the owner's read timeout (a 503). An ask waits on nothing
  further: its owner leads it alone. So do the workers' own calls (``OWN``: invalidations,
  ``forget_state``, the admin calls, the scrapes), which waited for those requests' calls to
  end (an invalidation 23 s; a scrape left the worker out).
- ``run_on(owner, client)``: a request with an Idempotency-Key, sent whole to the owner of its
  record (the same bytes and headers: a value that is not ASCII goes percent-encoded and is
  restored by the owner's door, ``server.PeerApp``; the query as it came), its reply relayed
  as it comes (a stream frame by frame). An owner whose socket cannot be reached (nothing
  sent: dead, its replacement starting) is tried again every ``OWNER_POLL_S`` for
  ``OWNER_RETURN_S``, unless this worker is stopping (``stopping``: no replacement comes): run
  here meanwhile, the request's record was where its retries, sent to the replacement, did not
  look, and they ran it again.
  None: the owner could not be reached in that time (nor, once so, until it answers); the
  request runs here. Sent but
  not answered (a timeout, the owner gone mid-way): a 503 with ``Retry-After``, never a run
  here too (the owner may be running it). The retry reaches the owner's record while the owner
  lives; an owner that died took its record with it (memory only), so the retry may run the
  request again, and the 503 says so.
- ``invalidate(spec)``: ``POST /admin/invalidate`` on every other worker at once (the slots'
  sockets and the spare ones); how many answers they dropped. A worker that does not answer
  holds nothing to drop when it is down (a new process starts empty); one that is alive but
  does not take it (no answer in time, an error) keeps its answers: ``StoreUnavailable``, the
  admin call's 503 with ``Retry-After``, once the others have. A spare socket refusing connections ``STALE_SPARE_S``
  after it was made is a killed worker's file: removed, and never tried again. ``forget_state(tag)``: likewise, ``{"state": tag}`` (a
  deleted response's, ``Gateway.forget_state``: what each stored under it, by key), which only
  a peer may send (the door's secret) and no admin token opens. ``tell_refused(tenant)``: in
  the background (drained by ``aclose``), ``{"refused": tenant}`` to every other worker (a key
  the upstream refused here: ``AcceptedCredentials.refuse``), which only a peer may send
  either. ``admin(route, spec)``: likewise
  any other ``POST /admin/...`` (the semantic audits' reset and reports: ``admin_http``), each
  answer's status and JSON object.
- ``metrics()``, ``stats()``: every other worker's own ``/metrics`` text or ``/stats``
  document, asked at once through its door (which answers for that worker alone), for
  ``peers.metrics``; one that does not answer within ``_SCRAPE_TIMEOUT`` is left out (logged).
- A worker without a slot (``Peers(meeting, config)``: every slot was held as it started) is a
  client of the owners, owning nothing: ``index`` is None, so ``owner_of`` always names an
  owner; it asks them, sends keyed requests to their records' owners, and passes invalidations
  on. A keyed request whose owner cannot be reached is a 503 with ``Retry-After`` there, never
  run there (its record would be where no retry looks). It keeps the answers it served, and
  listens on a spare socket (``slots.spare_path``) for the invalidations of the others. From
  ``listen`` on it tries for a slot every ``CLAIM_POLL_S`` (``slots.claim`` never blocks: the
  loop goes on serving) until ``claim_wait_s``: uvicorn's SIGHUP starts each new worker while
  the old one holds its slot and retires the old one once the new one serves, which then has
  its slot as soon as the old one has stopped (its requests, then its peers' door: up to twice
  ``shutdown.grace_s``; the wait is that plus ``CLAIM_MARGIN_S``). It listens on the slot it
  takes, then closes its spare socket. Past the wait (a worker SIGTTIN added beyond N), it stays
  a client for good and says so in the log; a slot that frees later goes to the worker uvicorn
  starts in its holder's place.
- ``calls`` (asked of an owner), ``unreachable`` (asked, no answer: done here), ``served`` (run
  here for a peer): ``/stats`` ``peers``; ``overloaded`` (an owner this worker had no resources
  to reach), in ``/stats`` ``overloaded`` with the upstream calls' (``wiring``). ``calls`` are
  not ``upstream_calls``: the owner counts its upstream call, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote_from_bytes

import aiohttp
import orjson
from yarl import URL

from ..apis import BY_PATH, Api
from ..background import Background, stop_reader
from ..errors import (
    RETRY_HEADERS,
    FlightAbandoned,
    GatewayOverloaded,
    LeaderLost,
    ShuttingDown,
    UpstreamStreamBroken,
)
from ..idempotency.errors import IdempotencyUnavailable
from ..logs import Throttle
from ..outcome import Outcome
from ..reply import Reply, refusal
from ..request import header_bytes
from ..store.base import StoreUnavailable
from ..upstream.base import HOP_BY_HOP, UpstreamResponse
from ..upstream.http import closer, sse_payloads
from ..upstream.sim.replies import SIMULATED_HEADER
from ..upstream.wire import local_reason
from .server import CONNECTION_HEADER, PEER_HEADER, RAW_HEADER, PeerApp, PeerServer
from .slots import SPARE_PREFIX, Meeting, Slot, claim, socket_path, spare_path, spares

if TYPE_CHECKING:
    from ..config import Config
    from ..request import ClientRequest, Request
    from ..upstream.base import UpstreamRequest

log = logging.getLogger("carpool.peers")
#: Tenants whose refusal may be being told to the other workers at once.
MAX_TELLING = 10_000

# What a client that got part of a stream relayed from its key's owner is told when that worker
# went away part-way: a lost leader, as with Redis (``redis.flight_relay.LOST``), not an
# upstream's broken stream.
LOST = "lost the stream of the worker leading this call"

# Never sent to a peer: they describe this hop (the body sent may not be the client's), and the
# peer's secret is set here, never copied from a client.
# (A client's own peer headers are never passed on: only this worker sets them.)
_HOP = HOP_BY_HOP | {
    "accept-encoding",
    PEER_HEADER.decode(),
    RAW_HEADER.decode(),
    CONNECTION_HEADER.decode(),
}
_IDEMPOTENCY = frozenset({"idempotency-key", "x-idempotency-key"})
#: The kinds of connection a flight's ask and the workers' own calls (invalidations, admin
#: calls, scrapes) take (``_session``): each a pool apart from the keyed requests passed on.
ASKS = "asks"
OWN = "own"
# Response headers the relaying worker writes itself (its server frames the body, names the
# request).
_NOT_RELAYED = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"x-request-id",
        SIMULATED_HEADER[0].encode(),  # (this worker writes its own: the client got it twice)
    }
)
_OUTCOMES = frozenset(outcome.value for outcome in Outcome)
_FAILED = (aiohttp.ClientError, OSError, asyncio.TimeoutError)
# What a gateway's own limits answer (body, headers too large): nothing was run.
_OWN_LIMITS = frozenset({413, 431})
# The owner's answer's headers a flight's call keeps: what it is, and when to retry.
_KEPT = ("content-type", "x-carpool", "age", "cache-control", *RETRY_HEADERS)
# A worker's door that could not be reached: the worker is down (``Peers._admin_on``).
_DOWN: tuple[int, dict[str, Any]] = (0, {})
# The owner's socket could not be reached at all: nothing of the request was sent.
_UNREACHED = (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError)
# A worker without a slot: how often it tries for one, and how long past the wait for the worker
# it replaces to stop (twice ``shutdown.grace_s``; uvicorn retires it once the new one serves).
CLAIM_POLL_S = 0.05
# How long a scrape waits for another worker's metrics (a hung one must not hang the scrape).
_SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
CLAIM_MARGIN_S = 15.0
# How long a keyed request waits for its record's owner out of reach (its replacement starting),
# trying again every ``OWNER_POLL_S``, before it runs where it is (``Peers._owner_back``).
OWNER_RETURN_S = 10.0
OWNER_POLL_S = 0.1
# A spare socket refusing connections this long after it was made is a killed worker's (a spare
# listens from the moment its file is made, and one that stops removes its own file).
STALE_SPARE_S = 10.0


class Peers:
    """This worker (its ``slot``, or none yet: the run's ``Meeting``) and the others of its run
    (see the module's contract)."""

    def __init__(self, place: Slot | Meeting, config: Config) -> None:
        self.slot: Slot | None = place if isinstance(place, Slot) else None
        self.index: int | None = self.slot.index if self.slot is not None else None
        self.count, self.directory = place.count, place.directory
        self._secret_bytes = place.secret
        self._secret = place.secret.decode("ascii")
        self._admin_token = config.admin_token
        limits = config.limits
        # An owner may hold a request as long as a joiner waits, then as long as its call takes.
        read_s = config.coalesce.join_timeout_ms / 1000 + limits.upstream_timeout
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=limits.upstream_connect_timeout, sock_read=read_s
        )
        self._max_connections = limits.upstream_max_connections
        self._grace_s = config.shutdown.grace_s
        # A peer's idle connection is closed by its client first, never by its server as a
        # request comes (that request, never read, was taken for one sent and unanswered: a
        # keyed request's 503): the server keeps it ``client_keepalive``, the client half.
        self._keepalive_s = limits.client_keepalive
        self.claim_wait_s = 2 * config.shutdown.grace_s + CLAIM_MARGIN_S
        self._sessions: dict[tuple[Path, str], aiohttp.ClientSession] = {}
        self._telling = Background("telling the workers of a refusal", log)
        # The tenants whose refusal is being told, each whether it was refused again meanwhile.
        self._told: dict[str, bool] = {}
        self._closing = False
        self._server = PeerServer()
        self._door: PeerApp | None = None
        # Without a slot: the spare socket it listens on, and its tries for a slot.
        self._spare: tuple[PeerServer, Path] | None = None
        self._claiming: asyncio.Task[None] | None = None
        self.calls = 0
        self.unreachable = 0
        self.served = 0
        # Owners this worker could not open a connection to for want of its own resources
        # (``_short``), and when that was last logged (once per ``log_interval`` at most).
        self.overloaded = 0
        self._overload_log = Throttle(config.routing.log_interval)
        # Owners a keyed request waited for in vain (``_owner_back``), until one answers.
        self._gone: set[int] = set()
        # This worker is stopping (``Gateway.begin_draining``): an owner is waited for no more.
        self.stopping = False

    def owner_of(self, key: str) -> int | None:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        owner = int.from_bytes(digest, "big") % self.count
        return None if owner == self.index else owner

    # ---------------------------------------------------------------------------------------
    # Asking the owner

    async def ask(
        self, owner: int, request: Request, call: UpstreamRequest
    ) -> UpstreamResponse | None:
        """The owner's answer to a flight's ``call`` (see the module's contract)."""
        headers = self._headers(request.headers, _HOP | _IDEMPOTENCY)
        headers["content-type"] = "application/json"
        url = _url(request.api.path, call.query)
        try:
            response = await self._session(owner, ASKS).post(
                url, data=orjson.dumps(call.body), headers=headers
            )
        except _FAILED as error:
            if (shortage := self._short(owner, error)) is not None:
                raise shortage from error  # (not asked: no call here either, the owner lives)
            self._missed(owner, error)
            return None
        self.calls += 1
        if response.status in _OWN_LIMITS and response.headers.get("x-carpool") == "bypass":
            # The owner's own limits refused what this worker added to the request (its body's
            # stream_options; the headers of a peer's request are not measured again), which
            # the client's request was within: done here.
            response.release()
            self._missed(owner, RuntimeError(f"HTTP {response.status} from its limits"))
            return None
        kept = {  # (and when to retry: an SDK retried at once, or ran a generation again)
            name: response.headers[name] for name in _KEPT if name in response.headers
        }
        content_type = kept.get("content-type", "")
        if call.stream and 200 <= response.status < 300 and "text/event-stream" in content_type:
            return UpstreamResponse(
                response.status,
                kept,
                events=_lost_if_cut(
                    sse_payloads(response, call.last_event, f"worker {owner}"), owner
                ),
                close=closer(response),
            )
        try:
            body = await response.read()
        except _FAILED as error:
            self._missed(owner, error)
            return None
        finally:
            response.release()
        if response.status in _STOPPING_STATUSES and _owner_stopping(body):
            # The owner closed with the call still running (a reload, a stop): it cancelled
            # it, nothing was answered. Done here, as for an owner that did not answer.
            self._missed(owner, RuntimeError(f"HTTP {response.status}: it is shutting down"))
            return None
        return UpstreamResponse(response.status, kept, body=body)

    async def run_on(self, owner: int, client: ClientRequest) -> Reply | None:
        """``client``'s request run whole by ``owner``, its reply as it comes; an owner out of
        reach waited for (``_owner_back``)."""
        url = _url(client.path, client.query.decode("latin-1"))
        sent = self._headers(client.headers, _HOP)
        waited: float | None = None  # (since when, on the loop's clock)
        while True:
            try:
                response = await self._session(owner).post(url, data=client.body, headers=sent)
                break
            except _UNREACHED as error:  # nothing was sent: the key may run here
                if (shortage := self._short(owner, error)) is not None:
                    # This worker's want, not the owner's death: not run here (its record would
                    # be where the retries, reaching the owner, do not look), nor waited.
                    return refusal(shortage, BY_PATH[client.path])
                if self.index is None:  # (not on a worker without a slot: it owns no record)
                    self._missed(owner, error)
                    return _owner_unreachable(owner, client)
                waited = await self._owner_back(owner, waited)
                if waited is None:
                    self._missed(owner, error)
                    return None
            except _FAILED as error:
                return _sent_unanswered(owner, client, error)
        self._gone.discard(owner)
        self.calls += 1
        headers = [
            (name.lower(), value)
            for name, value in response.raw_headers
            if name.lower() not in _NOT_RELAYED
        ]
        said = response.headers.get("x-carpool")
        outcome = Outcome(said) if said is not None and said in _OUTCOMES else None
        if "text/event-stream" in response.headers.get("content-type", ""):
            return Reply(
                response.status,
                headers,
                stream=_relayed(response, BY_PATH[client.path]),
                outcome=outcome,
                on_close=response.close,
            )
        try:
            body = await response.read()
        except _FAILED as error:
            return _sent_unanswered(owner, client, error)
        finally:
            response.release()
        return Reply(response.status, headers, body, outcome=outcome)

    async def invalidate(self, spec: Any) -> int:
        """``spec`` invalidated on every other worker; how many answers they dropped. Raises
        ``StoreUnavailable`` (a 503: the caller retries; an invalidation may be repeated) when
        a worker that answers its door did not take it, once every other worker has: it keeps
        its answers. One that is down holds none."""
        others = await self._others()
        dropped = await asyncio.gather(*(self._invalidate_on(path, spec) for path in others))
        missed = [path.stem for path, count in zip(others, dropped, strict=True) if count is None]
        if missed:
            raise StoreUnavailable(
                f"worker {', '.join(missed)} did not take the invalidation: its answers "
                "stay; retry it"
            )
        return sum(count or 0 for count in dropped)

    async def forget_state(self, tag: str) -> int:
        """A deleted response's ``tag`` (``state_tag``) dropped on every other worker, by key:
        ``{"state": tag}`` through their doors (``Gateway.forget_state``: no invalidation);
        how many answers they dropped."""
        dropped = await asyncio.gather(
            *(self._invalidate_on(path, {"state": tag}) for path in await self._others())
        )
        return sum(count or 0 for count in dropped)  # (one that did not take it: logged)

    def tell_refused(self, tenant: str) -> None:
        """Every other worker takes back its acceptances of ``tenant`` (the upstream refused
        its credentials here: each worker accepts by itself), in the background: one telling
        a tenant at a time, ``MAX_TELLING`` tenants at most (a flood of 401s sends no more)."""
        if self._closing:
            return
        if tenant in self._told:
            self._told[tenant] = True  # (told again once this telling ends)
        elif len(self._told) < MAX_TELLING:
            self._told[tenant] = False
            self._telling.spawn(self._tell_refused(tenant))

    async def _tell_refused(self, tenant: str) -> None:
        try:
            others = await self._others()
            await asyncio.gather(
                *(self._invalidate_on(path, {"refused": tenant}) for path in others)
            )
        finally:
            if self._told.pop(tenant, False):
                self.tell_refused(tenant)  # (refused again while this one was told)

    async def _others(self) -> list[Path]:
        """The sockets of every other worker of the run: the slots', and the spare ones (the
        connections to a spare no longer there let go)."""
        own = self._spare[1] if self._spare is not None else None
        others = [
            *(socket_path(self.directory, i) for i in range(self.count) if i != self.index),
            *(path for path in spares(self.directory) if path != own),
        ]
        for held in [h for h in self._sessions if _is_spare(h[0]) and h[0] not in others]:
            if (session := self._sessions.pop(held, None)) is not None:
                await session.close()
        return others

    async def _unreached(self, path: Path, error: BaseException) -> None:
        """``path`` did not answer: a spare socket that refuses connections past
        ``STALE_SPARE_S`` is a killed worker's file, removed (else every invalidation, scrape
        and admin call of the run tries it again, and logs it)."""
        if _is_spare(path) and isinstance(
            getattr(error, "os_error", error), ConnectionRefusedError
        ):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.stat().st_mtime > STALE_SPARE_S:
                    path.unlink()
                    log.info("removed %s, a stopped worker's spare socket", path.name)

    async def metrics(self) -> list[str]:
        """Every other worker's own ``/metrics`` (``peers.metrics``); one that does not answer
        adds nothing (logged)."""
        return await self._own_of_each("/metrics")

    async def stats(self) -> list[str]:
        """Every other worker's own ``/stats`` document (JSON text), as ``metrics``."""
        return await self._own_of_each("/stats")

    async def sim_stats(self) -> list[str]:
        """Every other worker's own ``/sim/stats`` (its embedded simulated engine's), as
        ``metrics``."""
        return await self._own_of_each("/sim/stats")

    async def _own_of_each(self, path: str) -> list[str]:
        texts = await asyncio.gather(
            *(self._own_of(socket, path) for socket in await self._others())
        )
        return [text for text in texts if text is not None]

    async def _own_of(self, socket: Path, path: str) -> str | None:
        """``path`` (``/metrics``, ``/stats``, ``/sim/stats``) as the worker on ``socket``
        answers it for itself (through its door), or None."""
        headers = {PEER_HEADER.decode(): self._secret}
        if self._admin_token:
            headers["authorization"] = f"Bearer {self._admin_token}"
        try:
            async with self._session(socket, OWN).get(
                f"http://worker{path}", headers=headers, timeout=_SCRAPE_TIMEOUT
            ) as response:
                if response.status == 200:
                    return await response.text()
                why = f"status {response.status}"
        except _UNREACHED as error:  # (down: a spare's stale file, often)
            log.info("worker %s is down: not in this %s (%s)", socket.name, path, _why(error))
            await self._unreached(socket, error)
            return None
        except _FAILED as error:
            why = _why(error)
        log.warning("worker %s gave no %s: %s", socket.name, path, why)
        return None

    async def _invalidate_on(self, path: Path, spec: Any) -> int | None:
        """How many answers the worker on ``path`` dropped: 0 if it is down (it holds none),
        None if it answered without taking it (it keeps them)."""
        answer = await self._admin_on(path, "/admin/invalidate", spec, "invalidation")
        if answer is _DOWN:
            return 0
        dropped = answer[1].get("invalidated") if answer is not None else None
        if answer is None or answer[0] != 200 or not isinstance(dropped, int):
            if answer is not None:
                log.warning("worker %s did not take the invalidation: %s", path.name, answer[0])
            return None
        return dropped

    async def admin(self, route: str, spec: Any) -> list[tuple[int, dict[str, Any]]]:
        """``POST route`` (``/admin/semantic/...``) with ``spec`` on every other worker at once,
        as the operator's (its admin token): each answer's status and JSON object, of those that
        gave one (one down or that does not answer in time gives none: logged)."""
        answers = await asyncio.gather(
            *(self._admin_on(path, route, spec, route) for path in await self._others())
        )
        return [answer for answer in answers if answer is not None and answer is not _DOWN]

    async def _admin_on(
        self, path: Path, route: str, spec: Any, what: str
    ) -> tuple[int, dict[str, Any]] | None:
        """``POST route`` through the door on ``path``: its status and JSON object; ``_DOWN``
        when nothing could be sent (the worker is down); None when it gave no such answer."""
        headers = {"content-type": "application/json", PEER_HEADER.decode(): self._secret}
        if self._admin_token:
            headers["authorization"] = f"Bearer {self._admin_token}"
        try:
            async with self._session(path, OWN).post(
                f"http://worker{route}", data=orjson.dumps(spec), headers=headers
            ) as response:
                status, answer = response.status, await response.json(content_type=None)
        except _UNREACHED as error:  # (down: it holds nothing; a spare's stale file, often)
            if local_reason(getattr(error, "os_error", error)) is not None:
                # This worker's own want (no descriptor here), not the other's absence: that
                # one may hold answers, so it did not take the call (an invalidation: a 503).
                log.warning("worker %s did not take the %s: %s", path.name, what, _why(error))
                return None
            log.info("worker %s is down: no %s there (%s)", path.name, what, _why(error))
            await self._unreached(path, error)
            return _DOWN
        except (*_FAILED, ValueError) as error:
            log.warning("worker %s did not take the %s: %s", path.name, what, _why(error))
            return None
        return (status, answer) if isinstance(answer, dict) else None

    def _headers(self, given: Mapping[str, str], dropped: frozenset[str]) -> dict[str, str]:
        headers, raw = {}, []
        for name, value in given.items():
            if name in dropped:
                continue
            if not value.isascii():
                # (The client's bytes, sent as they came: the owner reads them as this worker
                # did, a control header's name as UTF-8, any other a byte a character.)
                value = quote_from_bytes(header_bytes(name, value), safe="")
                raw.append(name)
            headers[name] = value
        if raw:
            headers[RAW_HEADER.decode()] = ",".join(raw)
        if "connection" in given:
            # The headers it lists are the client's to the first recipient, read by this
            # worker (a control, a credential, an Idempotency-Key): sent on, with the list
            # itself, so that the owner reads them alike and forwards none of them upstream.
            headers[CONNECTION_HEADER.decode()] = given["connection"]
        headers["accept-encoding"] = "identity"
        headers[PEER_HEADER.decode()] = self._secret
        return headers

    async def _owner_back(self, owner: int, since: float | None) -> float | None:
        """A keyed request's ``owner`` out of reach: waited for, its replacement (uvicorn
        starts one at once; it listens within a second or two), for ``OWNER_RETURN_S`` at most
        since the first try (``since``); after a pause, the time to try again from, or None to
        run the request here. Run here while the owner's replacement starts, its record would
        be where its retries, sent to the owner then, do not look: they ran it again. An owner
        waited for in vain (a slot SIGTTOU took away) is not waited for again until it
        answers."""
        if self.stopping:  # (no replacement is coming: the run stops)
            return None
        loop = asyncio.get_running_loop()
        now = loop.time()
        since = now if since is None else since
        if owner in self._gone or now - since >= OWNER_RETURN_S:
            self._gone.add(owner)
            return None
        await asyncio.sleep(OWNER_POLL_S)
        return since

    def _short(self, owner: int, error: BaseException) -> GatewayOverloaded | None:
        """``error`` as this worker's own want (``GatewayOverloaded``), when its connection to
        ``owner`` could not be opened for lack of a descriptor, buffer or memory here (the
        upstream calls' ``local_reason``): counted in ``overloaded`` and logged once per
        ``log_interval`` at most (a burst that took every descriptor fails every request
        then), with how many came since; None for any other failure (the owner's)."""
        if not isinstance(error, _UNREACHED):
            return None
        reason = local_reason(getattr(error, "os_error", error))
        if reason is None:
            return None
        self.overloaded += 1
        more = self._overload_log.due(time.monotonic())
        if more is not None:
            log.warning(
                "could not open a connection to worker %d: %s on this machine (its clients get "
                "503%s; %s)",
                owner,
                reason,
                f", {more} more since the last such line" if more else "",
                GatewayOverloaded.advice,
            )
        shortage = GatewayOverloaded(
            f"the gateway could not open a connection to its worker {owner} ({reason}): retry later"
        )
        shortage.reason = reason
        return shortage

    def _missed(self, owner: int, error: BaseException) -> None:
        self.unreachable += 1
        log.info("worker %d did not answer (%s): done here instead", owner, _why(error))

    def _session(self, worker: int | Path, kind: str = "") -> aiohttp.ClientSession:
        """The connections to ``worker``'s socket (an index: its slot's; or a socket's path);
        ``kind`` ``ASKS``: those of the flights' asks, ``OWN``: the workers' own calls, each a
        pool apart from the keyed requests' (the module's contract)."""
        path = worker if isinstance(worker, Path) else socket_path(self.directory, worker)
        session = self._sessions.get((path, kind))
        if session is None or session.closed:
            session = self._sessions[path, kind] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(
                    path=str(path),
                    limit=self._max_connections,
                    keepalive_timeout=self._keepalive_s / 2,
                ),
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                # No cookie jar: a cookie on one client's answer relayed by a peer would be
                # sent on every later request to that peer, other clients' too.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return session

    # ---------------------------------------------------------------------------------------
    # Being asked

    async def listen(self, app: Any) -> None:
        """Serve ``app`` (the worker's ``GatewayApp``) to the peers, on this slot's socket; without
        a slot, on a spare socket, while trying for a slot (see the module's contract)."""

        def counted(scope: dict[str, Any]) -> None:
            if scope["path"].startswith("/v1/"):
                self.served += 1

        door = self._door = PeerApp(app, self._secret_bytes, counted)
        if self.slot is not None:
            await self._server.start(
                door, self.slot.socket_path(self.slot.index), self._grace_s, self._keepalive_s
            )
            return
        spare, path = PeerServer(), spare_path(self.directory)
        await spare.start(door, path, self._grace_s, self._keepalive_s)
        self._spare = (spare, path)
        self._claiming = asyncio.get_running_loop().create_task(self._claim_when_free())

    async def _claim_when_free(self) -> None:
        """Tries for a slot until one frees or ``claim_wait_s`` has passed; listens on it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.claim_wait_s
        while (slot := self._try_claim()) is None:
            if not self.directory.is_dir():  # (the parent removed it: the run is ending)
                return
            if loop.time() >= deadline:
                log.warning(
                    "no worker slot freed in %.0f s: this worker stays a client of the %d that "
                    "own the keys (it asks them, owns none)",
                    self.claim_wait_s,
                    self.count,
                )
                return
            await asyncio.sleep(CLAIM_POLL_S)
        assert self._door is not None  # (set by ``listen``, which started this)
        try:
            await self._server.start(
                self._door, slot.socket_path(slot.index), self._grace_s, self._keepalive_s
            )
        except BaseException as error:
            os.close(slot.lock_fd)  # (not served: the slot goes to another worker)
            if not isinstance(error, Exception):
                raise
            log.exception("cannot listen on worker slot %d: a client of the others", slot.index)
            return
        self.slot, self.index = slot, slot.index
        log.info("took worker slot %d of %d", slot.index, self.count)
        await self._close_spare()

    def _try_claim(self) -> Slot | None:
        try:
            return claim(self.directory, self.count)
        except OSError:  # (the parent removed the directory: it is stopping)
            return None

    async def _close_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            server, path = spare
            await server.aclose()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def snapshot(self) -> dict[str, Any]:
        return {
            "worker": self.index,
            "workers": self.count,
            "calls": self.calls,
            "unreachable": self.unreachable,
            "served": self.served,
        }

    async def aclose(self) -> None:
        self._closing = True  # (no refusal told from now on: those being told drain)
        await self._telling.drain(self._grace_s)
        claiming, self._claiming = self._claiming, None
        # (Its cancellation awaited, this one's own not swallowed: a suppressed CancelledError
        # took the caller's with it.)
        await stop_reader(claiming)
        await self._server.aclose()
        await self._close_spare()
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()


def _url(path: str, query: str) -> URL:
    # (The host is a placeholder: the connector reaches the worker through its socket. The
    # query as it came: not normalized, as yarl would, ``%7E`` to ``~``.)
    return URL("http://worker" + path + ("?" + query if query else ""), encoded=True)


async def _lost_if_cut(
    payloads: AsyncIterator[list[bytes]], owner: int
) -> AsyncIterator[list[bytes]]:
    """The owner's stream; cut short (the owner died: its own failures come as error events),
    the call is lost, as a Redis follower's whose leader died (``LeaderLost``): taken over
    here if nothing was relayed yet (``Exchange.fetch``, ``Gateway._follow``). Its clients are
    told that (``LOST``), not that the upstream broke it: the upstream did not; how the owner's
    stream ended goes to the log."""
    try:
        async for payload in payloads:
            yield payload
    except UpstreamStreamBroken as error:
        log.warning("worker %d leading a stream's call went away: %s", owner, error)
        raise LeaderLost(LOST) from error


async def _relayed(response: aiohttp.ClientResponse, api: Api) -> AsyncIterator[bytes]:
    """A relayed stream's events as they come, whole; if the worker running it dies part-way,
    the client's stream ends with its API's error event, as when an upstream's stream breaks
    (after the last whole event: an event cut in two reached the SDK as broken JSON)."""
    held = b""  # the start of an event whose end has not come yet
    sent = 0  # events relayed (an error event is numbered after them: ``Api.error_event``)
    try:
        async for chunk in response.content.iter_any():
            data = held + chunk if held else chunk
            end = data.rfind(b"\n\n") + 2  # (the owner ends each event so: ``Api.frame``)
            held = data[end:] if end > 1 else data
            if end > 1:
                sent += data.count(b"\n\n", 0, end)
                yield data[:end]
        if held:
            yield held  # (ended whole: as it came)
    except _FAILED as error:
        yield api.error_event(
            UpstreamStreamBroken(f"the worker running it went away ({_why(error)})"), sent
        )
    finally:
        response.close()


def _is_spare(path: Path) -> bool:
    return path.name.startswith(SPARE_PREFIX)


def _why(error: BaseException) -> str:
    return type(error).__name__ + (f": {error}" if str(error) else "")


# What an owner that closed with a flight's call running says of it (``FlightGroup.settling``:
# ``ShuttingDown``; an older worker, mid-reload: ``FlightAbandoned``), by status, and by code
# (OpenAI's shape) or message (the Messages API's shape has no code).
_STOPPING_STATUSES = frozenset({499, 503})
_STOPPING_CODES = frozenset({ShuttingDown.code, FlightAbandoned.code})
_STOPPING_MESSAGES = frozenset({ShuttingDown().message, FlightAbandoned.MESSAGE})


def _owner_stopping(body: bytes) -> bool:
    """Whether an owner's refusal says it cancelled the call as it closed (``ask``)."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and (
        error.get("code") in _STOPPING_CODES or error.get("message") in _STOPPING_MESSAGES
    )


def _owner_unreachable(owner: int, client: ClientRequest) -> Reply:
    """A keyed request on a worker without a slot whose record's owner cannot be reached (down,
    restarting): not run here, where no retry would find its record."""
    refused = IdempotencyUnavailable(
        f"The worker holding this Idempotency-Key's record (worker {owner}) is down or "
        "restarting; the request was not run. Retry it with the same key."
    )
    return refusal(refused, BY_PATH[client.path])


def _sent_unanswered(owner: int, client: ClientRequest, error: BaseException) -> Reply:
    """A keyed request the owner received but did not answer: not run here (it may run there)."""
    log.warning("worker %d did not answer a keyed request it received (%s)", owner, _why(error))
    refused = IdempotencyUnavailable(
        "The worker holding this Idempotency-Key's record took the request and did not answer. "
        "Retry with the same key: while that worker is running it or holds its answer, the "
        "retry is answered from its record; if that worker died, its record (kept in its "
        "memory: no Redis) died with it, and the retry may run the request again."
    )
    return refusal(refused, BY_PATH[client.path])
