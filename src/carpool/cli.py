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
@click.option("--redis", default=None, metavar="URL",
              help="Redis/Valkey URL of the store shared by every instance.")
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
        log.info("carpool: exact answers%s shared through Redis at %s (in-process fallback "
                 "while it is unreachable); the semantic cache is per instance for now",
                 " and calls in flight" if config.distributed.shared_flights else "",
                 config.redis)
    import uvicorn

    from .pipeline import Gateway
    from .server import create_app

    try:
        gateway = Gateway(config)
    except ImportError as error:
        click.echo(f"carpool: semantic.enabled needs the semantic extra: "
                   f"pip install 'carpool[semantic]' ({error})", err=True)
        sys.exit(2)
    if gateway.semantic is None:
        log.info("carpool: semantic cache off (turn it on with semantic.enabled: true, or "
                 "CARPOOL_SEMANTIC__ENABLED=true; needs pip install 'carpool[semantic]')")
    else:
        log.info("carpool: semantic cache on (mode %s, threshold %.2f, embedder %s)",
                 config.semantic.mode, gateway.semantic.threshold,
                 gateway.semantic.embedder.name)
    app = create_app(gateway)
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


@main.command("eval-semantic")
@click.option("--pairs", "pair_files", multiple=True, required=True,
              type=click.Path(exists=True, dir_okay=False),
              help="JSONL of {a, b, same_answer[, category]} (repeatable).")
@click.option("--decisions", type=click.Path(dir_okay=False), default=None,
              help="Write one JSONL row per pair with its decision.")
@click.option("--threshold", type=float, default=None,
              help="Similarity threshold [the calibrated default].")
@click.option("--sweep", is_flag=True, help="Also print hit/wrong rates over thresholds.")
def eval_semantic(pair_files: tuple[str, ...], decisions: str | None, threshold: float | None,
                  sweep: bool) -> None:
    """Score the semantic cache's hit/miss decisions on labeled prompt pairs."""
    from pathlib import Path

    try:
        from .semantic.cache import CALIBRATED_THRESHOLD
        from .semantic.embed import default_embedder
        from .semantic.evaluate import Evaluator, format_report, load_pairs, write_decisions
        embedder = default_embedder()
    except ImportError as error:
        click.echo(f"carpool: the semantic cache needs its extra: pip install 'carpool[semantic]'"
                   f" ({error})", err=True)
        sys.exit(2)
    threshold = CALIBRATED_THRESHOLD if threshold is None else threshold
    evaluator = Evaluator(load_pairs(pair_files), embedder)
    click.echo(format_report(evaluator.report(threshold), threshold))
    if sweep:
        click.echo(f"\n{'threshold':>10}{'served':>9}{'wrong':>8}")
        for row in evaluator.sweep([round(0.60 + 0.01 * i, 2) for i in range(36)]):
            click.echo(f"{row['threshold']:>10.2f}{100 * (row['hit_rate'] or 0):>8.1f}%"
                       f"{100 * (row['wrong_rate'] or 0):>7.1f}%")
    if decisions:
        write_decisions(evaluator, threshold, Path(decisions))


@main.command("config-reference")
def config_reference() -> None:
    """Print the configuration reference (Markdown), generated from the typed config model."""
    from .config import reference_markdown

    click.echo(reference_markdown(), nl=False)


if __name__ == "__main__":
    main()
