"""Which replica holds a stored response, file or batch: follow-up calls go where it is.

vLLM and SGLang keep the responses they make (Responses API, ``store`` true, the default) in
their own process. Only the replica that made a response can answer for it: ``GET
/v1/responses/{id}`` and the other ``/v1/responses/{id}/...`` calls (``input_items``,
``cancel``, ``DELETE``), and ``POST /v1/responses`` with ``previous_response_id``; any other
replica answers 404. A chat completion asked with ``store: true`` is kept alike by an upstream
that keeps them (OpenAI), under its answer's ``id``: ``GET``/``POST``/``DELETE
/v1/chat/completions/{id}`` and ``.../messages`` (``apis.openai``); followed the same way. The
routing policies know nothing of it (cache-aware and least-loaded even send a follow-up to the
other replica as a rule: it is the less loaded one). SGLang keeps the files uploaded to it
(``/v1/files``) and the batches made of them (``/v1/batches``, whose output and error files it
makes) in its own process too: ``/files/{id}`` (``.../content``, ``DELETE``),
``/batches/{id}`` (``.../cancel``) and a ``POST /v1/batches`` naming an ``input_file_id`` are
followed alike. So:

- ``StateHolders.remember(tenant, id, replica)``: the exchange (``exchange.send``) tells it which
  replica made each response, from the answer itself, before a client sees it: a whole body's
  ``id``, a stream's first event carrying the response (``response.created``); not one made with
  ``store: false`` (nothing is kept), nor a chat completion without ``store: true``
  (``Api.keeps_state``). Only where there is a choice (``ReplicaSet.chooses``). Pass-through
  (``Gateway.passthrough``) tells it the ids a 2xx answer of ``POST /files``, ``POST
  /batches`` or ``/batches/{id}...`` names (``answer_names``: its ``id``, a batch's
  ``input_file_id``, ``output_file_id``, ``error_file_id``), read as the answer is relayed
  (``learning``) and remembered before its last piece goes to the client; an answer that is
  not a JSON object within ``MAX_LEARNED`` bytes (a list, a compressed body) teaches nothing.
- ``StateHolders.holder(tenant, id)``: the replica that made ``id``, or None. A request that
  continues a response (``Api.state_continued``) and a pass-through call on one (``path_state``)
  are sent there by ``ReplicaSet`` (``Decision.STATE_HOLDER``), in back-off too (a probe),
  and never failed over: any other replica would answer a false, final 404, so the holder's
  failure is the request's (its 5xx, a 502 or 504), which the client's retry sends to it
  again. When it is unknown, the policy chooses as for any other request (and the replica
  chosen answers what it knows: a 404).
- Keyed by (tenant, id): an id routes only the requests of the tenant whose call made it;
  another tenant naming it is routed by the policy, as for an id unknown.
- Bounded: ``max_entries`` (``routing.state_entries``), shared fairly between tenants, as the
  idempotency records are (``idempotency.finished``): beyond it, the least recently made or
  named of all goes, unless its tenant holds fewer than its share (``max_entries //
  tenants``); then the least recently made or named of the tenant holding the most goes. So
  a tenant making more responses than the others forgets its own, never a quieter tenant's
  (whose follow-ups would go where the policy says: a false 404); tenants of an entry each
  (made-up keys) are each at their share, forgotten no sooner than in one plain LRU. ~260
  bytes an entry (measured full and churned, ids of vLLM's length), ~740 where each is its
  own tenant's (the tenant's count and rank). In this process only: a response made
  through another worker of ``--workers N`` or another gateway instance is unknown here, and
  routes by the policy (as does one forgotten). A cached answer needs nothing: its response
  was remembered when the upstream made it, if here.
- ``path_state(path)``: the stored object a pass-through path is about (``/responses/{id}``,
  ``/chat/completions/{id}``, ``/files/{id}``, ``/batches/{id}`` and below);
  ``posted_state(method, path, body)``: the one a pass-through body names (a ``POST /batches``'s
  ``input_file_id``). ``path_changed(method, path)``: the one a
  pass-through ``DELETE /responses/{id}``, ``DELETE /chat/completions/{id}`` or ``DELETE
  /files/{id}`` (OpenAI's and Anthropic's Files API alike) deletes, or a ``POST
  /chat/completions/{id}`` changes (its metadata, in a stored completion's key); once the upstream said
  2xx, the gateway drops the cached answers that are or continue it, or whose request names
  the file, in the deleter's tenant (``Gateway.passthrough``, ``state_tag``). (One namespace
  of ids for all three: each is the upstream's own, ``resp_...``, ``chatcmpl-...``,
  ``file-...``/``file_...``.)
- The Conversations API (``/v1/conversations``, ``conversation``) is not followed: neither
  vLLM nor SGLang serves it, and OpenAI has one store behind one endpoint. Nor are the lists
  (``GET /files``, ``GET /batches``): each replica lists its own, the policy chooses which.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable
from urllib.parse import unquote

import orjson

from carpool.idempotency.finished import Finished, by_count

__all__ = [
    "StateHolders",
    "answer_names",
    "learning",
    "path_changed",
    "path_state",
    "posted_state",
]

# Most responses remembered by default (``routing.state_entries``).
DEFAULT_ENTRIES = 100_000


class StateHolders:
    """(tenant, id) -> the name of the replica that made it; beyond the bound, the least
    recently made or named of the tenant over its share out first (the module's contract)."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        # One string a key (a tuple would cost another object an entry), its tenant before the
        # line feed as ``Finished`` reads it: a tenant is hex digits or "anonymous". Values:
        # the replicas' own name strings.
        self._held: Finished[str] = by_count(max_entries)

    def remember(self, tenant: str, state_id: str, replica: str) -> None:
        self._held.put(f"{tenant}\n{state_id}", replica)

    def holder(self, tenant: str, state_id: str | None) -> str | None:
        """The replica that made ``state_id`` for ``tenant``, if known (the most recently
        named now)."""
        if not state_id:
            return None
        key = f"{tenant}\n{state_id}"
        replica = self._held.pop(key)
        if replica is not None:
            self._held.put(key, replica)  # (``Finished`` moves none on a read)
        return replica

    def __len__(self) -> int:
        return len(self._held)


# The pass-through paths under which a stored object's id comes first: those whose objects
# cached answers may be, continue or name (a file: ``path_changed``), and all those followed.
_STORED = ("/responses/", "/chat/completions/", "/files/")
_KEPT = (*_STORED, "/batches/")
# What a kept object's answer names, each kept where it answered (``learning``).
_NAMED = ("id", "input_file_id", "output_file_id", "error_file_id")
# The most bytes of an answer read for its ids: a file or batch object is well under 2 KiB.
MAX_LEARNED = 64 * 1024
_SPACES = b" \t\r\n"  # JSON's whitespace


def _after_id(path: str, prefixes: tuple[str, ...] = _STORED) -> tuple[str, str | None] | None:
    """(the id segment, what follows it or None) of a path under ``prefixes``; else None."""
    for prefix in prefixes:
        if path.startswith(prefix):
            segment, *rest = path[len(prefix) :].split("/", 1)
            return segment, rest[0] if rest else None
    return None


def path_state(path: str) -> str | None:
    """The stored object a pass-through ``path`` (relative to ``/v1``, as ``paths.confine``
    gives it) is about: ``/responses/{id}``, ``/chat/completions/{id}``, ``/files/{id}``,
    ``/batches/{id}`` and below, or None."""
    if (named := _after_id(path, _KEPT)) is None:
        return None
    return unquote(named[0]) or None


def reads_body(method: str, path: str) -> bool:
    """Whether routing reads a pass-through call's body (``posted_state``): the server reads it
    whole then, every other one going to the upstream as it comes (``inbound.read_upload``)."""
    return method == "POST" and path == "/batches"


def posted_state(method: str, path: str, body: bytes | AsyncIterable[bytes]) -> str | None:
    """The kept object a pass-through call's body names: a ``POST /batches``'s
    ``input_file_id`` (the file it is made of, on the replica that keeps it), or None."""
    if not reads_body(method, path) or not isinstance(body, bytes):
        return None
    try:
        asked = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # (the replica says what is wrong with it)
    named = asked.get("input_file_id") if isinstance(asked, dict) else None
    return named if isinstance(named, str) and named else None


def answer_names(method: str, path: str) -> bool:
    """Whether a pass-through call's 2xx answer names objects its replica keeps: a file
    uploaded (``POST /files``), a batch made (``POST /batches``) or looked at (``/batches/{id}``
    and below: its output and error files, made there)."""
    return (method == "POST" and path in ("/files", "/batches")) or (path.startswith("/batches/"))


async def learning(
    body: AsyncIterator[bytes], remember: Callable[[str], None]
) -> AsyncIterator[bytes]:
    """``body`` as it comes, each id its JSON object names (``_NAMED``) given to ``remember``
    once the object is whole, before the piece that completed it is passed on: a client that
    has the whole answer asks after the id only once it routes. An answer not a JSON object
    within ``MAX_LEARNED`` bytes names nothing. ``body`` is closed however this ends."""
    seen = bytearray()
    learned = False  # done with it: its ids remembered, or it names none
    opened = False  # whether a byte but JSON's spaces has come
    closed = False  # whether the last such byte is "}": only then can an object be whole
    try:
        async for piece in body:
            if not learned:
                seen += piece
                if tail := piece.rstrip(_SPACES):
                    learned = not opened and not tail.lstrip(_SPACES).startswith(b"{")
                    opened, closed = True, tail.endswith(b"}")
                learned = learned or len(seen) > MAX_LEARNED
                # Parsed only when it can be whole: once per piece was quadratic in its size.
                if not learned and closed:
                    try:
                        answer = orjson.loads(seen)
                    except orjson.JSONDecodeError:
                        pass  # (not whole yet)
                    else:
                        learned = True
                        if isinstance(answer, dict):
                            for name in _NAMED:
                                if isinstance(named := answer.get(name), str) and named:
                                    remember(named)
            yield piece
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()


def path_changed(method: str, path: str) -> str | None:
    """The stored object a pass-through call deletes (``DELETE /responses/{id}``, ``DELETE
    /chat/completions/{id}``, ``DELETE /files/{id}``) or changes (``POST
    /chat/completions/{id}``: its metadata, which a stored completion's key holds), or None."""
    if (named := _after_id(path)) is None or named[1]:
        return None
    if method != "DELETE" and not (method == "POST" and path.startswith("/chat/completions/")):
        return None
    return unquote(named[0]) or None
