"""This worker's peers: who owns a key, and asking the owner (``Peers``).

Contract:
- ``owner_of(key)``: the worker that leads the upstream calls of ``key`` (a fingerprint, or an
  idempotency record's scope): BLAKE2b(key) mod N, the same in every worker (Python's ``hash``
  is salted per process); None when it is this one.
- ``ask(owner, request, call)``: a flight's call, asked of the owner instead of the upstream
  (``Exchange.fetch``): the body the upstream would get (``call``), under the gateway path of
  its API, with the client's own headers (its credentials and controls: the owner computes the
  same tenant and fingerprint) less the hop-by-hop ones and any Idempotency-Key (the key's
  record is not the flight's), plus the run's secret. The owner's own path answers it (its
  cache, its flight, its upstream call: one per key); what comes back is read as an upstream's
  answer, its ``x-carpool`` and ``age`` headers kept. None: the owner did not answer (down,
  restarting, or gone before its answer was whole): the caller calls the upstream itself. An
  owner's stream cut short raises ``LeaderLost``, as a Redis follower's does.
- ``run_on(owner, client)``: a request with an Idempotency-Key, sent whole to the owner of its
  record (the same bytes and headers: a value that is not ASCII goes percent-encoded and is
  restored by the owner's door, ``server.PeerApp``; the query as it came), its reply relayed
  as it comes (a stream frame by frame).
  None: the owner's socket could not be reached (nothing sent); the request runs here. Sent but
  not answered (a timeout, the owner gone mid-way): a 503 with ``Retry-After``, never a run
  here too (the owner may be running it). The retry reaches the owner's record while the owner
  lives; an owner that died took its record with it (memory only), so the retry may run the
  request again, and the 503 says so.
- ``invalidate(spec)``: ``POST /admin/invalidate`` on every other worker at once; how many
  answers they dropped. A worker that does not answer holds nothing to drop when it is down (a
  new process starts empty); one that is alive but does not answer in time is logged.
- ``calls`` (asked of an owner), ``unreachable`` (asked, no answer: done here), ``served`` (run
  here for a peer): ``/stats`` ``peers``. ``calls`` are not ``upstream_calls``: the owner counts
  its upstream call, once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote_from_bytes

import aiohttp
import orjson
from yarl import URL

from ..apis import BY_PATH, Api
from ..errors import LeaderLost, UpstreamStreamBroken
from ..idempotency.errors import IdempotencyUnavailable
from ..outcome import Outcome
from ..reply import Reply, error_reply
from ..upstream.base import HOP_BY_HOP, UpstreamResponse, connection_listed
from ..upstream.http import closer, sse_payloads
from .server import PEER_HEADER, RAW_HEADER, PeerApp, PeerServer
from .slots import Slot

if TYPE_CHECKING:
    from ..config import Config
    from ..request import ClientRequest, Request
    from ..upstream.base import UpstreamRequest

log = logging.getLogger("carpool.peers")

# Never sent to a peer: they describe this hop (the body sent may not be the client's), and the
# peer's secret is set here, never copied from a client.
# (A client's own peer headers are never passed on: only this worker sets them.)
_HOP = HOP_BY_HOP | {"accept-encoding", PEER_HEADER.decode(), RAW_HEADER.decode()}
_IDEMPOTENCY = frozenset({"idempotency-key", "x-idempotency-key"})
# Response headers the relaying worker writes itself (its server frames the body, names the
# request).
_NOT_RELAYED = frozenset(
    {b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"x-request-id"}
)
_OUTCOMES = frozenset(outcome.value for outcome in Outcome)
_FAILED = (aiohttp.ClientError, OSError, asyncio.TimeoutError)
# What a gateway's own limits answer (body, headers too large): nothing was run.
_OWN_LIMITS = frozenset({413, 431})
# The owner's socket could not be reached at all: nothing of the request was sent.
_UNREACHED = (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError)


class Peers:
    """This worker (``slot``) and the others of its run (see the module's contract)."""

    def __init__(self, slot: Slot, config: Config) -> None:
        self.index, self.count = slot.index, slot.count
        self.slot = slot
        self._secret = slot.secret.decode("ascii")
        self._admin_token = config.admin_token
        limits = config.limits
        # An owner may hold a request as long as a joiner waits, then as long as its call takes.
        read_s = config.coalesce.join_timeout_ms / 1000 + limits.upstream_timeout
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=limits.upstream_connect_timeout, sock_read=read_s
        )
        self._max_connections = limits.upstream_max_connections
        self._grace_s = config.shutdown.grace_s
        self._sessions: dict[int, aiohttp.ClientSession] = {}
        self._server = PeerServer()
        self.calls = 0
        self.unreachable = 0
        self.served = 0

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
            response = await self._session(owner).post(
                url, data=orjson.dumps(call.body), headers=headers
            )
        except _FAILED as error:
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
        kept = {
            name: response.headers[name]
            for name in ("content-type", "x-carpool", "age")
            if name in response.headers
        }
        content_type = kept.get("content-type", "")
        if call.stream and 200 <= response.status < 300 and "text/event-stream" in content_type:
            return UpstreamResponse(
                response.status,
                kept,
                events=_lost_if_cut(sse_payloads(response, call.last_event, f"worker {owner}")),
                close=closer(response),
            )
        try:
            body = await response.read()
        except _FAILED as error:
            self._missed(owner, error)
            return None
        finally:
            response.release()
        return UpstreamResponse(response.status, kept, body=body)

    async def run_on(self, owner: int, client: ClientRequest) -> Reply | None:
        """``client``'s request run whole by ``owner``, its reply as it comes."""
        url = _url(client.path, client.query.decode("latin-1"))
        try:
            response = await self._session(owner).post(
                url, data=client.body, headers=self._headers(client.headers, _HOP)
            )
        except _UNREACHED as error:  # nothing was sent: the key may run here
            self._missed(owner, error)
            return None
        except _FAILED as error:
            return _sent_unanswered(owner, client, error)
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
        """``spec`` invalidated on every other worker; how many answers they dropped."""
        others = [i for i in range(self.count) if i != self.index]
        dropped = await asyncio.gather(*(self._invalidate_on(i, spec) for i in others))
        return sum(dropped)

    async def _invalidate_on(self, worker: int, spec: Any) -> int:
        headers = {"content-type": "application/json", PEER_HEADER.decode(): self._secret}
        if self._admin_token:
            headers["authorization"] = f"Bearer {self._admin_token}"
        try:
            async with self._session(worker).post(
                "http://worker/admin/invalidate", data=orjson.dumps(spec), headers=headers
            ) as response:
                answer = await response.json(content_type=None)
        except (*_FAILED, ValueError) as error:
            log.warning("worker %d did not take the invalidation: %s", worker, _why(error))
            return 0
        dropped = answer.get("invalidated") if isinstance(answer, dict) else None
        return dropped if isinstance(dropped, int) else 0

    def _headers(self, given: Mapping[str, str], dropped: frozenset[str]) -> dict[str, str]:
        headers, raw = {}, []
        listed = connection_listed(given)  # (this hop's too: the owner would forward them)
        for name, value in given.items():
            if name in dropped or name in listed:
                continue
            if not value.isascii():
                # (The client's bytes, read as latin-1: sent as they came, not as UTF-8.)
                value = quote_from_bytes(_bytes_of(value), safe="")
                raw.append(name)
            headers[name] = value
        if raw:
            headers[RAW_HEADER.decode()] = ",".join(raw)
        headers["accept-encoding"] = "identity"
        headers[PEER_HEADER.decode()] = self._secret
        return headers

    def _missed(self, owner: int, error: BaseException) -> None:
        self.unreachable += 1
        log.info("worker %d did not answer (%s): done here instead", owner, _why(error))

    def _session(self, worker: int) -> aiohttp.ClientSession:
        session = self._sessions.get(worker)
        if session is None or session.closed:
            session = self._sessions[worker] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(
                    path=str(self.slot.socket_path(worker)), limit=self._max_connections
                ),
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return session

    # ---------------------------------------------------------------------------------------
    # Being asked

    async def listen(self, app: Any) -> None:
        """Serve ``app`` (the worker's ``GatewayApp``) to the peers, on this slot's socket."""

        def counted(scope: dict[str, Any]) -> None:
            if scope["path"].startswith("/v1/"):
                self.served += 1

        door = PeerApp(app, self.slot.secret, counted)
        await self._server.start(door, self.slot.socket_path(self.index), self._grace_s)

    def snapshot(self) -> dict[str, Any]:
        return {
            "worker": self.index,
            "workers": self.count,
            "calls": self.calls,
            "unreachable": self.unreachable,
            "served": self.served,
        }

    async def aclose(self) -> None:
        await self._server.aclose()
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()


def _url(path: str, query: str) -> URL:
    # (The host is a placeholder: the connector reaches the worker through its socket. The
    # query as it came: not normalized, as yarl would, ``%7E`` to ``~``.)
    return URL("http://worker" + path + ("?" + query if query else ""), encoded=True)


def _bytes_of(value: str) -> bytes:
    """A header value's bytes: read as latin-1 from the client's (the server's), else UTF-8."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogateescape")


async def _lost_if_cut(payloads: AsyncIterator[list[bytes]]) -> AsyncIterator[list[bytes]]:
    """The owner's stream; cut short (the owner died: its own failures come as error events),
    the call is lost, as a Redis follower's whose leader died (``LeaderLost``): taken over
    here if nothing was relayed yet (``Exchange.fetch``, ``Gateway._follow``)."""
    try:
        async for payload in payloads:
            yield payload
    except UpstreamStreamBroken as error:
        raise LeaderLost(str(error)) from error


async def _relayed(response: aiohttp.ClientResponse, api: Api) -> AsyncIterator[bytes]:
    """A relayed stream's bytes as they come; if the worker running it dies part-way, the
    client's stream ends with its API's error event, as when an upstream's stream breaks."""
    try:
        async for chunk in response.content.iter_any():
            yield chunk
    except _FAILED as error:
        yield b"\n\n" + api.error_event(
            UpstreamStreamBroken(f"the worker running it went away ({_why(error)})")
        )
    finally:
        response.close()


def _why(error: BaseException) -> str:
    return type(error).__name__ + (f": {error}" if str(error) else "")


def _sent_unanswered(owner: int, client: ClientRequest, error: BaseException) -> Reply:
    """A keyed request the owner received but did not answer: not run here (it may run there)."""
    log.warning("worker %d did not answer a keyed request it received (%s)", owner, _why(error))
    refused = IdempotencyUnavailable(
        "The worker holding this Idempotency-Key's record took the request and did not answer. "
        "Retry with the same key: while that worker is running it or holds its answer, the "
        "retry is answered from its record; if that worker died, its record (kept in its "
        "memory: no Redis) died with it, and the retry may run the request again."
    )
    return error_reply(refused, Outcome.BYPASS, BY_PATH[client.path])
