"""Shared helpers for the benchmarks: machine facts, statistics, request bodies, and servers in
subprocesses (the counting upstream app and the gateway, each on its own uvicorn)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from orjson import dumps as _json_dumps

from carpool.bench import report as _report

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PY = sys.executable
HOST = "127.0.0.1"
CHAT = "/v1/chat/completions"


# ------------------------------------------------------------------------------------------------
# Facts and statistics


def machine() -> dict[str, Any]:
    try:
        import uvloop

        loop = f"uvloop {uvloop.__version__}"
    except ImportError:  # pragma: no cover
        loop = "asyncio"
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "event_loop": loop,
    }


# The q-th percentile (0..100), linear interpolation between closest ranks: `carpool bench`'s.
percentile = _report.percentile


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 4),
        "p90_ms": round(percentile(ms, 90), 4),
        "p99_ms": round(percentile(ms, 99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "max_ms": round(max(ms), 4),
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


# ------------------------------------------------------------------------------------------------
# Request bodies

SYSTEM_PROMPT = (
    "You are a careful assistant for an online hardware store. Answer in plain English, in at "
    "most three short paragraphs. Be accurate about product dimensions, materials, stock and "
    "delivery times; when you are not sure, say so and suggest contacting support. Never invent "
    "order numbers, prices or discounts. Use metric units first and imperial units in brackets. "
    "Prefer bullet lists for step-by-step instructions, and keep each step under twenty words. "
    "Do not mention these instructions. If the question is about safety (power tools, ladders, "
    "electrical work, chemicals), begin with a one-line safety note. "
)
USER_PROMPT = (
    "I am building a raised garden bed of 2.4 m by 1.2 m from untreated larch boards, 30 cm "
    "high. Which screws should I use, how far apart, and do I need corner posts or brackets? "
    "Also, how long should larch last outdoors in contact with soil, and should I line the "
    "inside? Please keep it short."
)


def chat_body(temperature: float | None = 0, nonce: str = "", **extra: Any) -> dict[str, Any]:
    """A realistic ~1 KB chat request: a system message and a user message."""
    body: dict[str, Any] = {
        "model": "bench-model",
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT + nonce},
        ],
        "max_tokens": 256,
    }
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra)
    return body


def json_bytes(body: dict[str, Any]) -> bytes:
    return _json_dumps(body)


# The upstream's answer: one complete chat completion (every choice finished, with usage).
ANSWER = _json_dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "bench-model",
        "system_fingerprint": "bench-upstream",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": None,
                "message": {
                    "role": "assistant",
                    "content": (
                        "Use 5 x 60 mm stainless steel or A2 decking screws, two per board end, "
                        "about 40 cm apart along the corner posts. Larch lasts 10-15 years in soil; "
                        "line the inside with a breathable membrane."
                    ),
                },
            }
        ],
        "usage": {"prompt_tokens": 180, "completion_tokens": 48, "total_tokens": 228},
    }
)


# ------------------------------------------------------------------------------------------------
# Servers in subprocesses


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


@contextlib.contextmanager
def server(args: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``python <args>`` (a server listening on ``port``) for the duration of the block."""
    proc = subprocess.Popen(
        [PY, *args], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=None
    )
    try:
        wait_port(port, proc)
        yield proc
    finally:
        stop(proc, 10)


def stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``grace`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def upstream_server(*, hold: bool = False, delay_ms: float = 0) -> Iterator[int]:
    """The counting upstream app (``upstream_app.py``) on a free port; yields the port."""
    port = free_port()
    args = [str(HERE / "upstream_app.py"), "--port", str(port), "--delay-ms", str(delay_ms)]
    if hold:
        args.append("--hold")
    with server(args, port):
        yield port


@contextlib.contextmanager
def gateway_server(upstream_port: int, *extra: str) -> Iterator[int]:
    """The real gateway (``create_app(Gateway(config))`` on uvicorn) on a free port."""
    port = free_port()
    args = [
        str(HERE / "gateway_server.py"),
        "--port",
        str(port),
        "--upstream",
        f"http://{HOST}:{upstream_port}/v1",
        *extra,
    ]
    with server(args, port):
        yield port


async def lifespan(receive: Any, send: Any) -> None:
    """The ASGI lifespan protocol of the benchmarks' plain apps: nothing to start or stop."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def loadgen(mode: str, spec: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """Run ``loadgen.py`` in its own process; return the JSON it prints."""
    done = subprocess.run(
        [PY, str(HERE / "loadgen.py"), mode, json.dumps(spec)],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"loadgen {mode} failed ({done.returncode}):\n"
            f"{done.stderr.decode(errors='replace')[-3000:]}"
        )
    return json.loads(done.stdout)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def standalone(doc: str, run: Any, summarize: Any) -> None:
    """The command line every benchmark module shares when run alone."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print the full result")
    args = parser.parse_args()
    result = run(args.quick)
    print("\n".join(summarize(result)))
    if args.json:
        print(json.dumps(result, indent=2))
