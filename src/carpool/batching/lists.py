"""Whether an upstream may be sent a list of embeddings inputs: the list check and its probe.

Merging must not change an answer (issue 15): some engines answer a list of inputs wrongly
(llama-cpp-python's server: every item but the first gets a wrong vector), though they answer
each input alone right. So :class:`carpool.batching.EmbeddingBatcher` asks a :class:`ListCheck`
(its ``lists``; None: always merge, for an upstream known to be right) before it merges.

Contract
--------
- ``ListCheck.verdict(group)`` is True when merging the group's items is known safe on every
  replica, False when it is known unsafe on one (or ``mode`` is ``off``), None while unknown.
  ``mode`` ``on`` is always True. With ``auto``, a replica is known safe for a group's path,
  model, parameters, query string, kind of item (texts, or token lists: an engine may take
  one and not the other, or answer a list of one kind wrongly), credentials and forwarded
  headers that may change the answer (the group's identity: a proxy or router in front of the
  engine may send each key or each such header to another engine, so a verdict found for one
  says nothing of another; the price is one probe per tenant) once a *probe* has sent it a
  2-item list of two fixed items of that kind (``PROBE_INPUTS``: sentences; ``PROBE_TOKENS``:
  token ids) and each of them alone (with the group's credentials) and the list's vectors
  matched the single ones (cosine >= ``SAME_VECTOR``, same length). A list answered wrongly,
  malformed, or refused with a 4xx other than 408/409/429 makes it unsafe for good (for that
  identity: another key's may be answered right); a probe
  that cannot decide (a single answered non-2xx, a transport failure, a 5xx) is tried again
  after ``retry_s``. Verdicts are kept per replica, for at most ``max_groups`` groups (the
  least recently asked forgotten: a group is a body template and an identity, the clients' to
  vary, so it is probed again if it comes back), shared fairly between identities
  (``idempotency.finished``: one making groups faster than the others forgets its own, never
  a quieter one's, which would lose its merging and pay a probe again), the identity as a
  digest (the raw credentials are never kept). Probes run in the
  background (``probe(group)``, at most one per replica and group at a time), started by the
  first batch of two or more items that could not be merged; their answers never reach a
  client. ``aclose()`` cancels those still running; ``wait_idle()`` waits for them.
- ``probe_lists(upstream, group)`` is one probe of one replica: True, False or None
  (undecided).

A group is the :class:`~carpool.batching.EmbeddingBatcher`'s: ``(path, identity headers, body
template without input and user, query string, kind of item)``, the kind ``"text"`` or
``"tokens"``.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import orjson

from carpool import exact_json
from carpool.idempotency.finished import Finished, by_count
from carpool.identity import pairs_digest
from carpool.upstream.base import UpstreamRequest, UpstreamResponse

__all__ = [
    "PROBE_INPUTS",
    "PROBE_TOKENS",
    "SAME_VECTOR",
    "ListCheck",
    "probe_lists",
    "rows_in_order",
]

# The probe's two inputs: unrelated sentences, so that one's vector given for the other (the
# usual way a broken list goes wrong) cannot pass for right.
PROBE_INPUTS = (
    "carpool checks that a list of inputs is answered item by item.",
    "Zwei völlig andere Wörter: 42 Äpfel, drei Birnen.",
)
# The probe's two inputs for a group of token lists: ids every vocabulary has (well under the
# smallest, BERT's 30,522), of different lengths and none in common.
PROBE_TOKENS = (
    (1996, 4248, 2829, 4419, 14523, 2058),
    (7592, 2088, 1010, 2023, 2003, 1037, 3231, 1012),
)
# Two vectors of one input are the same answer at this cosine or above: engines that batch on a
# GPU differ from their single answers in the last digits (padding, kernel order), far above
# this; a wrong item is another text's vector, far below it.
SAME_VECTOR = 0.99
# The most groups (body templates) whose verdicts are kept (``ListCheck``).
MAX_GROUPS = 4096
_HASH_MASK = (1 << 64) - 1  # (a hash as a non-negative number, for the slot's name)


class Replica(Protocol):
    """What a probe asks: one replica itself, not routed (``routing.replicas.OwnCalls``, whose
    calls are counted as any attempt)."""

    async def send(self, request: UpstreamRequest) -> UpstreamResponse: ...


# A list refused with these is not an answer about lists: the probe is tried again later.
_UNDECIDED = frozenset({408, 409, 429})


class ListCheck:
    """Whether merging embeddings inputs into one list call keeps every answer what it is alone,
    per replica; see the module docstring."""

    def __init__(
        self,
        mode: str,
        upstreams: Sequence[Replica],
        *,
        retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_groups: int = MAX_GROUPS,
    ) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"mode must be auto, on or off, not {mode!r}")
        self.mode = mode
        self.upstreams = list(upstreams)
        self.retry_s = retry_s
        self.clock = clock
        slots = max_groups * max(1, len(self.upstreams))  # (one per replica and group)
        # Each slot "<identity>\n<group's hash>\n<replica>": the identity first, whose share
        # it counts in (``by_count``: the part before the first newline). The group is named by
        # 64 bits of the process's keyed hash (a collision, which no client can aim at, would
        # share a verdict), never kept: a template is a client's, up to a body's size.
        self._verdicts: Finished[bool] = by_count(slots)
        self._retry_at: Finished[float] = by_count(slots)
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.probes = 0  # probes run (each: three upstream calls)

    @staticmethod
    def _key(group: Any) -> str:
        path, identity, template, query, kind = group
        # Who asks too: the credentials and answer-changing headers may pick another engine
        # (a router's deployment, a tenant's own backend), whose lists may be answered wrongly.
        # (The template's hash is computed once per bytes object, as a dict key's was: a
        # digest of it each call cost 52 ms an 8 MB template, twice a request.)
        what = hash((path, template, query, kind)) & _HASH_MASK
        return f"{_digest(identity).hex()}\n{what:x}"

    def verdict(self, group: Any) -> bool | None:
        if self.mode != "auto":
            return self.mode == "on"
        key = self._key(group)
        found = []
        for i in range(len(self.upstreams)):
            slot = f"{key}\n{i}"
            known = self._verdicts.peek(slot)
            if known is not None:
                self._verdicts.put(slot, known)  # (used: the newest of its identity's)
            found.append(known)
        if False in found:
            return False
        return True if found and all(found) else None

    def probe(self, group: Any) -> None:
        """Start the probes this group still needs (never more than one per replica)."""
        if self.mode != "auto":
            return
        key, now = self._key(group), self.clock()
        for i, upstream in enumerate(self.upstreams):
            slot = f"{key}\n{i}"
            retry_at = self._retry_at.peek(slot)
            if (
                slot in self._verdicts
                or slot in self._probes
                or (retry_at is not None and now < retry_at)
            ):
                continue
            task = asyncio.get_running_loop().create_task(self._probe(slot, upstream, group))
            self._probes[slot] = task

    async def _probe(self, slot: str, upstream: Replica, group: Any) -> None:
        self.probes += 1
        try:
            verdict = await probe_lists(upstream, group)
        finally:
            del self._probes[slot]
        if verdict is None:
            self._retry_at.put(slot, self.clock() + self.retry_s)
        else:
            self._verdicts.put(slot, verdict)

    def stats(self) -> dict[str, Any]:
        verdicts = [self._verdicts.peek(slot) for slot in self._verdicts]
        return {
            "mode": self.mode,
            "probes": self.probes,
            "groups": len({slot.rsplit("\n", 1)[0] for slot in self._verdicts}),
            "lists_right": verdicts.count(True),
            "lists_wrong": verdicts.count(False),
        }

    async def wait_idle(self) -> None:
        while self._probes:
            await asyncio.gather(*list(self._probes.values()), return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        await self.wait_idle()


async def probe_lists(upstream: Replica, group: Any) -> bool | None:
    """Whether ``upstream`` answers a 2-item list as it answers each item alone, for the
    group's path, body template, credentials, query and kind of item: True, False, or None
    (undecided)."""
    path, identity, template, query, kind = group
    inputs: Sequence[Any] = PROBE_INPUTS if kind == "text" else [list(t) for t in PROBE_TOKENS]
    body = exact_json.loads(template)
    body.pop("encoding_format", None)  # floats, to compare

    async def ask(value: Any) -> tuple[int, bytes]:
        response = await upstream.send(
            UpstreamRequest(path, {**body, "input": value}, dict(identity), False, query)
        )
        try:
            if response.streaming:
                return 502, b""
            return response.status, response.body
        finally:
            await response.aclose()

    answers = await asyncio.gather(
        ask(list(inputs)), *(ask(item) for item in inputs), return_exceptions=True
    )
    for answer in answers:
        if isinstance(answer, asyncio.CancelledError):
            raise answer
    if any(isinstance(answer, BaseException) for answer in answers):
        return None  # unreachable, timed out: undecided
    # (none is an exception now: each is a (status, body) pair)
    (listed_status, listed_body), *singles = cast(list[tuple[int, bytes]], answers)
    alone = [_vectors(raw, 1) if 200 <= status < 300 else None for status, raw in singles]
    if any(vectors is None for vectors in alone):
        return None  # the singles are the reference: none, no verdict
    if not 200 <= listed_status < 300:
        return None if listed_status in _UNDECIDED or listed_status >= 500 else False
    listed = _vectors(listed_body, len(inputs))
    return listed is not None and all(
        _same(one[0], item)  # type: ignore[index]  # (each is a list: checked above)
        for one, item in zip(alone, listed, strict=True)
    )


def _digest(identity: Sequence[tuple[str, str]]) -> bytes:
    """A group's identity headers as a digest: verdicts outlive requests, and the raw
    credentials are never kept (as ``identity.tenant_of``)."""
    return pairs_digest(identity, b"carpool-lists", 16).digest()


def rows_in_order(data: Any, count: int) -> list[Any] | None:
    """An embeddings answer's ``data`` rows in index order when they are exactly one per input,
    indexed 0..count-1; else None: which vector is whose, it does not say. Never raises."""
    try:
        rows = sorted(data, key=lambda row: row["index"])
    except (KeyError, TypeError):
        return None
    return rows if [row["index"] for row in rows] == list(range(count)) else None


def _vectors(raw: bytes, count: int) -> list[list[float]] | None:
    """The ``count`` vectors of an embeddings answer in index order, or None if it has not."""
    try:
        data = rows_in_order(orjson.loads(raw)["data"], count)
        if data is None:
            return None
        out = []
        for row in data:
            value = row["embedding"]
            if isinstance(value, str):  # base64 little-endian float32
                packed = base64.b64decode(value)
                value = list(struct.unpack(f"<{len(packed) // 4}f", packed))
            out.append([float(x) for x in value])
        return out
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, struct.error):
        return None


def _same(a: list[float], b: list[float]) -> bool:
    if len(a) != len(b) or not a:
        return False
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return norms > 0 and sum(x * y for x, y in zip(a, b, strict=True)) / norms >= SAME_VECTOR
