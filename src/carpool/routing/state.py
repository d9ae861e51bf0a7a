"""Which replica holds a stored response: follow-up calls go where the state is.

vLLM and SGLang keep the responses they make (Responses API, ``store`` true, the default) in
their own process. Only the replica that made a response can answer for it: ``GET
/v1/responses/{id}`` and the other ``/v1/responses/{id}/...`` calls (``input_items``,
``cancel``, ``DELETE``), and ``POST /v1/responses`` with ``previous_response_id``; any other
replica answers 404. The routing policies know nothing of it (cache-aware and least-loaded even
send a follow-up to the other replica as a rule: it is the less loaded one). So:

- ``StateHolders.remember(tenant, id, replica)``: the exchange (``exchange.send``) tells it which
  replica made each response, from the answer itself, before a client sees it: a whole body's
  ``id``, a stream's first event carrying the response (``response.created``); not one made with
  ``store: false`` (nothing is kept). Only where there is a choice (``ReplicaSet.chooses``).
- ``StateHolders.holder(tenant, id)``: the replica that made ``id``, or None. A request that
  continues a response (``Api.state_continued``) and a pass-through call on one (``path_state``)
  are sent there by ``ReplicaSet`` when it is eligible (``Decision.STATE_HOLDER``); when it is
  unknown or in back-off, the policy chooses as for any other request (and the replica chosen
  answers what it knows: a 404).
- Keyed by (tenant, id): an id routes only the requests of the tenant whose call made it;
  another tenant naming it is routed by the policy, as for an id unknown.
- Bounded: ``max_entries`` (``routing.state_entries``), the least recently made or named out
  first, at most ~250 bytes an entry (~145 measured). In this process only: a response made
  through another worker of ``--workers N`` or another gateway instance is unknown here, and
  routes by the policy (as does one forgotten). A cached answer needs nothing: its response
  was remembered when the upstream made it, if here.
- ``path_deleted(method, path)``: the stored response a pass-through ``DELETE
  /responses/{id}`` deletes; once the upstream said 2xx, the gateway drops the cached answers
  that are or continue it, in the deleter's tenant (``Gateway.passthrough``, ``state_tag``).
- The Conversations API (``/v1/conversations``, ``conversation``) is not followed: conversations
  are made by pass-through calls, whose replica this does not learn; neither vLLM nor SGLang
  serves it, and OpenAI has one store behind one endpoint.
"""

from __future__ import annotations

from urllib.parse import unquote

from carpool.lru import LRU

__all__ = ["StateHolders", "path_deleted", "path_state"]

# Most responses remembered by default (``routing.state_entries``).
DEFAULT_ENTRIES = 100_000


class StateHolders:
    """(tenant, id) -> the name of the replica that made it, least recently used out first."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        # One string a key (a tuple would cost another object an entry); the separator cannot
        # be in a tenant (hex digits or "anonymous"). Values: the replicas' own name strings.
        self._held: LRU[str, str] = LRU(max_entries=max_entries)

    def remember(self, tenant: str, state_id: str, replica: str) -> None:
        self._held.put(f"{tenant} {state_id}", replica)

    def holder(self, tenant: str, state_id: str | None) -> str | None:
        """The replica that made ``state_id`` for ``tenant``, if known."""
        if not state_id:
            return None
        return self._held.get(f"{tenant} {state_id}")

    def __len__(self) -> int:
        return len(self._held)


def path_state(path: str) -> str | None:
    """The stored response a pass-through ``path`` (relative to ``/v1``, as ``paths.confine``
    gives it) is about: ``/responses/{id}`` and below, or None."""
    if not path.startswith("/responses/"):
        return None
    segment = path[len("/responses/") :].split("/", 1)[0]
    return unquote(segment) or None


def path_deleted(method: str, path: str) -> str | None:
    """The stored response a pass-through call deletes (``DELETE /responses/{id}``), or None."""
    if method != "DELETE" or (state := path_state(path)) is None:
        return None
    rest = path[len("/responses/") :].split("/", 1)
    return state if len(rest) == 1 or rest[1] == "" else None
