"""The ``carpool`` command line: ``serve`` here, the other commands in ``carpool.commands``.

Contract: every setting can also come from the config file and ``CARPOOL_*`` variables (flags
win; a run's own options, ``carpool bench``'s and ``eval-semantic``'s, are flags only); a bad
configuration exits with status 2 and a message naming the field and what is allowed
(``carpool.commands.common``), as does a host no socket can take, or an address it cannot listen
on (``listen_problem``), a Redis older than 7.0, and a Redis user (an ACL user on a Redis shared
with other services) that may not run what carpool needs, each refusal named
(``_refuse_missing_permissions``; a Redis that does not answer then is no verdict: the start
goes on). The first log line of
``carpool serve`` says which engine it fronts, so nobody mistakes the simulator for a real model:
the simulated engine's is a WARNING, written whatever ``log_level`` (``_said_at_any_level``).
The "listening on" line comes once the socket is bound and names the port it got (``--port 0``:
the one the system chose), with one worker (``DrainingServer``) or several.
No log line carries a URL's credentials or query: upstreams are logged by their replica names
(``upstream.http.replica_names``), other URLs without user, password and query
(``without_credentials``); so is an upstream whose path does not end in ``/v1``, in the one
warning that says so. Start-up warns, once each, when the gateway
holds an upstream key for anyone who asks, when ``/stats``, ``/metrics`` and ``/dashboard``
are open (no ``admin_token``) on an address beyond loopback, and when the environment names a
proxy it cannot use for an upstream (``upstream.proxy``; one it uses is said at info). It raises
its soft file descriptor limit to the hard one, and warns when that is under
``FILE_LIMIT_WARN`` (``_raise_file_limit``).

With ``--workers N``, each worker rebuilds the config from a file the parent writes
(``config.loader.resolved_text``, a 0600 file) in the run's directory, which the parent locks
for the run and removes when it ends, also when stopped while starting (``carpool.rundir``):
the parent loads that file back as a worker will, before any worker starts, and exits 2 with
the reason if it fails or differs from its own, rather than let uvicorn restart workers that
cannot start, for ever. uvicorn's supervisor waits ``WORKER_HEALTHCHECK_S`` for a worker's
start and health check (not its 5 s); a health check's wait ends at once when the worker exits
or SIGINT or SIGTERM comes (``carpool.supervisor``): a Ctrl-C as the workers start is a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from yarl import URL

from . import peers, rundir
from .auth import ClientKeys
from .commands.bench import bench
from .commands.check import check_config
from .commands.common import (
    SEMANTIC_MODULES,
    default_of,
    listen_problem,
    load_config,
    missing_extra,
    missing_module,
    refuse_missing_extras,
)
from .commands.reference import config_reference
from .commands.semantic import eval_semantic, fetch_model
from .commands.sim import sim
from .config import CONFIG_FILE_VARIABLE, Config, ConfigError
from .config.loader import PARENT_VARIABLE, RUN_VARIABLE, load_resolved, resolved_text
from .config.urls import url_host, without_credentials
from .extras import install_hint
from .logs import configure as configure_logging
from .upstream.proxy import Unusable, proxy_for


@click.group()
@click.version_option(package_name="carpool")
def main() -> None:
    """carpool: an OpenAI-compatible gateway that never computes the same answer twice."""


@main.command()
@click.option(
    "--upstream",
    "upstreams",
    multiple=True,
    metavar="URL",
    help="Base URL of an OpenAI-compatible replica, ending in /v1 (repeat for several "
    "replicas). None: the embedded simulated engine.",
)
@click.option(
    "--host",
    default=None,
    help=f"Address to listen on {default_of(Config, 'host')}; 0.0.0.0 or :: for every interface.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help=f"Port to listen on {default_of(Config, 'port')}.",
)
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="YAML config file (also CARPOOL_CONFIG).",
)
@click.option(
    "--redis",
    default=None,
    metavar="URL",
    help="Redis/Valkey URL of the store shared by every instance.",
)
@click.option(
    "--workers",
    type=int,
    default=None,
    help=f"Gateway processes on this port {default_of(Config, 'workers')}; they share their "
    "upstream calls (through --redis when given, else through each other).",
)
def serve(
    upstreams: tuple[str, ...],
    host: str | None,
    port: int | None,
    config_file: str | None,
    redis: str | None,
    workers: int | None,
) -> None:
    """Run the gateway."""
    config = load_config(
        config_file,
        {
            "upstreams": list(upstreams) or None,
            "host": host,
            "port": port,
            "redis": redis,
            "workers": workers,
        },
    )
    refuse_missing_extras(config)
    configure_logging(config.log_level, config.log_format)
    log = logging.getLogger("carpool.cli")
    if config.upstreams:
        from .upstream.http import replica_names

        # By the names /stats, /metrics and the failure warnings will use.
        log.info(
            "fronting %d upstream replica(s): %s",
            len(config.upstreams),
            ", ".join(name for name, _ in replica_names(config.upstreams, config.upstream_names)),
        )
    else:
        _said_at_any_level(
            log,
            "no --upstream given, using the embedded SIMULATED engine "
            "(%d replica(s)); its answers are synthetic text, not a real model",
            config.sim.replicas,
        )
    for url in config.upstreams:
        if not URL(url).path.rstrip("/").endswith("/v1"):
            # Used as given (a provider's /v1beta/openai): only said, in case /v1 was left out.
            log.warning(
                "upstream %s does not end in /v1: the API's paths (/chat/completions...) are "
                "sent under it as given; if the server serves them under /v1, add it",
                without_credentials(url),
            )
        _say_proxy(log, url, config.upstream.proxy)
    if config.semantic.judge.url is not None:
        _say_proxy(log, config.semantic.judge.url, config.upstream.proxy)
    _raise_file_limit(log)
    if config.holds_upstream_credentials() and not config.auth.client_keys_file:
        log.warning(
            "the gateway holds the upstream key (upstream.api_key, or a user and password in "
            "an upstream URL) and auth.client_keys_file is not set: anyone who can reach this "
            "port spends that key"
        )
    config = config.model_copy(update={"allowed_hosts": _allowed_hosts(config)})
    if config.admin_token is None and not _loopback(config.host):
        log.warning(
            "admin_token is not set and the gateway listens on %s, beyond loopback: /stats, "
            "/metrics and /dashboard are open to anyone who can reach this port (their counters "
            "can tell whether another tenant sent a given prompt); set admin_token",
            config.host,
        )
    if config.redis:
        try:
            from .redis.connection import server_mode

            mode = asyncio.run(server_mode(config.redis))
        except ImportError as error:
            missing_extra("--redis", "redis", error)
        except ValueError as error:  # a URL redis-py cannot read, a server older than 7.0,
            # a user and password it refused
            click.echo(
                f"carpool: --redis: {error}".replace(
                    config.redis, without_credentials(config.redis)
                ),
                err=True,
            )
            sys.exit(2)
        if mode is None:
            log.warning(
                "Redis at %s does not answer now; starting with this instance's memory "
                "and trying again. If it is a cluster node, set distributed.cluster: true "
                "(it could not be detected)",
                without_credentials(config.redis),
            )
        elif mode == "cluster" and not config.distributed.cluster:
            # A plain client would get MOVED for the other masters' keys: half-shared.
            log.info(
                "%s is a cluster node: using a cluster client",
                without_credentials(config.redis),
            )
            config.distributed.cluster = True
        if mode is not None:  # (a Redis that does not answer now: no verdict to wait for)
            _refuse_missing_permissions(config)
        log.info(
            "exact answers%s shared through Redis at %s (in-process fallback "
            "while it is unreachable)",
            ", semantic entries and calls in flight"
            if config.distributed.shared_flights
            else " and semantic entries",
            without_credentials(config.redis),
        )
    import uvicorn

    from . import http_protocol
    from .server import GatewayApp
    from .wiring import build_gateway

    try:
        gateway = build_gateway(config)
    except ImportError as error:
        missing_extra("semantic.enabled (and its model)", "semantic", error)
    except ValueError as error:  # a model or verifier folder: a file or setting missing or bad
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)
    if gateway.semantic is None:
        installed = missing_module(SEMANTIC_MODULES) is None
        log.info(
            "semantic cache off (turn it on with semantic.enabled: true, or "
            "CARPOOL_SEMANTIC__ENABLED=true%s)",
            "" if installed else f"; it needs the semantic extra: {install_hint('semantic')}",
        )
    else:
        log.info(
            "semantic cache on (mode %s, threshold %.2f, embedder %s)",
            config.semantic.mode,
            gateway.semantic.threshold,
            gateway.semantic.embedder.name,
        )
    problem = listen_problem(config.host, config.port)  # (before anything says it listens)
    if problem is not None:
        click.echo(f"carpool: {problem}", err=True)
        sys.exit(2)

    def listening(port: int) -> None:
        # Once the socket is bound: the port it got, not the one asked for (0: the system's
        # choice, which nothing else says).
        log.info("listening on http://%s:%d/v1", url_host(config.host), port)

    served: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "log_level": config.log_level,
        "access_log": False,
        "log_config": None,  # (uvicorn's own lines through carpool's logging: its format)
        "loop": "auto",
        "http": http_protocol.protocol(),  # (exact hits answered as they are parsed)
        # No WebSocket route is served: an upgrade to one is an ordinary request (refused if it
        # has a body, ``http_protocol``), never a connection handed to a handshake that waits.
        "ws": "none",
        "timeout_graceful_shutdown": config.shutdown.grace_s,
        "timeout_keep_alive": config.limits.client_keepalive,
    }
    if config.workers == 1:
        from .draining import DrainingServer

        DrainingServer(
            uvicorn.Config(GatewayApp(gateway, freeze_gc=True), **served),
            gateway,
            config,
            listening,
        ).run()
        return
    # Several processes: each builds its own gateway from the resolved config, written once;
    # the one built here only checked the config (and would hold the embedding model).
    asyncio.run(gateway.aclose())
    del gateway
    # Until uvicorn's supervisor takes the signals over, a SIGTERM (a service manager stopping
    # the run as it starts) ends the run through the stack below, the run's directory removed:
    # by default it ended the process at once, and the copy of the keys stayed.
    signal.signal(signal.SIGTERM, _stopped_while_starting)
    with contextlib.ExitStack() as stack:
        # Everything the workers read as they start, for the whole run, in one directory that
        # this process locks: age-based cleaners of the temporary directory skip it, and the
        # next run removes it if this one is killed with its workers (``carpool.rundir``).
        with rundir.stops_noted():
            # (The temporary directory's first look writes a file in it and removes it: a
            # SIGTERM in between left that file.)
            parent = peers.parent_directory(config.workers)
        run = stack.enter_context(rundir.run_directory(parent))
        resolved = run / RESOLVED_FILE
        workers_config = _keys_read_for_the_run(config, run)
        fd = os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # (the keys)
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(resolved_text(workers_config))
        _workers_load(str(resolved), workers_config)
        # Without Redis the workers share through each other: each key's upstream calls are
        # made by the worker that owns it, reached on a unix socket in the run's directory,
        # which only this user can open, with a secret of this run (``carpool.peers``).
        if not config.redis:
            peers.prepare(run)
            os.environ[peers.PEERS_VARIABLE] = str(run)
            log.info(
                "%d workers share their flights without Redis: each key is led by one of them "
                "(caches and semantic entries stay per worker; /metrics sums them all)",
                config.workers,
            )
        os.environ[CONFIG_FILE_VARIABLE] = str(resolved)
        os.environ[RUN_VARIABLE] = str(run)  # (its workers remove it if this process is killed)
        os.environ[PARENT_VARIABLE] = str(os.getpid())  # (its workers stop when it is gone)
        if "timeout_worker_healthcheck" in inspect.signature(uvicorn.Config).parameters:
            # uvicorn's 5 s: a worker starting (carpool loaded, with the embedding model, on a
            # busy machine) was not ready in time and a SIGHUP's restart was given up, the old
            # workers serving on; one whose health-check thread got no turn for 5 s (a call
            # holding the GIL, a stalled machine) was killed with its requests.
            served["timeout_worker_healthcheck"] = WORKER_HEALTHCHECK_S
        server_config = uvicorn.Config(
            "carpool.server:create_worker_app", factory=True, workers=config.workers, **served
        )
        _supervise_workers(server_config, listening)


# The resolved config's name in the run's directory (``serve --workers``).
RESOLVED_FILE = "config.yaml"
CLIENT_KEYS_FILE = "client-keys"


def _keys_read_for_the_run(config: Config, run: Path) -> Config:
    """``config`` with its client keys read now, once for the run: their digests written in the
    run's directory, which its ``auth.client_keys_file`` names. A worker started later (in
    place of one that died) read the file as it was then: a key removed since was refused by
    that worker only, and a file gone meanwhile (a secret rotated) failed it for ever."""
    keys_file = config.auth.client_keys_file
    if not keys_file:
        return config
    copy = run / CLIENT_KEYS_FILE
    ClientKeys.load(keys_file).save(copy)
    auth = config.auth.model_copy(update={"client_keys_file": str(copy)})
    return config.model_copy(update={"auth": auth})


def _refuse_missing_permissions(config: Config) -> None:
    """Exit 2 naming what the Redis user may not run of what carpool needs (an ACL user on a
    Redis shared with other services, ``carpool.redis.permissions``): run anyway, each refusal
    looked like Redis down, nothing was shared and a keyed retry on another instance ran twice.
    A Redis that does not answer now gives no verdict: the start goes on, as without the check."""
    from .redis.permissions import permission_problems

    assert config.redis is not None
    prefix = config.distributed.key_prefix
    problems = asyncio.run(
        permission_problems(config.redis, prefix, cluster=config.distributed.cluster)
    )
    if not problems:
        return
    click.echo(
        f"carpool: --redis: the Redis user of {without_credentials(config.redis)} may not run "
        f"what carpool needs: {'; '.join(problems)}. Allow them (ACL SETUSER <user> "
        f'~{prefix}* &{prefix}* +@all -@dangerous): see "A Redis shared with other services" '
        "in docs/scaling.md",
        err=True,
    )
    sys.exit(2)


def _stopped_while_starting(signum: int, frame: Any) -> None:
    """SIGTERM before the workers' supervisor handles it: a stop, as after (status 0)."""
    raise SystemExit(0)


# How long uvicorn's supervisor waits for a worker to start, or to answer its health check,
# before it gives a restart up or kills the worker (``serve --workers``); less when the worker
# exits or the run is stopped meanwhile (``carpool.supervisor``).
WORKER_HEALTHCHECK_S = 30


def _supervise_workers(server_config: Any, listening: Callable[[int], None]) -> None:
    """What ``uvicorn.run`` does for ``workers`` > 1, the socket's port said once bound: the
    workers share the socket the parent binds, in ``uvicorn.run`` out of sight."""
    import uvicorn

    from .supervisor import Supervisor  # (uvicorn's, its health checks cut short)

    socket = server_config.bind_socket()
    listening(socket.getsockname()[1])
    # (uvicorn's supervisor was given the function each worker runs up to some version (0.35
    # still); it builds the workers' servers itself since (0.54).)
    target = (
        {"target": uvicorn.Server(server_config).run}
        if "target" in inspect.signature(Supervisor).parameters
        else {}
    )
    with socket, contextlib.suppress(KeyboardInterrupt):  # (as ``uvicorn.run``; closed after)
        Supervisor(server_config, sockets=[socket], **target).run()


def _said_at_any_level(log: logging.Logger, message: str, *args: Any) -> None:
    """``message`` as a WARNING record handed to the handlers whatever ``log_level`` is (the
    level is checked by ``Logger.warning``, not by ``Logger.handle``; the handler has none):
    at ``error``, nothing else would tell the operator that the answers are synthetic."""
    log.handle(log.makeRecord(log.name, logging.WARNING, __file__, 0, message, args, None))


def _workers_load(path: str, config: Config) -> None:
    """Load ``path`` as each worker will (``server.create_worker_app``) and exit 2 saying why
    unless it is ``config``: a worker that cannot start is restarted by uvicorn for ever, the
    port never served, and nothing said but in each worker's traceback."""
    try:
        loaded = load_resolved(path)
    except ConfigError as error:
        click.echo(
            f"carpool: the workers could not load the config written for them: {error}", err=True
        )
        sys.exit(2)
    differing = _differing(config, loaded)
    if differing:
        click.echo(
            "carpool: the config written for the workers reads back otherwise, in "
            + ", ".join(differing),
            err=True,
        )
        sys.exit(2)


def _differing(given: Any, loaded: Any, prefix: str = "") -> list[str]:
    """The keys (dotted, never their values: some are secrets) whose values differ."""
    from pydantic import BaseModel

    if isinstance(given, BaseModel) and type(given) is type(loaded):
        found: list[str] = []
        for name in type(given).model_fields:
            found += _differing(getattr(given, name), getattr(loaded, name), f"{prefix}{name}.")
        return found
    return [] if given == loaded else [prefix.rstrip(".")]


# Below this many file descriptors, start-up warns (``_raise_file_limit``): a few hundred
# clients, with their upstream and Redis connections, use them up.
FILE_LIMIT_WARN = 4096


def _raise_file_limit(log: logging.Logger) -> None:
    """Every client connection, and every upstream and Redis connection, holds a file
    descriptor: the soft limit (1024 on most systems) is raised to the hard one, as Go's
    runtime and nginx's ``worker_rlimit_nofile`` do, or a burst of a thousand clients left
    none for the upstream calls (each a 503 ``gateway_overloaded``). Workers inherit it. Still
    under ``FILE_LIMIT_WARN``, said: only the operator can raise the hard limit."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20  # (Linux's nr_open default)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # (over the kernel's own bound: kept as it was)
            pass
    if soft != resource.RLIM_INFINITY and soft < FILE_LIMIT_WARN:
        log.warning(
            "the file descriptor limit is %d: each client connection and each upstream or "
            "Redis connection takes one, and past it clients are cut and calls fail; raise the "
            "hard limit (ulimit -Hn, systemd's LimitNOFILE, docker's --ulimit nofile)",
            soft,
        )


def _say_proxy(log: logging.Logger, url: str, setting: str) -> None:
    """Which proxy the calls to ``url`` go through (``upstream.proxy``), if any; a warning for
    one the environment names that the gateway cannot use (it then connects directly): an
    upstream reached only through it would otherwise fail with no hint."""
    try:
        proxy = proxy_for(url, setting)
    except Unusable as unusable:
        log.warning(
            "%s: %s is reached directly (docs/security.md)", unusable, without_credentials(url)
        )
        return
    if proxy is not None:
        log.info(
            "%s is reached through the proxy %s (%s)",
            without_credentials(url),
            proxy.public,
            proxy.variable,
        )


def _allowed_hosts(config: Config) -> list[str] | None:
    """``allowed_hosts`` as ``carpool serve`` serves it: given, as given; not given, on
    loopback, ``localhost`` alone (a client on this machine names the gateway by an address
    or by it; a web page's own name made to resolve here is DNS rebinding), else any."""
    if config.allowed_hosts is None and _loopback(config.host):
        return ["localhost"]
    return config.allowed_hosts


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``): reached from this machine only."""
    if host.lower() in ("localhost", "localhost."):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback  # (``[::1]`` is ::1 once loaded)
    with contextlib.suppress(OSError):  # (127.1: IPv4 as the socket calls read it)
        return ipaddress.ip_address(socket.inet_aton(host)).is_loopback
    return False


for _command in (sim, bench, eval_semantic, config_reference, fetch_model, check_config):
    main.add_command(_command)


if __name__ == "__main__":
    main()
