"""wrk, a load generator in C, where it is installed: throughput with the load generator's own
cost kept small.

Why: ``carpool.bench.loadgen`` is Python, and at the rates of exact hits it takes a core of its
own. On a machine with two cores that leaves one to the servers, so that two workers cannot show
what they add over one. wrk (https://github.com/wg/wrk, Debian's ``wrk`` package) spends a
fraction of that per request.

Contract:
- ``available()``: whether ``wrk`` is on PATH. Nothing here installs it; a benchmark without it
  reports the Python load generator's figures alone.
- ``throughput(port, body, connections, seconds, threads)``: ``wrk`` POSTing ``body`` (JSON) to
  the chat endpoint on 127.0.0.1:``port`` on ``connections`` keep-alive connections for
  ``seconds`` (rounded to whole seconds, at least one); returns requests/s and the answers
  that were not 2xx, or raises ``WrkError`` (what wrk said) when it reports no rate.
- ``rounds(ports, body, connections, seconds, rounds)``: the targets compared side by side
  (``ports``: name -> port): one short warm-up each, then ``rounds`` rounds of ``throughput``
  over every target, the order reversed every other round (so that no target always follows
  the same one); each target's requests/s per round, and the answers that were not 2xx in all.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import orjson

from .loadgen import CHAT

_RATE = re.compile(rb"^Requests/sec:\s+([0-9.]+)", re.MULTILINE)
_NON_2XX = re.compile(rb"^\s*Non-2xx or 3xx responses:\s+(\d+)", re.MULTILINE)


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
    port: int, body: Any, connections: int, seconds: float, threads: int = 1
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="carpool-wrk-") as tmp:
        lua = Path(tmp) / "post.lua"
        lua.write_text(script(body))
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
    rate = _RATE.search(done.stdout)
    if done.returncode != 0 or rate is None:
        raise WrkError(f"wrk said: {(done.stdout + done.stderr).decode(errors='replace')[-500:]}")
    non_2xx = _NON_2XX.search(done.stdout)
    return {"rps": float(rate.group(1)), "non_2xx": float(non_2xx.group(1)) if non_2xx else 0.0}


def rounds(
    ports: dict[str, int], body: Any, connections: int, seconds: float, rounds: int
) -> tuple[dict[str, list[float]], float]:
    """Interleaved rounds over ``ports`` (module contract): requests/s per target and round,
    and the non-2xx answers of them all."""
    for port in ports.values():
        throughput(port, body, connections, 1.0)  # (warm)
    taken: dict[str, list[float]] = {name: [] for name in ports}
    non_2xx = 0.0
    for r in range(rounds):
        order = list(ports) if r % 2 == 0 else list(ports)[::-1]
        for name in order:
            measured = throughput(ports[name], body, connections, seconds)
            taken[name].append(measured["rps"])
            non_2xx += measured["non_2xx"]
    return taken, non_2xx
