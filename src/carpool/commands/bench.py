"""``carpool bench``: replay a workload against a gateway and report upstream calls vs the oracle.

Contract: the run itself is ``carpool.bench.runner.run_bench`` (its contract says what it does and
writes); here only the flags, the summary printed (with the commonest errors, when requests
failed, and for a 401 how the workload's tenants authenticate), and the exit statuses: 2 for a
workload or options the user can fix, 1 for a gateway that could not be started or reached and
for a run in which every request failed (its report is written all the same), 130 when SIGINT
(Ctrl-C) stopped the run and 143 when SIGTERM (a timeout, a CI job cancelled) did. Either signal
cancels the run, so the children it started (the embedded gateway, the audit's upstream) are
stopped on the way out rather than left to notice that their stdin closed; no report is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import Any

import click

from ..signals import stopping
from .common import config_path, load_config


@click.command()
@click.option(
    "--url",
    default=None,
    metavar="URL",
    help="Base URL of a running gateway (http://host:port). None: start an embedded "
    "gateway in front of the simulated engine (or config.upstreams).",
)
@click.option(
    "--workload",
    default=None,
    help="Built-in synthetic workload: mixed, faq, bursty, tenants, streaming, prefix, "
    "paraphrase, apis, audit (docs/bench.md) [mixed]; not with --workload-file.",
)
@click.option(
    "--workload-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Replay a recorded workload: JSONL, one request per line (docs/bench.md).",
)
@click.option(
    "--requests",
    "requests_",
    type=int,
    default=None,
    help="Number of requests [3000; 600 with --quick]; with --workload-file the first N lines "
    "(in the file's order, then sorted by t).",
)
@click.option(
    "--rate",
    type=float,
    default=None,
    help="Open loop: mean arrival rate in requests/s [40]; rescales a recorded file's timestamps.",
)
@click.option(
    "--concurrency",
    type=int,
    default=None,
    help="Closed loop instead: this many clients, each sending its next request when "
    "the previous one is answered.",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed of the synthetic workload (same seed, same requests) [0]; not with --workload-file.",
)
@click.option("--quick", is_flag=True, help="A short run (600 requests, under a minute).")
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="YAML config of the embedded gateway (e.g. semantic.enabled: true); with --url "
    "give the gateway's own: the oracle is computed under it (TTLs, coalescing window, "
    "sampling, namespaces), and it gives the tenant header, the cost model (sim section) and "
    "the admin_token (for the gateway's /stats).",
)
@click.option(
    "--out",
    default=None,
    type=click.Path(file_okay=False),
    help="Report directory [./carpool-bench-<timestamp>].",
)
@click.option(
    "--tenants",
    type=int,
    default=None,
    help="Synthetic presets (not audit, nor --workload-file): number of tenants.",
)
@click.option(
    "--duplicate-rate",
    type=float,
    default=None,
    help="Synthetic presets (not audit, nor --workload-file): share of shareable requests "
    "repeating an earlier one exactly.",
)
@click.option(
    "--stream-share",
    type=float,
    default=None,
    help="Synthetic presets (not audit, nor --workload-file): share of streaming requests.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def bench(
    url: str | None,
    workload: str | None,
    workload_file: str | None,
    requests_: int | None,
    rate: float | None,
    concurrency: int | None,
    seed: int | None,
    quick: bool,
    config_file: str | None,
    out: str | None,
    tenants: int | None,
    duplicate_rate: float | None,
    stream_share: float | None,
    no_progress: bool,
) -> None:
    """Replay a workload against a gateway and report upstream calls vs the oracle."""
    from pathlib import Path

    from ..bench.embedded import EmbeddedError
    from ..bench.replay import GatewayUnreachable
    from ..bench.runner import BenchOptions, default_out, run_bench
    from ..bench.workloads import WorkloadError

    if rate is not None and concurrency is not None:
        raise click.UsageError("give --rate (open loop) or --concurrency (closed loop), not both")
    config = load_config(config_file, {})
    # The file the config was read from, the flag's or CARPOOL_CONFIG's (as ``load_config``).
    config_file = config_path(config_file)
    options = BenchOptions(
        out=Path(out) if out else default_out(),
        config=config,
        url=url,
        workload=workload,
        workload_file=workload_file,
        requests=requests_,
        rate=rate,
        concurrency=concurrency,
        seed=seed,
        quick=quick,
        progress=not no_progress,
        config_file=config_file,
        spec={"tenants": tenants, "duplicate_rate": duplicate_rate, "stream_share": stream_share},
    )
    stopped_by: list[signal.Signals] = []
    try:
        report = asyncio.run(_stopped_by_signal(run_bench(options), stopped_by))
    except asyncio.CancelledError:
        signum = stopped_by[0] if stopped_by else signal.SIGTERM
        click.echo(f"carpool bench: stopped by {signum.name}; no report written", err=True)
        sys.exit(128 + signum)
    except WorkloadError as error:
        click.echo(f"carpool bench: {error}", err=True)
        sys.exit(2)
    except (EmbeddedError, GatewayUnreachable) as error:
        click.echo(f"carpool bench: {error}", err=True)
        sys.exit(1)
    latency = report["latency_ms"]
    click.echo(
        f"requests {report['requests']}  upstream_calls {report['upstream_calls']}  "
        f"oracle_calls {report['oracle_calls']}  errors {report['errors']}  "
        f"tokens_saved {report['tokens_saved']}"
    )
    if report["errors"]:
        _print_errors(report, config.tenant.header, synthetic=workload_file is None)
    click.echo(
        "p50 ms: "
        + "  ".join(
            f"{name} {summary['p50']:.1f}" for name, summary in latency.items() if summary["count"]
        )
    )
    if report.get("plots_missing"):
        click.echo(report["plots_missing"])
    click.echo(f"report: {options.out / 'report.md'}")
    if report["requests"] and report["errors"] == report["requests"]:
        sys.exit(1)  # nothing was measured: a run of failures is no benchmark


def _print_errors(report: dict[str, Any], tenant_header: str, synthetic: bool) -> None:
    """The commonest errors of the run on stderr, and what a 401 most likely means."""
    from ..bench.workloads import tenant_header_value

    click.echo(
        f"carpool bench: {report['errors']} of {report['requests']} requests failed; the "
        "commonest errors:",
        err=True,
    )
    for error, count in report["error_samples"].items():
        click.echo(f"  {count} x {error}", err=True)
    if any(str(error).startswith("HTTP 401") for error in report["error_samples"]):
        sent = (
            "the synthetic workloads' tenants send "
            f"`{tenant_header}: {tenant_header_value(tenant_header, 'bench-tenant-K')}` "
            "(K = 1, 2, ...): a gateway that checks client keys (auth.client_keys_file) must "
            "accept those, or replay a --workload-file whose requests carry valid keys"
            if synthetic
            else "the requests carry the tenant and headers of the workload file: a gateway "
            "that checks client keys must accept those"
        )
        click.echo(f"carpool bench: HTTP 401: {sent}", err=True)


async def _stopped_by_signal(run: Any, stopped_by: list[signal.Signals]) -> Any:
    """``run``, cancelled on SIGINT (unless ignored: ``carpool.signals``) or SIGTERM (each signal received is added to
    ``stopped_by``): its ``finally`` blocks stop what it started. SIGTERM's default action ended
    this process there and then; SIGINT's KeyboardInterrupt ended it as a failure (click's
    "Aborted!", exit 1)."""
    task = asyncio.current_task()
    assert task is not None

    def stop(signum: signal.Signals) -> None:
        stopped_by.append(signum)
        task.cancel()

    loop = asyncio.get_running_loop()
    for signum in stopping():  # (not SIGINT where it is ignored: a background job's)
        # (No signal handlers on this platform, or not in the main thread: a test's CliRunner.)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop, signum)
    return await run
