"""``carpool serve --workers N`` for the benchmarks: the real command in a child process.

Contract:
- ``served(workers, upstream_url, redis=None, shared=True, log_path=None)`` (context manager)
  starts ``python -m carpool.cli serve --workers N`` on a free loopback port in front of
  ``upstream_url`` (with ``--redis`` when given) and yields ``Workers`` (``port``, ``pids`` of
  the workers, ``processes``: theirs and their supervisor's) once every worker has answered
  ``/stats`` (each request on a new connection: the kernel spreads them). ``shared=False`` runs the same workers as ``carpool serve`` ran them before
  they shared without Redis (uvicorn's ``--workers`` on ``carpool.server:create_worker_app``,
  without ``CARPOOL_PEERS``): each worker alone, for comparison.
- ``stats_of_each(port, n)``: every worker's ``/stats`` (new connections until ``n`` distinct
  ``pid``s answered), by pid.
- Leaving the block stops the process (SIGTERM, SIGKILL after 15 s) and its workers.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config
from ..config.loader import resolved_text
from . import process
from .client import fetch

START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Workers:
    port: int
    pids: tuple[int, ...]  # the workers'
    supervisor: int = 0  # the process that started them (itself the worker, with one)

    @property
    def processes(self) -> tuple[int, ...]:
        """Every process of the gateway: its workers and their supervisor."""
        return tuple(sorted({*self.pids, self.supervisor} - {0}))

    @property
    def url(self) -> str:
        return f"http://{process.HOST}:{self.port}"


def stats_of_each(port: int, n: int, tries: int = 200) -> dict[int, dict[str, Any]]:
    """Each worker's /stats, by pid (``tries`` new connections at most)."""
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        status, _, body = fetch("GET", f"http://{process.HOST}:{port}/stats", timeout=10)
        if status == 200:
            snapshot = json.loads(body)
            seen[snapshot["pid"]] = snapshot
            if len(seen) == n:
                return seen
    raise RuntimeError(f"only {len(seen)} of {n} workers answered /stats")


@contextlib.contextmanager
def served(
    workers: int,
    upstream_url: str,
    redis: str | None = None,
    shared: bool = True,
    log_path: Path | None = None,
) -> Iterator[Workers]:
    port = process.free_port()
    env = {"CARPOOL_LOG_LEVEL": "warning"}
    with contextlib.ExitStack() as stack:
        if shared or workers == 1:
            args = ["-m", "carpool.cli", "serve", "--upstream", upstream_url]
            args += ["--port", str(port), "--workers", str(workers)]
            args += ["--redis", redis] if redis else []
        else:
            config = Config(upstreams=[upstream_url], port=port, workers=workers, redis=redis)
            resolved = stack.enter_context(
                tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="carpool-bench-")
            )
            resolved.write(resolved_text(config))  # (what carpool serve writes its workers)
            resolved.flush()
            env["CARPOOL_CONFIG"] = resolved.name
            args = ["-m", "uvicorn", "carpool.server:create_worker_app", "--factory"]
            args += ["--port", str(port), "--workers", str(workers), "--log-level", "warning"]
            args += ["--no-access-log"]
        log = stack.enter_context(open(log_path, "wb")) if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=process.child_env(env),
        )
        try:
            process.wait_port(port, proc, START_TIMEOUT_S)
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                with contextlib.suppress(RuntimeError):
                    pids = tuple(sorted(stats_of_each(port, workers)))
                    break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise process.ChildError(f"{workers} workers did not all start")
            yield Workers(port, pids, proc.pid)
        finally:
            process.stop(proc, 15.0)
