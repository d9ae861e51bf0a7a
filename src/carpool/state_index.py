"""Which cached answers each stored response's or file's ``DELETE`` drops, in this process:
``StateIndex``.

An answer is stored with the gateway's own tags (``store.base.state_tag``), in the requester's
tenant: each file its request's input names (``apis.base.named_files``: every API, state kept
or not), and, for a request that keeps state upstream (Responses; a chat completion with
``store: true``: ``Api.keeps_state``), the stored response it continues and the one it is. A
2xx pass-through ``DELETE /v1/responses/{id}``, ``DELETE /v1/chat/completions/{id}`` or
``DELETE /v1/files/{id}`` drops them (``Gateway.passthrough``), by key, not by scanning the
layers: a client may delete as often as it creates, and an invalidation of every layer
(flights, epochs, a Redis SCAN) is an operator's.

Contract:
- ``add(tags, keys, entry)``: ``Leader._store`` names, before it stores an answer carrying state
  tags, the exact-cache keys it is put (and its flight was led) under; ``entry``, once it is in
  the semantic cache, that cache's id of it (``SemanticCache.forget_entry``). O(1) a tag.
- ``fly(tags, key)``: ``Leader.lead`` names a call as it begins, under the files it names and
  the response it continues, and again as the upstream first names the response it makes (a stream's first
  lifecycle event, before any client sees it; a whole answer), with the key its flight is led
  under (``Held.flying``, counted: two calls of a key may run); ``landed`` once it ends: the
  key stays indexed if its answer lingers in the window (joinable still), else it goes (a
  stored answer's keys were ``add``-ed): a call that failed or was not kept leaves nothing.
  So a ``DELETE`` shuts the flights running under the tag too (``Gateway.forget_state``): no
  request joins them from then on. A call counts in the bounds as an answer while it runs.
- ``take(tag)``: what this process stored under ``tag`` (its keys and semantic entries) and the
  flights running under it, no longer held here; ``tag`` is remembered as deleted from then on
  (``deleted``; a call continuing or naming it is not indexed, ``fly``: the upstream refuses
  it). O(its keys).
- ``deleted(tags)``: whether one of ``tags`` was taken: an answer continuing (or being) a
  response, or naming a file, deleted while its call ran is not stored (``Leader._store`` asks before storing,
  and again once stored, taking back what it put meanwhile). ``TOMBSTONES`` tags taken are
  remembered, shared fairly between tenants (``idempotency.finished``): beyond, the oldest
  goes unless its tenant holds fewer than its share, then the oldest of the tenant holding
  the most; so one tenant deleting in a loop pushes out its own, never a quieter tenant's.
  A call outliving that many DELETEs since (its own tenant's, or of tenants of one each)
  may store its answer.
- Bounded: ``max_entries`` tags (``routing.state_entries``), the least recently stored under
  out first; and ``2 * max_entries`` answers (keys and entries) under them in all, a tag
  holding ``PER_TAG`` letting its oldest go for each one added (one stored response continued
  by every request: its list only grew, each key in it long gone from the cache; pushed out
  whole, a file every request attaches lost all its answers at each ``PER_TAG``-th). What a tag pushed out
  held, or the oldest answer it let go, is forgotten from the layers then (``evicted``, set by
  the gateway; in a task of its own, not on the storing flight's path, a failure logged): no answer of a tag this
  index no longer knows outlives a ``DELETE`` of it. (One bound for all tenants, not shared
  fairly: a tag pushed out costs its tenant cache misses only, as the cache's own bounds,
  one for all tenants, do.) In this process only: what another worker
  or instance stored is in its own index, and a ``DELETE`` reaches it (``carpool.peers``'s
  ``{"state": tag}``, the Redis invalidation channel's state message).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from .background import Background
from .idempotency.finished import Finished, by_count
from .lru import LRU
from .store.base import state_tenant

__all__ = ["Held", "StateIndex"]

log = logging.getLogger("carpool.state")

# Most tags indexed by default (``routing.state_entries``).
DEFAULT_ENTRIES = 100_000
# Deleted tags remembered (``deleted``).
TOMBSTONES = 10_000
# Most answers one tag holds: beyond, it is pushed out whole (its answers forgotten).
PER_TAG = 1_024


class Held:
    """What one tag's answers are here: exact-cache keys, semantic entries (ids), and the keys
    of the flights whose calls run under it (each with how many calls: ``fly``)."""

    __slots__ = ("entries", "flying", "keys", "order")

    def __init__(self) -> None:
        self.keys: dict[str, None] = {}  # (insertion-ordered, deduplicated)
        self.entries: dict[int, None] = {}
        self.flying: dict[str, int] = {}
        # Keys (str) and entries (int) together, oldest first: which goes first when the tag
        # is full (``StateIndex._trim``).
        self.order: dict[str | int, None] = {}

    def __len__(self) -> int:
        """Its answers, as the bounds count them (a call running: one)."""
        return len(self.keys) + len(self.entries) + len(self.flying)


class StateIndex:
    """state tag -> ``Held``; the tags deleted lately (see the module's contract)."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, tombstones: int = TOMBSTONES) -> None:
        if max_entries < 1 or tombstones < 1:
            raise ValueError("the bounds must be positive")
        self._held: LRU[str, Held] = LRU(max_entries=max_entries, on_evict=self._pushed_out)
        self._answers = 0  # under every tag held, counted once a tag
        self._max_answers = 2 * max_entries
        # The tags taken, each under its tenant (``_tombstone``).
        self._gone: Finished[bool] = by_count(tombstones)
        # What a tag pushed out held, forgotten from the layers (the gateway sets it).
        self.evicted: Callable[[Held], Coroutine[Any, Any, Any]] | None = None
        self._forgetting = Background("forgetting a pushed-out tag's answers", log)

    def __len__(self) -> int:
        return len(self._held)

    def add(self, tags: Iterable[str], keys: Iterable[str] = (), entry: int | None = None) -> None:
        keys, tags = tuple(keys), tuple(tags)
        added: tuple[str | int, ...] = keys if entry is None else (*keys, entry)
        for tag in tags:
            held = self._held.get(tag)
            if held is None:
                held = Held()
                self._held.put(tag, held)
            before = len(held)
            for key in keys:
                held.keys[key] = None
            if entry is not None:
                held.entries[entry] = None
            for item in added:  # (the newest, if added again: its answer stored again)
                held.order.pop(item, None)
                held.order[item] = None
            self._answers += len(held) - before
            self._trim(held, added)
        self._bound(len(tags))

    def fly(self, tags: Iterable[str], key: str) -> list[tuple[str, Held]]:
        """A call begins (or has just named the response it makes) under ``tags``, its flight
        led under ``key``: a ``DELETE`` of one of them shuts that flight from now on, running
        or done (``Gateway.forget_state``). What to hand ``landed`` once the call ends; a tag
        deleted already is left out (its call is the upstream's to refuse)."""
        flown: list[tuple[str, Held]] = []
        tags = tuple(tag for tag in tags if _tombstone(tag) not in self._gone)
        for tag in tags:
            held = self._held.get(tag)
            if held is None:
                held = Held()
                self._held.put(tag, held)
            before = len(held)
            held.flying[key] = held.flying.get(key, 0) + 1
            self._answers += len(held) - before
            self._trim(held, ())  # (as ``add`` does)
            flown.append((tag, held))
        self._bound(len(tags))
        return flown

    def landed(self, flown: Iterable[tuple[str, Held]], key: str, lingers: bool) -> None:
        """The call ``fly`` indexed under ``key`` ended. Its answer lingering in the window
        (``lingers``), ``key`` stays indexed as a stored answer's is (till a ``DELETE`` or its
        tag is pushed out): the flight is joinable still. Else the call is indexed no more (a
        stored answer was indexed by ``add``): one that failed, or was not stored, leaves
        nothing behind. A tag taken or pushed out meanwhile is left as it is."""
        for tag, held in flown:
            calls = held.flying.get(key, 0)
            if calls == 0:
                continue
            before = len(held)
            if calls > 1:
                held.flying[key] = calls - 1
            else:
                del held.flying[key]
                if lingers:
                    held.order.pop(key, None)
                    held.keys[key] = held.order[key] = None
            if self._held.peek(tag) is held:
                self._answers += len(held) - before

    def _bound(self, added: int) -> None:
        # Over the answers' bound: the least recently stored under go, never the tags just
        # added to (the answer being stored is theirs).
        while self._answers > self._max_answers and len(self._held) > added:
            self._held.evict()  # (``_pushed_out``)

    def answers(self, tag: str) -> int:
        """How many answers this process holds under ``tag`` (keys and entries)."""
        held = self._held.peek(tag)
        return 0 if held is None else len(held)

    def deleted(self, tags: Iterable[str]) -> bool:
        return any(_tombstone(tag) in self._gone for tag in tags)

    def take(self, tag: str) -> Held:
        self._gone.put(_tombstone(tag), True)
        held = self._held.pop(tag) or Held()
        self._answers -= len(held)
        return held

    def _trim(self, held: Held, added: tuple[str | int, ...]) -> None:
        """Over ``PER_TAG``, ``held``'s oldest answers (keys and entries alike) let go and
        forgotten from the layers, never one just ``added`` (the answer being stored), the
        rest kept. (Pushed out whole, a file every request attaches, or a response every
        request continues, lost all its answers at each ``PER_TAG``-th.) Calls running are
        never let go: a tag holding only those and what was just added stays over."""
        while len(held) > PER_TAG:
            oldest = next((item for item in held.order if item not in added), None)
            if oldest is None:
                return
            del held.order[oldest]
            gone = Held()
            if isinstance(oldest, str):
                del held.keys[oldest]
                gone.keys[oldest] = None
            else:
                del held.entries[oldest]
                gone.entries[oldest] = None
            self._pushed_out("", gone)

    def _pushed_out(self, _: str, held: Held) -> None:
        self._answers -= len(held)
        if self.evicted is None:
            return
        self._forgetting.spawn(self.evicted(held))


def _tombstone(tag: str) -> str:
    """The key of a taken tag among the tombstones: its tenant first, as ``Finished`` reads it."""
    return f"{state_tenant(tag)}\n{tag}"
