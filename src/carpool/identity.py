"""Who is asking: the tenant of a request, from every credential it presents.

Contract (CONTRACT.md "Tenants"; docs/security.md):
- The tenant is a digest of the values of *every* credential header the client sent, by name:
  ``Authorization`` (OpenAI, vLLM, SGLang...), ``api-key`` (Azure OpenAI), ``x-api-key``
  (Anthropic-style), ``OpenAI-Organization``, ``OpenAI-Project``, ``x-goog-api-key`` and
  Cloudflare's gateway and access tokens by default
  (``tenant.header`` plus ``tenant.credential_headers``). Two requests are the same tenant only if
  they present the same value for each of them, and the same absent ones: a wrong ``api-key``
  beside no ``Authorization`` is not the tenant of a right one. The digest is one-way and
  truncated (BLAKE2b, 8 bytes, with a ``person`` string that only separates it from carpool's
  other digests), not keyed: whoever holds a credential can compute its tenant id, so the id is
  written to no log line, response or metric, and is not the raw value.
- A client with no credential at all is the tenant ``anonymous``: it shares only with other
  clients that present nothing, which the upstream treats alike.
- ``AcceptedCredentials`` remembers what the upstream has recently answered with a 2xx on a
  cached endpoint: a tenant for one *grant* (the endpoint, the model and the query string, since
  an upstream may give a key one model and not another). In a namespace shared across tenants,
  only a tenant accepted for the request's grant reads what others computed (cache, flights,
  semantic entries); any other request is scoped to its own tenant until the upstream accepts
  it, so a made-up, revoked or under-privileged key never reads anything it was not given. A 401
  or 403 for a tenant forgets every grant of it at once (``refuse``), and a 2xx of a call sent
  before that refusal (``begun``: a long stream that ends after it) accepts nothing: the key may
  have been revoked since the call was sent. Each instance (each worker) accepts by itself, so
  a refusal is told to the others (``on_refused``: the Redis invalidation channel, or the peers'
  door), which take it as ``refused_elsewhere(tenant)``; ``refused_elsewhere(None)`` (a
  subscription that may have missed some) forgets every acceptance. Bounded (``max_entries``,
  oldest out, and at most ``per_tenant`` grants a tenant, so that one key making up query
  strings cannot push the others out) and forgetful (``ttl`` seconds after the last 2xx, on
  ``clock.monotonic()``: the system's unless given another).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Container, Hashable, Iterable, Mapping
from urllib.parse import parse_qsl

from .clock import SYSTEM_CLOCK, Clock
from .lru import LRU

ANONYMOUS_TENANT = "anonymous"
# What an OpenAI-compatible, Azure OpenAI or Anthropic-compatible upstream reads as credentials.
DEFAULT_CREDENTIAL_HEADERS = (
    "authorization",
    "api-key",
    "x-api-key",
    "openai-organization",
    "openai-project",
)


def credential_headers(primary: str, others: Iterable[str]) -> tuple[str, ...]:
    """The lower-case credential header names, the primary one first, without repeats."""
    return tuple(dict.fromkeys(name.lower() for name in (primary, *others)))


# The words of a name that says it carries a secret: a query parameter (``?key=``,
# ``?access_token=``) or a header carpool does not know by name (``x-vendor-api-key``).
_SECRET_WORDS = frozenset(
    "key apikey token secret password passwd auth authorization sig signature session "
    "sessionid credential credentials cookie".split()
)
_WORD = re.compile(r"[a-z0-9]+")
# Cookies that infrastructure sets and changes, never a user's credential: load balancers'
# affinity (AWS ALB/ELB re-issue theirs on every response, so a client with a cookie jar sends
# a new value with each retry), Cloudflare's bot management, analytics. Lower-case names,
# then prefixes.
_INFRASTRUCTURE_COOKIES = frozenset(
    "awsalb awsalbcors awsalbtg awsalbtgcors awselb awselbcors __cf_bm _cfuvid cf_clearance "
    "ingresscookie serverid routeid _ga _gid _gat _fbp _fbc".split()
)
_INFRASTRUCTURE_PREFIXES = ("_ga_", "_gat_", "__utm", "bigipserver")


def _secret_name(name: str) -> bool:
    return any(
        word in _SECRET_WORDS or word.endswith(("key", "token", "secret"))
        for word in _WORD.findall(name.lower())
    )


def names_a_secret(name: str) -> bool:
    """Whether a header or query parameter name says it carries a secret (a key, token,
    secret, signature, session, cookie...): what ``other_credentials`` reads."""
    return _secret_name(name)


def other_credentials(headers: Mapping[str, str], query: str, known: Container[str]) -> str:
    """A digest of the credentials a client presents beside the headers in ``known`` (the
    tenant's, the idempotency key's), "" when none: its cookies (but infrastructure's: a load
    balancer's affinity, analytics), and every query parameter or header whose name says it
    carries a secret. What the idempotency records are scoped by, with the tenant: only
    credentials, so that a retry differing in anything else (a tracing header each attempt sets
    anew, a query parameter, a load balancer's new affinity cookie) meets its first try's
    record, a replay or a 422, never a second run."""
    found = []
    for name, value in headers.items():
        if name in known or not _secret_name(name):
            continue
        if name == "cookie":
            value = user_cookies(value)
        if value:
            found.append((name, value))
    if query:
        found += [(n, v) for n, v in parse_qsl(query, keep_blank_values=True) if _secret_name(n)]
    if not found:
        return ""
    return pairs_digest(sorted(found), b"carpool-others", 8).hexdigest()


def user_cookies(header: str) -> str:
    """A ``Cookie`` header's cookies but infrastructure's, in their order ("": none). Only a
    plain ``name=value`` list is read so: a header with a quote or a comma in it (lines joined
    by another client, a quoted value holding a ";") is kept whole, as sent; a part that is not
    ``name=value`` (``=value``, a bare word) is kept as it is: when unsure, don't share."""
    if '"' in header or "," in header:
        return header
    kept = []
    for pair in header.split(";"):
        part = pair.strip()
        name, equals, _ = part.partition("=")
        name = name.strip().lower()
        infrastructure = name in _INFRASTRUCTURE_COOKIES or name.startswith(
            _INFRASTRUCTURE_PREFIXES
        )
        if part and not (equals and name and infrastructure):
            kept.append(part)
    return "; ".join(kept)


def pairs_digest(pairs: Iterable[tuple[str, str]], person: bytes, size: int) -> hashlib.blake2b:
    """A BLAKE2b of ``pairs`` (header or parameter names and values), each part
    length-prefixed: no choice of values can make two different lists hash the same text.
    The credentials' ids (``tenant_of``, ``other_credentials``) and the batcher's verdicts
    (``batching.lists``) are made so: never the raw credentials."""
    digest = hashlib.blake2b(digest_size=size, person=person)
    for name, value in pairs:
        for part in (name, value):
            data = part.encode("utf-8", "surrogateescape")
            digest.update(len(data).to_bytes(4, "big") + data)
    return digest


def tenant_of(headers: Mapping[str, str], names: Iterable[str]) -> str:
    """A stable, non-reversible id of the credentials in ``headers`` (lower-case names)."""
    # Present with an empty value is presented: the upstream receives it and may refuse it.
    present = [(name, headers[name]) for name in names if name in headers]
    if not present:
        return ANONYMOUS_TENANT
    return pairs_digest(present, b"carpool-tenant", 8).hexdigest()


class AcceptedCredentials:
    """(tenant, grant) pairs the upstream accepted within the last ``ttl`` seconds."""

    def __init__(
        self,
        ttl: float,
        max_entries: int = 100_000,
        per_tenant: int = 64,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.per_tenant = per_tenant
        # (tenant, grant) -> when it was last accepted (monotonic), oldest first
        self._last: LRU[tuple[str, Hashable], float] = LRU(
            max_entries=max_entries,
            expires=lambda accepted: accepted + self.ttl,
            clock=clock,
            on_evict=self._unlist,
        )
        # tenant -> its grants, oldest first (a dict as an ordered set), for ``refuse``
        self._grants: dict[str, dict[Hashable, None]] = {}
        # Refusals numbered in order: tenant -> its last one's number, oldest first, at most
        # ``max_entries``; one pushed out raises ``_floor``, which a tenant not listed is held
        # to (unsure whether it was refused after a call was sent: that call accepts nothing).
        self._refusals = 0
        self._refused: dict[str, int] = {}
        self._floor = 0
        # Told of each refusal seen here (the invalidation channel's or the peers'
        # ``tell_refused``): another instance would accept the key on until ``ttl``.
        self.on_refused: Callable[[str], object] | None = None

    def __len__(self) -> int:
        return len(self._last)

    def begun(self) -> int:
        """What a call sent now passes to ``accept`` once its 2xx came (the refusals so far)."""
        return self._refusals

    def accept(self, tenant: str, grant: Hashable, begun: int | None = None) -> None:
        """The upstream answered ``tenant`` for ``grant`` with a 2xx, on a call sent when
        ``begun`` said so; none accepts if the tenant was refused since (None: sent now)."""
        if begun is not None and begun < self._refused.get(tenant, self._floor):
            return  # (its 2xx says nothing of the credential since it was refused)
        grants = self._grants.setdefault(tenant, {})
        grants.pop(grant, None)
        grants[grant] = None
        # The tenant's own bound first: one tenant's grants never push another tenant out.
        if len(grants) > self.per_tenant:
            self._forget((tenant, next(iter(grants))))
        if grant in self._grants.get(tenant, ()):
            self._last.put((tenant, grant), self._last.now())  # oldest pairs out (``_unlist``)

    def refuse(self, tenant: str) -> None:
        """The upstream refused the tenant's credential (401, 403): it is accepted for nothing,
        nor by a call sent before now (``accept``), here and on every other instance told
        (``on_refused``)."""
        self.refused_elsewhere(tenant)
        if self.on_refused is not None:
            self.on_refused(tenant)

    def refused_elsewhere(self, tenant: str | None) -> None:
        """Another instance saw ``tenant`` refused: as ``refuse``, told to nobody; None: a
        refusal may have been missed (the channel was cut), every tenant is accepted anew."""
        if tenant is None:
            for pair in list(self._last):
                self._forget(pair)
            self._refusals += 1
            self._refused.clear()
            self._floor = self._refusals
            return
        for grant in list(self._grants.get(tenant, ())):
            self._forget((tenant, grant))
        self._refusals += 1
        self._refused.pop(tenant, None)
        self._refused[tenant] = self._refusals
        if len(self._refused) > self.max_entries:
            oldest = next(iter(self._refused))
            self._floor = self._refused.pop(oldest)

    def __contains__(self, pair: object) -> bool:
        return pair in self._last  # an expired pair is forgotten (``_unlist``)

    def _forget(self, pair: tuple[str, Hashable]) -> None:
        self._last.pop(pair)
        self._unlist(pair, 0.0)

    def _unlist(self, pair: tuple[str, Hashable], accepted: float) -> None:
        """Drop ``pair`` from its tenant's grants (it has left ``_last``)."""
        tenant, grant = pair
        grants = self._grants.get(tenant)
        if grants is not None:
            grants.pop(grant, None)
            if not grants:
                del self._grants[tenant]
