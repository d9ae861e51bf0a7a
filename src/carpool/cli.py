"""The ``carpool`` command line: ``serve`` and ``sim``.

Contract: every option can also come from the config file and ``CARPOOL_*`` variables (flags win);
a bad configuration exits with status 2 and a message naming the field and what is allowed. The
first log line of ``carpool serve`` says which engine it fronts, so nobody mistakes the simulator
for a real model.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import click

from .config import Config, ConfigError


def _load(config_file: str | None, overrides: dict[str, Any]) -> Config:
    try:
        return Config.load(config_file or os.environ.get("CARPOOL_CONFIG"),
                           overrides={k: v for k, v in overrides.items() if v is not None})
    except ConfigError as error:
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)


@click.group()
@click.version_option(package_name="carpool")
def main() -> None:
    """carpool: an OpenAI-compatible gateway that never computes the same answer twice."""


@main.command()
@click.option("--upstream", "upstreams", multiple=True, metavar="URL",
              help="Base URL of an OpenAI-compatible replica, ending in /v1 (repeat for several "
                   "replicas). None: the embedded simulated engine.")
@click.option("--host", default=None, help="Address to listen on [127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port to listen on [8080].")
@click.option("--config", "config_file", default=None, type=click.Path(dir_okay=False),
              help="YAML config file (also CARPOOL_CONFIG).")
@click.option("--redis", default=None, metavar="URL", help="Redis/Valkey URL (not implemented "
              "yet).")
def serve(upstreams: tuple[str, ...], host: str | None, port: int | None,
          config_file: str | None, redis: str | None) -> None:
    """Run the gateway."""
    config = _load(config_file, {"upstreams": list(upstreams) or None, "host": host,
                                 "port": port, "redis": redis})
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger("carpool")
    if config.upstreams:
        log.info("carpool: fronting %d upstream replica(s): %s", len(config.upstreams),
                 ", ".join(config.upstreams))
    else:
        log.info("carpool: no --upstream given, using the embedded SIMULATED engine "
                 "(%d replica(s)); its answers are synthetic text, not a real model",
                 config.sim.replicas)
    if config.redis:
        log.warning("carpool: --redis is not implemented yet; using the in-process store")
    if config.semantic.enabled:
        log.warning("carpool: the semantic cache is not implemented yet; it stays off")
    import uvicorn

    from .pipeline import Gateway
    from .server import create_app

    app = create_app(Gateway(config))
    log.info("carpool: listening on http://%s:%d/v1", config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                access_log=False, loop="auto", http="auto")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True,
              help="Port of the first replica; replica i listens on port + i.")
@click.option("--replicas", type=int, default=None, help="Number of simulated replicas [1].")
@click.option("--config", "config_file", default=None, type=click.Path(dir_okay=False),
              help="YAML config file; its `sim` section sets the cost model.")
@click.option("--decode-ms-per-token", type=float, default=None)
@click.option("--prefill-ms-per-token", type=float, default=None)
@click.option("--max-concurrency", type=int, default=None)
def sim(host: str, port: int, replicas: int | None, config_file: str | None,
        decode_ms_per_token: float | None, prefill_ms_per_token: float | None,
        max_concurrency: int | None) -> None:
    """Run the simulated engine alone as an OpenAI-compatible server (SIMULATED, not a model)."""
    sim_overrides = {k: v for k, v in {
        "replicas": replicas, "decode_ms_per_token": decode_ms_per_token,
        "prefill_ms_per_token": prefill_ms_per_token, "max_concurrency": max_concurrency,
    }.items() if v is not None}
    config = _load(config_file, {"sim": sim_overrides} if sim_overrides else {})
    from .upstream.sim_server import serve_replicas

    asyncio.run(serve_replicas(config.sim, host, port))


@main.command("config-reference")
def config_reference() -> None:
    """Print the configuration reference (Markdown), generated from the typed config model."""
    from .config import reference_markdown

    click.echo(reference_markdown(), nl=False)


if __name__ == "__main__":
    main()
