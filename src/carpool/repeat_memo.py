"""The repeat memo: byte-identical repeats skip parsing and the canonical form.

Contract:
- The memo key is every input of ``fingerprint`` that is not configuration: the endpoint, the
  query string, the body's bytes themselves, the value of each header that ``parse_controls``
  and ``requester`` read and the forwarded headers in the key (``varying_headers``; ``neutral``:
  the configured ``fingerprint.neutral_headers``, left out as the key leaves them), and whether
  it carries an ``Origin`` (neutral, but a Messages request's scope marks it). Equal memo
  keys therefore mean equal fingerprints, exactly (no digest of the body, so no collision is
  possible), except for the one input that changes over time, whether the upstream accepts the
  requester: a repeat in a shared namespace carries its requester (``shared_by``) to be
  checked again.
- Remembered only for a request that parsed, is shareable and may read the cache; a request
  carrying an ``Idempotency-Key`` has no memo key (its record must be consulted first), nor
  has one with a ``Content-Encoding`` (not forwarded, so not in the key: ``request.parse``
  must judge its coding, or a plain body labelled gzip was served as its twin's hit).
- Bounded by ``max_bytes``, counting each entry's body, header values and a fixed overhead
  (oldest out first: ``carpool.lru``, a look does not refresh); bodies over ``max_body`` bytes and header values over
  ``MAX_MEMO_HEADERS`` bytes in all are not remembered. A forgotten repeat costs one parse.
- Its entries are plain tuples of strings, numbers and bytes: the garbage collector stops
  tracking them once it has seen them, so that a full memo adds nothing to its passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from .canonical import IDEMPOTENCY_HEADERS, grant_of, varying_headers
from .lru import LRU, SLOT_BYTES, held
from .request import CONTROL_HEADERS, ClientRequest, Request

if TYPE_CHECKING:
    from .fingerprint import Fingerprint

__all__ = ["MAX_MEMO_HEADERS", "Repeat", "RepeatMemo"]

# Headers whose request has no memo key (module contract): one intersection a request.
_UNREMEMBERED = IDEMPOTENCY_HEADERS | {"content-encoding"}


class Repeat(NamedTuple):
    """What a byte-identical repeat needs to be answered from the exact cache."""

    key: str
    stream: bool
    include_usage: bool
    max_age: float | None  # the reader's bound: Cache-Control max-age and its type's TTL
    # In a shared namespace: (requester, grant), checked against ``AcceptedCredentials`` again.
    shared_by: tuple[str, Any] | None = None


class RepeatMemo:
    """Byte-identical repeats skip parsing and the canonical form: raw request -> ``Repeat``
    (the contract is the module's)."""

    def __init__(
        self,
        tenant_headers: tuple[str, ...],
        max_bytes: int,
        max_body: int = 64 * 1024,
        neutral: frozenset[str] = frozenset(),
    ) -> None:
        self.names = (*CONTROL_HEADERS, *tenant_headers)
        self.tenant_headers = tenant_headers
        # The configured neutral headers (``canonical.neutral_of``), left out as the key does.
        self.neutral = neutral
        self.max_bytes = max_bytes
        self.max_body = max_body
        # Each entry is kept as plain tuples of strings, numbers and bytes, which the garbage
        # collector stops tracking once it has seen them (a level of tuples a pass): the memo's
        # ~20,000 entries (16 MiB) are not walked by every later pass of the older generations
        # (a ``Repeat``, a tuple subclass, would be). ``get`` makes the ``Repeat`` back.
        self._memo: LRU[tuple[Any, ...], tuple[Any, ...]] = LRU(
            max_bytes=max_bytes, size=lambda memo_key, _: _size(memo_key)
        )

    @property
    def bytes(self) -> int:
        return self._memo.bytes

    def __len__(self) -> int:
        return len(self._memo)

    def key_of(self, client: ClientRequest) -> tuple[Any, ...] | None:
        headers = client.headers
        if _UNREMEMBERED & headers.keys() or len(client.body) > self.max_body or not self.max_bytes:
            return None
        return (
            # (Whether it carries an ``Origin``, which is neutral but for a Messages request's
            # scope: ``canonical.scope``. Marked on the path, a string no header sum counts.)
            client.path if "origin" not in headers else client.path + "\norigin",
            client.body,
            client.query,
            varying_headers(headers, self.tenant_headers, self.neutral),
            *map(headers.get, self.names),
        )

    def get(self, memo_key: tuple[Any, ...]) -> Repeat | None:
        kept = self._memo.peek(memo_key)
        return None if kept is None else Repeat._make(kept)

    def remember(
        self, memo_key: tuple[Any, ...], request: Request, key: Fingerprint, max_age: float | None
    ) -> None:
        """``max_age``: the oldest answer the request accepts (its max-age and its type's TTL)."""
        if (
            key.key is None
            or not request.controls.may_read
            or memo_key in self._memo
            or (max_age is not None and max_age <= 0)
            or key.shared_key is not None
        ):
            return  # (a requester not yet accepted: its key will change)
        # The body kept is a copy of exactly its length: one built by orjson.dumps (the library
        # API's ``Gateway.request``) has a 4 KB buffer whatever its length, which ``bytes``
        # (its len) would not count.
        memo_key = (memo_key[0], bytes(memoryview(memo_key[1])), *memo_key[2:])
        if _header_bytes(memo_key) > MAX_MEMO_HEADERS:
            return  # a large credential or cache-control: not worth its room
        self._memo.put(
            memo_key,
            (
                key.key,
                request.stream,
                request.include_usage,
                max_age,
                (key.owner, grant_of(request, self.tenant_headers, self.neutral))
                if key.tenant == "*"
                else None,
            ),
        )


MAX_MEMO_HEADERS = 4096
# The key tuple and the Repeat, roughly, and the entry's place in the LRU (bytes).
_ENTRY_OVERHEAD = 400 + SLOT_BYTES


def _header_bytes(memo_key: tuple[Any, ...]) -> int:
    return sum(len(value) for value in memo_key[4:] if value) + sum(
        len(name) + len(value) for name, value in memo_key[3]
    )


def _size(memo_key: tuple[Any, ...]) -> int:
    # The headers as the memo holds them (``lru.held``): each pair a tuple of two strings, ~170
    # bytes for a short one, not its characters' count (40 forwarded headers held ~6x the budget).
    headers = memo_key[3]
    objects = [headers, *memo_key[4:]]
    for pair in headers:
        objects += (pair, *pair)
    return _ENTRY_OVERHEAD + len(memo_key[1]) + len(memo_key[2]) + held(*objects)
