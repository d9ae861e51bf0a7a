"""The request fingerprint: what makes two requests "identical", and whether they may share at all.

The key is the digest of the request's canonical form (:mod:`carpool.canonical`: which fields and
headers are in it, and how they are spelled); this module decides the scope it is taken in and
whether a request gets a key at all. The semantic cache's view of a request is
:mod:`carpool.semantic.view`, the memo of byte-identical repeats :mod:`carpool.repeat_memo`; both
are re-exported here, as is the canonical form's API.

Contract (CONTRACT.md "Request fingerprint", "Sampling policy", "Tenants"; what is included in
the key and how it is spelled: :mod:`carpool.canonical`):
- Scoped: the tenant (``identity.tenant_of``: a digest of every credential header, never the raw
  value), the namespace, the freshness token, the request type (``x-carpool-type``: it picks
  what may be stored and for how long) and the query string (Azure's ``api-version``...) are part
  of the key, so no answer crosses them, cached or in flight. So is every other request header
  that reaches the upstream and might change its answer (``OpenAI-Beta``, a deployment
  selector...): all forwarded headers but the ``NEUTRAL_HEADERS`` of transport, tracing,
  client telemetry and hosting platforms' request ids and client addresses, and those named in
  ``fingerprint.neutral_headers`` (``varying_headers``). So are the settings of the instance
  that change the answer or who may get it (a held upstream credential, white space collapsed,
  the neutral headers: ``canonical.scope``), so that instances whose configs differ in them
  share none of those keys. A namespace listed in
  ``tenant.shared_namespaces`` drops the tenant from the scope (``tenant`` is ``*``), but only
  for a tenant ``accepted`` for the request's grant (the upstream answered it recently for
  this endpoint, model and query string): any other is scoped to itself. A request naming
  state the upstream keeps for one account (``Api.tenant_bound``: a stored answer, a file, an
  earlier response, a chat's audio) is scoped to its tenant even there. ``owner`` is always the requester's
  tenant, which
  scopes what is never shared (idempotency records).
- Sampling: a request is shareable when its output is deterministic: ``temperature`` 0, ``top_k``
  1, or a ``seed`` (``Api.deterministic``). An absent temperature is the upstream's default, which
  samples (Anthropic's default is 1). A request whose API says it never shares
  (``Api.never_shared``: Responses' ``background`` and ``conversation``, the tools an upstream
  runs itself, chat's live searches: ``apis.openai.ChatApi.never_shared``) bypasses whatever the
  controls say. Sampled requests
  get no key (``bypass``) unless the config says ``sampling: same-params`` or the request sends
  ``x-carpool-share: sampled``; then they share only with identical parameters, which the key
  already guarantees. Embeddings are always deterministic.
- The key is a 32-hex-digit BLAKE2b digest: no input can collide with another by construction of
  its text, or inject anything into a store key.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from .apis.base import is_deterministic
from .canonical import (
    EXCLUDED_BY_KIND,
    EXCLUDED_FIELDS,
    IDEMPOTENCY_HEADERS,
    KEY_VERSION,
    NEUTRAL_HEADERS,
    NEUTRAL_PREFIXES,
    canonical_body,
    collapses,
    digest,
    grant_of,
    names_of,
    neutral_of,
    normalize_text,
    requester,
    varying_headers,
)
from .config import Config
from .identity import ANONYMOUS_TENANT
from .repeat_memo import MAX_MEMO_HEADERS, Repeat, RepeatMemo
from .request import Request
from .semantic.view import INSTRUCTION_ROLES, SemanticView, conversation, readable, semantic_view

__all__ = [
    "ANONYMOUS_TENANT",
    "EXCLUDED_BY_KIND",
    "EXCLUDED_FIELDS",
    "IDEMPOTENCY_HEADERS",
    "INSTRUCTION_ROLES",
    "KEY_VERSION",
    "MAX_MEMO_HEADERS",
    "NEUTRAL_HEADERS",
    "NEUTRAL_PREFIXES",
    "Fingerprint",
    "Repeat",
    "RepeatMemo",
    "SemanticView",
    "canonical_body",
    "conversation",
    "fingerprint",
    "grant_of",
    "is_deterministic",
    "names_of",
    "neutral_of",
    "normalize_text",
    "readable",
    "request_digest",
    "requester",
    "semantic_view",
    "varying_headers",
]


@dataclass(slots=True, frozen=True)
class Fingerprint:
    """The sharing decision for one request: ``key`` is None when it must bypass."""

    key: str | None
    tenant: str  # the sharing scope: "*" in a shared namespace
    namespace: str
    bypass_reason: str | None = None
    owner: str = ""  # the requester's own tenant, even in a shared namespace
    # In a shared namespace, for a requester not (yet) accepted by the upstream: the key it
    # would have there. It reads nothing under it, but its answer, once the upstream accepted
    # it, is stored under it for the others.
    shared_key: str | None = None


def fingerprint(
    request: Request,
    config: Config,
    accepted: Container[tuple[str, tuple[str, Any, str, tuple[Any, ...]]]] | None = None,
) -> Fingerprint:
    """The request's key and scope. ``accepted``: the tenants the upstream has recently answered
    (``identity.AcceptedCredentials``); None trusts every tenant (offline tools: the bench
    oracle, eval-semantic), never the gateway."""
    controls = request.controls
    namespace = controls.namespace
    tenant = owner = requester(request.headers, config)
    api = request.api
    shared = (
        bool(namespace)
        and namespace in config.tenant.shared_namespaces
        and not api.tenant_bound(request.body)
    )
    if shared and (
        accepted is None
        or (owner, grant_of(request, names_of(config.tenant), neutral_of(config.fingerprint)))
        in accepted
    ):
        tenant, shared = "*", False
    never = api.never_shared(request.body)  # (Responses' background, server tools...)
    if never is not None:
        return Fingerprint(None, tenant, namespace, never, owner)
    if not api.deterministic(request.body, config.upstream.engine):
        if not (controls.share_sampled or config.sampling == "same-params"):
            return Fingerprint(None, tenant, namespace, "sampled", owner)
    canonical = canonical_body(request.kind, request.body, collapses(request, config))
    return Fingerprint(
        digest(request, config, "answer", tenant, namespace, canonical),
        tenant,
        namespace,
        owner=owner,
        shared_key=digest(request, config, "answer", "*", namespace, canonical) if shared else None,
    )


def request_digest(request: Request, key: Fingerprint, config: Config) -> str:
    """What identifies a request for its idempotency record: its canonical body in its scope.

    Unlike ``Fingerprint.key`` it exists for sampled requests too: a retry of a sampled request
    must not run twice either.
    """
    # The requester's own scope (``owner``), not the sharing scope: the same request must map
    # to the same record whether or not the upstream has accepted its key meanwhile.
    canonical = canonical_body(request.kind, request.body, collapses(request, config))
    return digest(request, config, "request", key.owner, key.namespace, canonical)
