"""The embedded gateway of ``carpool bench``: the real app in a child process on a free port.

Contract:
- ``embedded_gateway(config, log_path)`` (async context manager) starts
  ``python -m carpool.bench.embedded CONFIG.json`` and yields its base URL once ``/healthz``
  answers. The child runs ``carpool.server.create_app(Gateway(config))`` on uvicorn (uvloop and
  httptools when installed, access log off), in front of ``config.upstreams`` or, when empty, the
  embedded simulated engine (the gateway's default upstream).
- A separate process, so the load generator and the gateway do not share one event loop (the
  latencies measured are the gateway's, not the client's queueing), as in production.
- The child binds 127.0.0.1 port 0 itself and prints ``{"port": N}`` on stdout once it listens;
  its log (stderr) goes to ``log_path``. It adds one route to the gateway: ``GET /sim/stats``, the
  simulated replicas' own counters (``SimReplica.stats()``), so the report can cross-check the
  gateway's ``upstream_calls`` against the calls the engine received.
- Leaving the context terminates the child (SIGTERM, then SIGKILL after 10 s). The child also
  exits when its stdin closes, so it never outlives a parent that was killed.
- A child that fails to start raises ``EmbeddedError`` with the end of its log (e.g. the semantic
  layer enabled without the ``[semantic]`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from ..config import Config

STARTUP_TIMEOUT_S = 60.0


class EmbeddedError(RuntimeError):
    """The embedded gateway did not start."""


@contextlib.asynccontextmanager
async def embedded_gateway(config: Config, log_path: Path) -> AsyncIterator[str]:
    """Run the gateway for ``config`` in a child process; yield ``http://127.0.0.1:PORT``."""
    with tempfile.NamedTemporaryFile(
        "w", suffix=".json", prefix="carpool-bench-", delete=False
    ) as handle:
        json.dump(config.model_dump(mode="json"), handle)
        config_path = handle.name
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115  (closed below, after the child)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "carpool.bench.embedded",
        config_path,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = await _started(process, log_path)
        yield url
    finally:
        await _stop(process)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(config_path)


async def _started(process: asyncio.subprocess.Process, log_path: Path) -> str:
    assert process.stdout is not None
    try:
        line = await asyncio.wait_for(process.stdout.readline(), STARTUP_TIMEOUT_S)
        port = int(json.loads(line)["port"])
    except (TimeoutError, ValueError, KeyError, TypeError):
        await _stop(process)
        raise EmbeddedError(f"the embedded gateway did not start:\n{_tail(log_path)}") from None
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/healthz") as response:
                    if response.status == 200:
                        return url
            if process.returncode is not None or loop.time() > deadline:
                await _stop(process)
                raise EmbeddedError(
                    f"the embedded gateway did not answer /healthz:\n{_tail(log_path)}"
                )
            await asyncio.sleep(0.05)


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    if process.stdin is not None:
        process.stdin.close()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------- the child


def _with_sim_stats(app: Any, gateway: Any) -> Any:
    """The gateway's app plus ``GET /sim/stats`` (the in-process simulated replicas' counters)."""
    import orjson

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/sim/stats":
            replicas = [u.replica.stats() for u in gateway.upstreams if hasattr(u, "replica")]
            body = orjson.dumps({"simulated": bool(replicas), "replicas": replicas})
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return wrapped


def _exit_with_parent() -> None:
    """Stop (as on SIGTERM) once stdin closes: the parent is gone or done."""

    def watch() -> None:
        with contextlib.suppress(Exception):
            sys.stdin.buffer.read()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    import logging

    import uvicorn

    from ..server import create_app
    from ..wiring import build_gateway

    args = sys.argv[1:] if argv is None else argv
    config = Config.model_validate(json.loads(Path(args[0]).read_text()))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        gateway = build_gateway(config)
    except ImportError as error:
        print(
            f"carpool bench: semantic.enabled needs the semantic extra: "
            f"pip install 'carpool[semantic]' ({error})",
            file=sys.stderr,
        )
        sys.exit(2)
    engine = (
        "the embedded SIMULATED engine" if not config.upstreams else ", ".join(config.upstreams)
    )
    print(
        f"carpool bench: embedded gateway in front of {engine}; semantic cache "
        f"{'on' if gateway.semantic is not None else 'off'}",
        file=sys.stderr,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    server = uvicorn.Server(
        uvicorn.Config(
            _with_sim_stats(create_app(gateway), gateway),
            log_level="warning",
            access_log=False,
            lifespan="on",
            backlog=2048,
        )
    )
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    _exit_with_parent()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
