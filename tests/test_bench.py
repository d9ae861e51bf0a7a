"""`carpool bench`: workloads, the oracle, the recorded format, and whole runs (embedded and --url)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from carpool.bench import loadgen, plots, process, report, wrk
from carpool.bench.bodies import chat_body
from carpool.bench.canned import canned
from carpool.bench.client import fetch
from carpool.bench.faults import FaultPlan
from carpool.bench.fixed import fixed_app
from carpool.bench.oracle import Oracle, oracle, request_key
from carpool.bench.recorded import load_jsonl
from carpool.bench.relay import relay
from carpool.bench.replay import Result, Run
from carpool.bench.runner import BenchOptions, build_workload, run_bench
from carpool.bench.stats import percentile, summary_ms
from carpool.bench.synthetic import PRESETS, synthetic
from carpool.bench.upstream import Options, expected, upstream
from carpool.bench.workloads import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    RESPONSES,
    BenchRequest,
    Workload,
    WorkloadError,
    traits,
)
from carpool.cli import main
from carpool.config import Config
from fakes.model_env import UNREADABLE, model_env
from fakes.required import missing

PNGS = ("outcomes_over_time.png", "latency_cdf.png", "upstream_vs_oracle.png")


def _snapshot(workload: Workload) -> list[tuple]:
    return [
        (
            r.t,
            r.endpoint,
            orjson.dumps(r.body, option=orjson.OPT_SORT_KEYS),
            tuple(sorted(r.headers.items())),
            r.label,
        )
        for r in workload.requests
    ]


# ------------------------------------------------------------------------------ workloads


def test_a_synthetic_workload_is_the_same_for_the_same_seed_and_differs_for_another():
    assert _snapshot(synthetic("mixed", 400, 40, seed=7)) == _snapshot(
        synthetic("mixed", 400, 40, seed=7)
    )
    assert _snapshot(synthetic("mixed", 400, 40, seed=7)) != _snapshot(
        synthetic("mixed", 400, 40, seed=8)
    )


def test_the_default_workload_has_its_stated_traits():
    workload = synthetic("mixed", 2000, 40, seed=3)
    measured = traits(workload)
    spec = workload.params["spec"]
    assert measured["requests"] == 2000
    assert measured["tenants"] == spec["tenants"] == 4
    assert measured["mean_rate_rps"] == pytest.approx(40, rel=0.01)
    assert measured["peak_rate_rps_1s"] > 2 * 40  # bursts
    assert abs(measured["duplicate_share"] - spec["duplicate_rate"]) < 0.05
    assert abs(measured["stream_share"] - spec["stream_share"]) < 0.04
    labels = measured["labels"]
    assert abs(labels["sampled"] / 2000 - spec["sampled_share"]) < 0.02
    assert labels["paraphrase"] > 0 and labels["trending"] > 0
    assert set(measured["endpoints"]) == {CHAT, COMPLETIONS}
    requests = workload.requests
    # Every stream asks for its usage; tenants differ by their Authorization header.
    assert all(r.body["stream_options"] == {"include_usage": True} for r in requests if r.stream)
    assert len({r.headers["Authorization"] for r in requests}) == 4
    # Shared prefixes: each tenant's chats open with one of its 2 long system prompts.
    for tenant in {r.tenant for r in requests}:
        systems = {
            r.body["messages"][0]["content"]
            for r in requests
            if r.tenant == tenant and r.endpoint == CHAT
        }
        assert len(systems) <= 2 and all(len(s.split()) >= 290 for s in systems)
    # Sampled requests are unshareable; paraphrases are new fingerprints, repeats are not.
    config = Config()
    seen: set[str] = set()
    for r in requests:
        key = request_key(r, config)
        assert (key is None) == (r.label == "sampled")
        if r.label in ("new", "paraphrase"):
            assert key not in seen
        if r.label in ("repeat", "trending"):
            assert key in seen
        if key is not None:
            seen.add(key)


def test_every_preset_builds_and_the_prefix_preset_has_nothing_to_deduplicate():
    for name in PRESETS:
        assert len(synthetic(name, 100, 50, seed=1)) == 100
    faq = traits(synthetic("faq", 500, 50))
    assert faq["stream_share"] == 0 and faq["tenants"] == 1
    prefix = synthetic("prefix", 300, 50)
    assert oracle(prefix, Config()).calls == 300
    assert traits(synthetic("mixed", 300, 50, tenants=9))["tenants"] == 9


def test_the_apis_preset_sends_responses_and_messages_requests_by_their_sampling_rules():
    workload = synthetic("apis", 400, 50, seed=4)
    endpoints = traits(workload)["endpoints"]
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages"} <= set(endpoints)
    assert "/v1/completions" not in endpoints
    for request in workload.requests:
        if request.endpoint not in ("/v1/responses", "/v1/messages"):
            continue
        body = request.body
        assert "seed" not in body and "stream_options" not in body and "n" not in body
        # Both APIs sample by default: a shareable request says temperature 0 explicitly.
        assert body["temperature"] == (0.8 if request.label == "sampled" else 0)
        assert (request_key(request, Config()) is None) == (request.label == "sampled")
        if request.endpoint == "/v1/responses":
            assert body["instructions"] and body["input"] and body["max_output_tokens"] == 64
        else:
            assert body["system"] and body["messages"][0]["role"] == "user"
    # Adding the option left the other presets' requests as they were.
    assert "/v1/responses" not in traits(synthetic("mixed", 400, 50, seed=4))["endpoints"]


def test_bad_synthetic_parameters_are_workload_errors():
    with pytest.raises(WorkloadError, match="unknown workload"):
        synthetic("nope", 10)
    with pytest.raises(WorkloadError, match="stream_share"):
        synthetic("mixed", 10, stream_share=1.5)
    # (each tenant's system prompts are made up front: 10**8 tenants for one request grew the
    # run past 16 GB, deaf to SIGTERM)
    with pytest.raises(WorkloadError, match="tenants must be at most 10,000"):
        synthetic("mixed", 1, tenants=10_001)


# ------------------------------------------------------------------------------ the oracle


def _chat(
    content: str, t: float = 0.0, tenant: str = "a", headers: dict | None = None, **params
) -> BenchRequest:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **params,
    }
    return BenchRequest(
        t, CHAT, body, {"Authorization": f"Bearer {tenant}", **(headers or {})}, tenant
    )


def test_the_oracle_on_a_small_hand_made_workload():
    requests = [
        _chat("How do I reset it?"),  # 1: new
        _chat("How do I reset it?", 1, stream=True),  # same (stream excluded)
        _chat("How do I reset it?", 2, user="u1"),  # same (user excluded)
        _chat("How do I reset it?", 3, tenant="b"),  # 2: another tenant
        _chat("How do I reset it?", 4, headers={"x-carpool-namespace": "n"}),  # 3: namespace
        _chat("How do I reset it?", 5, max_tokens=5),  # 4: output-affecting
        _chat("Tell a story", 6, temperature=0.7),  # 5: sampled, no seed
        _chat("Tell a story", 7, temperature=0.7),  # 6: again, unshareable
        _chat("Tell a story", 8, temperature=0.7, seed=3),  # 7: seeded: shareable
        _chat("Tell a story", 9, temperature=0.7, seed=3),  # same
        _chat(
            "Tell a story", 10, temperature=0.7, headers={"x-carpool-share": "sampled"}
        ),  # 8: opted in
        _chat("Tell a story", 11, temperature=0.7, headers={"x-carpool-share": "sampled"}),  # same
        BenchRequest(12, CHAT, {"model": "m", "messages": "nope"}, {}),  # rejected: 400
        _chat("Pay", 13, headers={"Idempotency-Key": "k1"}),  # 9
        _chat("Pay", 14, headers={"Idempotency-Key": "k1", "Cache-Control": "no-cache"}),  # replay
    ]
    result = oracle(Workload("hand", requests), Config())
    assert result.calls == 9
    assert (result.distinct, result.unshareable, result.rejected, result.replays) == (7, 2, 1, 1)
    assert result.needs_call == [
        True,
        False,
        False,
        True,
        True,
        True,
        True,
        True,
        True,
        False,
        True,
        False,
        False,
        True,
        False,
    ]


def test_the_oracle_refreshes_answers_that_expire_during_the_run():
    factual = {"x-carpool-type": "factual"}  # ttl 0: only coalesced
    requests = [
        _chat("q", 0.0, headers=factual),  # call
        _chat("q", 0.5, headers=factual),  # within call + window: joins
        _chat("q", 60.0, headers=factual),  # call again
        _chat("r", 0.0, headers={"x-carpool-type": "realtime"}),  # ttl 300: call
        _chat("r", 200.0, headers={"x-carpool-type": "realtime"}),  # cached
        _chat("r", 400.0, headers={"x-carpool-type": "realtime"}),  # expired: call
        _chat(
            "r", 401.0, headers={"Cache-Control": "no-cache", "x-carpool-type": "realtime"}
        ),  # no-cache: call
    ]
    result = oracle(Workload("ttl", requests), Config(), call_seconds=0.2)
    assert (result.calls, result.distinct, result.refreshes) == (5, 2, 3)
    assert any("expire during the run" in note for note in result.assumptions)


def test_an_answer_never_stored_is_joined_only_while_its_call_is_in_flight():
    requests = [_chat("q", 0.0), _chat("q", 0.1), _chat("q", 0.5), _chat("q", 0.6)]
    cut = oracle(Workload("cut", requests), Config(), call_seconds=0.2, never_stored=[True] * 4)
    assert cut.needs_call == [True, False, True, False]  # (no window, no cache after it)
    assert cut.never_stored == 2 and any("never stores" in note for note in cut.assumptions)
    whole = oracle(Workload("whole", requests), Config(), call_seconds=0.2)
    assert (whole.calls, whole.never_stored) == (1, 0)


# ------------------------------------------------------------------------------ recorded JSONL


def _write(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_a_recorded_workload_is_read_sorted_with_its_tenants_and_headers(tmp_path):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    path = _write(
        tmp_path / "w.jsonl",
        [
            {"t": 10.5, "body": body, "tenant": "acme"},
            "",
            {
                "t": 10.0,
                "body": {"model": "m", "prompt": "p", "temperature": 0},
                "endpoint": "/v1/completions",
                "headers": {"x-carpool-namespace": "docs"},
            },
            {"t": 12, "body": body, "tenant": "acme", "headers": {"Authorization": "Bearer own"}},
        ],
    )
    workload = load_jsonl(path)
    assert workload.timed and workload.source == str(path)
    assert [r.t for r in workload.requests] == [0.0, 0.5, 2.0]
    first, second, third = workload.requests
    assert first.endpoint == COMPLETIONS and first.headers == {"x-carpool-namespace": "docs"}
    assert second.headers == {"Authorization": "Bearer acme"} and second.tenant == "acme"
    assert third.headers == {"Authorization": "Bearer own"}  # explicit header wins
    assert load_jsonl(path, tenant_header="x-tenant").requests[1].headers == {"x-tenant": "acme"}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"t": 0, "body": {', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"t": 0}', "'body' must be a JSON object"),
        ('{"t": "soon", "body": {}}', "'t' must be a finite number"),
        ('{"t": 0, "body": {}, "endpoint": "/v1/models"}', "'endpoint' must be one of"),
        ('{"t": 0, "body": {}, "headers": {"a": 1}}', "'headers' must be an object of strings"),
        ('{"body": {}}', "has no timestamp"),
        # (read, orjson reads 1024 levels, but not written back, it writes 254: the first send
        # raised, a traceback, no report)
        ('{"t": 0, "body": {"metadata": %s}}' % ("[" * 300 + "]" * 300), "cannot be sent"),
        # (a big integer named by its digits, not as "<orjson.Fragment object at 0x...>")
        ('{"t": 0, "body": {}, "tenant": 123456789012345678901234567890}', "got 1234567890123"),
        ('{"t": 0, "body": {}, "endpoint": 123456789012345678901234567890}', "got 1234567890123"),
    ],
)
def test_a_malformed_recorded_workload_names_the_line_and_the_problem(tmp_path, line, message):
    good = '{"t": 0, "body": {"model": "m", "prompt": "p"}}'
    path = _write(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(WorkloadError, match=message) as error:
        load_jsonl(path)
    assert f"{path}:2:" in str(error.value)


def test_a_recorded_time_past_64_bits_is_a_finite_number_of_seconds(tmp_path):
    path = _write(tmp_path / "late.jsonl", ['{"t": 123456789012345678901234567890, "body": {}}'])
    assert load_jsonl(path).requests[0].t == 0.0  # (the earliest, made 0)


def test_a_recorded_integer_past_64_bits_is_sent_as_written(tmp_path):
    """Read as a double, ``123456789012345678901234567890`` went out as
    ``1.2345678901234568e+29``: another request than the one recorded (the gateway keeps it)."""
    digits = "123456789012345678901234567890"
    path = tmp_path / "big.jsonl"
    path.write_text('{"t": 0, "body": {"model": "m", "prompt": "p", "seed": ' + digits + "}}\n")
    assert b'"seed":%s' % digits.encode() in load_jsonl(path).requests[0].payload()


def test_a_workload_file_line_ends_at_a_line_feed_only(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (orjson writes them so): they
    do not end a line; ``\\r\\n`` does; line numbers count line feeds."""
    texts = ["one\u2028two", "three\u2029four", "five\u0085six"]
    rows = [
        orjson.dumps({"t": i, "body": {"model": "m", "prompt": text}}) + (b"\r\n" if i else b"\n")
        for i, text in enumerate(texts)
    ]
    path = tmp_path / "seps.jsonl"
    path.write_bytes(b"".join(rows))
    assert all(text.encode() in path.read_bytes() for text in texts)  # written unescaped
    assert [r.body["prompt"] for r in load_jsonl(path).requests] == texts
    path.write_bytes(b"".join(rows) + b"\n" + b'{"t": 9, "body": {"model": "m", "prompt": "x"')
    with pytest.raises(WorkloadError, match=f"^{path}:5: not valid JSON"):
        load_jsonl(path)
    path.write_bytes(b"".join(rows) + b"\n" + b'{"body": {"model": "m", "prompt": "x"}}\n')
    with pytest.raises(WorkloadError, match=f"^{path}:5: this line has no timestamp"):
        load_jsonl(path)


def test_requests_keeps_a_workload_files_first_lines_in_the_files_order_then_sorts_them(
    tmp_path,
):
    """``--requests 2`` keeps the file's first two requests (a blank line is none), not the two
    earliest timestamps of the whole file; the kept ones are replayed in ``t`` order from 0."""
    lines = [
        {"t": t, "body": {"model": "m", "prompt": f"line {i}"}}
        for i, t in enumerate((10, 7, 3, 1), 1)
    ]
    path = _write(tmp_path / "unsorted.jsonl", [lines[0], "", *lines[1:]])
    workload = build_workload(
        BenchOptions(out=tmp_path / "out", workload_file=str(path), requests=2)
    )
    assert [(r.t, r.body["prompt"]) for r in workload.requests] == [
        (0.0, "line 2"),
        (3.0, "line 1"),
    ]
    everything = build_workload(BenchOptions(out=tmp_path / "out", workload_file=str(path)))
    assert [r.body["prompt"] for r in everything.requests] == [f"line {i}" for i in (4, 3, 2, 1)]


@pytest.mark.parametrize(
    "flag, value", [("--tenants", "8"), ("--duplicate-rate", "0"), ("--stream-share", "1")]
)
def test_synthetic_trait_options_are_refused_for_a_workload_they_do_not_shape(
    tmp_path, flag, value
):
    path = _write(tmp_path / "two.jsonl", [{"body": _HI}, {"body": _HI}])
    out = tmp_path / "out"
    for source, what in (
        (["--workload-file", str(path)], "a workload file"),
        (["--workload", "audit"], "the audit workload"),
    ):
        code, output = _bench(*source, flag, value, "--requests", "2", "--out", str(out))
        assert code == 2, output
        assert f"{flag}: these shape the synthetic workloads only, not {what}" in output
        assert not out.exists()
    spec = {"tenants": None, "duplicate_rate": None, "stream_share": 0.5}
    with pytest.raises(WorkloadError, match="--stream-share: these shape"):
        build_workload(BenchOptions(out=out, workload="audit", requests=4, spec=spec))
    assert traits(build_workload(BenchOptions(out=out, workload="faq", requests=40, spec=spec)))


def test_the_cli_exits_2_on_a_malformed_workload_file_and_on_conflicting_options(tmp_path):
    path = _write(
        tmp_path / "bad.jsonl", ['{"t": 0, "body": {"model": "m", "prompt": "p"}}', "not json"]
    )
    result = CliRunner().invoke(
        main,
        ["bench", "--workload-file", str(path), "--no-progress", "--out", str(tmp_path / "out")],
    )
    assert result.exit_code == 2
    assert f"{path}:2: not valid JSON" in result.output
    result = CliRunner().invoke(main, ["bench", "--rate", "5", "--concurrency", "2"])
    assert result.exit_code == 2 and "not both" in result.output
    result = CliRunner().invoke(
        main, ["bench", "--workload", "nope", "--no-progress", "--out", str(tmp_path / "out2")]
    )
    assert result.exit_code == 2 and "unknown workload" in result.output


_HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def _bench(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["bench", "--no-progress", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize("requests", ["0", "-2"])
def test_requests_below_1_are_a_bad_option_for_a_file_and_a_synthetic_workload(tmp_path, requests):
    path = _write(tmp_path / "two.jsonl", [{"body": _HI}, {"body": _HI}])
    out = tmp_path / "out"
    for source in (["--workload-file", str(path)], ["--workload", "faq"]):
        code, output = _bench(*source, "--requests", requests, "--out", str(out))
        assert code == 2, output
        assert f"--requests must be >= 1, got {requests}" in output
        assert not out.exists()


@pytest.mark.parametrize("rate", ["nan", "inf", "-inf", "0", "-1"])
def test_the_rate_must_be_a_finite_number_above_0(tmp_path, rate):
    code, output = _bench("--requests", "5", "--rate", rate, "--out", str(tmp_path / "out"))
    assert code == 2, output
    assert "--rate must be a finite number > 0" in output
    assert not (tmp_path / "out").exists()


def test_an_out_directory_that_cannot_be_created_is_a_bad_option(tmp_path):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"
    code, output = _bench("--requests", "5", "--out", str(out))
    assert code == 2, output
    assert f"--out {out}: cannot create the report directory" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "url", ["notaurl", "ftp://127.0.0.1:1", "", "http://", "http://127.0.0.1:99999", "//host:80"]
)
def test_a_url_that_is_not_an_http_url_is_a_bad_option_not_an_unreachable_gateway(tmp_path, url):
    out = tmp_path / "out"
    code, output = _bench("--url", url, "--requests", "5", "--out", str(out))
    assert code == 2, output
    assert f"--url {url!r}: not an http(s) URL" in output and "Traceback" not in output
    assert not out.exists()


@pytest.mark.parametrize(
    "url, part",
    [
        ("http://admin:s3cret@127.0.0.1:1/v1", "a user or password"),
        ("http://s3cret@127.0.0.1:1", "a user or password"),
        ("http://127.0.0.1:1/v1?key=s3cret", "a query"),
        ("http://127.0.0.1:1/?s3cret", "a query"),
        ("http://127.0.0.1:1/v1#s3cret", "a fragment"),
        ("http://127.0.0.1:1/s3cret", "a path other than /v1"),
        ("http://127.0.0.1:1/v1/s3cret", "a path other than /v1"),
        ("http://127.0.0.1:1/v1/v1", "a path other than /v1"),
        # A URL that does not parse either was repeated whole, with the parser's error.
        ("http://alice:s3cret@127.0.0.1:99999", "a user or password"),
        ("ftp://alice:s3cret@127.0.0.1:8080", "a user or password"),
        ("alice:s3cret@127.0.0.1:8080", "a user or password"),
        ("http://127.0.0.1:8080x/v1?api_key=s3cret", "a query"),
    ],
)
def test_a_url_with_credentials_a_query_a_fragment_or_another_path_is_a_bad_option_never_echoed(
    tmp_path, url, part
):
    """None of these is sent as given (userinfo and query were dropped, "/v1?..." became a
    "/v1/v1/..." pass-through path), and the refusal must not repeat the secret it carries."""
    out = tmp_path / "out"
    code, output = _bench("--url", url, "--requests", "5", "--out", str(out))
    assert code == 2, output
    assert part in output and "s3cret" not in output and "Traceback" not in output
    assert not out.exists()


async def test_the_report_names_the_gateway_url_the_requests_were_sent_to(fake, gw, tmp_path):
    out = tmp_path / "url"
    # As typed, not as used: an upper-case scheme and "/v1/" (both valid) must not reach the report.
    given = gw.url.replace("http://", "HTTP://", 1) + "/v1/"
    args = ["bench", "--url", given, "--requests", "5", "--out", str(out)]
    result = await asyncio.to_thread(CliRunner().invoke, main, [*args, "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["errors"] == 0 and report["params"]["gateway_url"] == gw.url
    assert f"`{gw.url}`" in (out / "report.md").read_text()


def test_a_gateway_that_does_not_answer_is_unreachable_exit_1(tmp_path):
    url = f"http://127.0.0.1:{process.free_port()}"
    code, output = _bench("--url", url, "--requests", "5", "--out", str(tmp_path / "out"))
    assert code == 1, output
    assert "Traceback" not in output


@pytest.mark.parametrize("name", ["requests.jsonl", "report.json", "gateway.log"])
def test_an_out_folder_whose_report_would_overwrite_the_workload_file_is_refused(tmp_path, name):
    """``--out DIR --workload-file DIR/requests.jsonl`` replaced the workload with the
    per-request results (then unreadable as a workload): refused, exit 2, the file intact."""
    out = tmp_path / "out"
    out.mkdir()
    path = _write(out / name, [{"body": _HI}, {"body": _HI}])
    before = path.read_bytes()
    code, output = _bench("--workload-file", str(path), "--out", str(out))
    assert code == 2, output
    assert len(output.strip().splitlines()) == 1 and "would overwrite the workload" in output
    assert path.read_bytes() == before


def test_a_run_starts_by_removing_an_earlier_reports_files_and_only_those(tmp_path):
    """A run into a folder of an earlier report that ended without one (stopped, or its gateway
    unreachable) left the earlier report.json, report.md and plots beside its own gateway.log,
    reading as this run's: they go as the run starts; the folder's other files stay."""
    out = tmp_path / "out"
    out.mkdir()
    earlier = ["report.json", "report.md", "requests.jsonl", *PNGS, "audit.png"]
    for name in [*earlier, "gateway.log", "upstream.log", "notes.txt", "report.json.bak"]:
        (out / name).write_text("earlier")
    url = f"http://127.0.0.1:{process.free_port()}"
    code, output = _bench("--url", url, "--requests", "5", "--out", str(out))
    assert code == 1, output  # (the gateway unreachable: no report written)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "report.json.bak"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"headers": {"X-Note": "a\r\nX-Injected: 1"}}, "header 'X-Note': its value"),
        ({"headers": {"X-Note": "a\nb"}}, "header 'X-Note': its value"),
        ({"headers": {"X-Note": "a\x00b"}}, "header 'X-Note': its value"),
        ({"headers": {"bad name": "x"}}, "header 'bad name': not a valid header name"),
        ({"headers": {"": "x"}}, "header '': not a valid header name"),
        ({"headers": {"X-Note:": "x"}}, "header 'X-Note:': not a valid header name"),
        (
            {"headers": {"Content-Length": "5"}},
            "header 'Content-Length': carpool bench sets the host and framing",
        ),
        (
            {"headers": {"transfer-encoding": "chunked"}},
            "header 'transfer-encoding': carpool bench sets the host and framing",
        ),
        (
            {"headers": {"Host": "api.openai.com"}},
            "header 'Host': carpool bench sets the host and framing",
        ),
        ({"tenant": "acme\r\nX-Injected: 1"}, "'tenant' must be a string that fits in a header"),
    ],
)
def test_a_workload_file_header_must_be_one_valid_header_that_the_client_does_not_set(
    tmp_path, extra, message
):
    path = _write(tmp_path / "hdr.jsonl", [{"body": _HI}, {"body": _HI, **extra}])
    with pytest.raises(WorkloadError, match="^" + str(path) + ":2: ") as error:
        load_jsonl(path)
    assert message in str(error.value)
    code, output = _bench("--workload-file", str(path), "--out", str(tmp_path / "out"))
    assert code == 2 and f"{path}:2: " in output and message in output


def test_ordinary_workload_file_headers_are_kept_as_they_are(tmp_path):
    headers = {
        "Cache-Control": "no-cache",
        "x-carpool-type": "faq",
        "X-Tab": "a\tb",
        "Idempotency-Key": "k-1",
    }
    path = _write(tmp_path / "ok.jsonl", [{"body": _HI, "headers": headers}])
    assert load_jsonl(path).requests[0].headers == headers


# ------------------------------------------------------------------------------ whole runs


def test_quick_bench_on_the_embedded_gateway_writes_the_report_and_matches_the_oracle(tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "--quick",
            "--out",
            str(out),
            "--no-progress",
            "--requests",
            "150",
            "--rate",
            "60",
            "--seed",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == 150 and report["errors"] == 0
    assert abs(report["upstream_calls"] - report["oracle_calls"]) <= 0.05 * report["oracle_calls"]
    # The simulated engine's own counter agrees with the gateway's.
    assert report["engine"]["calls"] == report["upstream_calls"]
    assert sum(report["outcomes"].values()) == 150
    assert {"hit", "miss", "bypass"} <= set(report["outcomes"])
    for outcome in report["outcomes"]:
        assert {"p50", "p95", "p99"} <= set(report["latency_ms"][outcome])
    assert report["ttfb_ms"]["all"]["count"] > 0
    assert report["tokens_saved"] > 0 and report["gpu_seconds_saved"] > 0
    assert report["params"]["target"] == "embedded" and report["params"]["seed"] == 2
    assert report["params"]["quick"] is True and report["params"]["rate"] == 60
    markdown = (out / "report.md").read_text()
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in markdown
    assert f"requests {report['requests']}  upstream_calls" in result.output


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started (from any of its threads) and still holds."""
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            kids |= {int(kid) for kid in (task / "children").read_text().split()}
    return kids


@pytest.mark.parametrize("signal_", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_stopped_bench_leaves_no_file_with_the_gateways_secrets(tmp_path, signal_):
    """The embedded gateway's config (the admin token, the upstream key) went to a temporary
    file that only the command's ``finally`` removed: SIGTERM (a timeout, CI cancelling) and
    SIGKILL skipped it. SIGTERM now stops the run, the gateway stopped, exit 143; Ctrl-C
    (SIGINT, to the whole foreground group, the gateway too, as a terminal sends it) the same
    way with 130 (it was click's "Aborted!", exit 1: a failed run's status); and no file ever
    holds the config, so not even SIGKILL leaves one."""
    private = tmp_path / "tmp"  # this run's TMPDIR: nobody else's files in it
    private.mkdir()
    config = tmp_path / "secrets.yaml"
    config.write_text("admin_token: TOPSECRET-ADMIN\nupstream:\n  api_key: sk-REAL-UPSTREAM-KEY\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")  # an earlier run's: never read as this one's
    command = [sys.executable, "-m", "carpool.cli", "bench", "--config", str(config)]
    command += ["--requests", "3000", "--rate", "20", "--out", str(out), "--no-progress"]
    bench = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(private)},
        start_new_session=True,  # (its own process group: for Ctrl-C's, below)
    )
    try:
        deadline = time.monotonic() + 60
        started = "embedded gateway in front of"  # the gateway's first line: it has its config
        while started not in _text(out / "gateway.log"):
            assert bench.poll() is None and time.monotonic() < deadline, "no embedded gateway"
            time.sleep(0.05)
        gateway = _children(bench.pid)
        assert gateway
        if signal_ == signal.SIGINT:
            os.killpg(bench.pid, signal_)
        else:
            bench.send_signal(signal_)
        output = bench.communicate(timeout=60)[0].decode()
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    left = [path for path in private.rglob("*") if path.is_file()]
    assert left == [], left
    if signal_ != signal.SIGKILL:
        assert bench.returncode == 128 + signal_, output
        assert f"stopped by {signal_.name}; no report written" in output, output
        assert "Traceback" not in output and "Aborted" not in output
        assert not (out / "report.json").exists()
        assert not any(Path(f"/proc/{pid}").exists() for pid in gateway)  # stopped and reaped


def test_a_bench_started_with_sigint_ignored_keeps_ignoring_it_and_its_gateway_too(tmp_path):
    """A shell starts a background job with SIGINT ignored (`carpool bench &` in a script):
    the terminal's Ctrl-C stopped it all the same (130), the bench's own handler set."""
    from fakes.instances import ignoring_sigint, signal_handled

    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "carpool.cli", "bench", "--requests", "3000"]
    command += ["--rate", "20", "--out", str(out), "--no-progress"]
    bench = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=ignoring_sigint
    )
    try:
        deadline = time.monotonic() + 60
        while "embedded gateway in front of" not in _text(out / "gateway.log"):
            assert bench.poll() is None and time.monotonic() < deadline, "no embedded gateway"
            time.sleep(0.05)
        gateway = _children(bench.pid)
        assert gateway
        assert signal_handled(bench.pid, signal.SIGINT)
        # (The gateway says it starts, then sets uvicorn's handlers, SIGTERM's among them:
        # until then SIGINT is ignored as it started; after, only if it was kept so.)
        while not all(
            signal_handled(pid, signal.SIGINT) and signal_handled(pid, signal.SIGTERM, "SigCgt")
            for pid in gateway
        ):
            assert time.monotonic() < deadline, "the gateway took SIGINT back"
            time.sleep(0.05)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def test_quick_bench_of_the_apis_preset_matches_the_oracle_on_every_endpoint(tmp_path):
    out = tmp_path / "apis"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "--quick",
            "--workload",
            "apis",
            "--out",
            str(out),
            "--no-progress",
            "--requests",
            "90",
            "--rate",
            "60",
            "--seed",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["requests"] == 90 and report["errors"] == 0
    assert report["upstream_calls"] == report["oracle_calls"]
    assert report["engine"]["calls"] == report["upstream_calls"]
    workload = synthetic("apis", 90, 60, seed=3)
    assert {"/v1/responses", "/v1/messages"} <= set(traits(workload)["endpoints"])
    assert {"/v1/responses", "/v1/messages"} <= {r.endpoint for r in workload.requests if r.stream}
    assert report["tokens_saved"] > 0


async def test_bench_against_a_running_gateway_counts_what_the_upstream_received(
    fake, gw, tmp_path
):
    out = tmp_path / "url"
    args = [
        "bench",
        "--url",
        gw.url + "/v1",
        "--requests",
        "120",
        "--rate",
        "100",
        "--out",
        str(out),
        "--no-progress",
        "--seed",
        "5",
    ]
    # The gateway and the fake serve in this loop; the command runs its own loop in a thread.
    result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["errors"] == 0 and report["requests"] == 120
    assert report["upstream_calls"] == fake.count()
    assert abs(report["upstream_calls"] - report["oracle_calls"]) <= 0.05 * report["oracle_calls"]
    assert report["params"]["target"] == "url" and report["params"]["gateway_url"] == gw.url
    assert report["engine"] is None


async def test_a_closed_loop_run_without_matplotlib_says_how_to_get_the_plots(
    fake, gw, tmp_path, monkeypatch
):
    monkeypatch.setattr(plots, "available", lambda: False)
    out = tmp_path / "closed"
    report = await run_bench(
        BenchOptions(
            out=out, url=gw.url, workload="faq", requests=60, concurrency=6, seed=1, progress=False
        )
    )
    assert report["params"]["mode"] == "closed-loop" and report["params"]["concurrency"] == 6
    assert report["upstream_calls"] == fake.count() == report["oracle_calls"]
    assert report["plots"] == [] and not list(out.glob("*.png"))
    assert "pip install '.[bench]' in carpool's checkout" in (out / "report.md").read_text()
    assert set(json.loads((out / "report.json").read_text())) >= {
        "requests",
        "upstream_calls",
        "oracle_calls",
        "latency_ms",
        "ttfb_ms",
        "tokens_saved",
        "gpu_seconds_saved",
        "errors",
        "params",
    }


async def test_the_oracle_counts_a_call_for_each_request_whose_answer_is_never_stored(
    fake, gw, tmp_path
):
    # A Responses answer that ended incomplete and a message without a stop reason are never
    # stored, nor do they linger (docs/design.md): each later request calls again. The oracle
    # counted one call for three such requests, and the report said 3x the optimum.
    responses = {"model": "m", "input": "Summarise the notes", "max_output_tokens": 4}
    messages = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Sum"}]}
    rows = [
        {"t": t + offset, "endpoint": endpoint, "body": {**body, "temperature": 0}}
        for t in (0.0, 0.5, 1.0)
        for offset, endpoint, body in ((0, RESPONSES, responses), (0.25, MESSAGES, messages))
    ]
    path = _write(tmp_path / "cut.jsonl", rows)
    fake.omit_finish_reason = True  # (the answers end without completing)
    cut = await run_bench(
        BenchOptions(out=tmp_path / "cut", url=gw.url, workload_file=str(path), progress=False)
    )
    assert cut["errors"] == 0
    assert cut["upstream_calls"] == fake.count() == 6 == cut["oracle_calls"]
    assert cut["oracle"]["never_stored"] == 6
    fake.omit_finish_reason = False  # the same requests, answered whole: stored, one call each
    whole = await run_bench(
        BenchOptions(out=tmp_path / "whole", url=gw.url, workload_file=str(path), progress=False)
    )
    assert whole["errors"] == 0
    assert whole["upstream_calls"] == fake.count() - 6 == 2 == whole["oracle_calls"]
    assert whole["oracle"]["never_stored"] == 0


async def test_an_untimed_workload_file_reports_the_rate_its_arrivals_were_spaced_at(
    fake, gw, tmp_path
):
    """One line or two without timestamps: sent evenly at --rate or the default 40 req/s, and
    that is the rate reported (not n / the last send offset; a single line has none)."""
    for lines, rate, want in ((1, None, 40), (2, None, 40), (2, 20.0, 20)):
        path = _write(tmp_path / f"untimed{lines}.jsonl", [{"body": _HI}] * lines)
        out = tmp_path / f"untimed{lines}-{rate}"
        result = await run_bench(
            BenchOptions(out=out, url=gw.url, workload_file=str(path), rate=rate, progress=False)
        )
        assert result["params"]["rate"] == want and result["requests"] == lines
        assert f"open loop, {want} req/s mean" in (out / "report.md").read_text()
        assert len((out / "requests.jsonl").read_text().splitlines()) == lines


async def test_recorded_timestamps_at_one_instant_have_no_mean_rate_and_the_report_says_so(
    fake, gw, tmp_path
):
    """Every line at the same ``t`` (or a single timed line): all sent at once, so there is no
    mean rate (``params.rate`` is null); the report is written all the same."""
    for lines in (1, 2):
        path = _write(tmp_path / f"same{lines}.jsonl", [{"t": 5, "body": _HI}] * lines)
        out = tmp_path / f"same{lines}"
        result = await run_bench(
            BenchOptions(out=out, url=gw.url, workload_file=str(path), progress=False)
        )
        assert result["params"]["rate"] is None and result["params"]["recorded_timestamps"]
        assert "recorded timestamps, all at one instant" in (out / "report.md").read_text()
        assert len((out / "requests.jsonl").read_text().splitlines()) == lines


async def test_the_reports_traits_count_tenants_as_the_gateway_does_and_rates_as_replayed(
    fake, gw, tmp_path
):
    """A recording whose tenants are only in their headers (no ``tenant`` field) is three
    tenants, as the gateway tells them apart; replayed at ``--rate``, its traits' rates are the
    replay's, not the recording's."""
    rows = [
        {
            "t": 100 + i,
            "body": {**_HI, "messages": [{"role": "user", "content": f"q{i % 10}"}]},
            "headers": {"Authorization": f"Bearer key-{i % 3}"},
        }
        for i in range(40)
    ]
    path = _write(tmp_path / "rec.jsonl", rows)
    out = tmp_path / "rec"
    result = await run_bench(
        BenchOptions(out=out, url=gw.url, workload_file=str(path), rate=20.0, progress=False)
    )
    measured = result["workload"]["traits"]
    assert measured["tenants"] == 3 and measured["distinct_fingerprints"] == 30
    assert measured["mean_rate_rps"] == pytest.approx(20, rel=0.05)
    assert measured["span_s"] == pytest.approx(39 / 20, rel=0.05)
    assert "40 requests, 3 tenant(s)" in (out / "report.md").read_text()
    closed = await run_bench(
        BenchOptions(
            out=tmp_path / "closed",
            url=gw.url,
            workload_file=str(path),
            concurrency=2,
            progress=False,
        )
    )
    # A closed loop has no arrival schedule: no rate to state.
    assert closed["workload"]["traits"]["mean_rate_rps"] is None


def empty_run_report(workload_traits: dict[str, Any]) -> dict[str, Any]:
    """A report of a run of no requests, its workload's ``traits`` given, without ``params``."""
    return {
        "requests": 0,
        "upstream_calls": 0,
        "oracle_calls": 0,
        "upstream_over_oracle": None,
        "within_5pct_of_oracle": True,
        "errors": 0,
        "outcomes": {},
        "outcomes_by_label": None,
        "latency_ms": {},
        "ttfb_ms": {},
        "tokens_saved": 0,
        "gpu_seconds_saved": 0.0,
        "cost_model": report.cost_model(Config()),
        "saved_fraction": 0.0,
        "duration_s": 0.0,
        "throughput_rps": None,
        "oracle": oracle(Workload("w", []), Config()).summary(),
        "workload": {"name": "w", "source": "w.jsonl", "traits": workload_traits},
        "plots": [],
    }


def test_the_markdown_report_states_the_arrivals_as_they_were():
    """``report.markdown`` for every arrival mode, a null rate included."""
    run_report = empty_run_report(traits(synthetic("faq", 3, 10)))
    common = {"target": "embedded", "seed": 0, "concurrency": None}
    cases = [
        (
            {"mode": "open-loop", "rate": 40.0, "recorded_timestamps": False},
            "open loop, 40 req/s mean",
        ),
        ({"mode": "open-loop", "rate": None, "recorded_timestamps": False}, "open loop;"),
        (
            {"mode": "open-loop", "rate": 2.5, "recorded_timestamps": True},
            "open loop, recorded timestamps, 2.5 req/s mean",
        ),
        (
            {"mode": "open-loop", "rate": None, "recorded_timestamps": True},
            "open loop, recorded timestamps, all at one instant",
        ),
        ({"mode": "closed-loop", "rate": None, "concurrency": 3}, "closed loop, 3 clients"),
    ]
    for params, want in cases:
        text = report.markdown({**run_report, "params": {**common, **params}})
        assert want in text, text


def _report_of(results: list[Result], oracle_calls: int = 1) -> dict:
    """``report.build`` over hand-made results (one chat request each) and a /stats delta."""
    requests = [BenchRequest(0.0, CHAT, _HI) for _ in results]
    run = Run(
        results,
        0.0,
        1.0,
        {"upstream_calls": 0, "tokens_saved": 0},
        {"upstream_calls": 1, "tokens_saved": 30},
    )
    return report.build(
        workload=Workload("w", requests),
        workload_traits=traits(Workload("w", requests)),
        run=run,
        oracle=Oracle(calls=oracle_calls),
        config=Config(),
        params={"mode": "closed-loop", "target": "embedded", "seed": 0, "concurrency": 2},
    )


def _outcome_legend(results: list[Result]) -> list[str]:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    figure = plots._outcomes(plt, Run(results, 0.0, 1.0, {}, {}), report.outcome_of)
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    plt.close(figure)
    return legend


def test_a_failed_request_is_an_error_whatever_its_header_and_is_never_saved():
    """A 5xx shared by a flight's joiners says ``x-carpool: coalesced``: it is still a failure,
    filed ``error`` in the outcomes, the saved fraction, the per-label table and the plot."""
    results = [
        Result(0, False, sent=0.0, latency=0.1, status=200, outcome="miss", prompt_tokens=10),
        Result(1, False, sent=0.1, latency=0.1, status=500, outcome="coalesced", error="HTTP 500"),
        Result(2, False, sent=0.2, latency=0.1, status=502, outcome="hit", error="HTTP 502"),
        Result(3, False, sent=0.3, latency=0.001, status=200, outcome="hit", prompt_tokens=10),
    ]
    built = _report_of(results)
    assert built["errors"] == 2
    assert built["outcomes"] == {"hit": 1, "miss": 1, "error": 2}
    assert built["saved_fraction"] == 0.25  # the one hit answered, of 4 sent
    assert built["latency_ms"]["all"]["count"] == 2  # failures have no latency figures
    text = report.markdown(built)
    assert "| requests answered without reaching upstream" in text and "| 25.0% |" in text
    assert "| error | 2 | 50.0% |" in text and "| coalesced |" not in text
    assert sorted(_outcome_legend(results)) == ["error (2)", "hit (1)", "miss (1)"]


def test_a_run_with_errors_makes_no_claim_against_the_oracle():
    """One upstream call for an oracle of one looks "within 5%", but the failed requests may or
    may not have cost calls: the verdict is null, with the reason, not true."""
    failed = Result(1, False, latency=0.1, status=500, outcome="coalesced", error="HTTP 500")
    answered = Result(0, False, latency=0.1, status=200, outcome="miss")
    built = _report_of([answered, failed])
    assert built["upstream_over_oracle"] == 1.0
    assert built["within_5pct_of_oracle"] is None
    assert "1 of 2 requests failed" in built["within_5pct_of_oracle_reason"]
    assert "(not compared: requests failed)" in report.markdown(built)
    clean = _report_of([answered, Result(1, False, latency=0.001, status=200, outcome="hit")])
    assert clean["within_5pct_of_oracle"] is True and clean["within_5pct_of_oracle_reason"] is None
    assert "(within 5%)" in report.markdown(clean)


def test_a_semantic_hit_known_wrong_is_shown_apart_and_never_counts_as_saved():
    """The audit workload knows each request's answer: a semantic hit that served another
    question's answer is ``wrong_semantic_hit``, apart from the right ones, and not saved."""
    results = [
        Result(0, False, sent=0.0, latency=0.1, status=200, outcome="miss", wrong=False),
        Result(1, False, sent=0.1, latency=0.01, status=200, outcome="semantic_hit", wrong=False),
        Result(2, False, sent=0.2, latency=0.01, status=200, outcome="semantic_hit", wrong=True),
        Result(3, False, sent=0.3, latency=0.01, status=200, outcome="semantic_hit", wrong=True),
    ]
    built = _report_of(results)
    assert built["outcomes"] == {"semantic_hit": 1, "wrong_semantic_hit": 2, "miss": 1}
    assert built["saved_fraction"] == 0.25 and built["errors"] == 0
    assert built["latency_ms"]["wrong_semantic_hit"]["count"] == 2
    assert "| wrong_semantic_hit | 2 | 50.0% |" in report.markdown(built)
    assert "wrong_semantic_hit (2)" in _outcome_legend(results)


def test_the_latency_plot_gives_the_p50_the_report_gives():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    results = [
        Result(i, False, sent=0.1 * i, latency=s, status=200, outcome="miss")
        for i, s in enumerate((0.010, 0.030, 0.050, 0.090))
    ]
    p50 = report._per_outcome(results, "latency")["miss"]["p50"]
    assert p50 == 40.0  # interpolated between the two middle ones
    figure = plots._latency(plt, Run(results, 0.0, 1.0, {}, {}), report.outcome_of)
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    plt.close(figure)
    assert legend == ["miss (n=4, p50 40.0 ms)"]


# ------------------------------------------------------------------- the benchmarks' pieces


def _greedy(text: str) -> dict:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def test_the_benchmark_upstream_holds_counts_answers_per_tenant_and_injects_faults():
    options = Options(hold=True, tenant_answers=True, faults={"503": 0.5})
    plan = FaultPlan(options.faults)
    texts = [f"question {i}" for i in range(64)]
    faulty = next(t for t in texts if plan.fault_of("a", t) == "503")
    fine = next(t for t in texts if plan.fault_of("a", t) is None and plan.fault_of("b", t) is None)
    with upstream(options) as up, ThreadPoolExecutor(1) as pool:
        url, tenant_a = up.url + "/chat/completions", {"authorization": "Bearer a"}
        held = pool.submit(fetch, "POST", url, _greedy(fine), tenant_a)
        deadline = time.monotonic() + 10
        while up.count()["in_flight"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert up.count()["in_flight"] == 1 and not held.done()  # held until released
        up.release()
        status, headers, body = held.result(10)
        assert status == 200 and headers["x-carpool-simulated"] == "true"
        text = json.loads(body)["choices"][0]["message"]["content"]
        want = expected(CHAT, _greedy(fine), "a", options).body
        assert text == want["choices"][0]["message"]["content"]
        other = fetch("POST", url, _greedy(fine), {"authorization": "Bearer b"})
        assert json.loads(other[2])["choices"][0]["message"]["content"] != text
        status, _, body = fetch("POST", url, _greedy(faulty), tenant_a)
        assert status == 503 and json.loads(body)["error"]["code"] == "injected"
        count = up.count()
        assert count["calls"] == count["chat"] == 3 and count["faults"] == {"503": 1}
        assert count["answered_at"] is not None
        up.reset()
        assert up.count()["calls"] == 0


def test_the_load_generator_measures_every_target_alike():
    with fixed_app() as fixed:
        target = {"name": "fixed", "port": fixed.port, "body": chat_body(0)}
        lat = loadgen.run("latency", {"n": 30, "warmup": 3, "block": 10, "targets": [target]})
        assert len(lat["fixed"]["samples_s"]) == 30 and lat["fixed"]["non_200"] == 0
        assert lat["fixed"]["outcomes"] == {"(none)": 30}
        spec = {"concurrency": 4, "seconds": 0.2, "rounds": 2, "warmup_s": 0.05}
        thr = loadgen.run("throughput", {**spec, "fresh_connections": True, "targets": [target]})
        assert len(thr["fixed"]["rps"]) == 2 and all(r > 0 for r in thr["fixed"]["rps"])


def test_the_canned_engine_answers_whole_and_streamed_alike_and_completely():
    """``carpool.bench.canned``: the same text whole or streamed, finished (storable), a usage
    chunk only when asked; through a gateway, a miss, then a hit."""
    from carpool.bench.embedded import gateway
    from carpool.sse import SSEDecoder, assemble, is_complete

    def chat(**extra) -> dict:
        return {
            "model": "m",
            "temperature": 0,
            **extra,
            "messages": [{"role": "user", "content": "hi"}],
        }

    with canned(tokens=5) as engine:
        url = f"{engine.url}/v1/chat/completions"
        status, _, raw = fetch("POST", url, chat())
        whole = orjson.loads(raw)
        assert status == 200 and is_complete("chat", whole, 1)
        assert whole["model"] == "m" and len(whole["choices"][0]["message"]["content"].split()) == 5
        for usage in (False, True):
            options = {"stream_options": {"include_usage": True}} if usage else {}
            status, _, raw = fetch("POST", url, chat(stream=True, **options))
            payloads = [payload for _, payload in SSEDecoder().feed(raw)]
            assert status == 200 and payloads[-1] == b"[DONE]"
            body = assemble("chat", [orjson.loads(p) for p in payloads[:-1]])
            assert body["choices"] == whole["choices"]
            assert ("usage" in body) is usage
        with gateway(Config(upstreams=[f"{engine.url}/v1"], log_level="warning")) as gw:
            outcomes = []
            for _ in range(2):
                status, headers, raw = fetch("POST", f"{gw.url}/v1/chat/completions", chat())
                outcomes.append(headers.get("x-carpool"))
            assert outcomes == ["miss", "hit"]


def test_the_embedded_gateway_names_its_upstreams_without_their_credentials(tmp_path):
    # Its first line printed the upstream URLs whole: a user and password in one went to the
    # bench's log.
    from carpool.bench.embedded import gateway

    log = tmp_path / "gateway.log"
    with canned(tokens=5) as engine:
        url = engine.url.replace("http://", "http://bench-user:BENCH-PASSWORD@", 1) + "/v1"
        with gateway(Config(upstreams=[url], log_level="warning"), log_path=log):
            pass
    text = log.read_text()
    assert f"embedded gateway in front of {engine.url}/v1;" in text, text
    assert "BENCH-PASSWORD" not in text and "bench-user" not in text


def test_the_byte_relay_passes_every_byte_both_ways_as_the_engine_sent_them():
    """``carpool.bench.relay``: the floor of ``bench_perf``'s misses. Through it, a whole answer
    and a stream are the engine's bytes (but the call number in its ids), and many requests
    go through one kept connection."""
    import re

    def unnumbered(raw: bytes) -> bytes:
        return re.sub(rb"chatcmpl-canned-\d+", b"id", raw)

    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    with canned(tokens=5) as engine, relay(engine.port) as hop:
        for extra in ({}, {"stream": True}):
            direct = fetch("POST", f"{engine.url}/v1/chat/completions", {**body, **extra})
            relayed = fetch("POST", f"{hop.url}/v1/chat/completions", {**body, **extra})
            assert relayed[0] == direct[0] == 200 and b"chatcmpl-canned-" in relayed[2]
            assert unnumbered(relayed[2]) == unnumbered(direct[2])
        target = {"name": "relayed", "port": hop.port, "body": body, "unique": True}
        raw = loadgen.run("latency", {"n": 20, "warmup": 2, "block": 5, "targets": [target]})
        assert raw["relayed"]["outcomes"] == {"(none)": 20}
        assert len(raw["relayed"]["samples_s"]) == 20


def test_pinned_holds_each_process_to_its_cpus_and_gives_them_back():
    """``process.pinned``: ``bench_perf`` measures misses with the engine on a CPU of its own.
    This process (pid 0) is pinned too, so a child it starts meanwhile inherits its CPUs; a
    process gone by the block's end is skipped."""
    mine = os.sched_getaffinity(0)
    one = {min(mine)}
    sleeper = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    with subprocess.Popen(sleeper, stdin=subprocess.PIPE) as kept:
        gone = subprocess.Popen(sleeper, stdin=subprocess.PIPE)
        before = os.sched_getaffinity(kept.pid)
        with process.pinned({kept.pid: one, gone.pid: one, 0: one}):
            assert os.sched_getaffinity(kept.pid) == os.sched_getaffinity(0) == one
            with subprocess.Popen(sleeper, stdin=subprocess.PIPE) as child:
                assert os.sched_getaffinity(child.pid) == one
                process.stop(child, 5.0)
            process.stop(gone, 5.0)
        assert os.sched_getaffinity(0) == mine
        assert os.sched_getaffinity(kept.pid) == before
        process.stop(kept, 5.0)


def test_wrk_posts_any_json_body_as_a_lua_long_string_that_it_cannot_end():
    for text in ("plain", "a ]] b", "]=]", "]==] and ]] and ]=]"):
        lua = wrk.script({"text": text})
        start = lua.index("wrk.body = [") + len("wrk.body = ")
        level = lua[start + 1 : lua.index("[", start + 1)]
        assert set(level) <= {"="}
        closing = f"]{level}]"
        body = lua[start + len(level) + 2 : lua.rindex(closing)]
        assert closing not in body and orjson.loads(body) == {"text": text}


def test_wrk_measures_a_rate_of_posted_requests_that_the_server_answered():
    """``carpool.bench.wrk`` where wrk is installed (CI installs it: ``REQUIRE_WRK``): its rate
    against the fixed-bytes app, every answer a 2xx; against the simulated engine, which
    counts what it answers, real POSTs of the body."""
    if not wrk.available():
        missing("wrk is not on PATH (apt-get install wrk)", "REQUIRE_WRK")
    with fixed_app() as app, upstream() as engine:
        measured = wrk.throughput(app.port, chat_body(0), connections=4, seconds=1)
        assert measured["rps"] > 0 and measured["non_2xx"] == 0
        before = engine.count()["chat"]
        assert wrk.throughput(engine.port, chat_body(0), connections=2, seconds=1)["rps"] > 0
        assert engine.count()["chat"] > before
        taken = wrk.rounds(
            {"fixed": app.port, "engine": engine.port},
            chat_body(0),
            2,
            1,
            rounds=2,
            pids={"fixed": [app.pid]},
        )
        assert {n: len(v) for n, v in taken.rps.items()} == {"fixed": 2, "engine": 2}
        assert all(rps > 0 for v in taken.rps.values() for rps in v) and taken.non_2xx == 0
        # The CPU its processes spent per request: the fixed app's, whose pid was given (some,
        # and less than the round's whole wall time over the requests); none for the engine.
        assert all(cpu > 0 for cpu in taken.cpu_us_per_request["fixed"])
        assert taken.cpu_us_per_request["engine"] == [0.0, 0.0]
        assert all(0 < cores < 4 for v in taken.wrk_cores.values() for cores in v)


def test_cpu_seconds_counts_the_processes_given_and_nothing_for_one_gone():
    """``wrk.cpu_seconds``: the CPU of the processes named, read from /proc; a pid that is no
    process (any more) counts nothing, rather than failing a benchmark at its end."""
    import resource

    spent = 0.0
    while spent < 0.05:  # (spend some CPU here: clock ticks are 10 ms)
        spent = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        sum(range(10_000))
    mine = wrk.cpu_seconds([os.getpid()])
    assert mine >= 0.04
    assert wrk.cpu_seconds([os.getpid(), 2**22 + 1]) >= mine
    assert wrk.cpu_seconds([]) == 0.0


def test_one_percentile_and_summary_for_the_benchmarks_and_the_report():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert summary_ms([0.001, 0.003]) == {
        "n": 2,
        "p50_ms": 2.0,
        "p90_ms": 2.8,
        "p99_ms": 2.98,
        "mean_ms": 2.0,
        "max_ms": 3.0,
    }
    assert summary_ms([]) == {} and report.summary_ms([]) == {"count": 0}
    assert set(report.summary_ms([0.001])) == {"count", "p50", "p95", "p99", "mean", "max"}


async def test_requests_jsonl_names_a_tenant_by_a_digest_never_by_its_credential(
    fake, gw, tmp_path
):
    """A workload file's ``tenant`` is sent as ``Authorization: Bearer <tenant>``: a key, which
    the per-request rows name by a digest (the same for the same tenant)."""
    path = _write(
        tmp_path / "tenants.jsonl",
        [{"body": _HI, "tenant": "sk-proj-REALKEY"}, {"body": _HI, "tenant": "sk-proj-REALKEY"}],
    )
    out = tmp_path / "tenants"
    await run_bench(BenchOptions(out=out, url=gw.url, workload_file=str(path), progress=False))
    text = (out / "requests.jsonl").read_text()
    assert "REALKEY" not in text
    rows = [orjson.loads(line) for line in text.splitlines()]
    assert rows[0]["tenant"] == rows[1]["tenant"] and len(rows[0]["tenant"]) == 12


def test_a_streamed_chunk_whose_error_field_is_null_is_no_error_event():
    # (Some servers write every field: the bench counted each such stream as failed.)
    from carpool.bench.replay import Result, _read_stream

    ok = Result(0, True, status=200)
    _read_stream(
        b'data: {"choices": [], "error": null, "usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n',
        ok,
    )
    assert ok.error is None
    failed = Result(1, True, status=200)
    _read_stream(b'data: {"error": {"message": "m"}}\n\ndata: [DONE]\n\n', failed)
    assert failed.error is not None and "error event" in failed.error


def test_a_messages_prompt_tokens_count_its_prompt_cache_as_tokens_saved_does():
    # gpu_seconds_saved splits the gateway's tokens_saved (a message's prompt-cache tokens in
    # its prompt) by the prompt/completion mix of the answers received: the same prompt.
    from carpool.bench.replay import Result, _read_body
    from carpool.bench.workloads import MESSAGES, BenchRequest

    usage = {
        "input_tokens": 10,
        "cache_creation_input_tokens": 7000,
        "cache_read_input_tokens": 990,
        "output_tokens": 4,
    }
    body = {"type": "message", "content": [], "stop_reason": "end_turn", "usage": usage}
    result = Result(0, False, status=200)
    _read_body(orjson.dumps(body), result, BenchRequest(0.0, MESSAGES, {}))
    assert (result.prompt_tokens, result.completion_tokens) == (8000, 4)


async def test_a_bench_request_cancelled_as_its_answer_arrives_stays_cancelled():
    """``carpool bench`` stops on SIGTERM by cancelling its run once; a request timed by
    ``asyncio.wait_for`` returned its answer when the cancel came in the same turn of the loop
    as the answer (Python 3.11), so the cancel was lost and the run went on to its end (CI: a
    bench still running 60 s after SIGTERM). A cancel the task accepted now always ends it."""
    from carpool.bench.client import Address, Pool, Response

    class Held:
        """A connection whose answer the test releases."""

        reusable = True

        def __init__(self) -> None:
            self.answer: asyncio.Future[Response] = asyncio.get_running_loop().create_future()

        async def request(self, raw: bytes) -> Response:
            return await self.answer

        def abort(self) -> None:
            pass

    for timeout in (60.0, None):
        held = Held()
        pool = Pool(Address.parse("http://127.0.0.1:9"))
        pool.idle.append(held)  # type: ignore[arg-type]
        task = asyncio.ensure_future(pool.request(b"GET / HTTP/1.1\r\n\r\n", timeout))
        await asyncio.sleep(0)  # (the request is waiting for its answer)
        held.answer.set_result(Response(200, None, b"{}", time.monotonic()))
        await asyncio.sleep(0)  # (the answer is in; the request has not been resumed yet)
        accepted = task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not accepted or task.cancelled(), f"a cancel accepted, then lost ({timeout=})"


def test_the_bench_gateway_closes_an_idle_client_connection_after_limits_client_keepalive():
    # As ``carpool serve`` does (the bench's client keeps its connections): uvicorn's 5 s there
    # while serve kept them 75 s, a bench run's lull raced the close.
    import socket

    from carpool.bench.embedded import gateway

    with gateway(Config(limits={"client_keepalive": 0.2})) as child:
        with socket.create_connection(("127.0.0.1", child.port), timeout=4) as connection:
            connection.sendall(b"GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n")
            received = b""
            while chunk := connection.recv(65536):  # (closed once idle: not uvicorn's 5 s)
                received += chunk
    assert received.startswith(b"HTTP/1.1 200")


def test_the_bench_client_writes_an_ipv6_host_in_brackets():
    # "bench --url http://[::1]:P" sent "Host: ::1:P" (urlsplit's hostname has no brackets),
    # which a strict front proxy refuses; its report named the URL so too.
    from carpool.bench.client import Address, build

    address = Address.parse("http://[::1]:8080/v1")
    assert address.url == "http://[::1]:8080/v1"
    assert b"\r\nhost: [::1]:8080\r\n" in build("GET", "/stats", address)
    assert b"\r\nhost: 127.0.0.1:9\r\n" in build("GET", "/", Address.parse("http://127.0.0.1:9"))


@pytest.mark.parametrize("call", ["fetch", "healthy"])
def test_the_bench_never_sends_its_own_requests_through_a_proxy(call):
    # With HTTP_PROXY set, urlopen sent the setup's and the checks' requests, and the embedded
    # gateway's start-up probes on loopback, to the proxy (the load client never used one): a
    # run against a healthy gateway failed after 60 s, "did not answer GET /healthz".
    code = {
        "fetch": "from carpool.bench.client import fetch; print(fetch('GET', sys.argv[1])[0])",
        "healthy": (
            "import subprocess; from carpool.bench.process import _healthy; "
            "p = subprocess.Popen(['sleep', '30']); print(200 if _healthy(sys.argv[1], p, 5) "
            "else 0); p.kill()"
        ),
    }[call]
    dead = "http://127.0.0.1:9"  # (the discard port: nothing listens)
    env = {**os.environ, "HTTP_PROXY": dead, "http_proxy": dead, "NO_PROXY": "", "no_proxy": ""}
    with upstream(Options()) as up:
        done = subprocess.run(
            [sys.executable, "-c", "import sys; " + code, up.url + "/models"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.stdout.strip() == "200", done.stderr[-2000:]


def _embedded_semantic(env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    """``carpool bench``'s gateway, semantic cache on, run in ``env`` until it exits."""
    from carpool.config import Config

    config = Config.model_validate({"semantic": {"enabled": True}})
    return subprocess.run(
        [sys.executable, "-m", "carpool.bench.embedded"],
        input=json.dumps(config.with_secrets()).encode() + b"\n",
        env=env,
        capture_output=True,
        timeout=60,
    )


def test_the_embedded_gateway_says_the_models_files_are_missing_not_the_extra(tmp_path):
    """The semantic extra installed, the model's files nowhere: ``carpool bench``'s gateway says
    where they come from, as ``carpool serve`` does, not "needs the semantic extra"."""
    pytest.importorskip("onnxruntime")
    done = _embedded_semantic(model_env(tmp_path, cache=True))
    said = done.stderr.decode()
    assert done.returncode == 2, said
    assert "weights are not here" in said and "needs the semantic extra" not in said


def test_the_embedded_gateway_says_a_hub_client_that_cannot_start_in_one_line(tmp_path):
    """As ``carpool serve`` says it: one line, exit 2, never a traceback (the model in no
    package: its cache is the only place left)."""
    pytest.importorskip("onnxruntime")
    done = _embedded_semantic(model_env(tmp_path, hub_setting=UNREADABLE))
    said = done.stderr.decode()
    assert done.returncode == 2, said
    assert "carpool bench: the Hugging Face hub client could not start" in said
    assert "Traceback" not in said


def test_the_embedded_gateway_announces_its_port_first_with_a_hub_client_that_cannot_start(
    tmp_path,
):
    """Its model found in a package, it starts: its first line on stdout is its port, never the
    hub client's own message (``carpool bench`` read "did not start", and no reason)."""
    pytest.importorskip("onnxruntime")
    import importlib.util

    from carpool.config import Config
    from carpool.semantic.embed import MODEL_PACKAGES

    if importlib.util.find_spec(MODEL_PACKAGES[0][0]) is None:
        pytest.skip("the tests' model package is not installed: requirements/test-model.txt")
    config = Config.model_validate({"semantic": {"enabled": True}})
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "carpool.bench.embedded"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=model_env(hub_setting=UNREADABLE),
        )
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(config.with_secrets()).encode() + b"\n")
        child.stdin.close()
        first = child.stdout.readline()
        assert first.startswith(b'{"port"'), (first, log.read_text())
        assert isinstance(json.loads(first)["port"], int)
    finally:
        child.kill()
        child.wait(timeout=30)
