"""The ``carpool`` command line: ``serve`` and ``sim``.

Contract: every option can also come from the config file and ``CARPOOL_*`` variables (flags win);
a bad configuration exits with status 2 and a message naming the field and what is allowed. The
first log line of ``carpool serve`` says which engine it fronts, so nobody mistakes the simulator
for a real model. No log line carries a URL's credentials or query: upstreams are logged by their
replica names (``upstream.http.replica_names``), other URLs without user, password and query.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import click

from .config import Config, ConfigError


def _without_credentials(url: str) -> str:
    """A URL fit for a log line: any user and password in it replaced by ``***``, and no query
    or fragment (where some services take their keys)."""
    parts = urlsplit(url)._replace(query="", fragment="")
    if "@" not in parts.netloc:
        return urlunsplit(parts)
    # (The port as written: ``parts.port`` raises on one that is not a number.)
    netloc = "***@" + parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=netloc))


def _load(config_file: str | None, overrides: dict[str, Any]) -> Config:
    try:
        return Config.load(
            config_file or os.environ.get("CARPOOL_CONFIG"),
            overrides={k: v for k, v in overrides.items() if v is not None},
        )
    except ConfigError as error:
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)


@click.group()
@click.version_option(package_name="carpool")
def main() -> None:
    """carpool: an OpenAI-compatible gateway that never computes the same answer twice."""


@main.command()
@click.option(
    "--upstream",
    "upstreams",
    multiple=True,
    metavar="URL",
    help="Base URL of an OpenAI-compatible replica, ending in /v1 (repeat for several "
    "replicas). None: the embedded simulated engine.",
)
@click.option("--host", default=None, help="Address to listen on [127.0.0.1].")
@click.option("--port", type=int, default=None, help="Port to listen on [8080].")
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="YAML config file (also CARPOOL_CONFIG).",
)
@click.option(
    "--redis",
    default=None,
    metavar="URL",
    help="Redis/Valkey URL of the store shared by every instance.",
)
@click.option(
    "--workers",
    type=int,
    default=None,
    help="Gateway processes on this port [1]; with --redis they share one cache.",
)
def serve(
    upstreams: tuple[str, ...],
    host: str | None,
    port: int | None,
    config_file: str | None,
    redis: str | None,
    workers: int | None,
) -> None:
    """Run the gateway."""
    config = _load(
        config_file,
        {
            "upstreams": list(upstreams) or None,
            "host": host,
            "port": port,
            "redis": redis,
            "workers": workers,
        },
    )
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    log = logging.getLogger("carpool")
    if config.upstreams:
        from .upstream.http import replica_names

        # By the names /stats, /metrics and the failure warnings will use.
        log.info(
            "carpool: fronting %d upstream replica(s): %s",
            len(config.upstreams),
            ", ".join(name for name, _ in replica_names(config.upstreams, config.upstream_names)),
        )
    else:
        log.info(
            "carpool: no --upstream given, using the embedded SIMULATED engine "
            "(%d replica(s)); its answers are synthetic text, not a real model",
            config.sim.replicas,
        )
    if config.redis:
        try:
            from .redis.connection import server_mode

            mode = asyncio.run(server_mode(config.redis))
        except ImportError as error:
            click.echo(
                f"carpool: --redis needs the redis extra (pip install 'carpool[redis]'): {error}",
                err=True,
            )
            sys.exit(2)
        except ValueError as error:  # a URL redis-py cannot read
            click.echo(
                f"carpool: --redis: {error}".replace(
                    config.redis, _without_credentials(config.redis)
                ),
                err=True,
            )
            sys.exit(2)
        if mode is None:
            log.warning(
                "carpool: Redis at %s does not answer INFO now (down, or INFO not "
                "allowed); starting with this instance's memory and trying again. If it "
                "is a cluster node, set distributed.cluster: true (it could not be "
                "detected)",
                _without_credentials(config.redis),
            )
        elif mode == "cluster" and not config.distributed.cluster:
            # A plain client would get MOVED for the other masters' keys: half-shared.
            log.info(
                "carpool: %s is a cluster node: using a cluster client",
                _without_credentials(config.redis),
            )
            config.distributed.cluster = True
        log.info(
            "carpool: exact answers%s shared through Redis at %s (in-process fallback "
            "while it is unreachable)",
            ", semantic entries and calls in flight"
            if config.distributed.shared_flights
            else " and semantic entries",
            _without_credentials(config.redis),
        )
    import uvicorn

    from .server import create_app
    from .wiring import build_gateway

    try:
        gateway = build_gateway(config)
    except ImportError as error:
        click.echo(
            f"carpool: semantic.enabled needs the semantic extra "
            f"(pip install 'carpool[semantic]') and its model ({error})",
            err=True,
        )
        sys.exit(2)
    except ValueError as error:  # a verifier folder that is absent or tampered with
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)
    if gateway.semantic is None:
        log.info(
            "carpool: semantic cache off (turn it on with semantic.enabled: true, or "
            "CARPOOL_SEMANTIC__ENABLED=true; needs pip install 'carpool[semantic]')"
        )
    else:
        log.info(
            "carpool: semantic cache on (mode %s, threshold %.2f, embedder %s)",
            config.semantic.mode,
            gateway.semantic.threshold,
            gateway.semantic.embedder.name,
        )
    log.info("carpool: listening on http://%s:%d/v1", config.host, config.port)
    if config.workers == 1:
        uvicorn.run(
            create_app(gateway),
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,
            loop="auto",
            http="auto",
        )
        return
    # Several processes: each builds its own gateway from the resolved config, written once;
    # the one built here only checked the config (and would hold the embedding model).
    asyncio.run(gateway.aclose())
    del gateway
    if not config.redis:
        log.warning(
            "carpool: %d workers without --redis: each has its own cache and flights, "
            "so identical requests landing on different workers are computed once per "
            "worker",
            config.workers,
        )
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="carpool-config-") as resolved:
        resolved.write(config.model_dump_json())
        resolved.flush()
        os.environ["CARPOOL_CONFIG"] = resolved.name
        uvicorn.run(
            "carpool.server:create_worker_app",
            factory=True,
            workers=config.workers,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,
            loop="auto",
            http="auto",
        )


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=int,
    default=8000,
    show_default=True,
    help="Port of the first replica; replica i listens on port + i.",
)
@click.option("--replicas", type=int, default=None, help="Number of simulated replicas [1].")
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="YAML config file; its `sim` section sets the cost model.",
)
@click.option("--decode-ms-per-token", type=float, default=None)
@click.option("--prefill-ms-per-token", type=float, default=None)
@click.option("--max-concurrency", type=int, default=None)
def sim(
    host: str,
    port: int,
    replicas: int | None,
    config_file: str | None,
    decode_ms_per_token: float | None,
    prefill_ms_per_token: float | None,
    max_concurrency: int | None,
) -> None:
    """Run the simulated engine alone as an OpenAI-compatible server (SIMULATED, not a model)."""
    sim_overrides = {
        k: v
        for k, v in {
            "replicas": replicas,
            "decode_ms_per_token": decode_ms_per_token,
            "prefill_ms_per_token": prefill_ms_per_token,
            "max_concurrency": max_concurrency,
        }.items()
        if v is not None
    }
    config = _load(config_file, {"sim": sim_overrides} if sim_overrides else {})
    from .upstream.sim_server import serve_replicas

    asyncio.run(serve_replicas(config.sim, host, port))


@main.command()
@click.option(
    "--url",
    default=None,
    metavar="URL",
    help="Base URL of a running gateway (http://host:port). None: start an embedded "
    "gateway in front of the simulated engine (or config.upstreams).",
)
@click.option(
    "--workload",
    default="mixed",
    show_default=True,
    help="Built-in synthetic workload: mixed, faq, bursty, tenants, streaming, prefix, "
    "paraphrase (docs/bench.md).",
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
    help="Number of requests [3000; 600 with --quick]; with --workload-file the first N lines.",
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
    default=0,
    show_default=True,
    help="Seed of the synthetic workload (same seed, same requests).",
)
@click.option("--quick", is_flag=True, help="A short run (600 requests, under a minute).")
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="YAML config of the embedded gateway (e.g. semantic.enabled: true); with --url "
    "it gives the tenant header and the cost model (sim section) only.",
)
@click.option(
    "--out",
    default=None,
    type=click.Path(file_okay=False),
    help="Report directory [./carpool-bench-<timestamp>].",
)
@click.option("--tenants", type=int, default=None, help="Synthetic: number of tenants.")
@click.option(
    "--duplicate-rate",
    type=float,
    default=None,
    help="Synthetic: share of shareable requests repeating an earlier one exactly.",
)
@click.option(
    "--stream-share", type=float, default=None, help="Synthetic: share of streaming requests."
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def bench(
    url: str | None,
    workload: str,
    workload_file: str | None,
    requests_: int | None,
    rate: float | None,
    concurrency: int | None,
    seed: int,
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

    from .bench.embedded import EmbeddedError
    from .bench.replay import GatewayUnreachable
    from .bench.runner import BenchOptions, default_out, run_bench
    from .bench.workloads import WorkloadError

    if rate is not None and concurrency is not None:
        raise click.UsageError("give --rate (open loop) or --concurrency (closed loop), not both")
    config = _load(config_file, {})
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
    try:
        report = asyncio.run(run_bench(options))
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
    click.echo(
        "p50 ms: "
        + "  ".join(
            f"{name} {summary['p50']:.1f}" for name, summary in latency.items() if summary["count"]
        )
    )
    if report.get("plots_missing"):
        click.echo(report["plots_missing"])
    click.echo(f"report: {options.out / 'report.md'}")


@main.command("eval-semantic")
@click.option(
    "--pairs",
    "pair_files",
    multiple=True,
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="JSONL of {a, b, same_answer[, category]} (repeatable).",
)
@click.option(
    "--decisions",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write one JSONL row per pair with its decision.",
)
@click.option(
    "--threshold", type=float, default=None, help="Similarity threshold [the calibrated default]."
)
@click.option(
    "--verifier-threshold",
    type=float,
    default=None,
    help="The verifier's threshold [the packaged model's calibrated one].",
)
@click.option("--sweep", is_flag=True, help="Also print hit/wrong rates over thresholds.")
@click.option(
    "--half",
    type=click.Choice(["even", "odd"]),
    default=None,
    help="Only the even (development) or odd (held-out) rows of each file [all].",
)
def eval_semantic(
    pair_files: tuple[str, ...],
    decisions: str | None,
    threshold: float | None,
    verifier_threshold: float | None,
    sweep: bool,
    half: str | None,
) -> None:
    """Score the semantic cache's hit/miss decisions on labeled prompt pairs."""
    from pathlib import Path

    try:
        from .semantic.cache import CALIBRATED_THRESHOLD
        from .semantic.embed import default_embedder
        from .semantic.evaluate import Evaluator, format_report, load_pairs, write_decisions
        from .semantic.guard import RulesThenVerifier
        from .semantic.verifier import shared_cross_encoder

        embedder = default_embedder()
        guard = RulesThenVerifier(shared_cross_encoder(), threshold=verifier_threshold)
    except ImportError as error:
        click.echo(
            f"carpool: the semantic cache needs its extra: pip install 'carpool[semantic]'"
            f" ({error})",
            err=True,
        )
        sys.exit(2)
    threshold = CALIBRATED_THRESHOLD if threshold is None else threshold
    evaluator = Evaluator(load_pairs(pair_files, half), embedder, guard)
    click.echo(format_report(evaluator.report(threshold), threshold))
    if sweep:
        click.echo(f"\n{'threshold':>10}{'verifier':>10}{'served':>9}{'wrong':>8}")
        verifier = [0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.96, 0.97, 0.98, 0.99]
        for row in evaluator.sweep([0.3, 0.4, 0.5, 0.6, 0.7, 0.8], verifier):
            click.echo(
                f"{row['threshold']:>10.2f}{row['verifier_threshold']:>10.2f}"
                f"{100 * (row['hit_rate'] or 0):>8.1f}%"
                f"{100 * (row['wrong_rate'] or 0):>7.1f}%"
            )
    if decisions:
        write_decisions(evaluator, threshold, Path(decisions))


@main.command("config-reference")
def config_reference() -> None:
    """Print the configuration reference (Markdown), generated from the typed config model."""
    from .config import reference_markdown

    click.echo(reference_markdown(), nl=False)


@main.command("fetch-model")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to keep it [the Hugging Face cache: $HF_HOME or ~/.cache/huggingface].",
)
def fetch_model(cache_dir: str | None) -> None:
    """Download the semantic cache's model (all-MiniLM-L6-v2 at its pinned revision) with the
    Hugging Face hub client, check its SHA-256 digests and print its directory. The only command
    that downloads it: the gateway never does."""
    try:
        from .semantic.embed import MODEL_REPO, MODEL_REVISION, SemanticDependencyError
        from .semantic.embed import fetch_model as fetch
    except ImportError as error:
        click.echo(
            f"carpool: fetching the model needs the semantic extra: pip install "
            f"'carpool[semantic]' ({error})",
            err=True,
        )
        sys.exit(2)
    click.echo(f"fetching {MODEL_REPO} at revision {MODEL_REVISION}", err=True)
    try:
        directory = fetch(cache_dir)
    except SemanticDependencyError as error:
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)
    except ValueError as error:  # a digest differs
        click.echo(f"carpool: {error}", err=True)
        sys.exit(1)
    except OSError as error:  # no network, no such revision...
        click.echo(f"carpool: could not fetch the model: {error}", err=True)
        sys.exit(1)
    click.echo(str(directory))
    if cache_dir is not None:
        click.echo(f"(outside the default cache: set semantic.model_dir to {directory})", err=True)


if __name__ == "__main__":
    main()
