"""The peers of ``bench_peers.py``: LiteLLM's proxy and GPTCache's server, each installed into a
virtual environment of its own and started on a free port. Never carpool dependencies.

Contract:
- ``ensure_env(name)`` (``name`` in ``REQUIREMENTS``) creates ``benchmarks/.envs/<name>``
  (``python -m venv``, then ``pip install`` of the pinned requirements, a few minutes, the only
  step that needs the network) once, and reuses it afterwards: a marker file records what was
  installed. Returns what happened (``ok``, ``cached``, ``install_s``, ``versions`` of
  ``REPORTED_PACKAGES``, ``error``); a failure is recorded, not raised.
- ``env_python(name)``, ``peer_env(name)``: a peer's interpreter and the environment it runs in
  (its venv first on PATH, none of carpool's paths).
- ``start_peers(tmp, upstream_port, envs, stack)`` starts, in ``stack``, every peer whose
  environment is ready: ``litellm`` (``litellm --config``: one model at the upstream, its
  in-memory cache on, a fixed master key ``MASTER_KEY``, no database, uvicorn's access log
  off), ``litellm_nocache`` (the same without the cache) and ``gptcache`` (``gptcache_http.py``).
  Returns their ports, and why any did not start. Logs go to ``tmp``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from carpool.bench import scenario
from carpool.bench.process import HOST, free_port, stop, wait_port

PEERS = Path(__file__).resolve().parent
ROOT = PEERS.parent.parent
ENVS = PEERS.parent / ".envs"
MARKER = ".carpool-bench-env.json"

# Pinned: the newest releases that install here. (litellm >= 1.108 asks for a
# litellm-proxy-extras release that is not on PyPI.) httptools makes LiteLLM's uvicorn parse
# HTTP with the same parser as every other target; openai<1 is what GPTCache's OpenAI adapter
# and server are written for; fastapi/uvicorn/uvloop/httptools are GPTCache's server stack,
# installed up front because GPTCache would otherwise pip-install them at run time.
REQUIREMENTS = {
    "litellm": ["litellm[proxy]==1.106.12", "httptools==0.9.0"],
    "gptcache": [
        "gptcache==0.1.44",
        "openai==0.28.1",
        "fastapi==0.165.0",
        "uvicorn==0.54.0",
        "uvloop==0.23.0",
        "httptools==0.9.0",
    ],
}
REPORTED_PACKAGES = {
    "litellm": [
        "litellm",
        "litellm-proxy-extras",
        "openai",
        "fastapi",
        "uvicorn",
        "uvloop",
        "httptools",
        "httpx",
        "aiohttp",
        "pydantic",
    ],
    "gptcache": [
        "gptcache",
        "openai",
        "fastapi",
        "starlette",
        "uvicorn",
        "uvloop",
        "httptools",
        "pydantic",
        "numpy",
        "cachetools",
    ],
}
INSTALL_TIMEOUT_S = 1800
START_TIMEOUT_S = 300

MASTER_KEY = "sk-carpool-bench-6f1c2a9e4b7d8e3f0a5c1b2d9e8f7a6b"


# ------------------------------------------------------------------------------------------------
# The peers' environments


def env_python(name: str) -> Path:
    return ENVS / name / "bin" / "python"


def peer_env(name: str, **extra: str) -> dict[str, str]:
    """The environment a peer runs in: its venv first on PATH (GPTCache shells out to ``pip``
    when it misses an optional package), none of carpool's paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(ENVS / name / "bin") + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(ENVS / name)
    env.setdefault("PYTHONHASHSEED", "0")
    env.update(extra)
    return env


def _versions(name: str) -> dict[str, str | None]:
    code = (
        "import json, sys\nfrom importlib.metadata import version, PackageNotFoundError\n"
        "out = {}\nfor p in sys.argv[1:]:\n    try: out[p] = version(p)\n"
        "    except PackageNotFoundError: out[p] = None\nprint(json.dumps(out))"
    )
    done = subprocess.run(
        [str(env_python(name)), "-c", code, *REPORTED_PACKAGES[name]],
        env=peer_env(name),
        capture_output=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def ensure_env(name: str) -> dict[str, Any]:
    """Create ``benchmarks/.envs/<name>`` and install the peer's pinned requirements, once."""
    requirements = REQUIREMENTS[name]
    root = ENVS / name
    info: dict[str, Any] = {
        "path": str(root.relative_to(ROOT)),
        "requirements": requirements,
        "ok": False,
        "cached": False,
        "install_s": 0.0,
        "error": None,
    }
    marker = root / MARKER
    try:
        if marker.exists() and json.loads(marker.read_text()).get("requirements") == requirements:
            info["cached"] = True
        else:
            print(
                f"[peers] installing {name} into {info['path']} (once; a few minutes) ...",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.monotonic()
            ENVS.mkdir(parents=True, exist_ok=True)
            base = getattr(sys, "_base_executable", None) or shutil.which("python3") or "python3"
            subprocess.run(
                [base, "-m", "venv", str(root)], check=True, capture_output=True, timeout=300
            )
            done = subprocess.run(
                [
                    str(env_python(name)),
                    "-m",
                    "pip",
                    "install",
                    "--disable-pip-version-check",
                    "-q",
                    *requirements,
                ],
                env=peer_env(name),
                capture_output=True,
                timeout=INSTALL_TIMEOUT_S,
            )
            info["install_s"] = round(time.monotonic() - t0, 1)
            if done.returncode != 0:
                lines = [
                    line
                    for line in done.stderr.decode(errors="replace").splitlines()
                    if not line.startswith("WARNING: Location")
                ]
                raise RuntimeError(
                    f"pip install failed ({done.returncode}): " + "\n".join(lines[-15:])
                )
            marker.write_text(
                json.dumps(
                    {"requirements": requirements, "installed_at": scenario.machine()["date"]}
                )
                + "\n"
            )
        info["versions"] = _versions(name)
        info["ok"] = True
    except Exception as exc:  # noqa: BLE001 - recorded, and the rest runs on
        info["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        print(f"[peers] {name}: {info['error']}", file=sys.stderr, flush=True)
    return info


# ------------------------------------------------------------------------------------------------
# Servers


@contextlib.contextmanager
def _process(
    cmd: list[str],
    port: int,
    env: dict[str, str],
    log: Path,
    cwd: Path,
    timeout: float = START_TIMEOUT_S,
    keep_stdout: bool = True,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server in a subprocess, its stderr (and stdout, with ``keep_stdout``) in ``log``."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stderr=out, stdout=out if keep_stdout else subprocess.DEVNULL
        )
    try:
        try:
            wait_port(port, proc, timeout)
        except Exception as exc:
            tail = log.read_bytes()[-2500:].decode(errors="replace")
            raise RuntimeError(f"{exc}; log tail:\n{tail}") from exc
        yield proc
    finally:
        stop(proc, 15)


def litellm_config(upstream_port: int, cache: bool) -> str:
    """LiteLLM's proxy config: one model at the fake upstream; its in-memory cache on or off."""
    lines = [
        "model_list:",
        "  - model_name: bench-model",
        "    litellm_params:",
        "      model: openai/bench-model",
        f"      api_base: http://{HOST}:{upstream_port}/v1",
        "      api_key: sk-upstream-unused",
        "litellm_settings:",
        "  set_verbose: false",
    ]
    if cache:
        lines += ["  cache: true", "  cache_params:", "    type: local", "    ttl: 3600"]
    lines += ["general_settings:", f"  master_key: {MASTER_KEY}"]
    return "\n".join(lines) + "\n"


# uvicorn's access log off (every other target runs with access_log=False), errors kept.
LITELLM_LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s %(message)s"}},
    "handlers": {
        "err": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stderr",
        }
    },
    "loggers": {
        "uvicorn": {"handlers": ["err"], "level": "WARNING", "propagate": False},
        "uvicorn.error": {"level": "WARNING"},
        "uvicorn.access": {"handlers": ["err"], "level": "WARNING", "propagate": False},
    },
}


def _litellm(
    tmp: Path, name: str, upstream_port: int, cache: bool, stack: contextlib.ExitStack
) -> int:
    port = free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(litellm_config(upstream_port, cache))
    log_config = tmp / "litellm-log.json"
    log_config.write_text(json.dumps(LITELLM_LOG_CONFIG))
    cmd = [
        str(ENVS / "litellm" / "bin" / "litellm"),
        "--config",
        str(config),
        "--host",
        HOST,
        "--port",
        str(port),
        "--log_config",
        str(log_config),
    ]
    env = peer_env("litellm", LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    stack.enter_context(_process(cmd, port, env, tmp / f"{name}.log", tmp))
    return port


def _gptcache(tmp: Path, upstream_port: int, stack: contextlib.ExitStack) -> int:
    port = free_port()
    cmd = [
        str(env_python("gptcache")),
        str(PEERS / "gptcache_http.py"),
        "--port",
        str(port),
        "--upstream",
        f"http://{HOST}:{upstream_port}/v1",
        "--data-dir",
        str(tmp / "gptcache-data"),
    ]
    # its server prints every request's messages to stdout: discarded, errors kept
    stack.enter_context(
        _process(cmd, port, peer_env("gptcache"), tmp / "gptcache.log", tmp, keep_stdout=False)
    )
    return port


def start_peers(
    tmp: Path, up: int, envs: dict[str, dict[str, Any]], stack: contextlib.ExitStack
) -> tuple[dict[str, int], dict[str, str]]:
    """The peers that installed and start: their ports, and why the others did not start."""
    ports: dict[str, int] = {}
    errors: dict[str, str] = {}
    starts: list[tuple[str, Any]] = []
    if envs["litellm"]["ok"]:
        starts += [
            ("litellm", lambda: _litellm(tmp, "litellm", up, True, stack)),
            ("litellm_nocache", lambda: _litellm(tmp, "litellm_nocache", up, False, stack)),
        ]
    if envs["gptcache"]["ok"]:
        starts.append(("gptcache", lambda: _gptcache(tmp, up, stack)))
    for name, start in starts:
        try:
            ports[name] = start()
        except Exception as exc:  # noqa: BLE001 - recorded, and the rest runs on
            errors[name] = f"did not start: {exc}"[-3000:]
    return ports, errors
