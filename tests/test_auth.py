"""Gateway-held upstream keys (``upstream.api_key``) and gateway-side client keys
(``auth.client_keys_file``): clients never see the upstream's key, and a request without a
listed key gets 401 before anything is read, cached, shared or sent upstream."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys

import pytest

from carpool.auth import ClientKeys
from carpool.config import Config, ConfigError

UPSTREAM_KEY = "sk-upstream-Zq8vTq2rWn5p"
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


@pytest.fixture
async def held(gateway_with, keys_file):
    config = {"upstream": {"api_key": UPSTREAM_KEY}, "auth": {"client_keys_file": str(keys_file)}}
    async with gateway_with(**config) as gw:
        yield gw


async def test_the_upstream_gets_the_gateways_key_and_never_the_clients(held, fake, caplog):
    caplog.set_level(logging.DEBUG)
    response = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-a"))
    assert response.status_code == 200 and response.headers["x-carpool"] == "miss"
    (call,) = fake.calls
    assert call.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert "client-a" not in json.dumps(call.headers)
    assert UPSTREAM_KEY not in response.text + json.dumps(dict(response.headers))
    stats = await held.client.get("/stats")
    assert UPSTREAM_KEY not in stats.text
    assert UPSTREAM_KEY not in caplog.text and "client-a" not in caplog.text


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
    assert (await held.client.get("/stats")).json()["rejected"] == 5
    assert held.gateway.store.entries == 0
    # The control endpoints are not the API: /healthz answers whoever asks.
    assert (await held.client.get("/healthz")).status_code == 200


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


async def test_pass_through_goes_with_the_gateways_key(held, fake):
    response = await held.client.get("/v1/models", headers=bearer("client-a"))
    assert response.status_code == 200
    assert fake.calls[-1].headers["authorization"] == f"Bearer {UPSTREAM_KEY}"


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


async def test_a_refusal_of_a_call_with_the_gateways_key_takes_no_replica_out(
    gateway_with, keys_file, fake
):
    """OpenAI answers 403 to a project's key for a model the project may not use: a refusal of
    that call, not of every call. It was taken for a replica failing: the same call failed
    over to the next replica, each replica left out, /readyz 503: one client's request for a
    model took the gateway out of rotation."""
    config = {"upstream": {"api_key": UPSTREAM_KEY}, "auth": {"client_keys_file": str(keys_file)}}
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


async def test_an_upstream_refusing_the_gateways_key_is_a_502_that_quotes_nothing(held, fake):
    fake.fail_status = 401
    fake.fail_body = {"error": {"message": f"Incorrect API key provided: {UPSTREAM_KEY[:8]}****"}}
    response = await held.client.post("/v1/chat/completions", json=BODY, headers=bearer("client-a"))
    assert response.status_code == 502
    assert UPSTREAM_KEY[:8] not in response.text and "refused the gateway's key" in response.text


def test_a_yaml_syntax_error_names_its_line_never_the_lines_text(tmp_path):
    # PyYAML's message quotes the offending line: here the key itself.
    path = tmp_path / "c.yaml"
    path.write_text("admin_token: x\nupstream:\n  api_key: sk-LIVE-SECRET: x\n")
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env={})
    message = str(raised.value)
    assert "sk-LIVE" not in message and "line 3" in message, message


async def test_with_a_held_key_the_upstreams_account_headers_never_reach_a_client(held, fake):
    # OpenAI names the account a key belongs to on every answer: the gateway's, not the client's.
    fake.response_headers = [
        (b"openai-organization", b"org-OPERATOR"),
        (b"openai-project", b"proj_OPERATOR"),
        (b"set-cookie", b"session=OPERATOR; HttpOnly"),
    ]
    response = await held.client.get("/v1/models", headers=bearer("client-a"))
    assert response.status_code == 200
    assert "OPERATOR" not in str(response.headers)


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
