"""Dynamic batching with dedup for the gateway's ``/embeddings``: many concurrent single-input
requests become one upstream call with a list ``input``.

Contract
--------
:class:`EmbeddingBatcher` runs a :class:`carpool.batching.KeyedBatcher` over ``send``:

- ``await embed(request) -> UpstreamResponse``. A request is *batchable* when it is a non-stream
  POST to ``/embeddings`` whose JSON body has a ``model`` string and an ``input`` that is a single
  non-empty string or a single non-empty list of token ids. Anything else (a list of inputs, a
  stream, an unknown shape) goes straight to ``send`` unchanged and is counted in ``bypassed``.
- Batch-compatible means: the same kind of item (a text, or a token list: an engine refuses a
  list that mixes them, as OpenAI's schema does), same path, same body apart from ``input`` and
  ``user`` (so the same ``model``, ``dimensions``, ``encoding_format``...), the same query
  string, and the same values
  of the identity headers (``key_headers``: the gateway passes the tenant's credential headers,
  ``identity.py``) and of every other forwarded header that might change the answer
  (``fingerprint.varying_headers``; ``neutral_headers``: the configured
  ``fingerprint.neutral_headers``, left out as the key leaves them), so tenants' credentials
  and callers' options are never mixed. The merged call carries that body with a list
  ``input`` (its ``user`` dropped, as callers may differ), that query string and only those
  headers.
- An item that goes alone (a batch of one item, each item while merging is not known safe,
  the item-by-item retry below) is sent as its client sent it: its own request, body
  (``user`` included) and every header forwarded (trace context, request id, user agent...),
  the first caller's when identical requests shared its slot (below: they differ at most in
  the headers that change no answer, as a flight's joiners and its leader may); its callers
  get the upstream's answer as it came (framing headers dropped on a 2xx), status included,
  and an exception from ``send`` reaches that item's callers only. Each such call of a batch
  is a task of its own, cancelled once every caller of its item has left, though the batch's
  other items still have callers (a call is cancelled when every client of it has gone).
  Such calls are counted in ``alone`` as they are sent: an item whose callers have all left
  before its call starts is never sent, nor counted.
- Counters of the calls it sends (what the engines were asked, not the batches it gathered: a
  batch of several items sent item by item is that many calls of one): ``batches`` (calls),
  ``items_sent`` (the items in them), ``max_items_seen`` (the most in one call), and
  ``observe_size(items)`` once per call; ``requests`` (``embed`` calls batched).
- ``flush()``, once the gateway begins to stop (``Gateway.begin_draining``): the batches
  still filling are sent at once, and later ones wait no longer than the next turn of the
  event loop, so that no request sits in a batch while the grace period runs out.
- The token budget (``max_batch_tokens``) counts approximate tokens: a string's characters / 4
  (rounded up, at least 1), a token list's length.
- Only a batch still filling is shared: identical requests in it take one slot (the same item,
  path and body as sent, ``user`` included: an item sent alone is sent as the first caller
  of its slot sent it, so that no caller ever gets the answer to another's ``user``, a refusal
  quoting it, as its own), but a request never joins a call already sent (the scheduler's
  ``join_running`` is off). Identical requests share one flight before they get here
  (``flight.py``), so one that reaches the batcher while its item's call runs is one that must
  not share that call: a request after an invalidation (no request joins a call begun before
  one), or a joiner that timed out waiting for that very call (``coalesce.join_timeout_ms``)
  and runs its own.
- Each caller of a merged call receives a complete OpenAI embeddings response for its own item,
  bytes ready to send: ``{"object": "list", "data": [{"object": "embedding", "index": 0,
  "embedding": ...}], "model": ..., "usage": {"prompt_tokens", "total_tokens",
  "apportioned"}}``, the upstream's usage apportioned to the slots (above) in proportion to
  their approximate tokens (integer shares by largest remainder, summing to the upstream's
  figures; a caller sharing a slot is charged its slot's share).
  Response headers are the upstream's, less framing ones (``content-length``...), with
  ``content-type: application/json``.
- A non-2xx answer to a merged call of two or more items that one item may have caused (a 4xx
  or 5xx, except those about the call's credentials, model or load: ``_NOT_AN_ITEM``) is not
  every caller's: engines refuse a whole list for one bad item (a text over the context, a token
  id outside the vocabulary). Each item is then sent alone (above), and each caller gets the
  upstream's answer to its own item. So it is for a 2xx answer that reports an error (a
  non-null top-level ``error``, whatever else it holds): no success
  (``completeness.is_complete``: alone, such an answer reaches its client as it came and is
  not stored), and it does not say whose; rebuilt per caller from its ``data``, it would
  lose the error and be stored. And so it is for a 2xx JSON answer that is not one embedding
  per input, indexed exactly 0..n-1 (an engine that left an input out, or numbered them
  wrong): whose vector is whose, it does not say, and each item alone may well be answered
  right. Any other non-2xx answer reaches every caller of the batch as the same status,
  headers and body; an exception from ``send`` is raised to every caller; a 2xx answer
  that is not JSON at all (a proxy's page, a cut body: nothing an engine answers about an
  item) is an ``UpstreamAnswerUnreadable`` (502, not retried by the SDKs: the engine took the
  call) for all of them, as a stream answered to the call is.
- Usage: only what the upstream reported is apportioned (``prompt_tokens`` and
  ``total_tokens``, each when it is there); an upstream that reported none gives answers
  without ``usage``: nothing is invented. Apportioned usage is an estimate (the engine counts
  tokens, not characters), and says so: its object ends with ``"apportioned": true``
  (``answer.APPORTIONED``), which the gateway answers with ``x-carpool-usage: apportioned``
  (``reply.whole``). The answer is stored with it: a later hit gets the same figure, marked the
  same way. An item sent alone gets the upstream's own usage, unmarked.

Merging must not change an answer (issue 15), so merging is asked of a
:class:`carpool.batching.ListCheck` (``lists``; None: always merge, for an upstream known to be
right; see :mod:`carpool.batching.lists` for its verdicts and probes):

- ``embed``: a group whose verdict is False is not buffered at all: the request goes to
  ``send`` as it came (counted in ``alone``). A batch of two or more items closed while its
  verdict is not True is sent item by item, each alone (above), concurrently (each call a
  task of its own, cancelled when its item's callers have all left).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import sys
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, cast

import orjson

from carpool import exact_json
from carpool.completeness import sound_vectors
from carpool.errors import UpstreamAnswerUnreadable
from carpool.fingerprint import varying_headers
from carpool.identity import DEFAULT_CREDENTIAL_HEADERS
from carpool.upstream.base import UpstreamRequest, UpstreamResponse, connection_listed

from .core import KeyedBatcher
from .lists import ListCheck, rows_in_order

__all__ = ["DEFAULT_KEY_HEADERS", "EmbeddingBatcher", "approx_tokens"]

DEFAULT_KEY_HEADERS = DEFAULT_CREDENTIAL_HEADERS
_DROPPED_RESPONSE_HEADERS = frozenset(
    {
        "content-length",
        "content-type",
        "transfer-encoding",
        "content-encoding",
        "connection",
        "keep-alive",
    }
)


# Non-2xx answers to a merged call that say nothing about one of its items: about the
# credentials, the account, the model or the path (shared by every item of a call), or the
# load or a proxy's transport (an item by item retry would only multiply the calls).
_NOT_AN_ITEM = frozenset({401, 402, 403, 404, 405, 407, 408, 409, 425, 429, 502, 503, 504})


class _BatchFailed(Exception):
    """The upstream answered the merged call with a non-2xx status that is every caller's."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.headers = dict(headers)
        self.body = body


# An item of a batch: its input, and the request of the caller that put it there (the first,
# when identical requests share its slot), sent as it came when the item goes alone.
_Item = tuple[str | tuple[int, ...], UpstreamRequest]


def approx_tokens(item: str | Sequence[int]) -> int:
    """Approximate tokens of one input: characters / 4 (at least 1) or a token list's length."""
    if isinstance(item, str):
        return max(1, math.ceil(len(item) / 4))
    return max(1, len(item))


def _single_item(value: Any) -> str | tuple[int, ...] | None:
    if isinstance(value, str):
        return value if value else None
    if isinstance(value, list) and value and all(type(token) is int for token in value):
        return tuple(value)
    return None


def _apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Integer shares of ``total`` in proportion to ``weights`` (largest remainder)."""
    weight_sum = sum(weights)
    if weight_sum <= 0:
        return [0] * len(weights)
    exact = [total * w / weight_sum for w in weights]
    shares = [math.floor(x) for x in exact]
    left = total - sum(shares)
    for i in sorted(range(len(weights)), key=lambda i: shares[i] - exact[i])[:left]:
        shares[i] += 1
    return shares


class EmbeddingBatcher:
    """Dynamic batching with dedup for ``/embeddings``; see the module docstring."""

    def __init__(
        self,
        send: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]],
        *,
        max_batch_size: int = 32,
        max_batch_delay_s: float = 0.005,
        max_batch_tokens: int = 8192,
        observe_wait: Callable[[float], None] | None = None,
        observe_size: Callable[[int], None] | None = None,
        max_in_flight: int | None = None,
        key_headers: Iterable[str] = DEFAULT_KEY_HEADERS,
        lists: ListCheck | None = None,
        neutral_headers: Iterable[str] = (),
    ) -> None:
        self._send = send
        self.key_headers = tuple(name.lower() for name in key_headers)
        # The configured neutral headers (``fingerprint.neutral_headers``): as in the key, two
        # requests that differ only in them share a call (which carries neither's).
        self.neutral_headers = frozenset(name.lower() for name in neutral_headers)
        self.lists = lists
        self.bypassed = 0
        self.alone = 0  # batchable requests/items sent alone, not merged
        self._core: KeyedBatcher[_Item, Any] = KeyedBatcher(
            self._compute,
            max_batch_size=max_batch_size,
            max_batch_delay_s=max_batch_delay_s,
            max_batch_cost=max_batch_tokens,
            max_in_flight=max_in_flight,
            # No request joins a call already sent: identical requests already share one
            # flight above, and a request that comes to the batcher while its item's call runs
            # wants a call of its own: one after an invalidation must not get (and store) the
            # answer of a call begun before it, nor a joiner that timed out on that very call
            # (``coalesce.join_timeout_ms``) wait on it again.
            join_running=False,
            observe_wait=observe_wait,
        )
        self.observe_size = observe_size
        self.batches = 0
        self.items_sent = 0
        self.max_items_seen = 0

    @classmethod
    def from_config(
        cls,
        send: Callable[[UpstreamRequest], Awaitable[UpstreamResponse]],
        config: Any,
        *,
        max_batch_tokens: int = 8192,
        observe_wait: Callable[[float], None] | None = None,
    ) -> EmbeddingBatcher:
        """From a ``BatchingConfig`` (``max_batch_size``, ``max_batch_delay_ms``)."""
        return cls(
            send,
            max_batch_size=config.max_batch_size,
            max_batch_delay_s=config.max_batch_delay_ms / 1000,
            max_batch_tokens=getattr(config, "max_batch_tokens", max_batch_tokens),
            observe_wait=observe_wait,
        )

    @property
    def requests(self) -> int:
        return self._core.requests

    def _sending(self, items: int) -> None:
        """Counts one call of ``items`` items (the module's contract: ``batches``...)."""
        self.batches += 1
        self.items_sent += items
        self.max_items_seen = max(self.max_items_seen, items)
        if self.observe_size is not None:
            self.observe_size(items)

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "items_sent": self.items_sent,
            "requests": self.requests,
            "max_items_seen": self.max_items_seen,
            "bypassed": self.bypassed,
            "alone": self.alone,
            **({"lists": self.lists.stats()} if self.lists is not None else {}),
        }

    async def wait_idle(self) -> None:
        """Wait until every batch and every list probe started so far has finished."""
        await self._core.wait_idle()
        if self.lists is not None:
            await self.lists.wait_idle()

    def flush(self) -> None:
        """The gateway is stopping: send the requests waiting in a batch now, and let none wait
        for more from now on (``KeyedBatcher.flush``): a batch's delay may well be longer than
        the grace period its requests have left."""
        self._core.flush()

    async def aclose(self) -> None:
        """Cancel the list probes still running (before the upstreams close)."""
        if self.lists is not None:
            await self.lists.aclose()

    def _plan(
        self, request: UpstreamRequest
    ) -> tuple[Hashable, str | tuple[int, ...], bytes] | None:
        """(group, item, slot) of a batchable request, else None: ``slot`` a digest of the
        request as it goes alone (the module's contract: identical requests share a slot)."""
        path = "/" + request.path.lstrip("/")
        if path.startswith("/v1/"):
            path = path[3:]
        body = request.body
        if request.stream or path != "/embeddings" or not isinstance(body, Mapping):
            return None
        if body.get("stream") or not isinstance(body.get("model"), str):
            return None
        item = _single_item(body.get("input"))
        if item is None:
            return None
        rest = {k: v for k, v in body.items() if k not in ("input", "user")}
        try:
            template = orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)
            # What of the request, sent alone, may differ from another's of the group (whose
            # query and headers that might change the answer are the group's): its path as
            # it came, and its body as sent, ``user`` included.
            slot = hashlib.blake2b(orjson.dumps([request.path, body]), digest_size=16).digest()
        except TypeError:
            return None
        lowered = {k.lower(): v for k, v in request.headers.items()}
        # The credentials, and every forwarded header that might change the answer: the merged
        # call carries them, so only requests that agree on them share it. (None that the
        # request's ``Connection`` names: hop-by-hop, never forwarded.)
        listed = connection_listed(lowered)
        identity = tuple(
            (name, lowered[name])
            for name in self.key_headers
            if name in lowered and name not in listed
        ) + varying_headers(lowered, self.key_headers, self.neutral_headers)
        # The item's kind too: texts and token lists never share a list (``input`` is a list of
        # texts or a list of token lists, never both: engines refuse a mixed one, 400).
        kind = "text" if isinstance(item, str) else "tokens"
        return (path, identity, template, request.query, kind), item, slot

    async def embed(self, request: UpstreamRequest) -> UpstreamResponse:
        plan = self._plan(request)
        if plan is None:
            self.bypassed += 1
            return await self._send(request)
        group, item, slot = plan
        if self.lists is not None and self.lists.verdict(group) is False:
            # Known unsafe to merge: not even buffered, sent as the client sent it.
            self.alone += 1
            self._sending(1)
            return await self._send(request)
        # One slot per body as it would go alone, not per item: a slot sent alone is sent as its
        # first caller sent it, and no caller may get the answer to another's ``user`` (a
        # refusal of it, quoting it, labelled as a refusal of the caller's own body).
        key = (type(item).__name__, item, slot)
        try:
            # The request rides with its item: sent alone, the item is sent as it came.
            result = await self._core.submit(group, key, (item, request), approx_tokens(item))
        except _BatchFailed as failed:
            return UpstreamResponse(failed.status, failed.headers, failed.body)
        return cast(UpstreamResponse, result)

    async def _compute(
        self, group: Any, items: list[_Item]
    ) -> Sequence[UpstreamResponse | asyncio.Future[UpstreamResponse]]:
        if len(items) == 1 or (self.lists is not None and self.lists.verdict(group) is not True):
            if len(items) > 1 and self.lists is not None:
                self.lists.probe(group)  # in the background: these go alone now
            return self._alone(items)
        values = [value for value, _ in items]
        async with self._call(group, [_value(value) for value in values]) as (response, body):
            if 200 <= response.status < 300:
                split = self._split(response, values, body["model"])
                if split is not None:
                    return [UpstreamResponse(200, headers, answer) for answer, headers in split]
            elif response.status in _NOT_AN_ITEM:
                raise _BatchFailed(response.status, response.headers, response.body)
        # Refused, maybe for one item (engines refuse a whole list for one), or answered with
        # an error beside the data, or not one vector per item in order (whose item's, it
        # does not say): each item alone, so that each caller gets the engine's own answer.
        return self._alone(items)

    def _alone(self, items: list[_Item]) -> list[asyncio.Future[UpstreamResponse]]:
        """Each item in a call of its own, concurrently: a task per item, whose result (or
        exception) is that item's callers' only, cancelled when they have all left (the
        scheduler's contract), the other items' calls going on."""
        return [asyncio.ensure_future(self._one(request)) for _, request in items]

    async def _one(self, request: UpstreamRequest) -> UpstreamResponse:
        """One item in a call of its own: its request as its client sent it (its body, ``user``
        included, and every header forwarded: nothing in it is another caller's), and the
        upstream's answer to it, as it came."""
        # Counted here, as it is sent: the task of an item whose callers have all left is
        # cancelled before it starts (``KeyedBatcher``), and that call is never made.
        self.alone += 1
        self._sending(1)
        response = await self._send(request)
        try:
            if response.streaming:
                raise UpstreamAnswerUnreadable(
                    "the upstream answered an embeddings call with a stream"
                )
            if not 200 <= response.status < 300:
                return UpstreamResponse(response.status, response.headers, response.body)
            return UpstreamResponse(response.status, _answer_headers(response), response.body)
        finally:
            await response.aclose()

    @contextlib.asynccontextmanager
    async def _call(
        self,
        group: Any,
        value: Any,
    ) -> AsyncIterator[tuple[UpstreamResponse, dict[str, Any]]]:
        """The group's embeddings call with ``value`` as its input: the upstream's (non-stream)
        response and the body sent; the response is closed on the way out."""
        path, identity, template, query, _kind = group
        body = exact_json.loads(template)
        body["input"] = value
        self._sending(len(value))
        response = await self._send(UpstreamRequest(path, body, dict(identity), False, query))
        try:
            if response.streaming:
                raise UpstreamAnswerUnreadable(
                    "the upstream answered an embeddings call with a stream"
                )
            yield response, body
        finally:
            await response.aclose()

    @staticmethod
    def _split(
        response: UpstreamResponse, items: list[str | tuple[int, ...]], model: str
    ) -> list[tuple[bytes, dict[str, str]]] | None:
        """Each item's own answer from a merged call's 2xx answer; None (each item then goes
        alone) when it reports an error (a non-null top-level ``error``), whatever else it
        holds, or is not one usable embedding per item indexed 0..n-1 (each non-empty, all
        of one length and type, as a stored answer's: ``completeness``); an
        ``UpstreamAnswerUnreadable`` when it is not JSON at all. (JSON but for a number JSON
        has not, ``NaN``, ``Infinity``, ``1e999``, which a Python ``json.dumps`` engine writes
        for one item's vector, is that item's fault: each goes alone, and only its caller gets
        its 502.)"""
        try:
            parsed = exact_json.loads(response.body)
        except orjson.JSONDecodeError as exc:
            if _json_but_for_its_numbers(response.body):
                return None
            raise UpstreamAnswerUnreadable(
                f"the upstream's embeddings answer for {len(items)} inputs is not JSON"
            ) from exc
        if isinstance(parsed, dict) and parsed.get("error") is not None:
            # No success (``completeness.is_complete``), and not every caller's: rebuilt
            # from ``data`` alone, it would lose the error and be stored as complete.
            return None
        # An input left out, or two answered as one index, or no ``data`` list of indexed
        # embeddings: which vector is whose is not known, and each alone is answered by the
        # engine itself.
        data = rows_in_order(parsed.get("data") if isinstance(parsed, dict) else None, len(items))
        if data is None:
            return None
        try:
            embeddings = [row["embedding"] for row in data]
        except (KeyError, TypeError):
            return None
        if not sound_vectors(embeddings):
            # A null, empty or short vector, or one of another type than the rest, in a 2xx
            # (as stored answers are judged, ``completeness``): the list answer is broken, not
            # an answer to serve the item's client; alone, the engine answers it itself.
            return None
        weights = [approx_tokens(item) for item in items]
        usage = parsed.get("usage") if isinstance(parsed.get("usage"), dict) else {}
        # Only what the upstream reported is shared out: a figure it did not give is not made up.
        shares = {
            name: _apportion(value, weights)
            for name in ("prompt_tokens", "total_tokens")
            if type(value := usage.get(name)) is int and value >= 0
        }
        model_name = parsed.get("model") if isinstance(parsed.get("model"), str) else model
        headers = _answer_headers(response)
        out = []
        for i, embedding in enumerate(embeddings):
            answer: dict[str, Any] = {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
                "model": model_name,
            }
            if shares:
                # Marked, last (``answer.APPORTIONED``): an estimate, not the engine's count
                # for this input; the mark rides in the body so that every copy keeps it.
                answer["usage"] = {
                    **{name: values[i] for name, values in shares.items()},
                    "apportioned": True,
                }
            out.append((orjson.dumps(answer), headers))
        return out


def _value(item: str | tuple[int, ...]) -> str | list[int]:
    return item if isinstance(item, str) else list(item)


def _answer_headers(response: UpstreamResponse) -> dict[str, str]:
    """The upstream's headers for a JSON answer we send as bytes: framing ones dropped."""
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in _DROPPED_RESPONSE_HEADERS
    }
    headers["content-type"] = "application/json"
    return headers


# Digits of the largest double's integer part (1.8e308): an integer of more is past any double.
_DOUBLE_DIGITS = 309


def _json_but_for_its_numbers(body: bytes) -> bool:
    """Whether ``body`` is a JSON object in UTF-8 but for a number JSON has not: ``NaN``,
    ``Infinity``, one past a double (``EmbeddingBatcher._split``). Not one that is no JSON for
    another reason (a byte order mark, UTF-16, a lone surrogate), which Python's reader takes
    too: no item's fault."""
    seen = False

    def constant(name: str) -> float:
        nonlocal seen
        seen = True
        return math.nan

    def number(text: str) -> float:
        nonlocal seen
        value = float(text)
        seen = seen or math.isinf(value)
        return value

    def integer(text: str) -> int | float:
        nonlocal seen
        if len(text.lstrip("-")) > _DOUBLE_DIGITS:
            # Past any double (``1`` and 400 zeros), and maybe past what ``int()`` reads at all
            # (4,300 digits): never converted.
            seen = True
            return math.inf
        value = int(text)
        if abs(value) > sys.float_info.max:
            seen = True
        return value

    try:
        parsed = json.loads(
            body.decode("utf-8"), parse_constant=constant, parse_float=number, parse_int=integer
        )
    except (ValueError, RecursionError):
        return False
    return seen and isinstance(parsed, dict)
