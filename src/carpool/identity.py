"""Who is asking: the tenant of a request, from every credential it presents.

Contract (CONTRACT.md "Tenants"; README "What is shared with whom"):
- The tenant is a digest of the values of *every* credential header the client sent, by name:
  ``Authorization`` (OpenAI, vLLM, SGLang...), ``api-key`` (Azure OpenAI), ``x-api-key``
  (Anthropic-style), ``OpenAI-Organization`` and ``OpenAI-Project`` by default
  (``tenant.header`` plus ``tenant.credential_headers``). Two requests are the same tenant only if
  they present the same value for each of them, and the same absent ones: a wrong ``api-key``
  beside no ``Authorization`` is not the tenant of a right one. The digest is keyed and
  truncated; the raw value is never stored or shown.
- A client with no credential at all is the tenant ``anonymous``: it shares only with other
  clients that present nothing, which the upstream treats alike.
- ``AcceptedCredentials`` remembers the tenants the upstream has recently answered with a 2xx on
  a cached endpoint. In a namespace shared across tenants, only such a tenant reads what others
  computed (cache, flights, semantic entries); any other request is scoped to its own tenant
  until the upstream accepts it, so a made-up key never reads anything it was not given.
  Bounded (``max_entries``, oldest out) and forgetful (``ttl`` seconds after the last 2xx).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

ANONYMOUS_TENANT = "anonymous"
# What an OpenAI-compatible, Azure OpenAI or Anthropic-compatible upstream reads as credentials.
DEFAULT_CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key", "openai-organization",
                              "openai-project")


def credential_headers(primary: str, others: Iterable[str]) -> tuple[str, ...]:
    """The lower-case credential header names, the primary one first, without repeats."""
    return tuple(dict.fromkeys(name.lower() for name in (primary, *others)))


def tenant_of(headers: Mapping[str, str], names: Iterable[str]) -> str:
    """A stable, non-reversible id of the credentials in ``headers`` (lower-case names)."""
    present = [(name, headers[name]) for name in names if headers.get(name)]
    if not present:
        return ANONYMOUS_TENANT
    digest = hashlib.blake2b(digest_size=8, person=b"carpool-tenant")
    for name, value in present:
        # Length-prefixed: no choice of values can make two different sets hash the same text.
        for part in (name, value):
            data = part.encode("utf-8", "surrogateescape")
            digest.update(len(data).to_bytes(4, "big") + data)
    return digest.hexdigest()


class AcceptedCredentials:
    """Tenants whose credentials the upstream accepted within the last ``ttl`` seconds."""

    def __init__(self, ttl: float, max_entries: int = 100_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._last: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def accept(self, tenant: str) -> None:
        self._last[tenant] = time.monotonic()
        self._last.move_to_end(tenant)
        while len(self._last) > self.max_entries:
            self._last.popitem(last=False)

    def __contains__(self, tenant: object) -> bool:
        seen = self._last.get(tenant)  # type: ignore[call-overload]
        if seen is None:
            return False
        if time.monotonic() - seen >= self.ttl:
            del self._last[tenant]     # type: ignore[arg-type]
            return False
        return True
