"""Gateway-held upstream credentials (``upstream.api_key``, or a user and password in an
upstream's URL) and gateway-side client keys (``auth.client_keys_file``): clients never see
the upstream's credential, nor reach the one account's state, and a request without a listed
key gets 401 before anything is read, cached, shared or sent upstream."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from carpool.auth import ClientKeys
from carpool.config import Config, ConfigError

UPSTREAM_KEY = "sk-upstream-Zq8vTq2rWn5p"
URL_USER, URL_PASSWORD = "gw-user", "pw-upstream-Hk3nB7x"
BODY = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "client-keys.txt"
    path.write_text(
        "# the gateway's own client keys\n"
        "client-a\n"
        f"{hashlib.sha256(b'client-b').hexdigest()}\n"
        "# client-b above, hashed at rest; a key may hold '#':\n"
        "key#with-hash\n"
        f"sha256:{hashlib.sha256(b'client-c').hexdigest()}\n"
        "\n"
    )
    return path


@dataclass
class Holding:
    """How the gateway holds the upstream's credential: its config, the ``Authorization`` every
    call then carries, and the secret that must never show."""

    config: dict[str, Any]
    authorization: str
    secret: str


HOLDING_WAYS = ["upstream.api_key", "a user and password in the upstream URL"]


@pytest.fixture(params=HOLDING_WAYS)
def holding(request, fake) -> Holding:
    if request.param == "upstream.api_key":
        return Holding(
            {"upstream": {"api_key": UPSTREAM_KEY}}, f"Bearer {UPSTREAM_KEY}", UPSTREAM_KEY
        )
    url = fake.url.replace("http://", f"http://{URL_USER}:{URL_PASSWORD}@", 1)
    basic = base64.b64encode(f"{URL_USER}:{URL_PASSWORD}".encode()).decode()
    return Holding({"upstreams": [url]}, f"Basic {basic}", URL_PASSWORD)


@pytest.fixture
async def held(gateway_with, keys_file, holding):
    async with gateway_with(**holding.config, auth={"client_keys_file": str(keys_file)}) as gw:
        yield gw


async def test_the_upstream_gets_the_gateways_key_and_never_the_clients(
    held, holding, fake, caplog
):
    caplog.set_level(logging.DEBUG)
    response = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-a"))
    assert response.status_code == 200 and response.headers["x-carpool"] == "miss"
    (call,) = fake.calls
    assert call.headers["authorization"] == holding.authorization
    assert "client-a" not in json.dumps(call.headers)
    assert holding.secret not in response.text + json.dumps(dict(response.headers))
    stats, metrics = await held.client.get("/stats"), await held.client.get("/metrics")
    assert holding.secret not in stats.text and holding.secret not in metrics.text
    assert URL_USER not in stats.text + metrics.text
    assert holding.secret not in caplog.text and "client-a" not in caplog.text


async def test_a_request_without_a_listed_key_gets_401_before_anything(held, fake):
    for headers in (
        bearer("client-z"),
        {},
        {"Authorization": "Basic Y2xpZW50LWE6"},
        {"x-api-key": "nope"},
    ):
        response = await held.client.post("/v1/chat/completions", json=BODY, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert "x-request-id" in response.headers
        assert response.headers["x-carpool"] == "bypass"  # (a cached endpoint's refusal)
    passthrough = await held.client.get("/v1/models", headers=bearer("client-z"))
    assert passthrough.status_code == 401 and "x-carpool" not in passthrough.headers
    assert fake.count() == 0  # nothing went upstream
    # (the cached endpoints' four: pass-through is in none of the request counters)
    assert (await held.client.get("/stats")).json()["rejected"] == 4
    assert held.gateway.store.entries == 0
    # The control endpoints are not the API: /healthz answers whoever asks.
    assert (await held.client.get("/healthz")).status_code == 200


async def test_rejected_counts_pass_through_refusals_consistently(held, fake):
    # A client key refused on /v1/models was in requests and rejected, the same request
    # answered was in neither, and the gateway's 431 or 400 there in neither: pass-through is
    # now in none of the request counters, whoever answers it; a cached endpoint's refusal is.
    async def counters() -> tuple[int, int]:
        stats = (await held.client.get("/stats")).json()
        return stats["requests"], stats["rejected"]

    for headers, status in (
        (bearer("client-z"), 401),
        (bearer("client-a"), 200),
        ({**bearer("client-a"), "x-pad": "a" * (64 * 1024 + 1)}, 431),
    ):
        assert (await held.client.get("/v1/models", headers=headers)).status_code == status
        assert await counters() == (0, 0), (headers.keys(), status)
    refused_path = await held.client.get("/v1/models%2F..%2Ffiles", headers=bearer("client-a"))
    assert refused_path.status_code == 400 and await counters() == (0, 0)
    assert fake.count("/v1/models") == 1  # (the one answered)
    cached = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-z"))
    assert cached.status_code == 401 and await counters() == (1, 1)


async def test_a_refused_key_on_the_messages_api_is_answered_in_anthropics_shape(held, fake):
    # It was OpenAI's shape on every path: the Anthropic SDK's error had no message of its own.
    response = await held.client.post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": "nope"},
    )
    assert response.status_code == 401 and response.headers["x-carpool"] == "bypass"
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["error"]["message"] and fake.count() == 0


async def test_a_hashed_key_and_the_other_credential_headers_are_accepted(held, fake):
    for headers in ({"x-api-key": "client-b"}, {"api-key": "client-b"}, bearer("client-b")):
        response = await held.client.post("/v1/chat/completions", json=BODY, headers=headers)
        assert response.status_code == 200, headers
    assert "client-b" not in json.dumps([c.headers for c in fake.calls])


async def test_each_client_key_is_its_own_tenant(held, fake):
    a = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-a"))
    b = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-b"))
    again = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-a"))
    assert [r.headers["x-carpool"] for r in (a, b, again)] == ["miss", "miss", "hit"]
    assert fake.count() == 2


async def test_pass_through_goes_with_the_gateways_key(held, holding, fake):
    response = await held.client.get("/v1/models", headers=bearer("client-a"))
    assert response.status_code == 200
    assert fake.calls[-1].headers["authorization"] == holding.authorization


async def test_a_refusal_of_the_gateways_key_on_pass_through_takes_back_no_clients_acceptance(
    gateway_with, keys_file, holding, fake
):
    """An upstream 401 to a pass-through call takes back its tenant's acceptance (the key was
    revoked upstream), but not when the call went with the gateway's key: the upstream refused
    that one (a 502 that quotes nothing), and said nothing of the client's, which the gateway
    judges itself."""
    shared = {"x-carpool-namespace": "docs"}
    config = {**holding.config, "auth": {"client_keys_file": str(keys_file)}}
    async with gateway_with(tenant={"shared_namespaces": ["docs"]}, **config) as gw:

        async def ask(content: str, key: str, **headers: str) -> Any:
            body = {**BODY, "messages": [{"role": "user", "content": content}]}
            return await gw.client.post(
                "/v1/chat/completions", json=body, headers={**bearer(key), **headers}
            )

        assert (await ask("shared", "client-a", **shared)).status_code == 200
        assert (await ask("warm up", "client-b")).status_code == 200  # client-b accepted
        fake.fail_status, fake.fail_times = 401, 1
        models = await gw.client.get("/v1/models", headers=bearer("client-b"))
        assert models.status_code == 502 and "refused the gateway's key" in models.text
        again = await ask("shared", "client-b", **shared)
        assert again.status_code == 200 and again.headers["x-carpool"] == "hit"


async def test_each_replica_may_hold_its_own_key(fake, gateway_with):
    config = {
        "upstreams": [fake.url, fake.url],
        "upstream_names": ["east", "west"],
        "routing": {"policy": "round-robin"},
        "upstream": {"api_keys": ["sk-east", "sk-west"]},
    }
    async with gateway_with(**config) as gw:
        for prompt in ("one", "two"):
            body = {**BODY, "messages": [{"role": "user", "content": prompt}]}
            assert (await gw.client.post("/v1/chat/completions", json=body)).status_code == 200
    assert sorted(c.headers["authorization"] for c in fake.calls) == [
        "Bearer sk-east",
        "Bearer sk-west",
    ]
    with pytest.raises(ValueError, match="one key per upstream"):
        Config(upstreams=[fake.url], upstream={"api_keys": ["a", "b"]})


async def test_a_replica_whose_own_key_is_refused_is_left_out_and_its_calls_fail_over(
    fake, gateway_with
):
    """With a key per replica, one of them revoked: its replica answered 401 to every call,
    taken for a refusal of the call (another replica would refuse it the same), so it was
    never failed over nor left out: half the requests failed 502 for as long as the key stayed
    wrong, and /stats showed the replica healthy, with no error."""
    fake.valid_keys = {"sk-west"}
    config = {
        "upstreams": [fake.url, fake.url],
        "upstream_names": ["east", "west"],
        "routing": {"policy": "round-robin", "backoff_s": 600, "backoff_max_s": 600},
        "upstream": {"api_keys": ["sk-east-REVOKED", "sk-west"]},
    }
    async with gateway_with(**config) as gw:
        for i in range(6):
            body = {**BODY, "messages": [{"role": "user", "content": f"question {i}"}]}
            response = await gw.client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        refused = [c for c in fake.calls if c.headers["authorization"] == "Bearer sk-east-REVOKED"]
        assert len(refused) == 1  # tried once, then left out
        stats = (await gw.client.get("/stats")).json()
        east = stats["replicas"]["east"]
        assert (east["state"], east["errors"], east["failures"]) == ("down", 1, 1)
        assert stats["routing"]["failover"] == 1 and sum(stats["routing"].values()) == 6
        metrics = (await gw.client.get("/metrics")).text
        assert 'carpool_upstream_requests_total{replica="east",status="401"} 1.0' in metrics
        assert not (await gw.client.get("/healthz")).json()["replicas"]["east"]["healthy"]
        assert (await gw.client.get("/readyz")).status_code == 200  # (west answers)


async def test_a_403_to_a_replicas_own_key_is_an_answer_and_takes_no_replica_out(
    fake, gateway_with
):
    """A 403 says what a key may do (a model, an endpoint: a restricted key refused /models),
    as often the request's as the key's: with keys of their own it downed the replica, so one
    client asking for a model its account may not use took every replica out of rotation, and
    an idle gateway whose keys may not list models was never ready."""
    fake.fail_status = 403
    config = {
        "upstreams": [fake.url, fake.url],
        "upstream_names": ["east", "west"],
        "upstream": {"api_keys": ["sk-east", "sk-west"]},
    }
    async with gateway_with(**config) as gw:
        response = await gw.client.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 502 and fake.count() == 1  # not failed over
        assert (await gw.client.get("/readyz")).status_code == 200
        replicas = (await gw.client.get("/stats")).json()["replicas"]
        assert {name: replica["state"] for name, replica in replicas.items()} == {
            "east": "healthy",
            "west": "healthy",
        }


def test_the_upstream_key_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("CARPOOL_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    config = Config(upstream={"api_key": "${CARPOOL_TEST_UPSTREAM_KEY}"})
    assert config.upstream.api_key is not None
    assert config.upstream.api_key.get_secret_value() == UPSTREAM_KEY
    assert UPSTREAM_KEY not in repr(config) and UPSTREAM_KEY not in config.model_dump_json()
    monkeypatch.delenv("CARPOOL_TEST_UPSTREAM_KEY")
    with pytest.raises(ValueError, match="CARPOOL_TEST_UPSTREAM_KEY"):
        Config(upstream={"api_key": "${CARPOOL_TEST_UPSTREAM_KEY}"})


@pytest.mark.parametrize("value", ["", "  ", "${CARPOOL_TEST_EMPTY_KEY}"])
def test_an_empty_held_key_is_a_config_error_never_no_key(monkeypatch, value):
    # An empty key would mean "no key held": the clients' own credentials (keys the gateway
    # issued) would then go upstream, and pass-through would reach every path.
    monkeypatch.setenv("CARPOOL_TEST_EMPTY_KEY", "")
    for section in ({"upstream": {"api_key": value}}, {"upstream": {"api_keys": [value]}}):
        with pytest.raises(ConfigError, match="upstream.api_key"):
            Config.load(env={}, overrides={"upstreams": ["http://127.0.0.1:9/v1"], **section})
    with pytest.raises(ConfigError, match="semantic.judge.api_key"):
        Config.load(env={}, overrides={"semantic": {"judge": {"api_key": value}}})


@pytest.mark.parametrize(
    "variable, field",
    [
        ("CARPOOL_UPSTREAM__API_KEY", "upstream.api_key"),
        ("CARPOOL_SEMANTIC__EMBEDDER_API_KEY", "semantic.embedder_api_key"),
        ("CARPOOL_SEMANTIC__JUDGE__API_KEY", "semantic.judge.api_key"),
        ("CARPOOL_ADMIN_TOKEN", "admin_token"),
    ],
)
def test_an_empty_variable_of_a_secret_is_refused_never_read_as_none(variable, field, tmp_path):
    # An empty variable is otherwise null; for a secret it is what one that was not mounted
    # looks like, and null would silently mean "no key held" (the clients' credentials go
    # upstream) or "no admin token" (the admin surfaces open). `null` says none on purpose.
    path = tmp_path / "c.yaml"
    path.write_text(
        "upstreams: [http://127.0.0.1:9/v1]\nadmin_token: from-the-file\n"
        "upstream:\n  api_key: from-the-file\n"
        "semantic:\n  embedder_api_key: from-the-file\n  judge:\n    api_key: from-the-file\n"
    )
    with pytest.raises(ConfigError, match=field) as raised:
        Config.load(path, env={variable: ""})
    assert "from-the-file" not in str(raised.value)
    Config.load(path, env={variable: "null"})  # (none, said so)


def test_a_config_error_never_shows_a_secret(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        'upstreams: ["https://svc:UPSTREAM-PASSWORD@llm.internal/v1"]\n'
        'redis: "redis://:REDIS-PASSWORD@cache:6379/0"\n'
        "admin_token: ADMIN-TOKEN-SECRET\n"
        'upstream: {api_keys: ["sk-LIVE-ONE", "sk-LIVE-TWO"]}\n'
    )
    bad_fields = [
        {"upstream": {"api_keys": "sk-LIVE-ONE"}},  # a string where a list belongs
        {"admin_token": ["ADMIN-TOKEN-SECRET"]},
        {"upstreams": ["ftp://svc:UPSTREAM-PASSWORD@llm.internal/v1"]},
        {"redis": "redis://:REDIS-PASSWORD@[::1/0"},
        {"redis": "default:REDIS-PASSWORD@redis.internal:6379"},  # no scheme
        # A password written with a raw "/", "?" or "#" ends the host part of a parser early.
        {"upstreams": ["http://svc:PASSWORD/x@llm.internal:8000/v1"]},
        {"upstreams": ["http://svc:PASSWORD?x@llm.internal:99999/v1"]},
        {"upstreams": ["http://svc:PASSWORD#x@llm.internal:99999/v1"]},
    ]
    messages = []
    with pytest.raises(ConfigError) as raised:  # (top level: two keys for one upstream)
        Config.load(path, env={})
    messages.append(str(raised.value))
    for overrides in bad_fields:
        with pytest.raises(ConfigError) as raised:
            Config.load(env={}, overrides=overrides)
        messages.append(str(raised.value))
    for message in messages:
        assert "invalid config" in message
        for secret in ("PASSWORD", "ADMIN-TOKEN", "sk-LIVE"):
            assert secret not in message, message


def test_check_config_names_an_unset_key_variable(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("upstream:\n  api_key: ${CARPOOL_SURELY_UNSET_VARIABLE}\n")
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "upstream.api_key" in result.stderr


def test_client_keys_keep_only_digests(keys_file):
    keys = ClientKeys.load(keys_file)
    assert len(keys) == 4
    assert "client-a" not in repr(vars(keys))
    assert keys.accepts([(b"authorization", b"Bearer client-a")])
    assert keys.accepts([(b"x-api-key", b"client-b")])
    assert not keys.accepts([(b"authorization", b"Bearer client-d")])
    assert not keys.accepts([])


async def test_a_client_keys_file_saved_with_a_byte_order_mark_keeps_its_first_key(
    tmp_path, gateway_with, fake
):
    # Windows' editors save UTF-8 with one: it was read as part of the first key, which then
    # matched no request (check-config said ok).
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"\xef\xbb\xbfclient-first\r\nclient-second\r\n")
    async with gateway_with(auth={"client_keys_file": str(keys)}) as gw:
        for key in ("client-first", "client-second"):
            response = await gw.client.post("/v1/chat/completions", json=BODY, headers=bearer(key))
            assert response.status_code == 200, key
    assert len(ClientKeys.load(keys)) == 2


def test_a_missing_keys_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="auth.client_keys_file"):
        Config.load(None, overrides={"auth": {"client_keys_file": str(tmp_path / "absent.txt")}})


def test_a_hash_sign_is_part_of_a_key_and_a_digest_line_is_a_digest(keys_file):
    keys = ClientKeys.load(keys_file)
    assert keys.accepts([(b"authorization", b"Bearer key#with-hash")])
    assert not keys.accepts([(b"authorization", b"Bearer key")])
    assert keys.accepts([(b"x-api-key", b"client-c")])  # a digest written sha256:...
    digest_of_b = hashlib.sha256(b"client-b").hexdigest().encode()
    assert not keys.accepts([(b"x-api-key", digest_of_b)])  # a digest is not itself a key
    bad = keys_file.with_name("bad.txt")
    bad.write_text("sha256:xyz\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        ClientKeys.load(bad)


async def test_no_header_that_names_the_client_goes_upstream_with_the_gateways_key(held, fake):
    headers = {**bearer("client-a"), "OpenAI-Organization": "org-a", "OpenAI-Project": "p-a"}
    assert (await held.client.post("/v1/chat/completions", json=BODY, headers=headers)).is_success
    sent = fake.calls[-1].headers
    assert "openai-organization" not in sent and "openai-project" not in sent


async def test_with_a_held_key_pass_through_reaches_only_the_model_list(held, fake):
    assert (await held.client.get("/v1/models", headers=bearer("client-a"))).status_code == 200
    stored = await held.client.get("/v1/chat/completions", headers=bearer("client-a"))
    files = await held.client.get("/v1/files", headers=bearer("client-a"))
    assert stored.status_code in (403, 405) and files.status_code == 403
    assert fake.count("/v1/files") == 0


@pytest.mark.parametrize(
    "held",
    [{"api_key": UPSTREAM_KEY}, {"api_keys": [UPSTREAM_KEY, UPSTREAM_KEY]}],
    ids=["one key", "the same key for each replica"],
)
async def test_a_refusal_of_a_call_with_the_gateways_key_takes_no_replica_out(
    gateway_with, keys_file, fake, held
):
    """OpenAI answers 403 to a project's key for a model the project may not use: a refusal of
    that call, not of every call. It was taken for a replica failing: the same call failed
    over to the next replica, each replica left out, /readyz 503: one client's request for a
    model took the gateway out of rotation. (With keys that differ, a refusal is the
    replica's key's: ``test_a_replica_whose_own_key_is_refused_is_left_out_...``.)"""
    config = {"upstream": held, "auth": {"client_keys_file": str(keys_file)}}
    async with gateway_with(upstreams=[fake.url, fake.url], **config) as gw:
        fake.fail_status, fake.fail_times = 403, 1
        fake.fail_body = {
            "error": {
                "message": "Project proj_x does not have access to model o1-pro",
                "type": "invalid_request_error",
                "code": "model_not_found",
            }
        }
        refused = await gw.client.post(
            "/v1/chat/completions", json={**BODY, "model": "o1-pro"}, headers=bearer("client-a")
        )
        assert refused.status_code == 502 and "refused the gateway's key" in refused.text
        assert "proj_x" not in refused.text  # (the upstream's body is still not relayed)
        assert refused.headers["x-should-retry"] == "false"  # (it would be refused again)
        assert fake.count() == 1  # not sent again to the other replica
        health = (await gw.client.get("/healthz")).json()
        assert health["status"] == "ok"
        assert all(replica["healthy"] for replica in health["replicas"].values())
        assert (await gw.client.get("/readyz")).status_code == 200
        ok = await gw.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-a"))
        assert ok.status_code == 200


async def test_an_upstream_refusing_the_gateways_key_is_a_502_that_quotes_nothing(
    held, holding, fake
):
    fake.fail_status = 401
    quoted = holding.secret[:8]
    fake.fail_body = {"error": {"message": f"Incorrect credentials provided: {quoted}****"}}
    response = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-a"))
    assert response.status_code == 502
    assert quoted not in response.text and "refused the gateway's key" in response.text


def test_a_yaml_syntax_error_names_its_line_never_the_lines_text(tmp_path):
    # PyYAML's message quotes the offending line: here the key itself.
    path = tmp_path / "c.yaml"
    path.write_text("admin_token: x\nupstream:\n  api_key: sk-LIVE-SECRET: x\n")
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env={})
    message = str(raised.value)
    assert "sk-LIVE" not in message and "line 3" in message, message


async def test_with_a_held_key_the_upstreams_account_headers_never_reach_a_client(held, fake):
    # OpenAI (and Anthropic) name the account a key belongs to on every answer: the gateway's,
    # not the client's; and its quota left, which every client's calls spend (what the others
    # are doing, read by one), while its when-to-retry is the client's to back off by.
    fake.response_headers = [
        (b"openai-organization", b"org-OPERATOR"),
        (b"openai-project", b"proj_OPERATOR"),
        (b"set-cookie", b"session=OPERATOR; HttpOnly"),
        (b"anthropic-organization-id", b"OPERATOR-org-uuid"),
        (b"x-ratelimit-remaining-requests", b"OPERATOR-4999"),
        (b"anthropic-ratelimit-tokens-remaining", b"OPERATOR-79000"),
        (b"x-ratelimitbysize-remaining", b"OPERATOR-5"),  # (Mistral's)
        (b"RateLimit", b'"OPERATOR";r=9;t=30'),  # (the IETF draft's fields, and earlier drafts')
        (b"RateLimit-Policy", b'"OPERATOR";q=100;w=60'),
        (b"RateLimit-Remaining", b"OPERATOR-9"),
        (b"retry-after", b"3"),
    ]
    response = await held.client.get("/v1/models", headers=bearer("client-a"))
    assert response.status_code == 200
    assert "OPERATOR" not in str(response.headers)
    assert response.headers["retry-after"] == "3"


async def test_where_pass_through_is_opened_no_credential_of_the_client_goes_upstream_next_to_the_gateways(
    gateway_with, keys_file, holding, fake
):
    # The operator opened pass-through (``passthrough.allow``): the one account's files are
    # every client's by choice, but a client's own key (its x-api-key beside the gateway's
    # Basic credentials reached the upstream), its Idempotency-Key (one client's would replay
    # another's answer) and the account's headers still stay on their side of the gateway.
    fake.response_headers = [
        (b"openai-organization", b"org-OPERATOR"),
        (b"set-cookie", b"session=OPERATOR; HttpOnly"),
    ]
    client = {
        **bearer("client-a"),
        "x-api-key": "client-a",
        "api-key": "client-a",
        "OpenAI-Organization": "org-client-a",
        "Idempotency-Key": "k-client-a",
        "X-Idempotency-Key": "k-client-a",
    }
    auth = {"client_keys_file": str(keys_file)}
    async with gateway_with(**holding.config, auth=auth, passthrough={"allow": ["/"]}) as gw:
        files = await gw.client.get("/v1/files", headers=client)
        chat = await gw.client.post("/v1/chat/completions", json=BODY, headers=client)
    assert files.status_code == 200 and chat.status_code == 200
    assert "OPERATOR" not in str(files.headers)
    assert [c.path for c in fake.calls] == ["/v1/files", "/v1/chat/completions"]
    for call in fake.calls:
        assert call.headers["authorization"] == holding.authorization
        assert "client-a" not in json.dumps(call.headers), call.headers


def test_a_user_and_password_in_any_upstream_url_narrow_pass_through_as_a_held_key_does():
    plain, held = "http://10.0.0.1:8000/v1", "http://svc:pw@10.0.0.2:8000/v1"
    password_only, empty = "http://:pw@10.0.0.3:8000/v1", "http://@10.0.0.4:8000/v1"

    def allowed(*upstreams: str, **config: Any) -> list[str]:
        return Config.load(
            env={}, overrides={"upstreams": list(upstreams), **config}
        ).passthrough.allow

    assert allowed(held) == ["/models"]
    assert allowed(plain, held) == ["/models"]  # (any replica's: the account's state is there)
    assert allowed(password_only) == ["/models"]
    # No user and no password: nothing of the gateway's is sent, the client's key goes.
    assert allowed(plain) == allowed(empty) == ["/"]
    assert allowed(held, passthrough={"allow": ["/files"]}) == ["/files"]  # (the operator's)


async def test_each_replica_is_called_with_the_credentials_of_its_own_url_in_place_of_the_clients(
    fake, gateway_with
):
    east = fake.url.replace("http://", "http://east:pw-east@", 1)
    west = fake.url.replace("http://", "http://west:pw-west@", 1)
    config = {
        "upstreams": [east, west, fake.url],
        "routing": {"policy": "round-robin"},
    }
    client = {**bearer("client-a"), "x-api-key": "client-a"}
    async with gateway_with(**config) as gw:
        for prompt in ("one", "two", "three"):
            body = {**BODY, "messages": [{"role": "user", "content": prompt}]}
            response = await gw.client.post("/v1/chat/completions", json=body, headers=client)
            assert response.status_code == 200
    sent = sorted((c.headers["authorization"], c.headers.get("x-api-key")) for c in fake.calls)

    def basic(user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    # The replica without credentials of the gateway's gets the client's, as they came.
    assert sent == [
        (basic("east", "pw-east"), None),
        (basic("west", "pw-west"), None),
        ("Bearer client-a", "client-a"),
    ]


@pytest.mark.parametrize(
    "content", [b"sha256:abc\n", b"\xff\xfe not utf-8\n"], ids=["short digest", "not utf-8"]
)
def test_a_client_keys_file_that_cannot_be_read_is_a_config_error(tmp_path, content):
    # check-config said ok; serve then failed with a traceback (with --workers, each worker's,
    # restarted for ever).
    path = tmp_path / "keys.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="client_keys_file"):
        Config.load(env={}, overrides={"auth": {"client_keys_file": str(path)}})


@pytest.mark.parametrize(
    "how", ["basic", "bearer", "x-api-key", "basic-user", "bearer-tab", "api-key-bearer"]
)
async def test_the_admin_token_presented_to_the_api_is_refused_never_sent_upstream(
    fake, gateway_with, how
):
    """/dashboard asks a browser for Basic credentials at the root of the origin, so the
    browser then sends them with every request there (RFC 7617 2.2), /v1 included: the admin
    token went upstream as the client's credential (a third party's, for a hosted API). A
    request to /v1 that presents it is a 401, read no further, sent nowhere."""
    token = "s3cret-ADMIN-token"
    headers = {
        "basic": {"Authorization": "Basic " + base64.b64encode(f"op:{token}".encode()).decode()},
        "bearer": bearer(token),
        "x-api-key": {"x-api-key": token},
        # (However else it is spelt: as Basic's user name, after a tab, after a scheme where
        # the header takes none.)
        "basic-user": {"Authorization": "Basic " + base64.b64encode(f"{token}:".encode()).decode()},
        "bearer-tab": {"Authorization": f"bearer\t{token}"},
        "api-key-bearer": {"api-key": f"Bearer {token}"},
    }[how]
    async with gateway_with(admin_token=token) as gw:
        for _ in range(2):  # (the second a byte-identical repeat)
            chat = await gw.client.post("/v1/chat/completions", json=BODY, headers=headers)
            assert chat.status_code == 401, chat.text
            assert chat.headers["x-carpool"] == "bypass"
        listed = await gw.client.get("/v1/models", headers=headers)
        assert listed.status_code == 401, listed.text
        assert token not in chat.text + listed.text
        assert chat.json()["error"]["code"] == "admin_token_not_a_credential"
        if how in ("basic", "bearer"):  # (the admin surfaces' own spellings)
            assert (await gw.client.get("/dashboard", headers=headers)).status_code == 200
    assert fake.count() == 0
