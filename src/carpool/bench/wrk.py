"""wrk, a load generator in C, where it is installed: throughput with the load generator's own
cost kept small.

Why: ``carpool.bench.loadgen`` is Python, and at the rates of exact hits it takes a core of its
own. On a machine with two cores that leaves one to the servers, so that two workers cannot show
what they add over one. wrk (https://github.com/wg/wrk, Debian's ``wrk`` package) spends a
fraction of that per request.

Contract:
- ``available()``: whether ``wrk`` is on PATH. Nothing here installs it; a benchmark without it
  reports the Python load generator's figures alone.
- ``throughput(port, body, connections, seconds, threads, pids)``: ``wrk`` POSTing ``body``
  (JSON) to the chat endpoint on 127.0.0.1:``port`` on ``connections`` keep-alive connections
  for ``seconds`` (rounded to whole seconds, at least one); returns requests/s, the requests
  answered and those not 2xx, and the CPU seconds (user + system) that wrk and the server's
  processes (``pids``: Linux ``/proc``; none given, 0) spent meanwhile; or raises ``WrkError``
  (what wrk said) when it reports no rate.
- ``rounds(ports, body, connections, seconds, rounds, pids)``: the targets compared side by side
  (``ports``: name -> port; ``pids``: name -> its processes, optional): one short warm-up each,
  then ``rounds`` rounds of ``throughput`` over every target, the order reversed every other
  round (so that no target always follows the same one); ``Rounds``: each target's requests/s
  per round, the answers that were not 2xx in all, and per round the servers' CPU per request
  (µs: what a request costs, whatever the cores left to them) and the cores wrk took.

Why the CPU: on a machine with few cores, wrk shares them with the servers, and at tens of
thousands of requests a second it takes a good part of one; a throughput ratio then measures the
cores left over as much as the servers. CPU per request does not depend on them.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from .loadgen import CHAT

_RATE = re.compile(rb"^Requests/sec:\s+([0-9.]+)", re.MULTILINE)
_NON_2XX = re.compile(rb"^\s*Non-2xx or 3xx responses:\s+(\d+)", re.MULTILINE)
_REQUESTS = re.compile(rb"^\s*(\d+) requests in ", re.MULTILINE)


class WrkError(RuntimeError):
    """wrk ran but reported no rate."""


def available() -> bool:
    return shutil.which("wrk") is not None


def script(body: Any) -> str:
    """The Lua that makes wrk POST ``body`` as JSON (a Lua long string holds any JSON text)."""
    text = orjson.dumps(body).decode()
    level = "=" * (max((len(m) for m in re.findall(r"\](=*)\]", text)), default=-1) + 1)
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [{level}[{text}]{level}]\n"
    )


def throughput(
    port: int,
    body: Any,
    connections: int,
    seconds: float,
    threads: int = 1,
    pids: Iterable[int] = (),
) -> dict[str, float]:
    pids = tuple(pids)
    with tempfile.TemporaryDirectory(prefix="carpool-wrk-") as tmp:
        lua = Path(tmp) / "post.lua"
        lua.write_text(script(body), encoding="utf-8")
        server_before, wrk_before = cpu_seconds(pids), _children_cpu()
        started = time.monotonic()
        done = subprocess.run(
            [
                "wrk",
                f"-t{threads}",
                f"-c{connections}",
                f"-d{max(1, round(seconds))}s",  # (whole seconds: wrk takes no fraction)
                "-s",
                str(lua),
                f"http://127.0.0.1:{port}{CHAT}",
            ],
            capture_output=True,
            timeout=seconds + 60,
        )
        wall = time.monotonic() - started
        server_cpu, wrk_cpu = cpu_seconds(pids) - server_before, _children_cpu() - wrk_before
    rate = _RATE.search(done.stdout)
    if done.returncode != 0 or rate is None:
        raise WrkError(f"wrk said: {(done.stdout + done.stderr).decode(errors='replace')[-500:]}")
    non_2xx = _NON_2XX.search(done.stdout)
    requests = _REQUESTS.search(done.stdout)
    return {
        "rps": float(rate.group(1)),
        "requests": float(requests.group(1)) if requests else 0.0,
        "non_2xx": float(non_2xx.group(1)) if non_2xx else 0.0,
        "server_cpu_s": server_cpu,
        "wrk_cpu_s": wrk_cpu,
        "wall_s": wall,
    }


def cpu_seconds(pids: Iterable[int]) -> float:
    """The user + system CPU seconds the processes ``pids`` have spent so far (Linux ``/proc``;
    a process that cannot be read counts 0)."""
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # (after the command's name, which may hold ")")
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    """The CPU seconds of this process's children that have ended (wrk, once run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Rounds(NamedTuple):
    """``rounds``' measurements, per target: one value per round."""

    rps: dict[str, list[float]]
    non_2xx: float
    cpu_us_per_request: dict[str, list[float]]  # (the target's processes; 0 without pids)
    wrk_cores: dict[str, list[float]]  # (wrk's CPU seconds over the round's wall seconds)


def rounds(
    ports: dict[str, int],
    body: Any,
    connections: int,
    seconds: float,
    rounds: int,
    pids: dict[str, Iterable[int]] | None = None,
) -> Rounds:
    """Interleaved rounds over ``ports`` (module contract)."""
    pids = {name: tuple((pids or {}).get(name, ())) for name in ports}
    for port in ports.values():
        throughput(port, body, connections, 1.0)  # (warm)
    rps: dict[str, list[float]] = {name: [] for name in ports}
    cpu: dict[str, list[float]] = {name: [] for name in ports}
    cores: dict[str, list[float]] = {name: [] for name in ports}
    non_2xx = 0.0
    for r in range(rounds):
        order = list(ports) if r % 2 == 0 else list(ports)[::-1]
        for name in order:
            measured = throughput(ports[name], body, connections, seconds, pids=pids[name])
            rps[name].append(measured["rps"])
            non_2xx += measured["non_2xx"]
            served = max(measured["requests"], 1.0)
            cpu[name].append(measured["server_cpu_s"] / served * 1e6)
            cores[name].append(measured["wrk_cpu_s"] / measured["wall_s"])
    return Rounds(rps, non_2xx, cpu, cores)
