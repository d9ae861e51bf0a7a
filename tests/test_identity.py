"""identity.py: the tenant from every credential, and what the upstream has accepted."""

from __future__ import annotations

import time

from carpool.identity import ANONYMOUS_TENANT, AcceptedCredentials, tenant_of

NAMES = ("authorization", "api-key", "x-api-key", "openai-organization", "openai-project")


def test_the_tenant_is_every_credential_presented_by_name_and_value():
    base = tenant_of({"authorization": "Bearer k"}, NAMES)
    assert tenant_of({}, NAMES) == ANONYMOUS_TENANT
    assert tenant_of({"authorization": "Bearer k", "api-key": "x"}, NAMES) != base
    assert tenant_of({"api-key": "Bearer k"}, NAMES) != base  # same value, other name
    assert tenant_of({"authorization": "Bearer k", "user-agent": "x"}, NAMES) == base
    # Length-prefixed: no split of the same characters between two values collides.
    assert tenant_of({"authorization": "ab", "api-key": "c"}, NAMES) != tenant_of(
        {"authorization": "a", "api-key": "bc"}, NAMES
    )
    assert "Bearer k" not in base


def test_accepted_credentials_are_per_grant_refused_at_once_and_forgotten_after_ttl(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    accepted = AcceptedCredentials(ttl=60, max_entries=3)
    accepted.refuse("nobody")  # nothing to refuse: no error
    accepted.accept("t", ("chat", "m", ""))
    accepted.accept("t", ("chat", "other", ""))
    assert ("t", ("chat", "m", "")) in accepted and ("t", ("chat", "x", "")) not in accepted
    accepted.refuse("t")
    assert len(accepted) == 0 and ("t", ("chat", "other", "")) not in accepted
    accepted.accept("t", "g")
    now[0] += 60
    assert ("t", "g") not in accepted and len(accepted) == 0
    for tenant in "abcd":
        accepted.accept(tenant, "g")
    assert len(accepted) == 3 and ("a", "g") not in accepted and ("d", "g") in accepted
