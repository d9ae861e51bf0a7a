"""`carpool bench`'s report says what the run measured and nothing it did not: the engine seconds
saved, the oracle's calls, the failures, the target and its upstreams, the plots' rates."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from carpool.bench import plots, process, report
from carpool.bench.recorded import load_jsonl
from carpool.bench.replay import Result
from carpool.bench.runner import BenchOptions, run_bench
from carpool.bench.workloads import WorkloadError
from carpool.cli import main
from carpool.config import Config
from carpool.upstream.http import replica_names
from test_bench import empty_run_report

_HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _bench(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["bench", "--no-progress", *args], env=env)
    return result.exit_code, result.output


def _streams(tmp_path: Path, name: str, usage: bool) -> Path:
    """Ten identical streaming requests (one call, nine hits), asking for usage or not."""
    body = {**_HI, "messages": [_user(f"How do I {name}?")], "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return _write(tmp_path / f"{name}.jsonl", [{"body": body}] * 10)


# ------------------------------------------------------------------- engine seconds saved


async def test_engine_seconds_saved_split_the_saved_tokens_by_what_is_known_never_by_a_guess(
    fake, gw, tmp_path
):
    """``tokens_saved`` is split into prompt and completion tokens by the saved answers' usage;
    when none carried usage and no engine counted its tokens, the figure is unknown (null, with
    the reason), not a 50/50 guess that prices decode 100x prefill on half the tokens."""
    runs = {}
    for usage in (True, False):
        path = _streams(tmp_path, f"usage-{usage}", usage)
        out = tmp_path / f"usage-{usage}"
        runs[usage] = await run_bench(
            BenchOptions(
                out=out, url=gw.url, workload_file=str(path), concurrency=1, progress=False
            )
        )
    told = runs[True]
    assert told["errors"] == 0 and told["outcomes"] == {"miss": 1, "hit": 9}
    rows = [orjson.loads(line) for line in (tmp_path / "usage-True" / "requests.jsonl").open()]
    prompt, completion = rows[-1]["prompt_tokens"], rows[-1]["completion_tokens"]
    share, sim, saved = prompt / (prompt + completion), Config().sim, told["tokens_saved"]
    ms = saved * share * sim.prefill_ms_per_token + saved * (1 - share) * sim.decode_ms_per_token
    assert saved > 0 and told["gpu_seconds_saved"] == pytest.approx(ms / 1000, abs=0.001)
    split = told["cost_model"]["split"]
    assert split["source"] == "saved answers" and split["saved_answers_with_usage"] == 9
    assert told["gpu_seconds_saved_reason"] is None

    untold = runs[False]
    assert untold["errors"] == 0 and untold["outcomes"] == {"miss": 1, "hit": 9}
    assert untold["gpu_seconds_saved"] is None
    assert "none of the 9 saved answers carried usage" in untold["gpu_seconds_saved_reason"]
    assert untold["cost_model"]["split"]["saved_answers_with_usage"] == 0
    markdown = (tmp_path / "usage-False" / "report.md").read_text()
    assert "| engine seconds saved (cost model below) | unknown |" in markdown
    assert "none of the 9 saved answers carried usage" in markdown


def test_engine_seconds_saved_of_streams_without_usage_split_by_the_engines_own_counts(tmp_path):
    """The embedded simulated engine counts the prompt and completion tokens of the calls it
    ran: with no usage in the saved answers, those counts give the split (the report says so)."""
    path = _streams(tmp_path, "no-usage", usage=False)
    out = tmp_path / "sim"
    code, output = _bench("--workload-file", str(path), "--concurrency", "1", "--out", str(out))
    assert code == 0, output
    built = json.loads((out / "report.json").read_text())
    engine, sim = built["engine"], Config().sim
    assert engine["calls"] == 1 and built["outcomes"] == {"miss": 1, "hit": 9}
    truth = 9 * (
        engine["prompt_tokens"] * sim.prefill_ms_per_token
        + engine["completion_tokens"] * sim.decode_ms_per_token
    )
    assert built["gpu_seconds_saved"] == pytest.approx(truth / 1000, rel=0.01)
    split = built["cost_model"]["split"]
    assert split["source"] == "engine" and split["saved_answers_with_usage"] == 0
    assert "the engine's own counts" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------------- oracle


async def test_the_oracle_ends_each_call_when_its_answer_arrived_not_after_the_median_call(
    fake, gw, tmp_path
):
    """Closed loop, one client: slow questions make the median call long; then pairs of a short
    ``no-store`` question and the same question again. Each follow-up is sent after the no-store
    answer arrived: nothing is in flight to join and nothing was stored, so each pair costs two
    calls. The oracle ended every call at its send time + the median call and had each follow-up
    join a finished call: it counted fewer calls than any deduplicator can make."""
    slow, pairs = 9, 3
    fake.delay = 0.3  # the slow questions' calls; fast from the one after the last slow one

    def answer(number: int, body: dict) -> str:
        if number >= slow:  # (read after this call's delay: the next calls are fast)
            fake.delay = 0.0
        return f"answer {number}"

    fake.answer_text = answer
    rows: list[dict] = [{"body": {**_HI, "messages": [_user(f"slow {i}")]}} for i in range(slow)]
    for i in range(pairs):
        short = {**_HI, "messages": [_user(f"short {i}")]}
        rows += [{"headers": {"Cache-Control": "no-store"}, "body": short}, {"body": short}]
    path = _write(tmp_path / "closed.jsonl", rows)
    out = tmp_path / "closed"
    built = await run_bench(
        BenchOptions(out=out, url=gw.url, workload_file=str(path), concurrency=1, progress=False)
    )
    assert built["errors"] == 0
    assert built["upstream_calls"] == fake.count() == slow + 2 * pairs
    assert built["oracle_calls"] == slow + 2 * pairs
    assert built["within_5pct_of_oracle"] is True
    assert any("its answer arrived" in note for note in built["oracle"]["assumptions"])


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


# -------------------------------------------------------------------------------- failures


async def test_a_run_whose_every_request_failed_exits_1_and_prints_why(
    fake, gateway_with, tmp_path
):
    """A gateway that checks client keys answers the synthetic tenants 401: the run exits 1
    (not 0), prints the commonest errors and how the tenants authenticate, and report.md says
    how many requests succeeded rather than a rate "achieved"."""
    keys = tmp_path / "keys.txt"
    keys.write_text("the-only-key\n")
    async with gateway_with(auth={"client_keys_file": str(keys)}) as served:
        out = tmp_path / "denied"
        args = ["--url", served.url, "--requests", "12", "--concurrency", "3", "--out", str(out)]
        code, output = await asyncio.to_thread(_bench, *args)
    assert code == 1, output
    assert "HTTP 401" in output and "12 of 12 requests failed" in output
    assert "Authorization: Bearer bench-tenant-" in output
    built = json.loads((out / "report.json").read_text())
    assert built["errors"] == built["requests"] == 12 and fake.count() == 0
    markdown = (out / "report.md").read_text()
    assert "achieved" not in markdown and "0 of 12 requests succeeded" in markdown


async def test_a_run_with_some_failures_prints_the_commonest_errors_and_exits_0(fake, gw, tmp_path):
    fake.fail_status, fake.fail_times = 400, 1
    path = _write(tmp_path / "two.jsonl", [{"body": _HI}, {"body": _HI}])
    out = tmp_path / "some"
    args = ["--url", gw.url, "--workload-file", str(path), "--concurrency", "1", "--out", str(out)]
    code, output = await asyncio.to_thread(_bench, *args)
    assert code == 0, output
    assert "1 of 2 requests failed" in output and "HTTP 400" in output
    markdown = (out / "report.md").read_text()
    assert "1 of 2 requests succeeded" in markdown
    # The `all` row counts both; its latencies are the one answered's, and the report says so.
    assert "| all | 2 |" in markdown
    assert "Latencies are those of the requests answered without error (1 of 2)." in markdown


async def test_a_gateway_whose_stats_need_the_admin_token_says_how_to_pass_it(
    gateway_with, tmp_path
):
    async with gateway_with(admin_token="s3cret-admin") as served:
        out = tmp_path / "admin"
        code, output = await asyncio.to_thread(
            _bench, "--url", served.url, "--requests", "5", "--out", str(out)
        )
    assert code == 1, output
    assert "HTTP 401" in output and "admin token" in output and "admin_token" in output
    assert "CARPOOL_ADMIN_TOKEN" in output and "s3cret" not in output
    assert not out.exists()  # (nothing written: no empty report directory left behind)


def test_a_failed_run_leaves_no_empty_report_directory(tmp_path):
    out = tmp_path / "never"
    url = f"http://127.0.0.1:{process.free_port()}"
    code, output = _bench("--url", url, "--requests", "5", "--out", str(out))
    assert code == 1, output
    assert not out.exists()


# ------------------------------------------------------------------------- what was benched


async def test_the_report_names_the_config_file_and_the_upstreams_the_embedded_gateway_used(
    fake, tmp_path
):
    """The embedded gateway in front of configured upstreams (a real server here, the fake) is
    no simulated engine: the report says which upstreams, by their /stats names, and the config
    file, named by CARPOOL_CONFIG as by --config; the cost model is not the engine's own."""
    config = tmp_path / "real.yaml"
    config.write_text(f"upstreams:\n  - {fake.url}\n")
    out = tmp_path / "real"
    args = ["--workload", "faq", "--requests", "20", "--concurrency", "2", "--out", str(out)]
    code, output = await asyncio.to_thread(_bench, *args, env={"CARPOOL_CONFIG": str(config)})
    assert code == 0, output
    built = json.loads((out / "report.json").read_text())
    name = replica_names([fake.url])[0][0]
    assert built["params"]["config_file"] == str(config)
    assert built["params"]["upstreams"] == [name]
    assert built["upstream_calls"] == fake.count() > 0 and built["engine"] is None
    assert "not measured on the engine used here" in built["cost_model"]["source"]
    markdown = (out / "report.md").read_text()
    assert f"embedded gateway + 1 configured upstream (`{name}`)" in markdown
    assert "embedded gateway + simulated engine" not in markdown
    assert "calls the simulated engine received" not in markdown


async def test_a_gateway_in_front_of_the_simulated_engine_is_reported_as_the_simulator(tmp_path):
    """Benched through --url, a ``carpool serve`` on its embedded simulated engine (its
    /sim/stats answered) is the simulator: its cost model is the engine's own, not "not measured
    on the engine used here", and no upstream is named."""
    from carpool.bench.embedded import embedded_gateway

    async with embedded_gateway(Config(), tmp_path / "gateway.log") as url:
        out = tmp_path / "sim"
        built = await run_bench(
            BenchOptions(out=out, url=url, workload="faq", requests=20, rate=200, progress=False)
        )
    assert built["engine"] is not None and built["engine"]["simulated"] is True
    assert built["cost_model"]["source"] == report.cost_model(Config())["source"]
    assert built["params"]["upstreams"] is None


def test_the_engine_counts_of_a_gateway_with_workers_are_the_runs_whichever_worker_answered():
    """Under `serve --workers 2` each worker has its own simulated engine; /sim/stats' `run`
    holds every worker's replicas. Read before the run on one worker and after it on the other,
    the engine's calls are the run's difference (before: one worker's own, 21 of 49)."""

    def replica(calls: int) -> dict[str, Any]:
        figures = dict.fromkeys(
            ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "errors"), 0
        )
        return {
            "calls": {"chat/completions": calls},
            **figures,
            "busy_seconds": 0.0,
            "queue_wait_seconds": 0.0,
        }

    before = {"replicas": [replica(3)], "run": {"workers": 2, "replicas": [replica(3), replica(4)]}}
    after = {
        "replicas": [replica(30)],
        "run": {"workers": 2, "replicas": [replica(5), replica(30)]},
    }
    engine = report.engine_delta(before, after)
    assert engine is not None and (engine["calls"], engine["replicas"]) == (28, 2)
    alone = report.engine_delta({"replicas": [replica(3)]}, {"replicas": [replica(9)]})
    assert alone is not None and alone["calls"] == 6


@pytest.mark.parametrize("flag", [["--seed", "3"], ["--workload", "faq"]])
def test_seed_or_workload_with_a_workload_file_is_refused_not_ignored(tmp_path, flag):
    path = _write(tmp_path / "one.jsonl", [{"body": _HI}])
    out = tmp_path / "out"
    code, output = _bench("--workload-file", str(path), *flag, "--out", str(out))
    assert code == 2, output
    assert f"{flag[0]}: " in output and "workload file" in output
    assert not out.exists()
    with pytest.raises(WorkloadError):
        options = {"seed": 3} if flag[0] == "--seed" else {"workload": "faq"}
        asyncio.run(run_bench(BenchOptions(out=out, workload_file=str(path), **options)))


def test_a_recorded_workloads_report_names_no_seed():
    text = report.markdown(_empty_report({"seed": None, "workload_file": "w.jsonl"}))
    assert "seed" not in text.split("\n")[2]


def _empty_report(params: dict) -> dict:
    from carpool.bench.workloads import CHAT, BenchRequest, Workload, traits

    hi = BenchRequest(0.0, CHAT, _HI)

    return {
        **empty_run_report(traits(Workload("w", [hi]))),
        "params": {
            "target": "embedded",
            "mode": "closed-loop",
            "concurrency": 1,
            "rate": None,
            **params,
        },
    }


# ------------------------------------------------------------------------- recorded workloads


def test_a_recorded_workloads_timestamps_may_have_any_origin_a_negative_one_too(tmp_path):
    path = _write(tmp_path / "neg.jsonl", [{"t": -2.5, "body": _HI}, {"t": -1.0, "body": _HI}])
    assert [r.t for r in load_jsonl(path).requests] == [0.0, 1.5]


# ---------------------------------------------------------------------------------- plots


def test_the_outcome_rates_divide_each_bin_by_its_own_duration_the_last_one_too():
    """31 requests at a steady 10 req/s (sent 0.0 .. 3.0 s): every bar reads about 10 req/s; the
    last bin, shorter than the others, was divided by a full bin's width and read 1 req/s."""
    results = [
        Result(i, False, sent=i * 0.1, latency=0.001, status=200, outcome="hit") for i in range(31)
    ]
    starts, durations, rates = plots.outcome_rates(results, report.outcome_of)
    assert starts[0] == 0.0 and starts[-1] + durations[-1] == pytest.approx(3.0)
    assert all(rate == pytest.approx(10, abs=1) for rate in rates["hit"]), rates["hit"]
    assert sum(r * d for r, d in zip(rates["hit"], durations, strict=True)) == pytest.approx(31)
    long_run = [
        Result(i, False, sent=i * 0.5, latency=0.001, status=200, outcome="miss")
        for i in range(301)  # 150 s at 2 req/s: bins wider than a second
    ]
    starts, durations, rates = plots.outcome_rates(long_run, report.outcome_of)
    assert all(rate == pytest.approx(2, rel=0.2) for rate in rates["miss"]), rates["miss"]
    assert sum(r * d for r, d in zip(rates["miss"], durations, strict=True)) == pytest.approx(301)


def test_the_report_is_written_in_utf8_whatever_the_locale(tmp_path):
    # Under a locale whose encoding is not UTF-8 (ASCII here, Latin-1 on some hosts), report.md
    # was written in it: a name it cannot encode (a workload file's, an upstream's) failed the
    # run at its very end, a UnicodeEncodeError traceback, report.md left empty.
    tests = Path(__file__).parent
    code = (
        "import sys; from pathlib import Path; from carpool.bench import report; "
        "from test_bench_report import _empty_report; "
        "r = _empty_report({'seed': None}); r['workload']['name'] = NAME; "
        "report.write(r, Path(sys.argv[1]))"
    ).replace("NAME", ascii("负载-wörk"))  # (argv itself is read in the locale's encoding)
    ascii_locale = {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    env = {**os.environ, **ascii_locale, "PYTHONPATH": str(tests)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        timeout=60,
        cwd=tests,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert "`负载-wörk`" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_the_cost_models_source_is_the_sim_section_only_when_the_config_has_one(tmp_path):
    """A loaded config sets every section: a config without a ``sim`` section was reported as
    pricing the engine with "the per-token costs given there", uncalibrated figures passed off
    as calibrated."""
    from carpool.bench.runner import _cost_source
    from carpool.config import Config

    bare, priced = tmp_path / "bare.yaml", tmp_path / "priced.yaml"
    bare.write_text("upstreams: [http://127.0.0.1:9/v1]\n")
    priced.write_text("sim:\n  prefill_ms_per_token: 0.1\n")
    assert "not measured" in _cost_source(Config.load(bare, env={}), str(bare))
    assert _cost_source(Config.load(priced, env={}), str(priced)).startswith(
        f"the sim section of {priced}"
    )
