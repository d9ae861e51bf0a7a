"""One typed config: file < environment < flags, and bad values named precisely."""

from __future__ import annotations

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
    ],
)
def test_a_bad_value_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as raised:
        Config.load(env={}, overrides=overrides)
    assert field in str(raised.value)


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
