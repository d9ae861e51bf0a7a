"""The judge, the audits, the error budget and feedback over HTTP, against a fake judge that
answers from labels (``tests/fakes/judge.py``) and the counting fake upstream."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("usearch")

from carpool.auditor import (  # noqa: E402
    MAX_RUNNING,
    MAX_RUNNING_PER_BUDGET,
    MAX_RUNNING_PER_TENANT,
)
from carpool.canonical import requester  # noqa: E402
from carpool.identity import ANONYMOUS_TENANT  # noqa: E402
from carpool.semantic.audit import MIN_AUDITS, Budget  # noqa: E402
from carpool.semantic.judge import MAX_REPLY_BYTES  # noqa: E402
from fakes.judge import FakeJudge  # noqa: E402
from fakes.serving import serve_app  # noqa: E402
from fakes.waiting import eventually  # noqa: E402

ADMIN = "admin-secret"
ROUTER = "How do I reset my router?"
NEAR_REPEAT = "how do I reset my router?"  # similarity >= BACKED_OFF_SIMILARITY: near repeat
PARAPHRASES = [  # cosine similarity to ROUTER: 0.985, 0.94, 0.925, 0.967 (none a near repeat
    "how can i reset my router",  # but the first: BACKED_OFF_SIMILARITY is 0.97)
    "what steps reset my router",
    "my router needs a reset, how",
    "tell me how to reset my router",
]


@pytest.fixture
async def judge() -> AsyncIterator[tuple[FakeJudge, str]]:
    fake_judge = FakeJudge()
    async with serve_app(fake_judge) as url:
        yield fake_judge, f"{url}/v1"


def semantic(judge_url: str | None = None, **settings: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"enabled": True, **settings}
    if judge_url is not None:
        config["judge"] = {"model": "judge-model", "url": judge_url, **config.get("judge", {})}
    return {"semantic": config, "admin_token": ADMIN}


async def ask(gw, content: str, namespace: str | None = None, max_age: int | None = None):
    headers = {"x-carpool-namespace": namespace} if namespace else {}
    if max_age is not None:
        headers["cache-control"] = f"max-age={max_age}"
    response = await gw.client.post(
        "/v1/chat/completions",
        headers=headers,
        json={"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]},
    )
    assert response.status_code == 200, response.text
    return response


def budget(namespace: str, tenant: str = ANONYMOUS_TENANT) -> Budget:
    """The error budget of ``namespace`` for a tenant (the requests here send no credential)."""
    return Budget(tenant, namespace)


def outcome(response) -> str:
    return response.headers["x-carpool"]


async def admin(gw, method: str, path: str, token: str = ADMIN, **kw):
    return await gw.client.request(method, path, headers={"authorization": f"Bearer {token}"}, **kw)


# --------------------------------------------------------------------------- the judge


async def test_in_the_band_the_judge_decides_a_paraphrase_the_verifier_would_serve(
    fake, gateway_with, judge
):
    fake_judge, url = judge
    async with gateway_with(**semantic(url, judge={"band": [0.0, 1.0]})) as gw:
        assert outcome(await ask(gw, ROUTER)) == "miss"
        # The judge says no (no label): a miss, though the verifier serves this one without it.
        assert outcome(await ask(gw, PARAPHRASES[0])) == "miss"
        assert fake_judge.calls("same") >= 1
        fake_judge.decide = lambda a, b: "reset my router" in a.casefold() + b.casefold()
        hit = await ask(gw, PARAPHRASES[1])
        assert outcome(hit) == "semantic-hit" and "x-carpool-entry" in hit.headers
        stats = (await admin(gw, "GET", "/stats")).json()
        assert stats["judge_calls"] == fake_judge.calls() and stats["judge_calls"] >= 2
        assert fake.count() == 2  # the judge's calls are not upstream calls
        assert fake_judge.bodies[0]["model"] == "judge-model"


async def test_a_verdict_remembered_in_one_scope_never_answers_another(fake, gateway_with, judge):
    # Remembered across scopes (tenants too), a verdict came back to another scope's lookup with
    # no call: /stats' `remembered`, or its speed, told what pairs another tenant had asked.
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True
    async with gateway_with(**semantic(url, judge={"band": [0.0, 1.0]})) as gw:
        for namespace in ("first", "second"):
            assert outcome(await ask(gw, ROUTER, namespace)) == "miss"
            asked = fake_judge.calls("same")
            hit = await ask(gw, PARAPHRASES[0], namespace)
            assert outcome(hit) == "semantic-hit"
            assert fake_judge.calls("same") == asked + 1, namespace  # (asked in its scope)
        again = await ask(gw, PARAPHRASES[0], "first")
        assert outcome(again) == "semantic-hit" and fake_judge.calls("same") == asked + 1
        stats = (await admin(gw, "GET", "/stats")).json()
        assert stats["judge"]["remembered"] >= 1, stats["judge"]


async def test_a_rule_refusal_is_never_put_to_the_judge(fake, gateway_with, judge):
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True
    async with gateway_with(**semantic(url, judge={"band": [0.0, 1.0]})) as gw:
        assert outcome(await ask(gw, "How do I reset router number 1?")) == "miss"
        assert outcome(await ask(gw, "How do I reset router number 2?")) == "miss"
        assert fake_judge.calls("same") == 0


async def test_a_rule_the_judge_overrules_is_put_to_it(fake, gateway_with, judge):
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True
    async with gateway_with(
        **semantic(url, judge={"band": [0.0, 1.0], "overrules": ["number"]})
    ) as gw:
        assert outcome(await ask(gw, "How do I reset router number 1?")) == "miss"
        assert outcome(await ask(gw, "How do I reset router number 2?")) == "semantic-hit"
        assert fake_judge.calls("same") == 1


async def test_outside_the_band_the_judge_is_not_asked(fake, gateway_with, judge):
    fake_judge, url = judge
    async with gateway_with(**semantic(url, judge={"band": [0.0, 0.01]})) as gw:
        await ask(gw, ROUTER)
        assert outcome(await ask(gw, PARAPHRASES[0])) == "semantic-hit"  # the verifier's
        assert fake_judge.calls() == 0


@pytest.mark.parametrize(
    "failure", ["500", "timeout", "not yes", "a bare yes", "a completion's text"]
)
async def test_a_failing_judge_is_a_miss(fake, gateway_with, judge, failure):
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True
    if failure == "500":
        fake_judge.fail_status = 500
    elif failure == "timeout":
        fake_judge.hang = asyncio.Event()
    elif failure == "a bare yes":  # (no chat completion: read as "yes" before, a review)
        fake_judge.body = "yes"
    elif failure == "a completion's text":
        fake_judge.body = {"choices": [{"index": 0, "text": "yes"}]}
    else:
        fake_judge.reply = "Probably yes"
    config = semantic(url, judge={"band": [0.0, 1.0], "timeout_ms": 50})
    async with gateway_with(**config) as gw:
        await ask(gw, ROUTER)
        assert outcome(await ask(gw, PARAPHRASES[0])) == "miss"
        assert fake.count() == 2
    if fake_judge.hang is not None:
        fake_judge.hang.set()


async def test_identical_concurrent_paraphrases_ask_the_judge_once(fake, gateway_with, judge):
    # 40 identical paraphrases at once sent the judge 40 identical questions at once. (Each
    # accepts another age: identical requests' lookups are one, ``SemanticCache.probe``.)
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True
    fake_judge.hang = asyncio.Event()
    config = semantic(url, judge={"band": [0.0, 1.0], "timeout_ms": 60_000}, max_pending=64)
    async with gateway_with(**config) as gw:
        await ask(gw, ROUTER)
        lookups = [
            asyncio.ensure_future(ask(gw, PARAPHRASES[0], max_age=600 + n)) for n in range(40)
        ]
        asked = gw.gateway.layers.judge
        # Each lookup's question sent (before) or joined to the one asked (now).
        await eventually(
            lambda: fake_judge.calls("same") + asked.snapshot().get("joined", 0) == 40,
            what="40 lookups at the judge",
        )
        fake_judge.hang.set()
        assert [outcome(r) for r in await asyncio.gather(*lookups)] == ["semantic-hit"] * 40
        assert fake_judge.calls("same") == 1 and asked.calls == 1
        stats = (await admin(gw, "GET", "/stats")).json()
        assert stats["judge"]["joined"] == 39 and stats["judge"]["busy"] == 0


async def test_a_hung_judge_costs_a_lookup_one_deadline_not_one_per_batch(
    fake, gateway_with, judge
):
    # The nearest candidate was asked about, then the others as a second batch, each with its
    # own timeout_ms: a hung judge held a lookup twice as long. The lookup's judging now ends
    # at one deadline: the second batch, past it, is never asked.
    fake_judge, url = judge
    config = semantic(url, threshold=0.5, judge={"band": [0.0, 1.0], "timeout_ms": 100})
    async with gateway_with(**config) as gw:
        asked = gw.gateway.layers.judge
        for n, text in enumerate([ROUTER, *PARAPHRASES[:3]], start=1):  # the judge says no
            assert outcome(await ask(gw, text)) == "miss"
            await eventually(lambda n=n: gw.gateway.semantic.entries == n, what="the entry")
        before = asked.calls
        fake_judge.hang = asyncio.Event()
        assert outcome(await ask(gw, PARAPHRASES[3])) == "miss"
        assert asked.calls == before + 1  # the nearest alone: the others not asked past it
        fake_judge.hang.set()


async def test_a_judge_reply_past_the_cap_is_a_miss_and_a_failure(fake, gateway_with, judge):
    # A 30 MB reply starting "yes" was read whole and served.
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True
    fake_judge.padding = MAX_REPLY_BYTES
    async with gateway_with(**semantic(url, judge={"band": [0.0, 1.0]})) as gw:
        await ask(gw, ROUTER)
        assert outcome(await ask(gw, PARAPHRASES[0])) == "miss"
        assert fake_judge.calls("same") == 1
        assert gw.gateway.layers.judge.failures == 1
        fake_judge.padding = 0
        assert outcome(await ask(gw, PARAPHRASES[1])) == "semantic-hit"  # (the same judge)


async def test_an_error_budget_without_audits_is_warned_about_at_start(fake, gateway_with, caplog):
    # With audit_rate 0 (the default) only feedback moves the budget: an operator who set one
    # had none in practice, silently (a review).
    said = "semantic.max_wrong_rate: with semantic.audit_rate 0 no hit is audited"
    async with gateway_with(semantic={"enabled": True, "max_wrong_rate": 0.1}):
        pass
    assert [r for r in caplog.records if r.levelname == "WARNING" and said in r.getMessage()]
    caplog.clear()
    budgeted = {"enabled": True, "max_wrong_rate": 0.1, "audit_rate": 0.2}
    async with gateway_with(semantic=budgeted):
        pass
    assert not [r for r in caplog.records if said in r.getMessage()]


async def test_a_judge_through_keyless_upstreams_is_warned_about_at_start(
    fake, gateway_with, caplog
):
    # Through the replicas the judge's calls carry judge.api_key or the gateway's held key,
    # never a client's: with neither, an upstream that wants a key refuses every judge call.
    said = "semantic.judge: its calls through the upstreams carry no credentials"
    async with gateway_with(semantic={"enabled": True, "judge": {"model": "judge-model"}}):
        pass
    assert [r for r in caplog.records if r.levelname == "WARNING" and said in r.getMessage()]
    caplog.clear()
    for judge_settings, upstream in (
        ({"api_key": "sk-judge"}, {}),
        ({}, {"upstream": {"api_key": "sk-held"}}),
        ({"url": "http://127.0.0.1:9/v1"}, {}),
    ):
        judged = {"enabled": True, "judge": {"model": "judge-model", **judge_settings}}
        async with gateway_with(semantic=judged, **upstream):
            pass
    assert not [r for r in caplog.records if said in r.getMessage()]


# --------------------------------------------------------------------------- audits


async def test_audits_run_in_the_background_after_the_client_got_its_answer(fake, gateway_with):
    fake.answer_text = lambda n, body: "Hold the reset button for 10 seconds."
    async with gateway_with(**semantic(audit_rate=1.0)) as gw:
        await ask(gw, ROUTER)
        fake.gate = asyncio.Event()  # the audit's upstream call is held
        hit = await ask(gw, PARAPHRASES[0])
        assert outcome(hit) == "semantic-hit"  # answered while its audit waits upstream
        await fake.wait_for_calls(2)
        assert gw.gateway.layers.audits.snapshot() == {}
        fake.gate.set()
        await eventually(
            lambda: gw.gateway.layers.audits.snapshot().get("", {}).get("audited") == 1,
            what="the audit",
        )
        report = (await admin(gw, "GET", "/stats")).json()["semantic_audit"][""]
        assert report["wrong"] == 0 and report["state"] == "serving"  # the answers agree
        # The audit's answer was not stored: the paraphrase is still served from the entry.
        assert outcome(await ask(gw, PARAPHRASES[0])) == "semantic-hit"


async def test_one_budgets_slow_audits_leave_room_for_another_budgets(fake, gateway_with):
    # At most MAX_RUNNING audits run at once, a draw beyond skipped: one budget's hits on
    # prompts its engine answers slowly held them all, and every hit of another budget drawn
    # meanwhile was skipped (its budget had no audit to back off by). Each budget now holds at
    # most its share of them.
    async with gateway_with(**semantic(audit_rate=1.0)) as gw:
        audits = gw.gateway.layers.audits
        await ask(gw, ROUTER, "slow")
        await ask(gw, ROUTER, "other")
        fake.gate = asyncio.Event()  # every audit's upstream call is held: a slow engine
        for _ in range(MAX_RUNNING):  # (each hit drawn, its audit begun before its answer)
            assert outcome(await ask(gw, PARAPHRASES[0], "slow")) == "semantic-hit"
        assert outcome(await ask(gw, PARAPHRASES[0], "other")) == "semantic-hit"
        fake.gate.set()
        await gw.gateway.auditor.settle()
        report = audits.snapshot()
        assert report.get("other", {}).get("audited") == 1, report  # its audit was not skipped
        assert report["slow"]["audited"] == MAX_RUNNING_PER_BUDGET  # the rest skipped


async def test_one_tenants_slow_audits_over_namespaces_it_names_leave_room_for_another_tenant(
    fake, gateway_with
):
    # Capped per budget (tenant and namespace) alone, a tenant whose engine answers slowly held
    # every place by spreading its hits over the namespaces it names (x-carpool-namespace):
    # 4 x MAX_RUNNING_PER_BUDGET, and another tenant's hits drawn meanwhile were skipped. A
    # tenant now holds at most MAX_RUNNING_PER_TENANT of them, whatever its namespaces.
    namespaces = [f"slow {n}" for n in range(MAX_RUNNING // MAX_RUNNING_PER_BUDGET)]
    slow, other = "Bearer key-of-the-slow-tenant", "Bearer key-of-another-tenant"

    async def ask_as(key: str, content: str, namespace: str = "") -> str:
        headers = {"authorization": key, "x-carpool-namespace": namespace}
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}
        response = await gw.client.post("/v1/chat/completions", headers=headers, json=body)
        assert response.status_code == 200, response.text
        return outcome(response)

    async with gateway_with(**semantic(audit_rate=1.0)) as gw:
        audits = gw.gateway.layers.audits
        for namespace in namespaces:
            await ask_as(slow, ROUTER, namespace)
        await ask_as(other, ROUTER)
        fake.gate = asyncio.Event()  # every audit's upstream call is held: a slow engine
        for namespace in namespaces:
            for _ in range(MAX_RUNNING_PER_BUDGET):  # (each hit drawn, its audit begun or not)
                assert await ask_as(slow, PARAPHRASES[0], namespace) == "semantic-hit"
        assert await ask_as(other, PARAPHRASES[0]) == "semantic-hit"
        fake.gate.set()
        await gw.gateway.auditor.settle()
        report = audits.snapshot()
        assert report.get("", {}).get("audited") == 1, report  # its audit was not skipped
        slow_audits = sum(report.get(namespace, {}).get("audited", 0) for namespace in namespaces)
        assert slow_audits == MAX_RUNNING_PER_TENANT  # the rest skipped


async def test_an_audited_semantic_hits_tokens_are_not_counted_saved(fake, gateway_with):
    # (They were: the engine computed the answer again for the audit, yet /stats said its
    # tokens were "not recomputed".) A hit not audited still counts its tokens.
    async with gateway_with(**semantic(audit_rate=1.0)) as gw:
        await ask(gw, ROUTER)
        before = (await admin(gw, "GET", "/stats")).json()
        assert outcome(await ask(gw, PARAPHRASES[0])) == "semantic-hit"
        await eventually(lambda: gw.gateway.layers.audits.calls == 1, what="the audit's call")
        after = (await admin(gw, "GET", "/stats")).json()
        assert after["semantic_hits"] == before["semantic_hits"] + 1
        assert after["tokens_saved"] == before["tokens_saved"]
        assert after["upstream_calls"] == before["upstream_calls"] + 1  # (the audit's)
    async with gateway_with(**semantic()) as gw:  # (no audits)
        await ask(gw, ROUTER)
        assert outcome(await ask(gw, PARAPHRASES[0])) == "semantic-hit"
        assert (await admin(gw, "GET", "/stats")).json()["tokens_saved"] > 0


async def test_an_audit_that_disagrees_counts_a_wrong_hit_in_its_namespace(fake, gateway_with):
    async with gateway_with(**semantic(audit_rate=1.0)) as gw:  # answers differ per call
        await ask(gw, ROUTER, "faq")
        assert outcome(await ask(gw, PARAPHRASES[0], "faq")) == "semantic-hit"
        await eventually(lambda: "faq" in gw.gateway.layers.audits.snapshot(), what="the audit")
        report = gw.gateway.layers.audits.snapshot()["faq"]
        assert (report["audited"], report["wrong"], report["estimate"]) == (1, 1, 1.0)
        assert 0 < report["low"] <= report["high"] == 1.0
        metrics = (await admin(gw, "GET", "/metrics")).text
        assert 'carpool_semantic_audits_wrong_total{namespace="faq"} 1.0' in metrics
        assert 'carpool_semantic_wrong_rate{bound="estimate",namespace="faq"} 1.0' in metrics


async def test_an_audit_of_an_unserved_match_makes_no_extra_upstream_call(fake, gateway_with):
    # mode: mark serves no match: the request leads its own upstream call, and its audit sent
    # the same body upstream again. It now compares the flight's own answer with the match.
    async with gateway_with(**semantic(mode="mark", audit_rate=1.0)) as gw:  # answers differ
        audits = gw.gateway.layers.audits
        await ask(gw, ROUTER)
        marked = await ask(gw, PARAPHRASES[0])
        assert outcome(marked) == "miss" and "x-carpool-semantic-nearest" in marked.headers
        await eventually(lambda: "" in audits.snapshot(), what="the audit")
        report = audits.snapshot()[""]
        assert (report["audited"], report["wrong"]) == (1, 1)  # recorded as before
        assert fake.count() == 2 and audits.calls == 0  # the two requests' own calls only
        assert audits.failed == 0


async def test_a_pair_an_audit_found_wrong_is_not_served_again(fake, gateway_with):
    # A hit an audit found wrong was served to the same paraphrase again and again, every
    # audit saying wrong. The pair (entry, prompt) is now refused; the entry still serves others.
    async with gateway_with(**semantic(audit_rate=1.0)) as gw:  # answers differ: audits disagree
        audits = gw.gateway.layers.audits
        await ask(gw, ROUTER)
        hit = await ask(gw, PARAPHRASES[0])
        assert outcome(hit) == "semantic-hit"
        await eventually(lambda: audits.snapshot().get("", {}).get("audited") == 1, what="audit")
        other = await ask(gw, PARAPHRASES[3])  # another paraphrase: the entry is kept
        assert outcome(other) == "semantic-hit"
        assert other.headers["x-carpool-entry"] == hit.headers["x-carpool-entry"]
        await eventually(lambda: audits.snapshot()[""]["audited"] == 2, what="its audit")
        again = await ask(gw, PARAPHRASES[0])
        assert outcome(again) == "miss"
        assert gw.gateway.layers.semantic.rejections.get("audit") == 1
        # (still named in mark mode's headers, with the reason: guard:audit)
        await gw.gateway.auditor.settle()
        assert audits.snapshot()[""]["audited"] == 2  # a pair not served is not audited again


async def test_metrics_label_a_bounded_number_of_namespaces_those_not_serving_first(
    fake, gateway_with
):
    # Namespaces are the clients' to name: one series set each made /metrics grow with every
    # namespace audited (up to 10,000 x 6 series).
    from carpool.metrics import METRIC_NAMESPACES

    async with gateway_with(**semantic(audit_rate=1.0, max_wrong_rate=0.05)) as gw:
        audits = gw.gateway.layers.audits
        for i in range(METRIC_NAMESPACES + 20):
            audits.record(budget(f"busy-{i}"), False)
            audits.record(budget(f"busy-{i}"), False)
        for _ in range(MIN_AUDITS):  # every audit wrong: backed off
            audits.record(budget("troubled"), True)
        assert audits.state(budget("troubled")) == "backed-off"
        metrics = (await admin(gw, "GET", "/metrics")).text
        labelled = re.findall(r'carpool_semantic_audits_total\{namespace="([^"]*)"\}', metrics)
        assert len(labelled) == METRIC_NAMESPACES and "troubled" in labelled


async def test_stats_lists_a_bounded_number_of_namespaces_ranked_as_metrics_and_counts_the_rest(
    fake, gateway_with
):
    # /stats listed every namespace audited (up to 20,000, 2.4 MB): polled every second by the
    # dashboard, each poll took seconds. It lists those /metrics labels (not serving first, then
    # the most audited in all) and counts the rest; the admin endpoint lists them all.
    from carpool.metrics import METRIC_NAMESPACES

    async with gateway_with(**semantic(audit_rate=1.0, max_wrong_rate=0.05)) as gw:
        audits = gw.gateway.layers.audits
        for i in range(METRIC_NAMESPACES + 20):
            for _ in range(1 + (i == METRIC_NAMESPACES + 19)):  # the last, most audited
                audits.record(budget(f"busy-{i}"), False)
        for _ in range(MIN_AUDITS):  # every audit wrong: backed off
            audits.record(budget("troubled"), True)
        assert audits.state(budget("troubled")) == "backed-off"
        listed = (await admin(gw, "GET", "/stats")).json()
        metrics = (await admin(gw, "GET", "/metrics")).text
        labelled = re.findall(r'carpool_semantic_audits_total\{namespace="([^"]*)"\}', metrics)
        assert list(listed["semantic_audit"])[:2] == ["troubled", f"busy-{METRIC_NAMESPACES + 19}"]
        assert set(listed["semantic_audit"]) == set(labelled)
        assert listed["semantic_audit_more"] == 21
        every = (await admin(gw, "GET", "/admin/semantic/audit")).json()
        assert len(every) == METRIC_NAMESPACES + 21


async def test_the_audit_counters_never_go_down_an_admin_reset_empties_only_the_windows(
    fake, gateway_with
):
    # The counters were the windows' counts: a reset took carpool_semantic_audits_total from
    # 50 to 1 (and to nothing: no series, then 1, for a reset of every namespace).
    async with gateway_with(**semantic(audit_rate=1.0, max_wrong_rate=0.05)) as gw:
        audits = gw.gateway.layers.audits

        async def counters() -> dict[str, float]:
            text = (await admin(gw, "GET", "/metrics")).text
            return {
                f"{name}:{namespace}": float(value)
                for name, namespace, value in re.findall(
                    r'^(carpool_semantic_audits(?:_wrong)?_total)\{namespace="([^"]*)"\} (\S+)$',
                    text,
                    re.M,
                )
            }

        for _ in range(50):
            audits.record(budget("team-a"), False)
        for _ in range(MIN_AUDITS):
            audits.record(budget("team-b"), True)  # backed off
        before = await counters()
        assert before["carpool_semantic_audits_total:team-a"] == 50
        reset = await admin(gw, "POST", "/admin/semantic/audit/reset", json={"namespace": "team-a"})
        assert reset.json() == {"reset": 1}
        assert await counters() == before  # nothing counted meanwhile: nothing moved
        audits.record(budget("team-a"), False)
        assert (await counters())["carpool_semantic_audits_total:team-a"] == 51
        assert (await admin(gw, "POST", "/admin/semantic/audit/reset", json={})).json() == {
            "reset": 2
        }
        after = await counters()
        assert all(after[series] >= value for series, value in before.items())
        assert after["carpool_semantic_audits_wrong_total:team-b"] == MIN_AUDITS
        text = (await admin(gw, "GET", "/metrics")).text
        assert 'carpool_semantic_backoff{namespace="team-b"} 0.0' in text  # serving again
        # /stats reports the windows: reset, with no audits since.
        assert (await admin(gw, "GET", "/stats")).json()["semantic_audit"] == {}


@pytest.mark.parametrize("spec", [{"namespace": None}, {"tenant": None}, {"namespace": 5}])
async def test_a_reset_naming_no_string_is_refused_and_resets_nothing(fake, gateway_with, spec):
    """``{"namespace": null}`` (a script's unset variable) reset every budget: a 400, as the
    OpenAPI document says of a value that is not a string; only ``{}`` means all."""
    async with gateway_with(**semantic(audit_rate=1.0, max_wrong_rate=0.05)) as gw:
        audits = gw.gateway.layers.audits
        for _ in range(MIN_AUDITS):  # every audit wrong: backed off
            audits.record(budget("troubled"), True)
        refused = await admin(gw, "POST", "/admin/semantic/audit/reset", json=spec)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert audits.state(budget("troubled")) == "backed-off"


# --------------------------------------------------------------------------- the budget


async def test_a_namespace_over_budget_backs_off_while_another_keeps_serving_then_recovers(
    fake, gateway_with, judge
):
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True  # every paraphrase a hit, until the budget says no
    config = semantic(url, judge={"band": [0.0, 1.0]}, audit_rate=1.0, max_wrong_rate=0.05)
    async with gateway_with(**config) as gw:  # the upstream's answers differ: audits disagree
        audits, bad = gw.gateway.layers.audits, budget("bad")
        for namespace in ("bad", "good"):
            await ask(gw, ROUTER, namespace)
        # A window moves nothing before MIN_AUDITS: all but the last of them recorded wrong
        # here, the last the audit of a hit served.
        for _ in range(MIN_AUDITS - 1):
            audits.record(bad, True)
        assert audits.state(bad) == "serving"
        assert outcome(await ask(gw, PARAPHRASES[0], "bad")) == "semantic-hit"
        await eventually(lambda: audits.state(bad) == "backed-off", what="the back-off")
        assert outcome(await ask(gw, PARAPHRASES[1], "bad")) == "miss"  # not a near repeat
        await eventually(
            lambda: audits.snapshot()["bad"]["audited"] == MIN_AUDITS + 1, what="its audit"
        )
        assert audits.state(bad) == "backed-off"  # (the near repeats it serves: not judged yet)
        # A near repeat is still served; its audit disagrees too, the last of a window of near
        # repeats found wrong: nothing is served any more.
        for _ in range(MIN_AUDITS - 1):
            audits.record(bad, True, near=True)
        assert outcome(await ask(gw, NEAR_REPEAT, "bad")) == "semantic-hit"
        await eventually(lambda: audits.state(bad) == "mark", what="mark-only")
        marked = await ask(gw, PARAPHRASES[2], "bad")
        assert outcome(marked) == "miss"
        assert "x-carpool-semantic-nearest" in marked.headers  # (marked: the match only named)
        assert outcome(await ask(gw, PARAPHRASES[0], "good")) == "semantic-hit"
        await eventually(lambda: audits.snapshot().get("good", {}).get("audited") == 1)
        states = (await admin(gw, "GET", "/admin/semantic/audit")).json()
        assert states["bad"]["state"] == "mark"
        # Audits that agree bring it back, one step at a time (what agreeing audits record).
        await eventually(
            lambda: audits.snapshot()["bad"]["audited"] == 2 * MIN_AUDITS + 2, what="the audits"
        )
        # (mark -> backed-off on near repeats' audits, backed-off -> serving on the usual bar's)
        for step, near in (("backed-off", True), ("serving", False)):
            for _ in range(200):  # (the upper bound under 0.05: some 75 to 150 agreeing audits)
                audits.record(bad, False, near)
                if audits.state(bad) == step:
                    break
            assert audits.state(bad) == step
        assert outcome(await ask(gw, PARAPHRASES[3], "bad")) == "semantic-hit"


async def test_one_tenants_wrong_hits_do_not_back_off_another(fake, gateway_with, judge):
    # The budget was the namespace's: tenant A's wrong hits in the default namespace (where
    # each tenant has its own entries) took it to backed-off for tenant B too, and A's right
    # ones could hide B's wrong ones. A budget is now the scope's: tenant and namespace.
    fake_judge, url = judge
    fake_judge.decide = lambda a, b: True  # every paraphrase a hit, until the budget says no
    config = semantic(url, judge={"band": [0.0, 1.0]}, audit_rate=1.0, max_wrong_rate=0.05)
    async with gateway_with(**config) as gw:  # the upstream's answers differ: audits disagree
        audits, config = gw.gateway.layers.audits, gw.gateway.config
        a = {"authorization": "Bearer key-of-tenant-a"}
        b = {"authorization": "Bearer key-of-tenant-b"}
        of_a, of_b = (budget("", requester(headers, config)) for headers in (a, b))

        async def asked(content: str, headers: dict[str, str]) -> str:
            body = {
                "model": "m",
                "temperature": 0,
                "messages": [{"role": "user", "content": content}],
            }
            response = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            return outcome(response)

        assert await asked(ROUTER, a) == await asked(ROUTER, b) == "miss"
        for _ in range(MIN_AUDITS - 1):  # A's hits found wrong, all but the last
            audits.record(of_a, True)
        assert await asked(PARAPHRASES[1], a) == "semantic-hit"  # (its audit disagrees too)
        await eventually(lambda: audits.state(of_a) == "backed-off", what="A's back-off")
        assert await asked(PARAPHRASES[2], a) == "miss"  # A: only near repeats now
        assert await asked(PARAPHRASES[2], b) == "semantic-hit"  # B had no wrong hit till now
        label_a, label_b = audits.label(of_a.tenant), audits.label(of_b.tenant)
        await eventually(
            lambda: label_b in audits.snapshot(tenants=True)[""]["tenants"], what="B's audit"
        )
        assert audits.state(of_b) == "serving"  # (its first wrong one: too few to say)
        # /stats (open without an admin token) says no tenant's budget; the admin's view does,
        # by a label that is not the tenant id.
        stats = (await admin(gw, "GET", "/stats")).json()["semantic_audit"][""]
        assert stats["budgets"] == {"serving": 1, "backed-off": 1} and "tenants" not in stats
        view = (await admin(gw, "GET", "/admin/semantic/audit")).json()[""]["tenants"]
        assert (view[label_a]["state"], view[label_b]["state"]) == ("backed-off", "serving")
        assert of_a.tenant not in str(view) and of_b.tenant not in str(view)
        # The admin puts one tenant's budget back: the other's stays as it is.
        reset = await admin(
            gw, "POST", "/admin/semantic/audit/reset", json={"namespace": "", "tenant": label_a}
        )
        assert reset.json() == {"reset": 1}
        assert (
            audits.state(of_a) == "serving"
            and label_b in audits.snapshot(tenants=True)[""]["tenants"]
        )


async def test_the_admin_endpoint_resets_a_namespace(fake, gateway_with):
    async with gateway_with(**semantic(audit_rate=1.0, max_wrong_rate=0.05)) as gw:
        audits, faq = gw.gateway.layers.audits, budget("faq")
        for _ in range(MIN_AUDITS):
            audits.record(faq, True)
        assert audits.state(faq) == "backed-off"
        reset = await admin(gw, "POST", "/admin/semantic/audit/reset", json={"namespace": "faq"})
        assert reset.json() == {"reset": 1} and audits.state(faq) == "serving"
        assert (await admin(gw, "POST", "/admin/semantic/audit/reset", json=[])).status_code == 400
        # A misspelt name is refused, not read as {} (which resets every namespace).
        for _ in range(MIN_AUDITS):
            audits.record(faq, True)
        typo = await admin(gw, "POST", "/admin/semantic/audit/reset", json={"nmspace": "faq"})
        assert typo.status_code == 400 and audits.state(faq) == "backed-off"
        denied = await admin(gw, "POST", "/admin/semantic/audit/reset", token="no", json={})
        assert denied.status_code == 401


# --------------------------------------------------------------------------- feedback


async def test_feedback_drops_the_entry_and_counts_a_wrong_hit(fake, gateway_with):
    async with gateway_with(**semantic()) as gw:
        await ask(gw, ROUTER, "faq")
        hit = await ask(gw, PARAPHRASES[0], "faq")
        assert outcome(hit) == "semantic-hit"
        entry = hit.headers["x-carpool-entry"]
        denied = await admin(
            gw, "POST", "/admin/semantic/feedback", token="x", json={"entry": entry}
        )
        assert denied.status_code == 401
        reported = await admin(gw, "POST", "/admin/semantic/feedback", json={"entry": entry})
        assert reported.status_code == 200, reported.text
        label = gw.gateway.layers.audits.label(ANONYMOUS_TENANT)
        assert reported.json() == {"dropped": True, "namespace": "faq", "tenant": label}
        report = gw.gateway.layers.audits.snapshot()["faq"]
        assert (report["audited"], report["wrong"]) == (1, 1)
        assert outcome(await ask(gw, PARAPHRASES[1], "faq")) == "miss"  # the entry is gone
        again = await admin(gw, "POST", "/admin/semantic/feedback", json={"entry": entry})
        assert again.status_code == 404
        bad = await admin(gw, "POST", "/admin/semantic/feedback", json={"id": entry})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


async def test_the_admin_endpoints_do_not_exist_without_an_admin_token(fake, gateway_with):
    async with gateway_with(semantic={"enabled": True}) as gw:
        for method, path in (
            ("POST", "/admin/semantic/feedback"),
            ("GET", "/admin/semantic/audit"),
            ("POST", "/admin/semantic/audit/reset"),
        ):
            response = await gw.client.request(method, path, json={})
            assert response.status_code == 404, path


async def test_a_judge_without_a_verdict_counts_no_audit(fake, gateway_with, judge):
    fake_judge, url = judge
    fake_judge.fail_status = 500  # every question fails: no verdict, no wrong hit
    async with gateway_with(**semantic(url, judge={"band": [1.0, 1.0]}, audit_rate=1.0)) as gw:
        await ask(gw, ROUTER)
        assert outcome(await ask(gw, PARAPHRASES[0])) == "semantic-hit"
        audits = gw.gateway.layers.audits
        await eventually(lambda: audits.failed == 1, what="the audit that got no verdict")
        assert audits.snapshot() == {} and fake_judge.calls("agree") == 1


async def test_answers_longer_than_the_guard_reads_whole_count_no_audit(fake, gateway_with):
    # Compared by the guard, two long answers are more than its verifier reads whole: it cannot
    # vouch for them either way. No verdict, like a judge that gave none (a "no" would count
    # every long answer as a wrong hit, and back the namespace off).
    steps = " ".join(f"Step {i}: hold the reset button and wait." for i in range(40))
    fake.answer_text = lambda n, body: f"{steps} {('Best wishes', 'Take care')[n % 2]}."
    async with gateway_with(**semantic(audit_rate=1.0)) as gw:
        await ask(gw, ROUTER)
        assert outcome(await ask(gw, PARAPHRASES[0])) == "semantic-hit"
        audits = gw.gateway.layers.audits
        await eventually(
            lambda: audits.failed + sum(r["audited"] for r in audits.snapshot().values()) == 1,
            what="the audit",
        )
        assert audits.failed == 1 and audits.snapshot() == {}


async def test_sampled_requests_are_not_audited(fake, gateway_with):
    async with gateway_with(**semantic(audit_rate=1.0)) as gw:
        for content in (ROUTER, PARAPHRASES[0]):
            response = await gw.client.post(
                "/v1/chat/completions",
                headers={"x-carpool-share": "sampled"},
                json={
                    "model": "m",
                    "temperature": 0.7,
                    "messages": [{"role": "user", "content": content}],
                },
            )
            assert response.status_code == 200
        assert response.headers["x-carpool"] == "semantic-hit"
        assert fake.count() == 1 and gw.gateway.layers.audits.calls == 0
