"""What every ``carpool`` command shares.

Contract: every option can also come from the config file (``--config``, else ``CARPOOL_CONFIG``)
and ``CARPOOL_*`` variables; flags win (``load_config``). A bad configuration exits with status 2
and a message naming the field and what is allowed. No log line carries a URL's credentials or
query: ``carpool.config.urls.without_credentials`` is how a URL other than an upstream's is
written into one.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click
from pydantic import BaseModel

from ..config import CONFIG_FILE_VARIABLE, Config, ConfigError


def load_config(config_file: str | None, overrides: dict[str, Any]) -> Config:
    """The configuration from the file, the environment and the flags given (``None``: not given);
    exits 2 naming the field when it is invalid."""
    try:
        return Config.load(
            config_file or os.environ.get(CONFIG_FILE_VARIABLE),
            overrides={k: v for k, v in overrides.items() if v is not None},
        )
    except ConfigError as error:
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)


def install_hint(extra: str) -> str:
    """How to install an extra (carpool installs from its repository, not a package index)."""
    return f"pip install '.[{extra}]' in carpool's checkout"


def missing_extra(what: str, extra: str, error: Exception) -> NoReturn:
    """Exit 2 saying that ``what`` needs the ``extra`` and how to install it."""
    click.echo(
        f"carpool: {what} needs the {extra} extra: {install_hint(extra)} ({error})", err=True
    )
    sys.exit(2)


def default_of(section: type[BaseModel], key: str) -> str:
    """A key's default as an option's help shows it (``[8080]``): read from the config model,
    which owns it."""
    return f"[{section.model_fields[key].get_default(call_default_factory=True)}]"
