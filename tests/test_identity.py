"""identity.py: the tenant from every credential, and what the upstream has accepted."""

from __future__ import annotations

from carpool.clock import ManualClock
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


def test_an_empty_credential_header_is_a_credential_presented():
    # The upstream receives it and may refuse or answer otherwise: it is part of the tenant.
    base = tenant_of({"authorization": "Bearer k"}, NAMES)
    assert tenant_of({"authorization": "Bearer k", "openai-organization": ""}, NAMES) != base
    assert tenant_of({"authorization": "Bearer k", "api-key": ""}, NAMES) != base
    assert tenant_of({"authorization": ""}, NAMES) != ANONYMOUS_TENANT


def test_accepted_credentials_are_per_grant_refused_at_once_and_forgotten_after_ttl():
    clock = ManualClock(monotonic=1000.0)
    accepted = AcceptedCredentials(ttl=60, max_entries=3, clock=clock)
    accepted.refuse("nobody")  # nothing to refuse: no error
    accepted.accept("t", ("chat", "m", ""))
    accepted.accept("t", ("chat", "other", ""))
    assert ("t", ("chat", "m", "")) in accepted and ("t", ("chat", "x", "")) not in accepted
    accepted.refuse("t")
    assert len(accepted) == 0 and ("t", ("chat", "other", "")) not in accepted
    accepted.accept("t", "g")
    clock.advance(59.5)
    assert ("t", "g") in accepted
    clock.advance(0.5)
    assert ("t", "g") not in accepted and len(accepted) == 0
    for tenant in "abcd":
        accepted.accept(tenant, "g")
    assert len(accepted) == 3 and ("a", "g") not in accepted and ("d", "g") in accepted


def test_a_tenant_is_bounded_by_its_own_grants_before_it_pushes_other_tenants_out():
    accepted = AcceptedCredentials(ttl=60, max_entries=3, per_tenant=2, clock=ManualClock())
    accepted.accept("b", "g1")
    accepted.accept("a", "g1")
    accepted.accept("a", "g2")
    accepted.accept("a", "g3")  # a's oldest grant goes, not b's
    assert ("b", "g1") in accepted and ("a", "g1") not in accepted
    assert ("a", "g2") in accepted and ("a", "g3") in accepted and len(accepted) == 3
    accepted.refuse("a")
    assert len(accepted) == 1 and ("b", "g1") in accepted


def test_a_2xx_of_a_call_sent_before_its_tenants_refusal_accepts_nothing():
    accepted = AcceptedCredentials(ttl=60, max_entries=2, clock=ManualClock())
    before = accepted.begun()
    accepted.refuse("t")
    accepted.accept("t", "g", before)  # (a long stream sent before the refusal, ended after)
    accepted.accept("u", "g", before)  # another tenant: not refused
    assert ("t", "g") not in accepted and ("u", "g") in accepted
    accepted.accept("t", "g", accepted.begun())  # sent after it: the key is good again
    assert ("t", "g") in accepted
    # Refusals pushed out of the bound: a tenant no longer listed may have been among them,
    # so no call sent before the last one pushed out accepts it (unsure: not shared).
    sent = accepted.begun()
    for tenant in "abc":
        accepted.refuse(tenant)
    accepted.accept("a", "g", sent)  # ("a" pushed out, refused after ``sent``)
    accepted.accept("c", "g", sent)  # (listed: refused after ``sent``)
    assert ("a", "g") not in accepted and ("c", "g") not in accepted
    accepted.accept("a", "g", accepted.begun())
    assert ("a", "g") in accepted


def test_accepting_again_keeps_a_grant_for_another_ttl():
    clock = ManualClock()
    accepted = AcceptedCredentials(ttl=60, clock=clock)
    accepted.accept("t", "g")
    clock.advance(50)
    accepted.accept("t", "g")
    clock.advance(50)
    assert ("t", "g") in accepted
    clock.advance(10)
    assert ("t", "g") not in accepted
    accepted.refuse("t")  # forgotten already: nothing left to refuse
    assert len(accepted) == 0
