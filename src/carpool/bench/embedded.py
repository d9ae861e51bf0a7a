"""The gateway of the benchmarks and of ``carpool bench``: the real app in a child process.

Contract:
- ``gateway(config, log_path, env)`` (context manager) starts ``python -m carpool.bench.embedded``
  (``process.server``), hands it ``config`` (secrets included) as the first line of its stdin,
  and yields its ``Server`` (``url``, ``port``, ``pid``) once ``/healthz`` answers. Never in a
  file: one in /tmp outlived a ``carpool bench`` that was killed, with the admin token and the
  upstream key in it. ``embedded_gateway(config, log_path)`` is the same as an async context
  manager yielding the URL (``carpool bench``). The child runs
  ``carpool.server.create_app(build_gateway(config))`` on uvicorn (uvloop and httptools when
  installed, access log off, backlog 4096: the stack of ``carpool serve``), in front of
  ``config.upstreams`` or, when empty, the embedded simulated engine (the gateway's default).
  Its first line (stderr) says which, the upstreams by their replica names (never a URL's user,
  password or query).
- A separate process, so the load generator and the gateway do not share one event loop (the
  latencies measured are the gateway's, not the client's queueing), as in production.
- The child binds 127.0.0.1 port 0 itself and announces it; its log (stderr) goes to ``log_path``
  (this process's stderr when None). In front of the simulated engine, the gateway's own
  ``GET /sim/stats`` (``server.py``: the in-process replicas' counters) lets the report
  cross-check the gateway's ``upstream_calls`` against the calls the engine received.
- Leaving the context terminates the child (SIGTERM, then SIGKILL after 10 s); the child also
  exits when its stdin closes, so it never outlives a parent that was killed.
- A child that fails to start raises ``EmbeddedError`` with the end of its log (e.g. the semantic
  layer enabled without the ``[semantic]`` extra).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from ..config import Config
from ..extras import missing_extra_said
from . import process


class EmbeddedError(process.ChildError):
    """The embedded gateway did not start."""


@contextlib.contextmanager
def gateway(
    config: Config, log_path: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[process.Server]:
    """Run the gateway for ``config`` in a child process for the block."""
    try:
        with process.server(
            "carpool.bench.embedded",
            name="the embedded gateway",
            health="/healthz",
            log_path=log_path,
            env=env,
            stdin=json.dumps(config.with_secrets()).encode() + b"\n",  # (one line: JSON's)
        ) as child:
            yield child
    except process.ChildError as error:
        raise EmbeddedError(str(error)) from None


@contextlib.asynccontextmanager
async def embedded_gateway(config: Config, log_path: Path) -> AsyncIterator[str]:
    """``gateway`` from async code: starts and stops it in a worker thread; yields its URL."""
    async with process.in_thread(gateway(config, log_path)) as child:
        yield child.url


# ---------------------------------------------------------------------------------- the child


def main() -> None:
    import logging

    from ..http_protocol import protocol
    from ..server import create_app
    from ..wiring import build_gateway

    config = Config.from_secrets(json.loads(sys.stdin.buffer.readline()))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        gateway = build_gateway(config)
    except ImportError as error:
        said = missing_extra_said("semantic.enabled", "semantic", error)
        print(f"carpool bench: {said}", file=sys.stderr)
        sys.exit(2)
    except ValueError as error:  # a model or verifier folder, the hub client: as serve says it
        print(f"carpool bench: {error}", file=sys.stderr)
        sys.exit(2)
    from ..upstream.http import replica_names

    # The upstreams by their replica names (as ``carpool serve`` logs them): never a URL's
    # user, password or query.
    engine = (
        ", ".join(name for name, _ in replica_names(config.upstreams, config.upstream_names))
        or "the embedded SIMULATED engine"
    )
    print(
        f"carpool bench: embedded gateway in front of {engine}; semantic cache "
        f"{'on' if gateway.semantic is not None else 'off'}",
        file=sys.stderr,
    )
    sock = process.listen()
    process.announce(sock)
    process.serve(
        create_app(gateway), sock, http=protocol(), keepalive_s=config.limits.client_keepalive
    )


if __name__ == "__main__":
    main()
