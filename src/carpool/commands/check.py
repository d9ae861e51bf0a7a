"""``carpool check-config FILE``: validate a configuration without serving.

Contract: the file (and the ``CARPOOL_*`` variables, which a served gateway would read too) is
loaded exactly as ``carpool serve --config FILE`` loads it (``commands.common.load_config``):
valid, it prints ``ok: FILE`` and a one-line summary and exits 0; invalid (or missing, or
``""``, or not YAML, or turning on what an extra that is not installed provides:
``refuse_missing_extras``, as serve), it exits 2 with a message naming the field and what is
allowed. Nothing is started, nothing is fetched, no connection is made.
"""

from __future__ import annotations

import click

from ..config.urls import url_host, without_credentials
from .common import load_config, refuse_missing_extras


@click.command("check-config")
@click.argument("file", type=click.Path(dir_okay=False))
def check_config(file: str) -> None:
    """Validate FILE (a carpool YAML config) without serving: exit 0, or 2 naming the field."""
    config = load_config(file, {})
    refuse_missing_extras(config)
    upstreams = (
        ", ".join(without_credentials(u) for u in config.upstreams) or "the simulated engine"
    )
    if config.redis:
        shared = f"Redis {without_credentials(config.redis)}"
    else:  # (workers without Redis share through each other: the owner of each key)
        shared = f"its {config.workers} workers" if config.workers > 1 else "this process"
    click.echo(f"ok: {file}")
    click.echo(
        f"upstreams: {upstreams}; shared through {shared}; "
        f"semantic cache {'on' if config.semantic.enabled else 'off'}; "
        f"listening on {url_host(config.host)}:{config.port}"
    )
