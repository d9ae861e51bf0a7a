"""What every benchmark scenario (``benchmarks/bench_*.py``) shares: the machine facts, the result
document, the command line and the event loop.

Contract:
- ``machine()``: date (UTC, ISO), ``platform.platform()``, processor, CPU count, Python version
  and implementation, the event loop (uvloop's version, or asyncio).
- ``document(results, figures, ok, errors, quick, duration_s, **extra)``: the JSON document a run
  writes: ``machine()``, then ``extra`` (``durations_s``, ``git``...), ``mode`` (quick | full),
  ``duration_s``, ``ok``, ``errors``, ``figures`` (flat headline numbers) and ``results``.
  ``write_json(path, data)`` writes it atomically (a temporary file, then a rename).
- ``standalone(doc, run, summarize)``: the command line of a benchmark run alone (``--quick``,
  ``--json`` to print the whole result): ``run(quick)`` returns the result, ``summarize(result)``
  its summary lines.
- ``run_async(work)``: runs a coroutine to completion on a new uvloop event loop (asyncio's when
  uvloop is not installed), as the servers under test run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def machine() -> dict[str, Any]:
    try:
        import uvloop

        loop = f"uvloop {getattr(uvloop, '__version__', '?')}"
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


def document(
    results: dict[str, Any],
    figures: dict[str, Any],
    *,
    ok: bool,
    errors: dict[str, str],
    quick: bool,
    duration_s: float,
    **extra: Any,
) -> dict[str, Any]:
    return {
        **machine(),
        **extra,
        "mode": "quick" if quick else "full",
        "duration_s": round(duration_s, 2),
        "ok": ok,
        "errors": errors,
        "figures": figures,
        "results": results,
    }


def result_name(name: str, quick: bool) -> str:
    """The name a benchmark's results are written under: a ``--quick`` run's its own
    (``NAME-quick``), so a smaller run never overwrites the published figures."""
    return f"{name}-quick" if quick else name


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def standalone(
    doc: str | None,
    run: Callable[[bool], dict[str, Any]],
    summarize: Callable[[dict[str, Any]], list[str]],
) -> None:
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples")
    parser.add_argument("--json", action="store_true", help="also print the full result")
    args = parser.parse_args()
    result = run(args.quick)
    print("\n".join(summarize(result)))
    if args.json:
        print(json.dumps(result, indent=2))


def run_async(work: Coroutine[Any, Any, T]) -> T:
    factory: Callable[[], asyncio.AbstractEventLoop] | None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(work)
