"""One ``carpool bench`` run from end to end: workload -> gateway -> replay -> oracle -> report.

Contract:
- ``run_bench(options)`` builds the workload (``synthetic.py`` or ``recorded.py``), starts the embedded gateway
  (``embedded.py``) unless ``options.url`` names one, replays the workload (``replay.py``),
  computes the oracle (``oracle.py``), and writes ``report.json``, ``report.md``,
  ``requests.jsonl`` and the plots (``report.py``, ``plots.py``) to ``options.out`` (and
  ``gateway.log``, the embedded gateway's log); it returns the report dict.
- Arrivals: ``concurrency`` set = closed loop. Otherwise open loop: a synthetic workload is drawn at
  ``rate`` (default ``DEFAULT_RATE``); a recorded one follows its timestamps, rescaled to a mean of
  ``rate`` when ``rate`` is given, or is spaced evenly at ``rate`` when it has none. A ``rate``
  that is not a finite number > 0 is a ``WorkloadError``. ``params.rate`` is the mean rate of
  those arrivals (``_rate``): None in a closed loop, and for recorded timestamps all at one
  instant without ``rate`` (sent at once).
- Sizes: ``requests`` (default ``FULL_REQUESTS``, or ``QUICK_REQUESTS`` with ``quick``); for a
  recorded workload it keeps the file's first ``requests`` lines in the file's order (blank
  lines do not count), as ``--help`` and docs/bench.md say, then sorts them by ``t`` (all of
  them by default, the first ``QUICK_REQUESTS`` with ``quick``). ``requests`` below 1 is a
  ``WorkloadError``.
- ``spec`` (``--tenants``, ``--duplicate-rate``, ``--stream-share``) shapes the synthetic
  presets only: a value given with a workload file or the ``audit`` workload, which it would
  not change, is a ``WorkloadError`` naming the flags (``build_workload``).
- The oracle sees the planned arrival times (open loop) or the actual send times (closed loop),
  and ends each call when its answer arrived: its request's send time + that request's latency
  when it was a ``miss`` (answered by its own call), else + the run's median ``miss`` latency.
- The ``audit`` workload (``meanings.py``) also starts the benchmark upstream answering by
  meaning (``upstream.py``, ``by_meaning``; its log ``upstream.log``), runs the embedded gateway
  on ``meanings.audit_config`` in front of it, waits for the audits to finish before the final
  ``/stats`` read, and adds ``audit`` (``meanings.grade``: the true wrong-hit rate next to the
  audits' estimate) and ``audit.png`` to the report; it refuses ``url``.
- Errors a user can fix raise ``WorkloadError`` (a bad workload or option, ``out`` a directory
  that cannot be created and a ``url`` that is not ``http(s)://host:port`` with ``/v1`` optional
  included: exit 2 in the CLI; ``_gateway_url``, whose refusal of a user, password, query or
  fragment does not repeat the URL), ``EmbeddedError`` or ``GatewayUnreachable`` (exit 1: a gateway that did not start or
  answer). A run that fails removes the ``out`` directory it created when nothing was written
  in it (a ``gateway.log`` stays, with the directory).
- ``out`` is checked and cleared as the run starts, before anything is written there: a
  ``workload_file`` that one of the files a run writes (``REPORT_FILES``) would overwrite is a
  ``WorkloadError``; then those files, an earlier run's, are removed (only those names), so
  that a run that ends without a report (stopped, its gateway unreachable) leaves none that
  reads as its own.
- ``workload`` (None: ``DEFAULT_WORKLOAD``) and ``seed`` (None: 0) choose a built-in workload: given
  with ``workload_file`` they are a ``WorkloadError`` (``_check_spec``), and a recorded run's
  ``params.seed`` is None.
- ``params.gateway_url`` is the URL the requests went to (``scheme://host:port``), never
  ``url`` as typed.
- ``params`` records ``config_file`` (the file ``config`` was read from: --config or
  CARPOOL_CONFIG) and ``upstreams``: the gateway's, as its ``/stats`` names them (never a URL's
  credentials), None for a simulated engine (the embedded one, the audit workload's, or the one
  a ``url`` gateway serves: its ``/sim/stats`` read); then the cost model's source says
  whether ``config.sim`` was given for that engine or is the simulator's default
  (``_cost_source``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import math
import os
import statistics
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from . import meanings, plots, process, report
from .client import Address
from .embedded import embedded_gateway
from .oracle import oracle
from .recorded import load_jsonl
from .replay import Result, replay
from .synthetic import synthetic
from .upstream import Options as UpstreamOptions
from .upstream import upstream
from .workloads import Workload, WorkloadError, traits

# Every file a run may write to ``out``: the report (``report``, ``plots``) and the logs of the
# children it starts.
REPORT_FILES = (
    "report.json",
    "report.md",
    "requests.jsonl",
    *plots.DRAWN,
    plots.AUDIT,
    "gateway.log",
    "upstream.log",
)

DEFAULT_RATE = 40.0
DEFAULT_WORKLOAD = "mixed"
FULL_REQUESTS = 3000
QUICK_REQUESTS = 600


@dataclass
class BenchOptions:
    out: Path
    config: Config = field(default_factory=Config)
    url: str | None = None
    workload: str | None = None  # a built-in one; None: DEFAULT_WORKLOAD (or the file's)
    workload_file: str | None = None
    requests: int | None = None
    rate: float | None = None
    concurrency: int | None = None
    seed: int | None = None  # None: 0 for a synthetic workload; a recorded one has none
    quick: bool = False
    spec: dict[str, Any] = field(default_factory=dict)  # Spec overrides
    progress: bool = True
    config_file: str | None = None  # the file ``config`` was read from (--config or CARPOOL_CONFIG)


def default_out() -> Path:
    return Path(f"carpool-bench-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")


def build_workload(options: BenchOptions) -> Workload:
    size = options.requests or (QUICK_REQUESTS if options.quick else FULL_REQUESTS)
    header = options.config.tenant.header
    _check_spec(options)
    if options.workload_file:
        keep = options.requests or (QUICK_REQUESTS if options.quick else None)
        return load_jsonl(options.workload_file, header, keep)
    seed = options.seed or 0
    if options.workload == meanings.WORKLOAD:
        return meanings.audit_workload(size, options.rate or DEFAULT_RATE, seed, header)
    return synthetic(
        options.workload or DEFAULT_WORKLOAD,
        size,
        options.rate or DEFAULT_RATE,
        seed,
        tenant_header=header,
        **options.spec,
    )


def _check_spec(options: BenchOptions) -> None:
    """Synthetic traits given for a workload they do not shape are refused, not ignored; so are a
    seed and a built-in workload's name given with a workload file, which is replayed as it is
    (the report printed "seed 0" for a recorded run)."""
    if options.workload_file:
        chosen = [
            flag
            for flag, value in (("--workload", options.workload), ("--seed", options.seed))
            if value is not None
        ]
        if chosen:
            raise WorkloadError(
                f"{', '.join(chosen)}: these choose and seed a built-in workload, not a "
                "workload file (--workload-file), which is replayed as recorded; leave them out"
            )
    given = [name for name, value in options.spec.items() if value is not None]
    if not given:
        return
    if options.workload_file:
        target = "a workload file (--workload-file), which is replayed as recorded"
    elif options.workload == meanings.WORKLOAD:
        target = (
            "the audit workload, whose traffic is fixed (one tenant, no exact repeats, no streams)"
        )
    else:
        return
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    raise WorkloadError(
        f"{flags}: these shape the synthetic workloads only, not {target}; leave them out"
    )


def arrival_times(workload: Workload, options: BenchOptions) -> list[float] | None:
    """Open-loop send offsets, or None for a closed loop."""
    if options.concurrency is not None:
        return None
    times = [r.t for r in workload.requests]
    if workload.source == "synthetic":
        return times
    rate = options.rate
    if not workload.timed or (rate and workload.span == 0):
        every = 1 / (rate or DEFAULT_RATE)
        return [i * every for i in range(len(times))]
    if rate:
        scale = (len(times) / workload.span) / rate
        return [t * scale for t in times]
    return times


def _gateway_url(url: str) -> str:
    """The gateway's base URL as requests are sent to it (``scheme://host:port``), or a
    ``WorkloadError``: the replay sends to a host, a port and the API's own paths, so a user or
    password, a query or a fragment would be silently dropped and any path but ``/v1`` would
    turn every request into a pass-through one. The refusals that may carry a secret do not
    repeat the URL: those parts are looked for in the text first, so a URL that also does not
    parse (a port out of range, another scheme, none) is not repeated either."""
    before_query = url.partition("#")[0]
    refused = [
        what
        for what, present in (
            ("a user or password", "@" in before_query.partition("?")[0]),
            # Even an empty "?" or "#": what follows them is never sent.
            ("a query", "?" in before_query),
            ("a fragment", "#" in url),
        )
        if present
    ]
    if not refused:
        try:
            parts = urllib.parse.urlsplit(url)
            Address.parse(url)  # a scheme, a host and a port in range
        except ValueError as error:
            why = "" if str(error).startswith("not an http(s) URL") else f": {error}"
            raise WorkloadError(
                f"--url {url!r}: not an http(s) URL (http://host:port){why}"
            ) from None
        if parts.path not in ("", "/", "/v1", "/v1/"):
            refused.append("a path other than /v1")
    if refused:
        raise WorkloadError(
            f"--url: a gateway URL is http(s)://host:port with /v1 optional; this one has "
            f"{', '.join(refused)} (not repeated here: it may hold a secret)"
        )
    return f"{parts.scheme}://{parts.netloc}"


async def run_bench(options: BenchOptions) -> dict[str, Any]:
    if options.rate is not None and not (math.isfinite(options.rate) and options.rate > 0):
        raise WorkloadError(f"--rate must be a finite number > 0, got {options.rate}")
    if options.requests is not None and options.requests < 1:
        raise WorkloadError(f"--requests must be >= 1, got {options.requests}")
    if options.concurrency is not None and options.concurrency < 1:
        raise WorkloadError(f"--concurrency must be >= 1, got {options.concurrency}")
    # Up front: a URL that names no gateway is a bad option, not an unreachable gateway.
    gateway_url = None if options.url is None else _gateway_url(options.url)
    audit = options.workload == meanings.WORKLOAD and not options.workload_file
    if audit and options.url:
        raise WorkloadError(
            "the audit workload needs an upstream that answers by meaning, which carpool bench "
            "starts itself: run it on the embedded gateway (without --url)"
        )
    workload = build_workload(options)
    arrivals = arrival_times(workload, options)
    out = options.out
    _check_out(out, options.workload_file)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise WorkloadError(
            f"--out {out}: cannot create the report directory ({error.strerror or error})"
        ) from None
    for name in REPORT_FILES:  # (an earlier run's: see the contract)
        try:
            (out / name).unlink(missing_ok=True)
        except OSError as error:
            raise WorkloadError(
                f"--out {out}: cannot remove an earlier run's {name} ({error.strerror or error})"
            ) from None
    try:
        return await _run(options, gateway_url, workload, arrivals, audit)
    except BaseException:
        if created:  # a failed run leaves no empty report directory (a gateway.log stays)
            with contextlib.suppress(OSError):
                out.rmdir()
        raise


def _check_out(out: Path, workload_file: str | None) -> None:
    """A ``WorkloadError`` when a file this run writes to ``out`` is the workload file (by
    path, a link or a hard link): the run would replace its own input with its results."""
    if workload_file is None:
        return
    for name in REPORT_FILES:
        with contextlib.suppress(OSError):  # (not there: not the workload, which was read)
            if os.path.samefile(out / name, workload_file):
                raise WorkloadError(
                    f"--out {out}: its {name} would overwrite the workload file "
                    f"{workload_file}; give another --out"
                )


async def _run(
    options: BenchOptions,
    gateway_url: str | None,  # ``options.url`` as used (``_gateway_url``); None: embedded
    workload: Workload,
    arrivals: list[float] | None,
    audit: bool,
) -> dict[str, Any]:
    out = options.out
    config = options.config
    with _Progress(len(workload), options.progress, workload.name) as progress:
        async with contextlib.AsyncExitStack() as stack:
            settle = None
            if audit:
                by_meaning = await stack.enter_async_context(
                    process.in_thread(
                        upstream(UpstreamOptions(by_meaning=True), out / "upstream.log")
                    )
                )
                config = Config.from_secrets(
                    {**meanings.audit_config(config), "upstreams": [by_meaning.url]}
                )
            url: str = (
                gateway_url
                if gateway_url is not None
                else await stack.enter_async_context(embedded_gateway(config, out / "gateway.log"))
            )
            if audit:
                settle = functools.partial(
                    meanings.audits_settled, url, by_meaning, config.admin_token
                )
            run = await replay(
                workload,
                url,
                arrivals=arrivals,
                concurrency=options.concurrency,
                on_result=progress.advance,
                admin_token=config.admin_token,
                settle=settle,
            )
    misses = [r.latency for r in run.results if r.outcome == "miss" and r.latency is not None]
    call_seconds = statistics.median(misses) if misses else 0.0
    times = arrivals if arrivals is not None else [r.sent for r in run.results]
    never_stored = [r.storable is False for r in run.results]  # (None: no answer judged)
    # A miss's answer came from its own call: the call ended when that answer arrived.
    durations = [
        r.latency if r.ok and r.outcome == "miss" and r.latency is not None else None
        for r in run.results
    ]
    best = oracle(workload, config, times, call_seconds, never_stored, durations)
    mode = "closed-loop" if options.concurrency is not None else "open-loop"
    # The engine is the simulator: the embedded gateway's own, the bench's (the audit
    # workload's, answering by meaning), or the one a --url gateway serves (its /sim/stats read).
    simulated = audit or run.sim_after is not None or (options.url is None and not config.upstreams)
    params = {
        "workload": workload.name,
        "workload_file": options.workload_file,
        "seed": None if options.workload_file else options.seed or 0,
        "mode": mode,
        "rate": _rate(options, workload, arrivals),
        "concurrency": options.concurrency,
        "requests": len(workload),
        "recorded_timestamps": workload.source != "synthetic"
        and workload.timed
        and arrivals is not None,
        "quick": options.quick,
        "duration_s": round(run.duration, 3),
        "target": "url" if options.url else "embedded",
        "gateway_url": url,
        "config_file": options.config_file,
        # As /stats names them (never a URL's user, password or query); None: the embedded
        # simulated engine.
        "upstreams": None if simulated else list(run.stats_after.get("replicas") or {}),
        "semantic_enabled": config.semantic.enabled,
        "started_at": _dt.datetime.fromtimestamp(run.started_at, _dt.UTC).isoformat(
            timespec="seconds"
        ),
        "carpool_version": _version(),
    }
    if audit:
        costs: str | None = AUDIT_COSTS
    else:
        costs = None if simulated else _cost_source(config, options.config_file)
    result = report.build(
        workload=workload,
        workload_traits=traits(workload, config, arrivals, closed_loop=arrivals is None),
        run=run,
        oracle=best,
        config=config,
        params=params,
        cost_source=costs,
    )
    if audit:
        result["audit"] = meanings.grade(workload, run, config.semantic.audit_window)
    if plots.available():
        result["plots"] = plots.draw(run, best.needs_call, out)
        if audit:
            result["plots"].append(plots.audit(result["audit"], out))
    else:
        result["plots_missing"] = plots.MISSING
    report.write(result, out)
    report.write_results(workload, run, out)
    return result


# The audit workload's engine (``upstream.py``'s, answering by meaning) answers at once: the
# engine seconds its report gives price the saved tokens at the simulator's defaults anyway.
AUDIT_COSTS = (
    "config.sim's defaults, a notional price: the audit workload's engine answers at once, at "
    "no cost"
)


def _cost_source(config: Config, config_file: str | None) -> str:
    """Where the per-token costs of a run on another engine than the simulated one come from."""
    # (The section's own keys set, not the section: a loaded config sets every section.)
    if config.sim.model_fields_set:
        return f"the sim section of {config_file or 'the config'}: the per-token costs given there"
    return (
        "config.sim's defaults: the simulated engine's cost model, not measured on the engine "
        "used here (give its per-token costs in the sim section of --config)"
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("carpool")
    except PackageNotFoundError:
        return "unknown"


def _rate(options: BenchOptions, workload: Workload, arrivals: list[float] | None) -> float | None:
    """``params.rate``: the open loop's mean arrival rate. The rate the arrivals were drawn or
    spaced at (``rate`` or ``DEFAULT_RATE``) for a synthetic workload and a file without
    timestamps; the recording's own (requests over span) for timestamps not rescaled. None in a
    closed loop, and for recorded timestamps all at one instant (one timed line, or every ``t``
    equal) without ``rate``: they are sent at once, at no mean rate."""
    if arrivals is None:
        return None
    if options.rate:
        return options.rate
    if workload.source == "synthetic" or not workload.timed:
        return DEFAULT_RATE
    span = max(arrivals) if arrivals else 0.0
    return round(len(arrivals) / span, 3) if span > 0 else None


class _Progress:
    """A rich progress bar on stderr with the outcome counts so far (nothing when disabled)."""

    def __init__(self, total: int, enabled: bool, name: str) -> None:
        self.total, self.enabled, self.name = total, enabled, name
        self.counts: dict[str, int] = {}
        self.progress: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[outcomes]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task(f"bench {self.name}", total=self.total, outcomes="")
        return self

    def advance(self, result: Result) -> None:
        if self.progress is None:
            return
        name = report.outcome_of(result)
        self.counts[name] = self.counts.get(name, 0) + 1
        text = " ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        self.progress.update(self.task, advance=1, outcomes=text)

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()
