"""The example configs in examples/ and ``carpool check-config`` (README, "Deploy in front of")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from carpool.config import Config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "carpool.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_there_is_an_example_for_each_engine_and_for_scaling_out() -> None:
    names = {path.stem for path in EXAMPLES}
    assert {"vllm", "sglang", "ollama", "llama-cpp", "openai", "redis-two-instances"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_config_validates(path: Path) -> None:
    config = Config.load(str(path))
    assert config.upstreams, "an example names the engine it fronts"
    result = check_config(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ok: {path}")


def test_check_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams: [http://127.0.0.1:8000/v1]\nrouting:\n  policy: fastest\n")
    result = check_config(bad)
    assert result.returncode == 2
    assert "routing.policy" in result.stderr and "cache-aware" in result.stderr
    assert result.stdout == ""


def test_check_config_of_a_missing_file_exits_2(tmp_path: Path) -> None:
    result = check_config(tmp_path / "nope.yaml")
    assert result.returncode == 2 and "nope.yaml" in result.stderr


def test_check_config_never_prints_credentials(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text('upstreams:\n  - "http://user:s3cret@127.0.0.1:8000/v1?key=k3y"\n')
    result = check_config(path)
    assert result.returncode == 0
    assert "s3cret" not in result.stdout + result.stderr and "k3y" not in result.stdout
