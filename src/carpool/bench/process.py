"""Child processes of the benchmarks and of ``carpool bench``: servers that start on a free port
and say so, one-shot workers that print their result, and how any of them is stopped.

Contract (parent side):
- Every child runs this interpreter with this process's ``carpool`` first on its PYTHONPATH (so a
  checkout's code measures itself, not an installed copy) and ``PYTHONHASHSEED=0`` unless set.
- ``server(module, args, name, health, log_path, stdin)`` (context manager) starts ``python -m
  MODULE ARGS``, writes ``stdin`` (bytes, e.g. a config with secrets: never in a file nor on a
  command line) to its stdin, which stays open, reads the port it announces (below), waits until ``GET health`` answers 200, and yields a
  ``Server`` (``pid``, ``port``, ``url``). Its stderr goes to ``log_path`` (inherited when None),
  its stdout is discarded after the announcement. A child that exits, or announces nothing, or
  does not answer within ``timeout`` raises ``ChildError`` (naming it ``name``) with the end of its
  log. Leaving the
  block stops it: SIGTERM, SIGKILL after ``grace`` seconds.
- ``in_thread(context)``: such a context manager entered from async code (start and stop in a
  worker thread); cancelled while it starts, it stops what it started once started.
- ``run_child(args, spec, timeout)``: ``python ARGS '<spec as JSON>'``, whose stdout is one JSON
  value, returned; a failure raises ``ChildError`` with the end of its stderr.
- For servers started otherwise (the peers' own command lines): ``free_port()``,
  ``wait_port(port, proc, timeout)`` and ``stop(proc, grace)``.
- ``pinned({pid: cpus})`` (context manager, Linux): each process held to those CPUs for the block
  (pid 0: this one, and so every child it starts meanwhile), then given back the CPUs it had;
  a process gone meanwhile is skipped. For a measurement that must not share a core.

Contract (child side):
- ``listen()`` binds 127.0.0.1 port 0 (backlog 4096: a thousand clients may connect at once),
  ``announce(sock)`` prints ``{"port": N}`` on stdout; ``serve(app, sock, log_level, lifespan)``
  runs uvicorn on that socket (uvloop and httptools when installed, access log off) and returns
  when it stops, which it does on SIGTERM and also once its stdin closes: a child never outlives
  a parent that was killed. A child serving otherwise calls ``exit_with_parent()`` for the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .client import DIRECT

T = TypeVar("T")
HOST = "127.0.0.1"
BACKLOG = 4096
START_TIMEOUT_S = 60.0


class ChildError(RuntimeError):
    """A child process did not start, or failed."""


@dataclass(frozen=True, slots=True)
class Server:
    pid: int
    port: int

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the directory holding this ``carpool``
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONHASHSEED", "0")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None:
        return "(its log went to this process's stderr)"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def server(
    module: str,
    args: Sequence[str] = (),
    *,
    name: str | None = None,
    health: str = "/",
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = START_TIMEOUT_S,
    grace: float = 10.0,
    stdin: bytes = b"",
) -> Iterator[Server]:
    """Run ``python -m MODULE ARGS`` (a server that announces its port) for the block."""
    log = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "wb")  # noqa: SIM115  (closed below, after the child)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        env=child_env(env),
    )
    try:
        if stdin:
            _write(proc, stdin)
        port = _announced(proc, timeout)
        if port is None:
            raise ChildError(f"{name or module} did not start:\n{_tail(log_path)}")
        if not _healthy(f"http://{HOST}:{port}{health}", proc, timeout):
            raise ChildError(f"{name or module} did not answer GET {health}:\n{_tail(log_path)}")
        yield Server(proc.pid, port)
    finally:
        stop(proc, grace)
        if log is not None:
            log.close()


@contextlib.asynccontextmanager
async def in_thread(context: contextlib.AbstractContextManager[T]) -> AsyncIterator[T]:
    """A blocking context manager (a child's start and stop) entered from async code: its
    ``__enter__`` and ``__exit__`` run in a worker thread, so the event loop keeps running.
    Cancelled while it starts, it still stops what it started, once started."""
    entering = asyncio.ensure_future(asyncio.to_thread(context.__enter__))
    try:
        value = await asyncio.shield(entering)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # (a start that failed started nothing)
            await entering
            await asyncio.to_thread(context.__exit__, None, None, None)
        raise
    try:
        yield value
    finally:
        await asyncio.to_thread(context.__exit__, None, None, None)


def _write(proc: subprocess.Popen[bytes], data: bytes) -> None:
    """``data`` to the child's stdin, kept open (its close tells the child to stop)."""
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it exited: said below, with its log
        proc.stdin.write(data)
        proc.stdin.flush()


def _announced(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The port of the child's ``{"port": N}`` line, then its stdout drained in the background."""
    assert proc.stdout is not None
    stdout = proc.stdout
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not line:
        return None
    threading.Thread(target=lambda: stdout.read(), daemon=True).start()
    try:
        return int(json.loads(line[0])["port"])
    except (ValueError, KeyError, TypeError):
        return None


def _healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with DIRECT.open(url, timeout=5) as response:  # (loopback: never a proxy)
                if response.status == 200:
                    return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def pinned(placement: dict[int, set[int]]) -> Iterator[None]:
    """Each process of ``placement`` on its CPUs for the block (module contract)."""
    before = {pid: os.sched_getaffinity(pid) for pid in placement}
    try:
        for pid, cpus in placement.items():
            os.sched_setaffinity(pid, cpus)
        yield
    finally:
        for pid, cpus in before.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(pid, cpus)


def stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def run_child(args: Sequence[str], spec: Any, timeout: float) -> Any:
    """``python ARGS '<spec>'`` to completion; its stdout, parsed as JSON."""
    done = subprocess.run(
        [sys.executable, *args, json.dumps(spec)],
        env=child_env(),
        capture_output=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise ChildError(
            f"{' '.join(args)} failed ({done.returncode}):\n"
            f"{done.stderr.decode(errors='replace')[-3000:]}"
        )
    return json.loads(done.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Until something accepts connections on ``port``; the process exiting first is an error."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ChildError(f"server on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


# ---------------------------------------------------------------------------------- the child


def listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(BACKLOG)
    return sock


def announce(sock: socket.socket) -> None:
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)


def exit_with_parent() -> None:
    """Stop (as on SIGTERM) once stdin closes: the parent is gone or done."""

    def watch() -> None:
        with contextlib.suppress(Exception):
            sys.stdin.buffer.read()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def serve(
    app: Any,
    sock: socket.socket,
    log_level: str = "warning",
    lifespan: str = "on",
    http: Any = "auto",
    keepalive_s: float = 5.0,
) -> None:
    """``http``: uvicorn's protocol setting (the gateway's: ``http_protocol.protocol()``);
    ``keepalive_s``: how long an idle client connection is kept (the gateway's:
    ``limits.client_keepalive``)."""
    import uvicorn

    from carpool.signals import keeping_sigint_ignored

    class _Server(uvicorn.Server):
        # (A bench started with SIGINT ignored, a background job's, starts its servers so.)
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with keeping_sigint_ignored(super().capture_signals()):
                yield

    server = _Server(
        uvicorn.Config(
            app,
            log_level=log_level,
            access_log=False,
            lifespan=lifespan,  # type: ignore[arg-type]  # ("on" | "off" | "auto")
            backlog=BACKLOG,
            http=http,
            ws="none",  # (as ``carpool serve``)
            timeout_keep_alive=keepalive_s,  # type: ignore[arg-type]  # (call_later: a float)
        )
    )
    exit_with_parent()
    server.run(sockets=[sock])
