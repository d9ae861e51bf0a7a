"""Invalidations reach every instance's coalescing window, through Redis pub/sub.

An admin invalidation (``Gateway.invalidate``) drops what the shared layers hold (the exact
store, the shared flights' lingering locks, the semantic stream), but each instance also keeps
its finished local flights lingering in its own coalescing window (``flight.FlightGroup``: up to
``coalesce.window_ms``, or ``max_window_ms`` when adaptive), which only that instance can forget.
``InvalidationChannel`` tells every instance to forget them.

Contract:
- ``publish()`` (the end of ``Gateway.invalidate``, once every layer is invalidated): ``PUBLISH
  P invalidations ID`` (``P`` = ``distributed.key_prefix``, ``ID`` this instance's random id). It
  returns once Redis has accepted the message (the admin endpoint answers after that), with the
  number of subscribers Redis handed it to; it does not wait for them to apply it (each does
  within milliseconds: tests wait on ``counts["received"]``).
- One subscriber task per instance (``start()``: the server's startup, or lazily the first flight
  led; stopped by ``aclose``) subscribes to that channel on its own connection and, for every
  message of ANOTHER instance, calls ``forget()`` (``FlightGroup.forget_all``) and tells the
  shared health (``health.invalidated_elsewhere()``: what this instance keeps in its own memory
  while degraded goes, counted in ``dropped_locally``; the message proves Redis answers). The
  publisher's own messages are skipped: ``Gateway.invalidate`` did both already.
- ``publish_state(tag)`` (a 2xx ``DELETE`` of a stored response or chat completion,
  ``Gateway.passthrough``): ``PUBLISH P invalidations ID TAG`` (the tag,
  ``store.base.state_tag``, begins with a line feed): every OTHER instance hands ``TAG`` to ``on_state`` (set by the gateway: ``Gateway.forget_state``,
  which drops what that instance stored under it, by key: no flight forgotten, no scan), counted
  in ``states_received``; nothing else. Sent and failing as ``publish`` (an instance that missed
  it keeps what it stored under the tag until its TTL; its other answers are untouched).
- ``tell_refused(tenant)`` (the upstream refused a tenant's credentials, 401 or 403:
  ``AcceptedCredentials.refuse``, which is sync, on the request's path): ``PUBLISH P invalidations
  ID\rTENANT[\rTENANT...]`` (``TOLD_AT_ONCE`` tenants a message at most) in the background
  (drained by ``aclose``): every OTHER instance hands ``TENANT`` to ``on_refusal``
  (``AcceptedCredentials.refused_elsewhere``: its acceptances there taken back too; counted in
  ``refusals_received``). Unlike an invalidation's, a refusal's PUBLISH is tried whatever the
  health says and again after each failure (the subscriber's backoff) until Redis takes it or
  ``refusal_retry_s`` passes (the gateway's ``tenant.accepted_ttl``: past it, nobody accepts the
  key on an old answer, counted in ``refusals_unsent``), its window starting again at each refusal
  of the tenant. One task tells them all, one try a backoff step while Redis fails (a flood of
  401s costs no more), at most ``MAX_TELLING`` tenants waiting (past it, counted in
  ``refusals_unsent``); closing, those pending get one more try within ``socket_timeout``, the
  rest counted. Subscribed after a failure (again, or for the first time after failing to), the
  subscriber hands it None: a refusal may have been missed, every acceptance goes.
- Redis never fails an invalidation and never hangs it: a failed PUBLISH is counted
  (``errors``) and reported to the shared store's health (degraded mode, /stats, /healthz, the
  log); while that health says Redis is not to be tried, nothing is sent (``unsent``) and
  ``publish`` returns at once. The other instances then keep their lingering answers for at most
  one window: the cost of a missed message.
- The subscriber reconnects by itself: after a failure (Redis killed, the connection reset, no
  answer to a keepalive PING within ``socket_timeout``: a Redis that hangs or vanished
  silently) it waits ``BACKOFF_MIN``, doubling up to ``retry_interval``, and subscribes again.
  Messages published while it was cut off are lost (pub/sub keeps nothing), so each time it is
  subscribed AGAIN it forgets every finished flight once (``resubscribed``): at most one extra
  upstream call per key, instead of answers that may have been invalidated meanwhile. The first
  subscription forgets nothing (at startup nothing lingers yet), unless an attempt failed before
  it. ``listening`` is true while it is subscribed (tests wait on it). Its failures and successes
  go to the shared health too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..background import Background
from .connection import (
    Backoff,
    Health,
    StoreUnavailable,
    close_client,
    counted_apart,
    stop_reader,
    unavailable_in,
)

if TYPE_CHECKING:
    import redis.asyncio as aredis

__all__ = ["InvalidationChannel"]

log = logging.getLogger("carpool.invalidation")

WAIT = 1.0  # s of one wait for a message (then the keepalive is considered)
_ID = 16  # an instance's id: 16 hex digits
KEEPALIVE = 5.0  # s without any message before the subscriber PINGs Redis
MAX_TELLING = 10_000  # tenants whose refusal may wait to be told at once
TOLD_AT_ONCE = 256  # tenants a refusal's message names at most

_unavailable = unavailable_in("the invalidation channel")


class InvalidationChannel:
    """Invalidations published to, and received from, every instance on ``client`` (a
    ``redis.asyncio`` client that does not decode responses). ``forget``: what a message of
    another instance does here (returns how many flights it forgot); ``socket_timeout`` (s): how
    long a keepalive PING may go unanswered; ``retry_interval``: the subscriber's longest
    backoff; ``health``: the shared store; ``owns_client``: ``aclose`` closes the client.
    """

    def __init__(
        self,
        client: aredis.Redis,
        forget: Callable[[], int],
        *,
        prefix: str = "carpool:",
        socket_timeout: float = 0.5,
        retry_interval: float = 1.0,
        health: Health | None = None,
        owns_client: bool = False,
        refusal_retry_s: float = 600.0,
    ) -> None:
        self.channel = (prefix + "invalidations").encode()
        self.instance = secrets.token_hex(8).encode()
        self.forget = forget
        # A deleted response's tag, from another instance (``publish_state``; the gateway's).
        self.on_state: Callable[[str], Awaitable[object]] | None = None
        # A tenant another instance saw refused (``tell_refused``), None for any (resubscribed).
        self.on_refusal: Callable[[str | None], object] | None = None
        self.refusal_retry_s = refusal_retry_s  # (the gateway's ``tenant.accepted_ttl``)
        self._telling = Background("telling a refusal", log)
        # The refusals to tell, each until when (its last refusal's window), oldest first;
        # told by one task (``_teller``).
        self._pending: dict[str, float] = {}
        self._teller: asyncio.Task[None] | None = None
        self.socket_timeout = socket_timeout
        self.retry_interval = retry_interval
        self.health = health
        self.listening = False
        self.counts = dict.fromkeys(
            (
                "published",  # messages accepted by Redis (invalidations, states, refusals)
                "unsent",  # not sent: Redis degraded (the others keep at most one window)
                "received",  # invalidations of other instances applied here
                "states_received",  # deleted responses of other instances dropped here
                "refusals_received",  # tenants other instances saw refused, refused here
                "refusals_unsent",  # refusals never told (too many waiting, or too long)
                "forgotten",  # finished flights forgotten on their account
                "dropped_locally",  # answers kept here while degraded, dropped on their account
                "resubscribed",  # subscriptions after a failure, a first one too (each forgets all)
                "errors",  # Redis failures (publishing and subscribing)
            ),
            0,
        )
        self._client = client
        self._owns_client = owns_client
        self._subscriber: asyncio.Task[None] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<InvalidationChannel {self.channel.decode()!r} instance={self.instance.decode()}>"

    def snapshot(self) -> dict[str, Any]:
        return {**self.counts, "listening": self.listening, "refusals_pending": len(self._pending)}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the subscriber (idempotent; needs a running event loop)."""
        if self._subscriber is None and not self._closed:
            self._subscriber = asyncio.get_running_loop().create_task(self._subscribe())

    async def aclose(self) -> None:
        self._closed = True  # (no refusal taken from now on; those pending get one more try)
        await self._telling.drain(self.socket_timeout)
        if self._pending:
            log.warning(
                "closing: %d refusals of keys were never told to the other instances (Redis "
                "did not take them): they accept those keys until tenant.accepted_ttl",
                len(self._pending),
            )
        self.counts["refusals_unsent"] += len(self._pending)
        self._pending.clear()
        subscriber, self._subscriber = self._subscriber, None
        await stop_reader(subscriber)
        if self._owns_client:
            await close_client(self._client)

    # ------------------------------------------------------------------ publishing

    async def publish(self) -> int:
        """Tell every other instance to forget its finished flights; how many subscribers Redis
        handed the message to (this instance's own included), 0 if it could not be sent."""
        return await self._publish(self.instance)

    async def publish_state(self, tag: str) -> int:
        """Tell every other instance to drop what it stored under ``tag`` (a deleted response's
        ``state_tag``), as ``publish``."""
        return await self._publish(self.instance + tag.encode())

    def tell_refused(self, tenant: str) -> None:
        """Tell every other instance, in the background, that the upstream refused ``tenant``'s
        credentials, until Redis takes it (the module's contract)."""
        if self._closed:
            return
        if tenant not in self._pending and len(self._pending) >= MAX_TELLING:
            self.counts["refusals_unsent"] += 1
            return
        # (Told again: its window starts again, the last refusal's; its place kept.)
        self._pending[tenant] = asyncio.get_running_loop().time() + self.refusal_retry_s
        if self._teller is None or self._teller.done():
            self._teller = self._telling.spawn(self._tell_pending())

    async def _tell_pending(self) -> None:
        """One task tells every refusal pending, oldest first, ``TOLD_AT_ONCE`` tenants a
        message (one PUBLISH a round trip would fall behind a flood of 401s); Redis failing, it
        tries once a backoff step, not once a refusal, and gives each up past its window."""
        loop = asyncio.get_running_loop()
        backoff = Backoff(self.retry_interval)
        while self._pending:
            now = loop.time()
            for tenant in [t for t, until in self._pending.items() if until <= now]:
                del self._pending[tenant]
                self.counts["refusals_unsent"] += 1
            told = dict(itertools.islice(self._pending.items(), TOLD_AT_ONCE))
            if not told:
                return
            message = self.instance + b"\r" + "\r".join(told).encode()
            try:
                with _unavailable("tell a refusal"):
                    await self._client.publish(self.channel, message)
            except StoreUnavailable as error:
                self._failed(error)
                if self._closed:
                    return  # (``aclose`` counts what is left)
                await backoff.wait()
                continue
            backoff.reset()
            for tenant, until in told.items():
                if self._pending.get(tenant) == until:  # (not refused again meanwhile)
                    del self._pending[tenant]
            self._published()

    async def _publish(self, message: bytes) -> int:
        if self.health is not None and not self.health.usable():
            self.counts["unsent"] += 1
            return 0
        try:
            with _unavailable("publish an invalidation"):
                receivers = await self._client.publish(self.channel, message)
        except StoreUnavailable as error:
            self.counts["unsent"] += 1
            self._failed(error)
            return 0
        self._published()
        return int(receivers)

    def _published(self) -> None:
        self.counts["published"] += 1
        if self.health is not None:
            self.health.report(None)

    # ------------------------------------------------------------------ subscribing

    async def _subscribe(self) -> None:
        backoff = Backoff(self.retry_interval)
        subscribed_before = False
        while not self._closed:
            pubsub = self._client.pubsub()
            try:
                with _unavailable("listen for invalidations"):
                    await pubsub.subscribe(self.channel)
                    loop = asyncio.get_running_loop()
                    heard = loop.time()  # when Redis last sent anything
                    pinged: float | None = None  # when an unanswered PING was sent
                    while not self._closed:
                        message = await pubsub.get_message(timeout=WAIT)
                        now = loop.time()
                        if message is None:
                            if pinged is not None and now - pinged > self.socket_timeout:
                                raise TimeoutError("no answer to a keepalive PING")
                            if pinged is None and now - heard >= KEEPALIVE:
                                await pubsub.ping()
                                pinged = now
                            continue
                        heard, pinged = now, None
                        kind = message.get("type")
                        if kind == "subscribe":  # the first time, or redis-py reconnected
                            self.listening = True
                            backoff.reset()
                            if subscribed_before:
                                self.counts["resubscribed"] += 1
                                self.counts["forgotten"] += self.forget()
                                if self.on_refusal is not None:
                                    self.on_refusal(None)  # (a refusal may have been missed)
                            subscribed_before = True
                            if self.health is not None:
                                self.health.report(None)
                        elif kind != "message" or message.get("data") == self.instance:
                            pass
                        elif (refused := _refusal_of(message.get("data"))) is not None:
                            if refused[0] != self.instance and self.on_refusal is not None:
                                for tenant in refused[1]:
                                    self.on_refusal(tenant)
                                    self.counts["refusals_received"] += 1
                        elif (state := _state_of(message.get("data"))) is not None:
                            if state[0] != self.instance:
                                await self._forget_state(state[1])
                        else:
                            self.counts["received"] += 1
                            self.counts["forgotten"] += self.forget()
                            if self.health is not None:
                                dropped = self.health.invalidated_elsewhere()
                                self.counts["dropped_locally"] += dropped
            except StoreUnavailable as error:
                self._failed(error)
                backing_off = True
                # (Messages may be missed until it is subscribed: the next subscription forgets
                # what this one would have been told, the first one too.)
                subscribed_before = True
            else:  # closed (``aclose``) while a cancellation was swallowed (``stop_reader``)
                backing_off = False
            finally:  # (failed, cancelled or closed: its connection goes)
                self.listening = False
                await _quietly(pubsub.aclose())
            if backing_off:
                await backoff.wait()

    async def _forget_state(self, tag: str) -> None:
        try:
            if self.on_state is not None:
                await self.on_state(tag)
        except Exception:  # (the subscriber goes on: the next message is another's)
            log.exception("dropping the answers of a deleted response failed")
        self.counts["states_received"] += 1  # (once done: tests wait on it)

    def _failed(self, error: StoreUnavailable) -> None:
        if not counted_apart(error):  # (Redis answered: the health counts it)
            self.counts["errors"] += 1
        if self.health is not None:
            self.health.report(error)
        else:
            log.debug("invalidation channel: %s", error)


def _state_of(data: Any) -> tuple[bytes, str] | None:
    """A ``publish_state`` message's (instance, tag); None for any other."""
    if not isinstance(data, bytes) or data[_ID : _ID + 1] != b"\n":
        return None
    return data[:_ID], data[_ID:].decode("utf-8", "replace")


def _refusal_of(data: Any) -> tuple[bytes, list[str]] | None:
    """A ``tell_refused`` message's (instance, tenants); None for any other."""
    if not isinstance(data, bytes) or data[_ID : _ID + 1] != b"\r":
        return None
    return data[:_ID], data[_ID + 1 :].decode("utf-8", "replace").split("\r")


async def _quietly(closing: Any) -> None:
    with contextlib.suppress(Exception):
        await closing
