"""What every ``carpool`` command shares.

Contract: every option that is a setting can also come from the config file (``--config``, else
``CARPOOL_CONFIG``; an empty ``CARPOOL_CONFIG=`` is no file, as any empty variable is null, but
``--config ""`` or ``check-config ""`` names a file that cannot be read: exit 2) and ``CARPOOL_*`` variables; flags
win (``load_config``). A run's own options are flags only (docs/deviations.md): what ``carpool
bench`` replays and ``carpool eval-semantic`` scores, and ``carpool sim``'s ``--host`` /
``--port``; they are one-off runs, not a deployment's settings. A bad configuration exits with status 2 and a message naming the field and
what is allowed; so does one that turns on what an extra that is not installed provides
(``refuse_missing_extras``: ``carpool serve`` and ``carpool check-config`` alike). No log line
carries a URL's credentials or query: ``carpool.config.urls.without_credentials`` is how a URL
other than an upstream's is written into one. ``listen_problem`` is the one check that a server
can listen where it is told to (``carpool serve``, each replica of ``carpool sim``), made before
anything says it listens, so that a port in use or a host no lookup finds exits 2 saying so.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

import click
from pydantic import BaseModel

from ..config import CONFIG_FILE_VARIABLE, Config, ConfigError
from ..config.urls import url_host
from ..extras import missing_extra_said


def config_path(config_file: str | None) -> str | None:
    """The file the configuration is read from: ``--config``'s, else ``CARPOOL_CONFIG``'s."""
    if config_file is not None:
        # Given, even empty: ``--config "$UNSET"`` is a mistake to report (``load`` refuses
        # the path ""), never all defaults, nor the file CARPOOL_CONFIG names.
        return config_file
    # (An empty variable, as a template leaves it, is no file, as an empty CARPOOL_* variable
    # is null: not the file "".)
    return os.environ.get(CONFIG_FILE_VARIABLE) or None


def load_config(config_file: str | None, overrides: dict[str, Any]) -> Config:
    """The configuration from the file, the environment and the flags given (``None``: not given);
    exits 2 naming the field when it is invalid."""
    try:
        return Config.load(
            config_path(config_file),
            overrides={k: v for k, v in overrides.items() if v is not None},
        )
    except ConfigError as error:
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)


#: The modules of the semantic extra that a served gateway imports with semantic.enabled (its
#: huggingface_hub only fetches the model: ``carpool fetch-model``); of the otel extra, with
#: ``tracing: on`` (``carpool.tracing``).
SEMANTIC_MODULES = ("numpy", "tokenizers", "safetensors", "onnxruntime", "onnx", "usearch")
OTEL_MODULES = ("opentelemetry.trace",)


def missing_module(modules: Iterable[str]) -> str | None:
    """The first of ``modules`` that is not installed (found, not imported), or None."""
    for module in modules:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):  # (a parent package missing, or blocked)
            return module
    return None


def refuse_missing_extras(config: Config) -> None:
    """Exit 2 naming the setting and the extra when ``config`` turns on what an extra that is
    not installed provides: ``semantic.enabled``, ``tracing: on`` (``auto`` traces only when
    OpenTelemetry is there, so it asks for nothing)."""
    for on, what, extra, modules in (
        (config.semantic.enabled, "semantic.enabled", "semantic", SEMANTIC_MODULES),
        (config.tracing == "on", "tracing: on", "otel", OTEL_MODULES),
    ):
        missing = missing_module(modules) if on else None
        if missing is not None:
            missing_extra(what, extra, ModuleNotFoundError(f"no module named {missing!r}"))


def missing_extra(what: str, extra: str, error: Exception) -> NoReturn:
    """Exit 2 saying what ``extras.missing_extra_said`` says."""
    click.echo(f"carpool: {missing_extra_said(what, extra, error)}", err=True)
    sys.exit(2)


def default_of(section: type[BaseModel], key: str) -> str:
    """A key's default as an option's help shows it (``[8080]``): read from the config model,
    which owns it."""
    return f"[{section.model_fields[key].get_default(call_default_factory=True)}]"


def listen_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host``:``port`` (None: it can), found by binding it
    once: uvicorn would only fail after start-up began, with a bare message and exit 3."""
    # In the family uvicorn binds it in (an IPv6 address has a colon): create_server's own
    # default, IPv4, refused every IPv6 address, "::" too.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            pass
    except (OSError, TypeError, ValueError) as error:  # (a host no name lookup could take)
        return f"cannot listen on {url_host(host)}:{port}: {error}"
    return None
