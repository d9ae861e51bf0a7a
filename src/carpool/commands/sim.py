"""``carpool sim``: the simulated engine alone, as an OpenAI-compatible server.

Contract: its cost model is the config's ``sim`` section (the file, ``CARPOOL_SIM__*``, then these
flags, strongest last); ``carpool.upstream.sim_server.serve_replicas`` runs it, saying that it is
simulated. Replica i listens on ``--port`` + i: a port and a replica count (from the flag or
the config) whose last port is beyond 65535 is a usage error (exit 2) before any replica starts,
as is a ``--host`` that ``host`` would refuse in a config (``config.urls.checked_host``), and an
address one replica could not listen on (a port in use, a host no lookup finds: every port is
tried first, as ``carpool serve`` tries its own, ``common.listen_problem``), naming ``--host`` /
``--port``. ``--host`` and ``--port`` are flags only (the config's ``host`` and ``port`` are the
gateway's).
"""

from __future__ import annotations

import asyncio

import click

from ..config import SimConfig
from ..config.urls import checked_host
from .common import default_of, listen_problem, load_config


def _an_address(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """``--host`` as ``host`` is checked in a config (``config.urls.checked_host``)."""
    try:
        return checked_host(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, callback=_an_address)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port of the first replica; replica i listens on port + i.",
)
@click.option(
    "--replicas",
    type=int,
    default=None,
    help=f"Number of simulated replicas {default_of(SimConfig, 'replicas')}.",
)
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="YAML config file; its `sim` section sets the cost model.",
)
@click.option("--decode-ms-per-token", type=float, default=None)
@click.option("--prefill-ms-per-token", type=float, default=None)
@click.option("--max-concurrency", type=int, default=None)
def sim(
    host: str,
    port: int,
    replicas: int | None,
    config_file: str | None,
    decode_ms_per_token: float | None,
    prefill_ms_per_token: float | None,
    max_concurrency: int | None,
) -> None:
    """Run the simulated engine alone as an OpenAI-compatible server (SIMULATED, not a model)."""
    sim_overrides = {
        k: v
        for k, v in {
            "replicas": replicas,
            "decode_ms_per_token": decode_ms_per_token,
            "prefill_ms_per_token": prefill_ms_per_token,
            "max_concurrency": max_concurrency,
        }.items()
        if v is not None
    }
    config = load_config(config_file, {"sim": sim_overrides} if sim_overrides else {})
    if port + config.sim.replicas - 1 > 65535:
        raise click.BadParameter(
            f"{port} + {config.sim.replicas} replicas: replica i listens on port + i, and the "
            f"last would be {port + config.sim.replicas - 1} (at most 65535)",
            param_hint="'--port'",
        )
    # Every replica's port, before any replica starts (port 0: each takes a free one, so only
    # the host can fail): uvicorn would fail one replica after the others had started, with its
    # bare message and exit 3.
    for i in range(config.sim.replicas if port else 1):
        problem = listen_problem(host, port + i if port else 0)
        if problem is not None:
            replica = f"replica sim-{i} (--port + {i}): " if i else ""
            raise click.BadParameter(replica + problem, param_hint="'--host' / '--port'")
    from ..upstream.sim_server import serve_replicas

    asyncio.run(serve_replicas(config.sim, host, port))
