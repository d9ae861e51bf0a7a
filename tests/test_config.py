"""One typed config: file < environment < flags, and bad values named precisely."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from carpool.config import Config, ConfigError


def test_defaults_match_the_contract():
    config = Config()
    assert config.upstreams == [] and config.redis is None and config.sampling == "strict"
    assert config.cache.default_ttl == 3600 and config.cache.max_bytes == 268435456
    assert {k: v.ttl for k, v in config.cache.types.items()} == {
        "translation": 86400,
        "faq": 3600,
        "code": 1800,
        "realtime": 300,
        "factual": 0,
    }
    assert config.coalesce.window_ms == 1000 and config.coalesce.join_timeout_ms == 30000
    assert config.limits.max_body_bytes == 8388608 and config.limits.upstream_timeout == 600
    assert config.idempotency.retention == 86400 and config.tenant.header == "Authorization"
    assert config.fingerprint.normalize_whitespace is False
    assert config.coalesce.adaptive is True and config.coalesce.finish_abandoned is False
    assert config.semantic.enabled is False and config.semantic.threshold is None
    assert config.tenant.shared_namespaces == [] and config.idempotency.on_conflict == "reject"
    assert config.routing.policy == "cache-aware"
    assert config.batching.max_batch_size == 32 and config.batching.max_batch_delay_ms == 5
    assert config.admin_token is None and (config.host, config.port) == ("127.0.0.1", 8080)


def test_flags_override_environment_override_file(tmp_path):
    path = tmp_path / "carpool.yaml"
    path.write_text("port: 1000\ncache:\n  default_ttl: 10\n  types:\n    faq: {ttl: 5}\n")
    env = {"CARPOOL_PORT": "2000", "CARPOOL_COALESCE__WINDOW_MS": "250"}
    config = Config.load(path, env=env, overrides={"port": 3000})
    assert config.port == 3000
    assert config.coalesce.window_ms == 250
    assert config.cache.default_ttl == 10
    assert config.cache.types["faq"].ttl == 5 and config.cache.types["code"].ttl == 1800
    assert Config.load(path, env=env).port == 2000


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"sampling": "loose"}, "sampling"),
        ({"cache": {"max_bytes": -1}}, "cache.max_bytes"),
        ({"coalesce": {"window_msec": 5}}, "coalesce.window_msec"),
        ({"upstreams": ["localhost:8000"]}, "upstreams"),
        # What serve would fail on later, refused when the config loads (check-config too).
        ({"upstreams": ["http://llm:99999/v1"]}, "upstreams"),
        ({"upstreams": ["http://svc:pw@/v1"]}, "upstreams"),
        ({"upstreams": ["http://[::1/v1"]}, "upstreams"),
        ({"upstreams": ["http://"]}, "upstreams"),
        ({"redis": "redis://[::1:6379/0"}, "redis"),
        ({"redis": "http://cache:6379"}, "redis"),
        ({"semantic": {"judge": {"url": "judge:8000/v1"}}}, "semantic.judge.url"),
        ({"cache": {"types": {"Realtime": {"ttl": 5}, "realtime": {"ttl": 6}}}}, "cache.types"),
    ],
)
def test_a_bad_value_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides=overrides)
    assert field in str(raised.value)


@pytest.mark.parametrize(
    "coalesce, field",
    [
        ({"window_ms": 5000}, "coalesce.window_ms"),  # above the default max_window_ms, 3000
        ({"window_ms": 500, "max_window_ms": 400}, "coalesce.window_ms"),
        ({"min_window_ms": 4000}, "coalesce.min_window_ms"),
    ],
)
def test_the_adaptive_window_stays_within_its_staleness_bound_or_the_config_is_refused(
    coalesce, field
):
    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides={"coalesce": coalesce})
    assert field in str(raised.value) and "coalesce.max_window_ms" in str(raised.value)
    # Without adaptive, the window is window_ms as given (the bounds are the adaptive one's).
    fixed = Config.load(env={}, overrides={"coalesce": {**coalesce, "adaptive": False}})
    assert fixed.coalesce.window_ms == coalesce.get("window_ms", 1000)


def test_a_max_window_ms_alone_below_the_default_window_is_accepted_and_bounds_it():
    # Refused once the bound was checked (the default window_ms, 1000, is above 500): a config
    # that started before. The default is held to the bound instead.
    from carpool.wiring import window_policy

    config = Config.load(env={}, overrides={"coalesce": {"max_window_ms": 500}})
    assert window_policy(config.coalesce).window("new", 0, 0.1) == 0.5


@pytest.mark.parametrize("routing", [{"backoff_s": 120}, {"backoff_s": 10, "backoff_max_s": 8}])
def test_a_back_off_above_its_maximum_is_refused_naming_both(routing):
    # Accepted before: every back-off was then the maximum, never the back-off the config gave.
    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides={"routing": routing})
    assert "routing.backoff_s" in str(raised.value)
    assert "routing.backoff_max_s" in str(raised.value)


def test_a_back_off_maximum_alone_below_the_default_back_off_is_accepted_and_bounds_it():
    # As max_window_ms alone: a config that started before the check is held to its bound.
    config = Config.load(env={}, overrides={"routing": {"backoff_max_s": 2}})
    assert config.routing.backoff_max_s == 2 and config.routing.backoff_s == 5


@pytest.mark.parametrize(
    "limits, coalesce",
    [
        ({"upstream_queue_timeout": 15}, {}),  # twice 15 s: the default join timeout, 30 s
        ({"upstream_queue_timeout": 4}, {"join_timeout_ms": 5000}),
    ],
)
def test_a_queue_timeout_that_with_its_failover_could_outlast_the_join_timeout_is_refused(
    limits, coalesce
):
    # A flight's call may wait for a connection twice (its replica's, then another's): past
    # the join timeout its joiners would each have made their own call, queued as long again.
    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides={"limits": limits, "coalesce": coalesce})
    assert "limits.upstream_queue_timeout" in str(raised.value)
    assert "coalesce.join_timeout_ms" in str(raised.value)


def test_a_join_timeout_alone_below_twice_the_default_queue_timeout_holds_it_under_half():
    # As max_window_ms alone: such a config was accepted before the check; the default queue
    # timeout (10 s) follows it, a third of it.
    config = Config.load(env={}, overrides={"coalesce": {"join_timeout_ms": 6000}})
    assert config.limits.upstream_queue_timeout == 2
    assert Config.load(env={}).limits.upstream_queue_timeout == 10


def test_a_request_types_policy_applies_whatever_the_case_of_its_key():
    # A request's type is read lower-cased (x-carpool-type: Realtime is realtime): a key given
    # as Realtime must be that type's policy, not one that never applies.
    config = Config.load(env={}, overrides={"cache": {"types": {"Realtime": {"ttl": 5}}}})
    assert config.ttl_for("realtime") == 5 and "Realtime" not in config.cache.types


def test_an_environment_variable_beats_a_file_type_key_written_in_another_case(tmp_path):
    # Variable names are read lower-cased: the file's Realtime and the variable's realtime were
    # merged as two keys, then refused ("two keys differ only in case"), not the variable won.
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  types:\n    Realtime: {ttl: 5}\n    NEWS: {ttl: 60}\n")
    assert Config.load(path, env={}).ttl_for("realtime") == 5
    env = {"CARPOOL_CACHE__TYPES__REALTIME__TTL": "10"}
    config = Config.load(path, env=env)
    assert config.ttl_for("realtime") == 10 and config.ttl_for("news") == 60
    assert set(config.cache.types) == {"translation", "faq", "code", "realtime", "factual", "news"}
    overridden = {"cache": {"types": {"ReAlTiMe": {"ttl": 20}}}}
    assert Config.load(path, env=env, overrides=overridden).ttl_for("realtime") == 20
    # A whole section given in a variable is one source too.
    whole = {"CARPOOL_CACHE": "{types: {REALTIME: {ttl: 30}}}"}
    assert Config.load(path, env=whole).ttl_for("realtime") == 30
    # Within one source, two keys that differ only in case are still refused.
    path.write_text("cache:\n  types:\n    Realtime: {ttl: 5}\n    realtime: {ttl: 6}\n")
    with pytest.raises(ConfigError, match="cache.types"):
        Config.load(path, env=env)


def test_ttl_for_a_type_falls_back_to_the_default():
    config = Config()
    assert config.ttl_for("factual") == 0 and config.ttl_for("unknown") == 3600
    assert config.ttl_for(None) == 3600


def test_the_config_reference_in_docs_is_generated_from_the_model():
    from pathlib import Path

    from carpool.config import reference_markdown

    committed = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert committed == reference_markdown(), "run: carpool config-reference > docs/config.md"
    for name in Config.model_fields:
        assert f"`{name}" in committed


# The environment is read by pydantic-settings (carpool.config.loader): the names, the YAML values
# and the precedence are the ones documented before it was.


def test_nested_keys_at_any_depth_and_names_in_any_case_after_the_prefix():
    env = {
        "CARPOOL_CACHE__TYPES__FAQ__TTL": "7",
        "CARPOOL_CACHE__TYPES__NEWS__TTL": "60",
        "CARPOOL_Coalesce__Window_MS": "250",
        "CARPOOL_SEMANTIC__ENABLED": "true",
    }
    config = Config.load(env=env)
    assert config.cache.types["faq"].ttl == 7 and config.cache.types["news"].ttl == 60
    assert config.cache.types["code"].ttl == 1800  # the other defaults stay
    assert config.coalesce.window_ms == 250 and config.semantic.enabled is True
    # Only ``CARPOOL_`` in capitals is ours; CARPOOL_CONFIG names the file, not a key.
    assert Config.load(env={"carpool_port": "1", "CARPOOL_CONFIG": "x.yaml"}) == Config()


def test_the_variables_carpool_reads_that_are_no_keys_are_not_refused_as_unknown_keys():
    # CARPOOL_REDIS_SERVER (the server `carpool bench` and the tests start), set in a shell,
    # made every command that reads a config refuse to start: "redis_server: unknown key".
    not_keys = ("CARPOOL_CONFIG", "CARPOOL_PEERS", "CARPOOL_RUN", "CARPOOL_PARENT")
    not_keys += ("CARPOOL_REDIS_SERVER",)
    assert Config.load(env=dict.fromkeys(not_keys, "x")) == Config()


def test_values_are_yaml_lists_mappings_and_scalars():
    env = {
        "CARPOOL_UPSTREAMS": "[http://a:8000/v1, http://b:8000/v1/]",
        "CARPOOL_SEMANTIC__SCRIPTS": '["Latin", "Greek"]',
        "CARPOOL_CACHE__TYPES": "{code: {ttl: 1}}",
        "CARPOOL_SEMANTIC__THRESHOLD": "0.8",
        "CARPOOL_ADMIN_TOKEN": "@not-yaml",  # YAML cannot read it: the string as written
    }
    config = Config.load(env=env)
    assert config.upstreams == ["http://a:8000/v1", "http://b:8000/v1"]
    assert config.semantic.scripts == ["Latin", "Greek"] and config.semantic.threshold == 0.8
    assert config.cache.types["code"].ttl == 1 and config.cache.types["faq"].ttl == 3600
    assert config.admin_token == "@not-yaml"


def test_a_single_url_in_carpool_upstreams_is_a_one_replica_list():
    # `upstreams` is "same as --upstream": one URL, as the flag takes it, was refused ("upstreams:
    # Input should be a valid list"); only the YAML list '[http://.../v1]' was read.
    config = Config.load(env={"CARPOOL_UPSTREAMS": "http://127.0.0.1:8000/v1"})
    assert config.upstreams == ["http://127.0.0.1:8000/v1"]
    # Any list key, at any depth, found by its type (not by its name).
    env = {
        "CARPOOL_TENANT__SHARED_NAMESPACES": "pub",
        "CARPOOL_UPSTREAMS": "http://a:8000/v1",
        "CARPOOL_UPSTREAM__API_KEYS": "sk-one",
        "CARPOOL_SEMANTIC__JUDGE__OVERRULES": "entity",
    }
    config = Config.load(env=env)
    assert config.tenant.shared_namespaces == ["pub"]
    assert [k.get_secret_value() for k in config.upstream.api_keys] == ["sk-one"]
    assert config.semantic.judge.overrules == ["entity"]
    # A key that is not a list keeps its one value (a port, a URL).
    config = Config.load(env={"CARPOOL_ADMIN_TOKEN": "a,b", "CARPOOL_PORT": "8081"})
    assert config.admin_token == "a,b" and config.port == 8081


def test_a_comma_separated_env_list_is_a_list():
    env = {
        "CARPOOL_UPSTREAMS": "http://a:8000/v1, http://b:8000/v1",
        "CARPOOL_TENANT__SHARED_NAMESPACES": "pub,docs",
        "CARPOOL_SEMANTIC__SCRIPTS": " Latin , Greek ",
        "CARPOOL_UPSTREAM_NAMES": "left,right",
    }
    config = Config.load(env=env)
    assert config.upstreams == ["http://a:8000/v1", "http://b:8000/v1"]
    assert config.tenant.shared_namespaces == ["pub", "docs"]
    assert config.semantic.scripts == ["Latin", "Greek"]
    assert config.upstream_names == ["left", "right"]
    # The YAML list is read as before, commas inside its quoted items kept.
    env = {"CARPOOL_TENANT__SHARED_NAMESPACES": '["a,b", c]'}
    assert Config.load(env=env).tenant.shared_namespaces == ["a,b", "c"]
    # An empty item is an item, refused by its key as in a file: a stray comma is not dropped.
    with pytest.raises(ConfigError, match="tenant.shared_namespaces"):
        Config.load(env={"CARPOOL_TENANT__SHARED_NAMESPACES": "pub,"})


def test_carpool_upstream_holding_a_url_says_carpool_upstreams(tmp_path):
    # CARPOOL_UPSTREAM is the `upstream` section (the key the gateway holds...), not the
    # --upstream flag's replicas: the error said only "should be a valid dictionary".
    with pytest.raises(ConfigError) as raised:
        Config.load(env={"CARPOOL_UPSTREAM": "http://user:pw@127.0.0.1:8000/v1"})
    message = str(raised.value)
    assert "did you mean CARPOOL_UPSTREAMS" in message and "upstream:" in message
    assert "pw" not in message
    # The same mistake in the file is named as the file's key.
    path = tmp_path / "carpool.yaml"
    path.write_text("upstream: http://127.0.0.1:8000/v1\n")
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env={})
    assert "did you mean `upstreams`" in str(raised.value)
    assert "CARPOOL_UPSTREAMS" not in str(raised.value)
    # A section given whole is still a section.
    config = Config.load(env={"CARPOOL_UPSTREAM": "{stream_usage: false}"})
    assert config.upstream.stream_usage is False


def test_an_empty_or_null_variable_sets_null_over_the_file(tmp_path):
    path = tmp_path / "carpool.yaml"
    path.write_text("redis: redis://localhost:6379/0\nadmin_token: secret\n")
    assert Config.load(path, env={}).admin_token == "secret"
    config = Config.load(path, env={"CARPOOL_REDIS": "", "CARPOOL_ADMIN_TOKEN": "null"})
    assert config.redis is None and config.admin_token is None
    with pytest.raises(ConfigError, match="upstreams"):
        Config.load(env={"CARPOOL_UPSTREAMS": ""})  # null is not a list


def test_a_section_given_whole_takes_its_nested_variables_over_it_in_any_order():
    whole, nested = (
        ("CARPOOL_CACHE", "{max_bytes: 5, default_ttl: 1}"),
        ("CARPOOL_CACHE__DEFAULT_TTL", "9"),
    )
    for env in (dict([whole, nested]), dict([nested, whole])):
        config = Config.load(env=env)
        assert config.cache.max_bytes == 5 and config.cache.default_ttl == 9


def test_precedence_of_a_nested_key_file_then_environment_then_overrides(tmp_path):
    path = tmp_path / "carpool.yaml"
    path.write_text("cache:\n  default_ttl: 10\n  max_bytes: 1000\nsim:\n  replicas: 2\n")
    env = {"CARPOOL_CACHE__DEFAULT_TTL": "20", "CARPOOL_SIM__REPLICAS": "3"}
    config = Config.load(path, env=env, overrides={"cache": {"default_ttl": 30}})
    assert config.cache.default_ttl == 30  # the override wins...
    assert config.cache.max_bytes == 1000  # ...key by key: the file's other keys stay
    assert config.sim.replicas == 3
    assert Config.load(path, env=env).cache.default_ttl == 20
    assert Config.load(path, env={}).cache.default_ttl == 10


@pytest.mark.parametrize(
    "env, field",
    [
        ({"CARPOOL_SAMPLNG": "strict"}, "samplng: unknown key"),
        ({"CARPOOL_CACHE__MAX_BYTESS": "1"}, "cache.max_bytess: unknown key"),
        ({"CARPOOL_BOGUS__X": "1"}, "bogus: unknown key"),
        ({"CARPOOL_PORT__X": "1", "CARPOOL_PORT": "5"}, "port:"),  # port has no keys
        ({"CARPOOL_CACHE__MAX_BYTES": "-1"}, "cache.max_bytes"),
        ({"CARPOOL_SEMANTIC__SCRIPTS": "{Latin: 1}"}, "semantic.scripts"),
        ({"CARPOOL_SEMANTIC__JUDGE__OVERRULES": "entity,nonsense"}, "semantic.judge.overrules"),
    ],
)
def test_a_variable_that_names_no_key_or_a_bad_value_is_an_error_naming_it(env, field):
    with pytest.raises(ConfigError) as raised:
        Config.load(env=env)
    assert field in str(raised.value)


def test_load_reads_os_environ_unless_given_one_and_a_plain_config_reads_nothing(monkeypatch):
    monkeypatch.setenv("CARPOOL_PORT", "2345")
    assert Config.load().port == 2345
    assert Config.load(env={}).port == 8080
    assert Config().port == 8080
    assert type(Config.load()) is Config


def test_the_file_and_the_overrides_name_keys_exactly(tmp_path):
    path = tmp_path / "carpool.yaml"
    path.write_text("Port: 1\n")
    with pytest.raises(ConfigError, match="Port: unknown key"):
        Config.load(path, env={})
    with pytest.raises(ConfigError, match="PORT: unknown key"):
        Config.load(env={}, overrides={"PORT": 1})
    with pytest.raises(ConfigError, match="config file"):
        Config.load(tmp_path / "missing.yaml", env={})


def test_a_scalar_variable_is_the_string_as_written_read_by_its_keys_type():
    # Read as YAML, "&Xyz123" was an anchor (null: the admin token dropped, /stats open),
    # "abc #tail" lost its tail, "~" was null, and on/off/yes were booleans a key of those
    # words refused.
    env = {
        "CARPOOL_ADMIN_TOKEN": "&Xyz123",
        "CARPOOL_UPSTREAM__API_KEY": "sk #tail",
        "CARPOOL_TRACING": "off",
        "CARPOOL_BATCHING__EMBEDDINGS": "on",
        "CARPOOL_PORT": "8081",
        "CARPOOL_SEMANTIC__ENABLED": "yes",
        "CARPOOL_SEMANTIC__THRESHOLD": "0.5",
        "CARPOOL_HOST": "::",
    }
    config = Config.load(env=env)
    assert config.admin_token == "&Xyz123"
    assert config.upstream.api_key is not None
    assert config.upstream.api_key.get_secret_value() == "sk #tail"
    assert (config.tracing, config.batching.embeddings) == ("off", "on")
    assert (config.port, config.semantic.enabled, config.semantic.threshold) == (8081, True, 0.5)
    assert config.host == "::"
    assert Config.load(env={"CARPOOL_ADMIN_TOKEN": "~"}).admin_token == "~"


def test_on_and_off_written_bare_in_a_file_are_the_words(tmp_path):
    # YAML 1.1 reads a bare on/off as a boolean: the documented "tracing: off" was refused.
    path = tmp_path / "carpool.yaml"
    path.write_text("tracing: off\nbatching:\n  embeddings: on\n")
    config = Config.load(path, env={})
    assert (config.tracing, config.batching.embeddings) == ("off", "on")


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_a_duration_is_a_finite_number(value, tmp_path):
    # Accepted, then every put with redis failed (OverflowError: a 502 for each request).
    path = tmp_path / "carpool.yaml"
    for field in ("cache.default_ttl", "idempotency.retention", "limits.upstream_timeout"):
        section, key = field.split(".")
        path.write_text(f"{section}:\n  {key}: {value}\n")  # (YAML's infinity, read as one)
        with pytest.raises(ConfigError, match=key):
            Config.load(path, env={})


def test_a_ttl_a_retention_or_a_lease_past_100_years_is_refused_naming_it():
    # 1e300 was accepted: every put in Redis failed (an expiry it cannot take), unsaid.
    from carpool.config.base import LONGEST_TTL

    for overrides, field in (
        ({"cache": {"default_ttl": 1e300}}, "default_ttl"),
        ({"cache": {"types": {"faq": {"ttl": LONGEST_TTL + 1}}}}, "ttl"),
        ({"idempotency": {"retention": 1e300}}, "retention"),
        # (Expiries in Redis too: a lease of 1e16 s took the instance off Redis.)
        ({"idempotency": {"lease": 1e16}}, "lease"),
        ({"distributed": {"lease_ms": 1e300}}, "lease_ms"),
        ({"coalesce": {"max_window_ms": 1e300}}, "max_window_ms"),
    ):
        with pytest.raises(ConfigError, match=field):
            Config.load(env={}, overrides=overrides)


@pytest.mark.parametrize(
    "field, files",
    [
        ("model_dir", ["model.safetensors", "tokenizer.json"]),
        ("verifier_dir", ["verifier.json", "model.onnx", "tokenizer.json"]),
    ],
)
def test_a_semantic_model_folder_that_is_not_one_is_a_config_error(field, files, tmp_path):
    # check-config said ok; serve then failed with a FileNotFoundError traceback. A folder
    # without one of its files is refused naming it (its digests are checked when it loads).
    with pytest.raises(ConfigError, match=field):
        Config.load(env={}, overrides={"semantic": {field: str(tmp_path / "nowhere")}})
    for name in files:
        with pytest.raises(ConfigError, match=f"{field}.*{name}"):
            Config.load(env={}, overrides={"semantic": {field: str(tmp_path)}})
        (tmp_path / name).write_text("{}")
    assert getattr(
        Config.load(env={}, overrides={"semantic": {field: str(tmp_path)}}).semantic, field
    )


@pytest.mark.parametrize(
    "url, said",
    [
        # redis-py read the path as database 0: the instances shared another database.
        ("redis://cache:6379/abc", "database number"),
        # check-config said ok; serve failed at the first connection (a TypeError per call).
        ("redis://:s3cret@cache:6379/0?foo=1", "'foo'"),
        ("redis://cache:6379/0?socket_timeout=abc", "socket_timeout"),
        ("redis://cache:6379/0?protocol=9", "protocol"),
    ],
)
def test_a_redis_url_redis_py_would_refuse_or_misread_is_a_config_error(url, said):
    with pytest.raises(ConfigError, match="redis") as raised:
        Config.load(env={}, overrides={"redis": url})
    assert said in str(raised.value) and "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://cache:6379",
        "redis://cache:6379/",
        "redis://cache/3",
        "unix:///run/r.sock?db=2",
        "redis://cache:6379/2/",  # (redis-py: database 2)
        "redis://cache:6379/%31",  # (database 1)
        "redis://cache:6379/0?read_from_replicas=true",  # (a cluster client's option)
    ],
)
def test_a_redis_url_redis_py_reads_is_accepted(url):
    assert Config.load(env={}, overrides={"redis": url}).redis == url


def test_a_redis_key_prefix_with_a_hash_tag_brace_is_a_config_error():
    # check-config said ok; serve failed building the shared layers (ValueError traceback).
    with pytest.raises(ConfigError, match="distributed.key_prefix"):
        Config.load(env={}, overrides={"distributed": {"key_prefix": "app{1}:"}})


def test_fingerprint_neutral_headers_are_lower_cased_header_names_never_a_credential():
    config = Config.load(
        env={}, overrides={"fingerprint": {"neutral_headers": ["X-Edge-Request", "x-edge-request"]}}
    )
    assert config.fingerprint.neutral_headers == ["x-edge-request"]
    assert Config().fingerprint.neutral_headers == []
    for name, said in [
        ("x edge", "not a header name"),
        ("", "not a header name"),
        ("x-\u212aey-id", "not a header name"),  # the Kelvin sign lower-cases to "k"
        ("X-Api-Key", "credential"),
        ("Authorization", "credential"),
        ("x-session-id", "credential"),
        ("cookie", "credential"),
    ]:
        with pytest.raises(ConfigError, match="fingerprint.neutral_headers") as raised:
            Config.load(env={}, overrides={"fingerprint": {"neutral_headers": [name]}})
        assert said in str(raised.value), name


def test_the_embedders_key_is_a_secret_read_from_the_environment_never_shown_kept_for_workers(
    monkeypatch,
):
    # semantic.embedder_api_key: like the judge's key (``${VAR}`` read at start, an empty one
    # refused), hidden from dumps and /admin/config, handed to `serve --workers` children.
    monkeypatch.setenv("CARPOOL_TEST_EMBEDDER_KEY", "sk-embedder")
    config = Config(semantic={"embedder_api_key": "${CARPOOL_TEST_EMBEDDER_KEY}"})
    key = config.semantic.embedder_api_key
    assert key is not None and key.get_secret_value() == "sk-embedder"
    assert "sk-embedder" not in str(config.model_dump(mode="json"))
    assert config.with_secrets()["semantic"]["embedder_api_key"] == "sk-embedder"
    assert Config.model_validate(config.with_secrets()).semantic.embedder_api_key == key
    for empty in ("", "${CARPOOL_TEST_NOT_SET}"):
        with pytest.raises(ValueError, match="embedder_api_key"):
            Config(semantic={"embedder_api_key": empty})


# ------------------------------------------------------- the config a worker of --workers N loads


def _leaves(model: type, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """A strategy per leaf key of the config (by its type and bounds), but for the paths that
    name files or folders, whose checks read the disk."""
    from pydantic import BaseModel

    leaves: dict[tuple[str, ...], Any] = {}
    for name, field in model.model_fields.items():
        where = (*path, name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            leaves.update(_leaves(annotation, where))
        elif not name.endswith(("_dir", "_file")) and name != "redis":
            leaves[where] = _values(annotation, field.metadata)
    return leaves


def _values(annotation: Any, metadata: list[Any]) -> Any:
    from typing import Literal, get_args, get_origin

    from hypothesis import strategies as st
    from pydantic import SecretStr

    bounds = {
        kind: getattr(m, kind) for m in metadata for kind in ("ge", "gt", "le") if hasattr(m, kind)
    }
    low = bounds.get("ge", bounds.get("gt", -1))
    high = bounds.get("le", 10**7)
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(int(low), int(min(high, 10**7)))
    if annotation is float:
        edges = st.sampled_from([v for v in (0.0, 1e-05, 40, 500, 1000, 3000) if low <= v <= high])
        return edges | st.floats(low, high, allow_nan=False)
    if annotation in (str, SecretStr):
        return st.text(max_size=12) | st.sampled_from(["tok-\U0001f600", "yes", "null", "1e-05"])
    if origin is Literal:
        return st.sampled_from(args)
    if type(None) in args:  # X | None
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | _values(inner, metadata)
    if origin is list:
        (inner,) = args
        if inner is str and annotation is not None:
            urls = st.sampled_from(["http://a/v1", "http://b:8000/v1", "https://u:p@c/v1beta/x"])
            return st.lists(urls | st.text(max_size=12), max_size=3)
        return st.lists(_values(inner, []), max_size=3)
    if origin is tuple:
        return st.tuples(*(_values(a, metadata) for a in args))
    if origin is dict:
        return st.dictionaries(
            st.text(max_size=8), st.fixed_dictionaries({"ttl": st.floats(0, 10)})
        )
    return st.nothing()


_LEAVES = _leaves(Config)


def _configs() -> Any:
    from hypothesis import strategies as st

    def nested(values: dict[tuple[str, ...], Any]) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for path, value in values.items():
            node = tree
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        return tree

    paths = st.lists(st.sampled_from(sorted(_LEAVES)), unique=True, max_size=6)
    return paths.flatmap(lambda chosen: st.fixed_dictionaries({p: _LEAVES[p] for p in chosen})).map(
        nested
    )


def _accepted(overrides: dict[str, Any]) -> Config | None:
    try:
        return Config.load(env={}, overrides=overrides)
    except ConfigError:
        return None


@pytest.mark.parametrize(
    "overrides",
    [
        {"coalesce": {"max_window_ms": 500}},  # (the default window_ms, 1000, held to it)
        {"coalesce": {"max_window_ms": 40}},  # (and the default min_window_ms, 50)
        {"admin_token": "tok-\U0001f600"},  # (outside the BMP: JSON wrote a surrogate pair)
        {"upstreams": ["http://a/v1"], "upstream_names": ["\U0001f600"]},  # (refused there)
        {"semantic": {"embedding_model": "e\u2028x\x85"}},  # (YAML line breaks)
        {"upstreams": ["http://a/v1"], "upstream": {"api_key": "sk-\u00e9"}},  # (allow: /models)
        {"semantic": {"audit_rate": 0.00001}},  # (JSON's 1e-05 is a string to YAML)
    ],
)
def test_a_worker_rebuilds_exactly_the_config_its_parent_validated(overrides, tmp_path):
    """`carpool serve --workers N` writes the config it validated to a file each worker loads
    (``resolved_text``, then ``load_resolved(file)``): every config check-config accepts
    comes back equal, with the same keys given (a validator may tell them from defaults)."""
    from carpool.config.loader import load_resolved, resolved_text

    config = Config.load(env={}, overrides=overrides)
    path = tmp_path / "resolved.yaml"
    path.write_text(resolved_text(config), encoding="ascii")
    loaded = load_resolved(path)
    assert loaded == config and loaded.with_secrets() == config.with_secrets()


@pytest.mark.parametrize(
    "overrides",
    [
        {"upstream": {"api_key": "${TEST_HELD_MYKEY}"}},
        {"upstreams": ["http://a/v1"], "upstream": {"api_keys": ["${TEST_HELD_MYKEY}"]}},
        {"semantic": {"judge": {"api_key": "${TEST_HELD_MYKEY}"}}},
        {"semantic": {"embedder_api_key": "${TEST_HELD_MYKEY}"}},
    ],
)
def test_a_child_takes_a_resolved_key_that_looks_like_a_variable_as_it_is(
    overrides, monkeypatch, tmp_path
):
    """Every held key's ``${NAME}`` is read once, where the config is loaded: a value that looks
    like ``${OTHER}`` is that key in a worker (its file) and the bench's embedded gateway (its
    data) too, never a variable's name read a second time ("OTHER ... is not set")."""
    from carpool.config.loader import load_resolved, resolved_text

    monkeypatch.setenv("TEST_HELD_MYKEY", "${TEST_HELD_OTHER}")
    monkeypatch.delenv("TEST_HELD_OTHER", raising=False)
    config = Config.load(env={}, overrides=overrides)
    path = tmp_path / "resolved.yaml"
    path.write_text(resolved_text(config), encoding="ascii")
    for rebuilt in (load_resolved(path), Config.from_secrets(config.with_secrets())):
        assert rebuilt == config and rebuilt.with_secrets() == config.with_secrets()
        assert "${TEST_HELD_OTHER}" in str(rebuilt.with_secrets())
    # The key is read from the environment where the config is first loaded, as before.
    monkeypatch.setenv("TEST_HELD_OTHER", "sk-other")
    assert "sk-other" not in str(load_resolved(path).with_secrets())


def test_a_worker_rebuilds_exactly_the_config_its_parent_validated_whatever_the_config(
    tmp_path_factory,
):
    """The property over generated configs (any keys, values within their bounds or not, text
    in any script): each that loads is rebuilt exactly, a field assigned after loading too
    (``carpool serve`` sets ``distributed.cluster`` when Redis is a cluster node)."""
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    from carpool.config.loader import load_resolved, resolved_text

    folder = tmp_path_factory.mktemp("resolved")

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
    )
    @given(_configs(), st.booleans())
    def rebuilt(overrides: dict[str, Any], cluster: bool) -> None:
        config = _accepted(overrides)
        assume(config is not None)
        assert config is not None
        if cluster:
            config.distributed.cluster = True
        path = folder / "resolved.yaml"
        path.write_text(resolved_text(config), encoding="ascii")
        loaded = load_resolved(path)
        assert loaded == config and loaded.with_secrets() == config.with_secrets()

    rebuilt()


# ----------------------------------------------------------------------- values that never apply


def test_a_config_file_that_is_not_utf8_is_a_config_error_naming_the_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b'admin_token: "\xff\xfe"\n')
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env={})
    assert str(path) in str(raised.value) and "not UTF-8" in str(raised.value)
    assert "byte 14" in str(raised.value)


@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_host_is_refused_every_interface_must_be_written(host):
    # An empty host is every interface to uvicorn and socket.create_server: never by accident.
    with pytest.raises(ConfigError, match="host"):
        Config.load(env={}, overrides={"host": host})
    for every in ("0.0.0.0", "::"):
        assert Config.load(env={}, overrides={"host": every}).host == every


@pytest.mark.parametrize(
    "host", ["http://127.0.0.1", "127.0.0.1:8080", "a b", "0.0.0.0.0", "999.1.1.1", "[x]", "-x"]
)
def test_a_host_that_is_neither_an_ip_address_nor_a_host_name_is_refused(host):
    # check-config said ok, and showed "listening on http://127.0.0.1:8080"; serve then
    # failed to listen (exit 2): what serve refuses, the config refuses when it loads.
    with pytest.raises(ConfigError, match="host") as raised:
        Config.load(env={}, overrides={"host": host})
    said = str(raised.value)
    assert "no IPv4 address" in said or "no address to listen on" in said, said
    for good in ("127.0.0.1", "::1", "fe80::1%lo", "localhost", "gateway_1", "gw.example.com."):
        assert Config.load(env={}, overrides={"host": good}).host == good
    for good in ("127.1", "0", "2130706433"):  # (IPv4 forms the socket calls take)
        assert Config.load(env={}, overrides={"host": good}).host == good


def test_an_ipv6_host_in_brackets_is_taken_without_them_and_shown_with_them(tmp_path):
    # "--host [::1]" was refused with a hint about YAML that cannot be read (it starts with a
    # bracket); "host: '::1'" was shown as "listening on ::1:8080".
    for host in ("[::1]", "[::]", "[fe80::1%lo]"):
        assert Config.load(env={}, overrides={"host": host}).host == host[1:-1]
    with pytest.raises(ConfigError, match="host"):
        Config.load(env={}, overrides={"host": "[127.0.0.1]"})  # (IPv6's form only)
    path = tmp_path / "c.yaml"
    path.write_text("host: '::1'\n")
    done = subprocess.run(
        [sys.executable, "-m", "carpool", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "listening on [::1]:8080" in done.stdout, done.stdout


@pytest.mark.parametrize("token", ["", "   ", " tok", "tok ", "to\nken", "tok\x00"])
def test_an_admin_token_is_one_a_client_can_present_never_empty(token, tmp_path):
    # Empty, it meant "no token": the admin surfaces open. With white space around it or a
    # control character, no Bearer header could carry it.
    with pytest.raises(ConfigError, match="admin_token"):
        Config.load(env={}, overrides={"admin_token": token})
    path = tmp_path / "c.yaml"
    path.write_text("admin_token: from-the-file\n")
    if not token.strip():  # an empty variable is a secret that was not mounted: refused too
        with pytest.raises(ConfigError, match="admin_token"):
            Config.load(path, env={"CARPOOL_ADMIN_TOKEN": token})
    assert Config.load(path, env={"CARPOOL_ADMIN_TOKEN": "null"}).admin_token is None
    assert Config.load(path, env={}).admin_token == "from-the-file"


@pytest.mark.parametrize(
    "tenant, field",
    [
        ({"header": "Bad Header"}, "tenant.header"),
        ({"header": ""}, "tenant.header"),
        ({"header": "x-\u212aey"}, "tenant.header"),  # (the Kelvin sign)
        ({"credential_headers": ["x y"]}, "tenant.credential_headers"),
        ({"credential_headers": ["api-key", ""]}, "tenant.credential_headers"),
    ],
)
def test_tenant_headers_are_header_names(tenant, field):
    # A name no request can carry would never be part of the tenant, silently.
    with pytest.raises(ConfigError, match=field):
        Config.load(env={}, overrides={"tenant": tenant})
    config = Config.load(env={}, overrides={"tenant": {"header": "X-Team-Key"}})
    assert config.tenant.header == "X-Team-Key"


@pytest.mark.parametrize("namespace", ["", "  ", " faq", "n" * 257, "a\tb"])
def test_a_shared_namespace_is_one_a_client_can_name(namespace):
    # x-carpool-namespace is stripped, 1-256 printable characters; none is the default
    # namespace, never shared: such an entry would share nothing, silently.
    with pytest.raises(ConfigError, match="tenant.shared_namespaces"):
        Config.load(env={}, overrides={"tenant": {"shared_namespaces": ["ok", namespace]}})
    shared = Config.load(env={}, overrides={"tenant": {"shared_namespaces": ["faq", "n" * 256]}})
    assert shared.tenant.shared_namespaces == ["faq", "n" * 256]


@pytest.mark.parametrize("name", ["", "  ", " realtime ", "t" * 257, "a\tb"])
def test_a_cache_type_is_one_a_client_can_name(name):
    # x-carpool-type is stripped, 1-256 printable characters: a policy under any other name
    # never applies, and a `ttl: 0` meant to keep answers out of the cache kept them an hour.
    with pytest.raises(ConfigError, match="cache.types"):
        Config.load(env={}, overrides={"cache": {"types": {name: {"ttl": 0}}}})
    named = Config.load(env={}, overrides={"cache": {"types": {"t" * 256: {"ttl": 0}}}})
    assert named.cache.types["t" * 256].ttl == 0
    # "İ" lower-cased is two characters: 200 of them are a type a client can send (a review).
    dotted = Config.load(env={}, overrides={"cache": {"types": {"İ" * 200: {"ttl": 0}}}})
    assert dotted.cache.types["İ".lower() * 200].ttl == 0


@pytest.mark.parametrize(
    "semantic, needed",
    [
        ({"max_wrong_rate": 0.005}, 765),  # the default window, 500: 0.0076 at best
        ({"max_wrong_rate": 0.05, "audit_window": 72}, 73),
        ({"max_wrong_rate": 0.5, "audit_window": 10}, 30),  # under the audits a move needs
    ],
)
def test_check_config_refuses_a_budget_the_window_cannot_resolve(semantic, needed):
    # With no audit of a full window wrong, the 95% upper bound is z^2 / (n + z^2): 0.0076 at
    # 500. A budget under it was accepted, and a namespace that backed off never served again.
    from carpool.semantic.audit import BACKED_OFF, SERVING, Audits, Budget

    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides={"semantic": semantic})
    said = str(raised.value)
    assert "semantic.max_wrong_rate" in said and f"audit_window >= {needed}" in said, said
    # The window it names is enough: a namespace backed off comes back on agreeing audits.
    config = Config.load(env={}, overrides={"semantic": {**semantic, "audit_window": needed}})
    budget, faq = config.semantic.max_wrong_rate, Budget("*", "faq")
    assert budget is not None
    audits = Audits(1.0, window=needed, budget=budget)
    while audits.state(faq) == SERVING:
        audits.record(faq, True)
    assert audits.state(faq) == BACKED_OFF
    for _ in range(needed):
        audits.record(faq, False, near=True)
    assert audits.state(faq) == SERVING
    assert Config.load(env={}, overrides={"semantic": {"max_wrong_rate": 0.05}})  # (as before)


@pytest.mark.parametrize("budget", [1e-300, 1e-17, 3e-6])
def test_a_budget_no_audit_window_can_show_met_is_refused_at_once(budget):
    # Its window was counted up to one by one: 1e-300 overflowed a float (a traceback, not a
    # config error), 1e-17 never ended (n + 1 rounds to n past 2**53).
    from carpool.semantic.audit import MAX_WINDOW

    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides={"semantic": {"max_wrong_rate": budget}})
    assert "smaller than any audit window" in str(raised.value), raised.value
    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides={"semantic": {"audit_window": MAX_WINDOW + 1}})
    assert "semantic.audit_window" in str(raised.value)
    # The smallest budget the largest window shows met is accepted with it.
    window = {"audit_window": MAX_WINDOW, "max_wrong_rate": 3.9e-6}
    assert Config.load(env={}, overrides={"semantic": window}).semantic.audit_window == MAX_WINDOW


def test_an_unknown_key_never_echoes_its_value(tmp_path):
    # A misspelt key was shown with its value ("redis_pass: unknown key; got 'hunter2'"): only
    # a key whose name looks secret hid it, and a misspelt name is anything.
    path = tmp_path / "c.yaml"
    path.write_text("admin_tokn: adm-SECRET\nupstream:\n  bearer: sk-live-SECRET\nport: 1\n")
    env = {"CARPOOL_REDIS_PASS": "hunter2-SECRET", "CARPOOL_CACHE__TYPO": "7-SECRET"}
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env=env)
    said = str(raised.value)
    assert "SECRET" not in said, said
    for key in ("admin_tokn", "upstream.bearer", "redis_pass", "cache.typo"):
        assert f"{key}: unknown key" in said
    with pytest.raises(ConfigError, match="port: .*got 'x'"):  # a known key's value is shown
        Config.load(env={"CARPOOL_PORT": "x"})


@pytest.mark.parametrize(
    "text, field",
    [
        # Each was read as its number: port 1, a 1 s upstream timeout, no coalescing window...
        ("port: true\n", "port"),
        ("limits: {upstream_timeout: true}\n", "limits.upstream_timeout"),
        ("coalesce: {window_ms: false}\n", "coalesce.window_ms"),
        ("sim: {replicas: true}\n", "sim.replicas"),
        ("semantic: {threshold: true}\n", "semantic.threshold"),
        ("semantic: {judge: {verifier_band: [false, 1]}}\n", "semantic.judge.verifier_band"),
        ("cache: {types: {faq: {ttl: true}}}\n", "cache.types.faq.ttl"),
    ],
)
def test_a_boolean_where_a_number_belongs_is_refused_naming_the_field(text, field, tmp_path):
    path = tmp_path / "carpool.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="a boolean is not a number") as raised:
        Config.load(path, env={})
    assert f"{field}:" in str(raised.value)


def test_a_number_in_a_variable_or_set_on_a_config_is_still_a_number_never_a_boolean():
    # A variable is a string, read by its key's type: the numbers still come through.
    env = {"CARPOOL_PORT": "1", "CARPOOL_COALESCE__WINDOW_MS": "0", "CARPOOL_SIM__REPLICAS": "2"}
    config = Config.load(env=env)
    assert (config.port, config.coalesce.window_ms, config.sim.replicas) == (1, 0, 2)
    with pytest.raises(ConfigError, match="CARPOOL_PORT|port"):
        Config.load(env={"CARPOOL_PORT": "true"})
    config.sim.replicas = 3  # (assignments are validated as loaded values are)
    with pytest.raises(ValueError, match="a boolean is not a number"):
        config.sim.replicas = True
    assert config.sim.replicas == 3


@pytest.mark.parametrize(
    "key, url",
    [
        ("upstreams", "http://a b/v1"),
        ("upstreams", "http://127.0.0.1:8000/v1 "),
        ("upstreams", "http://127.0.0.1:8000/v1\t"),
        ("redis", "redis://cache:6379/0 "),
    ],
)
def test_a_url_with_white_space_in_it_is_refused_naming_the_field(key, url):
    # check-config passed them: the gateway then called a host no lookup finds, or a path with
    # "%20" appended to every call.
    value = [url] if key == "upstreams" else url
    with pytest.raises(ConfigError, match="white space") as raised:
        Config.load(env={}, overrides={key: value})
    assert f"{key}:" in str(raised.value)


@pytest.mark.parametrize("key", ["upstreams", "redis"])
def test_a_url_naming_an_ipv6_zone_is_refused_naming_the_field(key):
    # "http://[fe80::1%25eth0]:8000/v1": the cached endpoints reached it, pass-through looked the
    # zone up as a name (a 502, the replica left out for 5 s), and both sent it as the Host.
    url = (
        "http://[fe80::1%25eth0]:8000/v1"
        if key == "upstreams"
        else "redis://[fe80::1%25eth0]:6379/0"
    )
    with pytest.raises(ConfigError, match="IPv6 zone") as raised:
        Config.load(env={}, overrides={key: [url] if key == "upstreams" else url})
    assert f"{key}:" in str(raised.value)
    accepted = Config.load(env={}, overrides={"upstreams": ["http://[fe80::1]:8000/v1"]})
    assert accepted.upstreams == ["http://[fe80::1]:8000/v1"]


HELD_KEYS = {
    "upstream.api_key": 'upstream: {api_key: "${HELD}"}\n',
    "upstream.api_keys": 'upstreams: ["http://a:1/v1"]\nupstream: {api_keys: ["${HELD}"]}\n',
    "semantic.judge.api_key": 'semantic: {judge: {model: m, api_key: "${HELD}"}}\n',
    "semantic.embedder_api_key": 'semantic: {embedder_api_key: "${HELD}"}\n',
}


@pytest.mark.parametrize(
    "key", ["sk-HELD\n", "sk-HELD\r\n", "sk-HE\rLD", " sk-HELD", "sk-\x7fHELD"]
)
@pytest.mark.parametrize("field", sorted(HELD_KEYS))
def test_a_held_key_no_header_can_carry_is_refused_naming_it_and_its_variable_never_its_value(
    field, key, tmp_path, monkeypatch
):
    # A key from a secret file (its trailing newline) passed, and every call then failed: a 502
    # "internal error while calling upstream", /v1/models a 500 ("Forbidden control character
    # detected in headers"). Refused, never trimmed: a key silently changed is another key.
    monkeypatch.setenv("HELD", key)
    path = tmp_path / "c.yaml"
    path.write_text(HELD_KEYS[field])
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env={})
    said = str(raised.value)
    assert f"{field}:" in said and "${HELD}" in said, said
    assert "sk-" not in said, said
    # Given as the value itself (a variable of the key's own), it is refused all the same.
    with pytest.raises(ConfigError, match="upstream.api_key"):
        Config.load(env={"CARPOOL_UPSTREAM__API_KEY": key})
    monkeypatch.setenv("HELD", "sk-HELD")
    Config.load(path, env={})  # the key as it should be


@pytest.mark.parametrize(
    "env",
    [
        # A stray brace: YAML cannot read it, so the section got the string, echoed whole.
        {"CARPOOL_UPSTREAM": "{api_key: sk-LIVE-SECRET, stream_usage: true"},
        {"CARPOOL_SEMANTIC__JUDGE": "{model: m, api_key: sk-LIVE-SECRET"},
        {"CARPOOL_SEMANTIC": "{embedder_api_key: sk-LIVE-SECRET"},
        {"CARPOOL_UPSTREAMS": "[http://a:1/v1, sk-LIVE-SECRET"},
    ],
)
def test_a_section_or_list_written_as_a_string_never_echoes_it(env, tmp_path):
    with pytest.raises(ConfigError) as raised:
        Config.load(env=env)
    said = str(raised.value)
    assert "SECRET" not in said and "cannot be read" in said, said
    path = tmp_path / "c.yaml"
    path.write_text('upstream: "api_key=sk-FILE-SECRET"\nsemantic: {judge: "sk-FILE-SECRET"}\n')
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env={})
    said = str(raised.value)
    assert "SECRET" not in said and "upstream:" in said and "semantic.judge:" in said, said


@pytest.mark.parametrize(
    "text, key, line, first",
    [
        ("cache:\n  max_bytes: 1000\nport: 9000\ncache:\n  default_ttl: 5\n", "cache", 4, 1),
        ("cache:\n  types:\n    faq: {ttl: 1}\n    faq: {ttl: 2}\n", "faq", 4, 3),
        ("port: 1\ncache: {max_bytes: 1, max_bytes: 2}\n", "max_bytes", 2, 2),
    ],
)
def test_a_key_given_twice_in_the_file_is_refused_naming_it_and_its_lines(
    text, key, line, first, tmp_path
):
    # PyYAML keeps the last: the first `cache:` section's max_bytes was silently the default.
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        Config.load(path, env={})
    said = str(raised.value)
    assert f"at line {line}," in said and f"{key!r} is given twice (first at line {first})" in said
    # A key a merge brought in may be given again: that is what a merge is for.
    path.write_text("semantic:\n  judge:\n    <<: {model: m, url: 'http://j:1/v1'}\n    model: n\n")
    assert Config.load(path, env={}).semantic.judge.model == "n"


@pytest.mark.parametrize("token", ["{Xy7-tok}", "[Xy7]", "{a: b}", "[a, b]"])
def test_a_string_keys_variable_starting_with_a_bracket_or_brace_is_the_string(token, tmp_path):
    # It was read as YAML: a mapping or list, which the key refused ("Input should be a valid
    # string"), while the file's "{Xy7-tok}" was accepted.
    path = tmp_path / "c.yaml"
    path.write_text(f'admin_token: "{token}"\n')
    assert Config.load(path, env={}).admin_token == token
    config = Config.load(env={"CARPOOL_ADMIN_TOKEN": token, "CARPOOL_UPSTREAM__API_KEY": token})
    assert config.admin_token == token
    assert config.upstream.api_key is not None
    assert config.upstream.api_key.get_secret_value() == token
    # A key that holds a section, a mapping or a list still reads one written as YAML.
    config = Config.load(
        env={
            "CARPOOL_CACHE": "{max_bytes: 5}",
            "CARPOOL_UPSTREAMS": "[http://a:1/v1]",
            "CARPOOL_SEMANTIC__JUDGE": "{model: m, band: [0.5, 0.9]}",
        }
    )
    assert config.cache.max_bytes == 5 and config.upstreams == ["http://a:1/v1"]
    assert config.semantic.judge.band == (0.5, 0.9)


def test_an_empty_config_path_is_refused_it_names_no_file():
    # Path("") is the working directory: "[Errno 21] Is a directory: '.'".
    with pytest.raises(ConfigError, match="config file '': an empty path names no file"):
        Config.load("", env={})


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("fingerprint:\n  repeat_memo_bytes: 18446744073709551616\n", "repeat_memo_bytes"),
        ("idempotency:\n  max_bytes: 18446744073709551616\n", "max_bytes"),
        ("cache:\n  max_bytes: 9007199254740993\n", "max_bytes"),
    ],
)
def test_an_integer_past_what_a_double_holds_is_refused_naming_the_field(text, field, tmp_path):
    """A byte budget of 2**64 was taken, then every /stats, which reports it, was a 500 for the
    life of the process (its JSON writer takes 64 bits at most)."""
    path = tmp_path / "carpool.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="at most 9007199254740992") as raised:
        Config.load(path, env={})
    assert f"{field}:" in str(raised.value)
    assert Config.load(env={"CARPOOL_CACHE__MAX_BYTES": str(2**53)}).cache.max_bytes == 2**53


def test_more_than_1024_simulated_replicas_are_refused_naming_the_field():
    """200,000 were taken: start-up took seconds, every embeddings request then waited for
    good while the process grew by gigabytes."""
    with pytest.raises(ConfigError, match="less than or equal to 1024") as raised:
        Config.load(env={"CARPOOL_SIM__REPLICAS": "1025"})
    assert "replicas" in str(raised.value)
    assert Config.load(env={"CARPOOL_SIM__REPLICAS": "1024"}).sim.replicas == 1024
