"""Gateway instances as separate processes (``carpool serve``), as they run in production.

    async with instances(3, fake.url, redis_server.url, settings) as gateways:
        gateways[0].url, gateways[1].client, gateways[2].kill()

Each instance is ``python -m carpool.cli serve --upstream URL --redis URL --port P`` with
``settings`` given as ``CARPOOL_*`` environment variables (nested keys joined by ``__``), its
output in a log file shown when it fails to start. ``instances`` returns once every one answers
``/healthz``; on exit they are killed. In-process gateways (``conftest.run_gateway``) share the
test's event loop, so a burst of requests measures that loop, not Redis: these do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .ports import free_port


def start_serve(
    args: list[str],
    env: dict[str, str],
    log: Path,
    skew_s: float | Path = 0,
    own_group: bool = False,
    stalled: Path | None = None,
    stuck: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m carpool.cli serve ARGS`` in a process of its own, its output in ``log``;
    ``skew_s``: its wall clock that many seconds off the system's, or a file holding them,
    written again to step it (``skewed_serve.py``); ``own_group``: in a process group of its
    own, its workers with it (``os.killpg(proc.pid, ...)`` signals them all at once);
    ``stalled``: a directory, its workers' health-check threads stalled at their first ping,
    each worker saying so there (``stalled_health_checks.py``); ``stuck``: a directory, its
    workers' event loops stuck on SIGUSR2, each worker saying it started there
    (``stuck_loops.py``)."""
    command = [sys.executable, "-m", "carpool.cli", "serve", *args]
    if skew_s:
        command[1:3] = [str(Path(__file__).with_name("skewed_serve.py"))]
        env = {**env, "SKEW_S": str(skew_s)}
    if stalled is not None:
        command[1:3] = [str(Path(__file__).with_name("stalled_health_checks.py"))]
        env = {**env, "STALLED_DIR": str(stalled)}
    if stuck is not None:
        command[1:3] = [str(Path(__file__).with_name("stuck_loops.py"))]
        env = {**env, "STUCK_DIR": str(stuck)}
    with open(log, "wb") as out:
        return subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=own_group,
        )


def ignoring_sigint() -> None:
    """(A child's ``preexec_fn``: started as a shell starts a background job, SIGINT ignored.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def signal_handled(pid: int, signum: int, how: str = "SigIgn") -> bool:
    """Whether ``pid`` ignores (``SigIgn``) or catches (``SigCgt``) ``signum``, as /proc says."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line for line in status.splitlines() if line.startswith(f"{how}:"))
    return bool(int(mask.split()[1], 16) & (1 << (signum - 1)))


def interrupt_when_imported(
    proc: subprocess.Popen[str], module: str, nth: int = 1, group: bool = False
) -> tuple[str, str]:
    """Read ``proc``'s standard error (run with ``-X importtime``) until it says ``module``
    loaded for the ``nth`` time (a worker's after its parent's: ``nth=2``), then send it SIGINT
    (to its whole group with ``group``, as a terminal's Ctrl-C); what it said before, and after
    (once it closed its standard error)."""
    assert proc.stderr is not None
    seen, loaded = [], 0
    for line in proc.stderr:
        seen.append(line)
        loaded += line.rstrip().endswith(f" {module}")
        if loaded == nth:
            if group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)
            break
    return "".join(seen), proc.stderr.read()


def serve_log(
    *args: str,
    preexec_fn: Callable[[], object] | None = None,
    on_listening: Callable[[int], object] | None = None,
) -> str:
    """``carpool serve ARGS`` run until it says it is listening, then stopped: its log so far
    (fails if it exits first). ``preexec_fn``: run in the child before it starts (its limits);
    ``on_listening(pid)``: called once it listens, before it is stopped."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # (No drain on the SIGTERM that stops it, unless the test sets one: nothing here is behind
    # a load balancer, and the default's 5 s a run was a minute of every CI run.)
    env.setdefault("CARPOOL_SHUTDOWN__DRAIN_S", "0")
    process = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=preexec_fn,
    )
    lines = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "Uvicorn running on" in line:
                if on_listening is not None:
                    on_listening(process.pid)
                return "".join(lines)
        raise AssertionError("carpool serve exited before listening:\n" + "".join(lines))
    finally:
        process.terminate()
        process.wait(10)


def environment(settings: dict[str, Any], prefix: str = "CARPOOL_") -> dict[str, str]:
    """``{"distributed": {"lease_ms": 600}}`` -> ``{"CARPOOL_DISTRIBUTED__LEASE_MS": "600"}``."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        name = f"{prefix}{key.upper()}"
        if isinstance(value, dict):
            out.update(environment(value, name + "__"))
        else:
            out[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def serve_env(settings: dict[str, Any] | None = None) -> dict[str, str]:
    """The environment of a ``carpool serve`` under test: this one without its ``CARPOOL_*``
    variables, plus ``settings`` (``environment``) and a log level of ``warning``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    env.update(environment({"log_level": "warning", **(settings or {})}))
    return env


async def answered_by(client: httpx.AsyncClient, proc: subprocess.Popen[bytes]) -> str | None:
    """Why the gateway answering ``client`` is not the one ``proc`` runs (or one of its workers),
    or None: two draws of one port before either bound it, and a test's client was served by
    another test's gateway (its settings, its cache) without a word. Unknown (``/stats`` closed
    by an admin token, no /proc) counts as ours."""
    stats = await client.get("/stats", timeout=5)
    if stats.status_code != 200:
        return None
    pid = stats.json()["pid"]
    try:  # (its parent: a worker of ``serve --workers``)
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    if proc.pid in (pid, parent):
        return None
    return f"the port is another process's (pid {pid}), not this instance's ({proc.pid})"


@dataclass
class Instance:
    port: int
    log: Path
    proc: subprocess.Popen[bytes]
    client: httpx.AsyncClient = field(init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL: the instance dies without cleaning anything up (its Redis keys stay)."""
        self.proc.kill()
        self.proc.wait()

    async def stats(self) -> dict[str, Any]:
        return (await self.client.get("/stats")).json()

    async def until_serving(self, timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            assert self.proc.poll() is None, f"the instance exited: {self.log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                if (await self.client.get("/healthz", timeout=0.5)).status_code == 200:
                    problem = await answered_by(self.client, self.proc)
                    assert problem is None, f"{problem}: {self.log.read_text()[-3000:]}"
                    return
            assert loop.time() < deadline, f"not serving: {self.log.read_text()[-3000:]}"
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def instances(
    n: int,
    upstream: str,
    redis: str | None,
    settings: dict[str, Any] | None = None,
    *,
    connections: int = 1000,
    workers: list[int] | None = None,
    skews: list[float | Path] | None = None,
) -> AsyncIterator[list[Instance]]:
    """``workers``: each instance's ``--workers`` (default 1); ``skews``: how many seconds each
    one's wall clock is off the system's (default 0: another machine's clock, minutes off), or
    a file holding them (``start_serve``)."""
    env = serve_env(settings)
    started: list[Instance] = []
    with tempfile.TemporaryDirectory(prefix="carpool-instances-") as folder:
        try:
            for i in range(n):
                port = free_port()
                log = Path(folder) / f"instance-{i}.log"
                proc = start_serve(
                    [
                        "--upstream",
                        upstream,
                        *(["--redis", redis] if redis else []),
                        "--port",
                        str(port),
                        *(["--workers", str(workers[i])] if workers else []),
                    ],
                    env,
                    log,
                    skews[i] if skews else 0,
                )
                instance = Instance(port, log, proc)
                # (a few more than the load, so /stats is never queued behind it)
                limits = httpx.Limits(
                    max_connections=connections + 8, max_keepalive_connections=connections + 8
                )
                instance.client = httpx.AsyncClient(
                    base_url=instance.url, limits=limits, timeout=60
                )
                started.append(instance)
            await asyncio.gather(*(i.until_serving() for i in started))
            yield started
        finally:
            for instance in started:
                instance.kill()
                await instance.client.aclose()
