"""`carpool eval-semantic`: hit rate on should-hit pairs, wrong-hit rate on should-miss pairs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")

PAIRS = [
    {
        "a": "How do I reset my router?",
        "b": "how do i reset my router",
        "same_answer": True,
        "category": "near_repeat",
    },
    {
        "a": "Where can I download my invoice?",
        "b": "Where can I download my invoice? Thanks!",
        "same_answer": True,
        "category": "near_repeat",
    },
    {
        "a": "Is this jacket waterproof?",
        "b": "Is this jacket not waterproof?",
        "same_answer": False,
        "category": "negation",
    },
    {
        "a": "What is the weather in Paris today?",
        "b": "What is the weather in Rome today?",
        "same_answer": False,
        "category": "entity_swap",
    },
    {
        "a": [
            {"role": "user", "content": "I have a gym membership."},
            {"role": "assistant", "content": "OK."},
            {"role": "user", "content": "Cancel it."},
        ],
        "b": [
            {"role": "user", "content": "I have a phone plan."},
            {"role": "assistant", "content": "OK."},
            {"role": "user", "content": "Cancel it."},
        ],
        "same_answer": False,
        "category": "conversation",
    },
]


def eval_semantic(pairs: Path, *extra: str) -> str:
    """``carpool eval-semantic --pairs PAIRS EXTRA...``'s output; it must exit 0."""
    return subprocess.run(
        [sys.executable, "-m", "carpool.cli", "eval-semantic", "--pairs", str(pairs), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


def test_eval_semantic_prints_rates_per_category_and_writes_decisions(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    decisions = tmp_path / "decisions.jsonl"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "carpool.cli",
            "eval-semantic",
            "--pairs",
            str(pairs),
            "--decisions",
            str(decisions),
            "--sweep",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["near_repeat"][1:3] == ["2", "100.0%"]
    assert lines["negation"][3:5] == ["1", "0.0%"]
    assert lines["all"][1:] == ["2", "100.0%", "3", "0.0%"]
    rows = [json.loads(line) for line in decisions.read_text().splitlines()]
    assert [r["decision"] for r in rows] == ["hit", "hit", "miss", "miss", "miss"]
    assert rows[2]["reason"] == "meaning" and rows[4]["reason"] in ("context", "entity")
    assert rows[0]["score"] == 1.0 and rows[1]["score"] > 0.5  # retyped: the model not asked
    assert all(r["correct"] for r in rows)
    assert "threshold" in out and "0.60" in out


def test_eval_semantic_reports_conversations_and_scores_one_half(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))

    def run(*extra: str) -> dict[str, list[str]]:
        out = eval_semantic(pairs, *extra)
        return {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}

    every = run()
    assert every["conversations"][1:] == ["0", "-", "1", "0.0%"]
    even, odd = run("--half", "even"), run("--half", "odd")  # rows 0, 2, 4 and 1, 3
    assert even["all"][1:] == ["1", "100.0%", "2", "0.0%"] and "conversations" in even
    assert odd["all"][1:] == ["1", "100.0%", "1", "0.0%"] and "conversations" not in odd


def test_a_labeled_judge_decides_the_band_and_its_calls_per_lookup_are_reported(tmp_path):
    # The jacket pair's negation is the verifier's to refuse (no exact rule): in the band a judge
    # answering from the label decides it; a rule's refusal (Paris/Rome: entity) stays.
    pairs = tmp_path / "pairs.jsonl"
    rows = [*PAIRS[:4], {**PAIRS[2], "same_answer": True, "category": "relabeled"}]
    pairs.write_text("".join(json.dumps(p) + "\n" for p in rows))
    out = eval_semantic(pairs, "--threshold", "0.0", "--labeled-judge", "0.0", "1.0")
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert lines["relabeled"][1:3] == ["1", "100.0%"]  # the verifier refused it; the judge not
    assert lines["negation"][3:5] == ["1", "0.0%"] and lines["entity_swap"][3:5] == ["1", "0.0%"]
    assert lines["labeled"][1:] == ["judge:", "0.800", "calls", "per", "lookup"]  # 4 of 5 asked


def test_a_pairs_file_line_that_is_no_labeled_pair_is_named_and_refused():
    # A line not JSON, or without "b", was a traceback; "same_answer": "false" was read as true.
    from carpool.semantic.evaluate import row_of

    for line, said in (
        ("{not json", "not JSON"),
        ('{"a": "x"}', "'b'"),
        ('{"a": 1, "b": "y", "same_answer": true}', "'a'"),
        ('{"a": "x", "b": "y", "same_answer": "false"}', "same_answer"),
    ):
        with pytest.raises(ValueError, match=said) as raised:
            row_of("pairs.jsonl", 7, line)
        assert "pairs.jsonl, line 7" in str(raised.value)


def test_eval_semantic_exits_2_on_a_bad_pairs_file_before_any_work(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"a": "x", "b": "y", "same_answer": "false"}\n')
    done = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "eval-semantic", "--pairs", str(pairs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "line 1" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "options, named",
    [
        # Each was taken as given: a report of a cache no config could have (a threshold of
        # 1.5 serves nothing; a band 0.9 0.1 asks the judge nothing; a misspelt rule overruled
        # nothing and the report said the judge could).
        (["--threshold", "1.5"], "--threshold"),
        (["--verifier-threshold", "-0.1"], "--verifier-threshold"),
        (["--labeled-judge", "0.9", "0.1"], "--labeled-judge"),
        (
            ["--labeled-judge", "0.5", "0.9", "--judge-verifier-band", "0", "2"],
            "--judge-verifier-band",
        ),
        (
            ["--labeled-judge", "0.5", "0.9", "--judge-overrules", "entity,nmber"],
            "--judge-overrules",
        ),
        (["--labeled-judge", "0.5", "0.9", "--judge-overrules", "meaning"], "--judge-overrules"),
    ],
)
def test_eval_semantic_options_out_of_what_the_config_takes_exit_2_naming_them(
    options, named, tmp_path
):
    from click.testing import CliRunner

    from carpool import cli

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    result = CliRunner().invoke(cli.main, ["eval-semantic", "--pairs", str(pairs), *options])
    assert result.exit_code == 2 and named in result.output, result.output


def _eval(*args: str):
    from click.testing import CliRunner

    from carpool import cli

    return CliRunner().invoke(cli.main, ["eval-semantic", *args])


def _rows(output: str, section: str) -> dict[str, list[str]]:
    """The report's rows of one section (``categories`` above the rule, ``totals`` below)."""
    above, _, below = output.partition("-" * 10)
    lines = (above if section == "categories" else below).splitlines()
    return {line.split()[0]: line.split() for line in lines if line.strip()}


def test_a_category_named_like_a_total_is_counted_apart_from_the_totals(tmp_path):
    # A file all.jsonl (its pairs' category by default) was merged into the total: 2 pairs
    # counted as 4.
    for name in ("all", "conversations"):
        pairs = tmp_path / f"{name}.jsonl"
        rows = [{k: v for k, v in p.items() if k != "category"} for p in (PAIRS[0], PAIRS[2])]
        pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
        result = _eval("--pairs", str(pairs))
        assert result.exit_code == 0, result.output
        assert _rows(result.output, "categories")[name][1:] == ["1", "100.0%", "1", "0.0%"]
        totals = _rows(result.output, "totals")
        assert totals["all"][1:] == ["1", "100.0%", "1", "0.0%"] and "conversations" not in totals


def test_decisions_and_the_sweep_decide_with_the_labeled_judge_the_report_uses(tmp_path):
    # --decisions called decide() without the judge's band: its rows disagreed with the printed
    # report; --sweep ignored the judge too, and printed a rate of no pairs as 0.0%.
    pairs = tmp_path / "judge.jsonl"
    pairs.write_text(json.dumps({"a": "What is 2+2?", "b": "What is 3+3?", "same_answer": True}))
    decisions = tmp_path / "decisions.jsonl"
    result = _eval(
        *("--pairs", str(pairs), "--decisions", str(decisions), "--sweep", "--threshold", "0"),
        *("--labeled-judge", "0", "1", "--judge-overrules", "number"),
    )
    assert result.exit_code == 0, result.output
    assert _rows(result.output, "totals")["all"][1:] == ["1", "100.0%", "0", "-"]
    (row,) = [json.loads(line) for line in decisions.read_text().splitlines()]
    assert row["decision"] == "hit" and row["reason"] == "judge" and row["correct"]
    sweep = result.output.split("verifier")[-1].split("\n")[1:]
    swept = [line.split() for line in sweep if line.strip()]
    assert swept and all(r[2:] == ["100.0%", "-"] for r in swept if float(r[0]) <= 0.5), swept
    without = _eval("--pairs", str(pairs), "--threshold", "0", "--decisions", str(decisions))
    assert _rows(without.output, "totals")["all"][1:] == ["1", "0.0%", "0", "-"]
    assert json.loads(decisions.read_text())["reason"] == "number"


@pytest.mark.parametrize(
    "content, extra, said",
    [
        # Each was a traceback (rc 1), or a report of no pairs (rc 0), or named no file.
        ('{"a": [1, 2], "b": "y", "same_answer": true}\n', [], "line 1"),
        ('{"a": [], "b": "y", "same_answer": true}\n', [], "line 1"),
        ("", ["--sweep"], "no pairs"),
        ("\n  \n", [], "no pairs"),
        (json.dumps(PAIRS[0]) + "\n", ["--half", "odd"], "no pairs"),
        ('{"a": "caf\xe9", "b": "cafe", "same_answer": true}\n'.encode("latin-1"), [], "UTF-8"),
    ],
)
def test_a_pairs_file_with_no_pair_to_score_exits_2_naming_the_file(tmp_path, content, extra, said):
    pairs = tmp_path / "pairs.jsonl"
    if isinstance(content, bytes):
        pairs.write_bytes(content)
    else:
        pairs.write_text(content)
    result = _eval("--pairs", str(pairs), *extra)
    assert result.exit_code == 2, (result.output, result.exception)
    assert said in result.output and "pairs.jsonl" in result.output


@pytest.mark.parametrize(
    "option, lacking", [("--model-dir", "model.safetensors"), ("--verifier-dir", "verifier.json")]
)
def test_eval_semantic_loads_the_model_folders_it_is_given_and_says_what_they_lack(
    option, lacking, tmp_path
):
    # The embedding model's folder was $CARPOOL_EMBED_MODEL_DIR, which `carpool serve` refused
    # (an unknown CARPOOL_ key) and which, without the files, was passed over for another copy.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    result = _eval("--pairs", str(pairs), option, str(folder))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert str(folder) in result.output and lacking in result.output


def test_a_decisions_file_that_cannot_be_written_exits_2_before_the_run(tmp_path):
    # Its folder was checked, not the file: the whole evaluation ran, then a traceback.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    unwritable = tmp_path / ("d" * 300 + ".jsonl")  # (a name too long, even for root)
    result = _eval("--pairs", str(pairs), "--decisions", str(unwritable))
    assert result.exit_code == 2, (result.output, result.exception)
    assert "--decisions" in result.output and "near_repeat" not in result.output


def test_a_run_that_fails_before_its_decisions_are_written_leaves_the_last_ones_whole(tmp_path):
    # --decisions was emptied as the options were read: a run that then failed (a bad pairs
    # file, exit 2) or was stopped left an empty file where the last run's rows were.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    decisions = tmp_path / "decisions.jsonl"
    assert _eval("--pairs", str(pairs), "--decisions", str(decisions)).exit_code == 0
    kept = decisions.read_text()
    assert kept.count("\n") == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": "x"}\n')
    result = _eval("--pairs", str(bad), "--decisions", str(decisions))
    assert result.exit_code == 2 and decisions.read_text() == kept, result.output
    # A new file is not made by a run that fails: nothing half-written left.
    fresh = tmp_path / "fresh.jsonl"
    assert _eval("--pairs", str(bad), "--decisions", str(fresh)).exit_code == 2
    assert not fresh.exists()


def test_decisions_to_standard_output_follow_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (no file named "-" made here)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    result = _eval("--pairs", str(pairs), "--decisions", "-")
    assert result.exit_code == 0, result.output
    report, _, last = result.output.rstrip("\n").rpartition("\n")
    assert "near_repeat" in report and json.loads(last)["category"] == "near_repeat"
    assert not (tmp_path / "-").exists()


def test_decisions_to_a_fifo_reach_its_reader(tmp_path):
    # (Checked by an open and a close before the run, the reader read that close as the end,
    # and the write at the end waited for a reader for ever.)
    import os
    import threading

    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    fifo = tmp_path / "decisions"
    os.mkfifo(fifo)
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_text()), daemon=True)
    reader.start()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "carpool.cli", "eval-semantic"),
            *("--pairs", str(pairs), "--decisions", str(fifo)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    reader.join(timeout=30)
    assert done.returncode == 0, done.stderr
    assert len(read) == 1 and json.loads(read[0])["category"] == "near_repeat", read


def test_a_decisions_file_that_is_a_pairs_file_is_refused_and_left_whole(tmp_path):
    # (The same path given to both: the labeled pairs were emptied, then "no pairs".)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    before = pairs.read_text()
    result = _eval("--pairs", str(pairs), "--decisions", str(pairs))
    assert result.exit_code == 2 and "--decisions" in result.output, result.output
    assert "also a --pairs file" in result.output and pairs.read_text() == before


def test_eval_semantic_takes_the_threshold_from_carpool_semantic_threshold(tmp_path, monkeypatch):
    # It read only its flags: CARPOOL_SEMANTIC__THRESHOLD=0.99 (and the file's semantic
    # settings) were ignored, and it scored a cache other than the one configured.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[1]) + "\n")  # similar, but under 0.99

    def header_and_served() -> tuple[str, str]:
        assert result.exit_code == 0, result.output
        return result.output.splitlines()[0], _rows(result.output, "totals")["all"][2]

    result = _eval("--pairs", str(pairs))
    assert header_and_served() == ("threshold 0.400  verifier 0.982", "100.0%")
    monkeypatch.setenv("CARPOOL_SEMANTIC__THRESHOLD", "0.99")
    monkeypatch.setenv("CARPOOL_SEMANTIC__VERIFIER_THRESHOLD", "0.25")
    result = _eval("--pairs", str(pairs))
    assert header_and_served() == ("threshold 0.990  verifier 0.250", "0.0%")
    # The flags win over the environment...
    result = _eval("--pairs", str(pairs), "--threshold", "0.5", "--verifier-threshold", "0.3")
    assert header_and_served() == ("threshold 0.500  verifier 0.300", "100.0%")
    # ...which wins over the file (--config, else CARPOOL_CONFIG), as for every command.
    config = tmp_path / "carpool.yaml"
    config.write_text("semantic:\n  threshold: 0.95\n  verifier_threshold: 0.75\n")
    monkeypatch.delenv("CARPOOL_SEMANTIC__VERIFIER_THRESHOLD")
    result = _eval("--pairs", str(pairs), "--config", str(config))
    assert header_and_served() == ("threshold 0.990  verifier 0.750", "0.0%")
    monkeypatch.delenv("CARPOOL_SEMANTIC__THRESHOLD")
    monkeypatch.setenv("CARPOOL_CONFIG", str(config))
    result = _eval("--pairs", str(pairs))
    assert header_and_served()[0] == "threshold 0.950  verifier 0.750"
    # A bad setting is refused as by every command: exit 2 naming it.
    monkeypatch.setenv("CARPOOL_SEMANTIC__THRESHOLD", "2")
    result = _eval("--pairs", str(pairs))
    assert result.exit_code == 2 and "semantic.threshold" in result.output


def test_a_pair_whose_text_holds_a_unicode_line_separator_is_one_line_of_its_file(tmp_path):
    # JSON allows U+2028, U+2029 and U+0085 unescaped in a string (orjson and
    # json.dumps(ensure_ascii=False) write them so): str.splitlines() cut the line there, and
    # the pair was refused as "not JSON". A line ends at a line feed only (a CR before it
    # dropped), as `carpool bench --workload-file` reads its lines.
    from carpool.semantic.evaluate import load_pairs

    texts = ["Reset my router\u2028please", "reset my router\u2029please", "next\x85line"]
    rows = [{"a": t, "b": t.upper(), "same_answer": True} for t in texts]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\r\n" for r in rows))
    loaded = load_pairs([pairs])
    assert [(p.a, p.b) for p in loaded] == [(t, t.upper()) for t in texts]
    assert [p.where for p in loaded] == [f"{pairs}, line {n}" for n in (1, 2, 3)]
    result = _eval("--pairs", str(pairs))
    assert result.exit_code == 0, result.output


def test_a_text_the_gateway_would_refuse_as_json_is_refused_naming_the_line_not_a_traceback(
    tmp_path,
):
    # A lone surrogate is JSON that json.loads reads; the gateway refuses the request that holds
    # one (400 invalid_json: orjson reads its bodies), and the pair went on to a TypeError
    # traceback, exit 1. The rows are read as the gateway reads a body.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + '\n{"a": "\\ud800x", "b": "y", "same_answer": true}\n')
    done = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "eval-semantic", "--pairs", str(pairs)],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"{pairs}, line 2: not JSON" in done.stderr


def test_a_pairs_file_line_is_named_by_its_number_in_the_file_whatever_blank_lines_precede_it(
    tmp_path,
):
    # Blank lines were left out of the count: the error named line 2 of a file whose line 5 was
    # wrong. --half still counts the pairs (the non-empty lines), so a blank line moves no pair
    # from one half to the other.
    from carpool.semantic.evaluate import load_pairs

    pairs = tmp_path / "pairs.jsonl"
    good = json.dumps(PAIRS[0])
    pairs.write_text(f'\n\n{good}\n\n{{"a": "x", "b": 5, "same_answer": true}}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl, line 5: 'b' must be"):
        load_pairs([pairs])
    result = _eval("--pairs", str(pairs))
    assert result.exit_code == 2 and "pairs.jsonl, line 5" in result.output, result.output
    pairs.write_text(f"\n{good}\n\n\n{json.dumps(PAIRS[2])}\n  \n{json.dumps(PAIRS[1])}\n")
    assert [p.where.rsplit(" ", 1)[1] for p in load_pairs([pairs])] == ["2", "5", "7"]
    (odd,) = load_pairs([pairs], "odd")
    assert (odd.a, odd.where) == (PAIRS[2]["a"], f"{pairs}, line 5")
    assert [p.a for p in load_pairs([pairs], "even")] == [PAIRS[0]["a"], PAIRS[1]["a"]]


#: Decided otherwise by a gateway with ``english_only: false`` and ``max_text_chars: 60`` than
#: by one with the defaults: German compared by meaning, a prompt past 60 characters not at all.
CONFIGURED_PAIRS = [
    {
        "a": "Wie setze ich meinen Router zurück?",
        "b": "wie setze ich meinen router zurück",
        "same_answer": True,
        "category": "german",
    },
    {
        "a": "How do I reset my home wifi router to its factory settings, step by step?",
        "b": "how do i reset my home wifi router to its factory settings step by step",
        "same_answer": True,
        "category": "long",
    },
]


async def test_eval_semantic_compares_the_prompts_the_configured_gateway_compares(
    tmp_path, gateway_with, fake
):
    # It read the thresholds from the config but made each side's semantic view with the
    # defaults: English only, up to 16,384 characters. The gateway configured so served the
    # German repeat and matched the long prompt exactly only; the eval said the opposite.
    pytest.importorskip("usearch")
    settings = {"enabled": True, "english_only": False, "max_text_chars": 60}
    config = tmp_path / "carpool.yaml"
    config.write_text(json.dumps({"semantic": settings}))  # (JSON is YAML)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in CONFIGURED_PAIRS))
    decisions = tmp_path / "decisions.jsonl"
    result = _eval("--config", str(config), "--pairs", str(pairs), "--decisions", str(decisions))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in decisions.read_text().splitlines()]
    assert [(r["decision"], r["reason"]) for r in rows] == [("hit", "served"), ("miss", "scope")]

    async def ask(gw, content: str) -> str:
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}
        response = await gw.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.headers["x-carpool"]

    async with gateway_with(semantic=settings) as gw:
        served = []
        for n, pair in enumerate(CONFIGURED_PAIRS):
            await ask(gw, pair["a"])
            # (Read-your-writes: a compared prompt's entry is in the index before its answer.)
            assert gw.gateway.semantic.entries == 1, n  # the long prompt: never stored
            served.append(await ask(gw, pair["b"]))
    assert served == ["semantic-hit", "miss"]
    assert [r["decision"] == "hit" for r in rows] == [x == "semantic-hit" for x in served]


def test_a_decisions_file_the_disk_cannot_take_exits_1_saying_so_not_a_traceback(tmp_path):
    # Disk full while writing --decisions: a traceback (OSError, errno 28, exit 1), or, the rows
    # still in the buffer when the file was closed, exit 0 and an empty file.
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "carpool.cli", "eval-semantic"),
            *("--pairs", str(pairs), "--decisions", "/dev/full"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "carpool: cannot write --decisions /dev/full: " in done.stderr, done.stderr


def test_a_developer_prompt_is_no_turn_of_a_conversation(tmp_path):
    # Only "system" was left out of the turns counted: a developer prompt and one user turn was
    # reported among the conversations, where the gateway reads it as a system prompt.
    from carpool.semantic.evaluate import Pair

    def side(role: str, text: str) -> list[dict[str, str]]:
        return [{"role": role, "content": "Be brief."}, {"role": "user", "content": text}]

    rows = [
        {"a": side(role, "How do I reset my router?"), "b": side(role, "how do i reset my router")}
        for role in ("developer", "system")
    ]
    assert [Pair(r["a"], r["b"], True, "c").conversation for r in rows] == [False, False]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({**r, "same_answer": True}) + "\n" for r in rows))
    result = _eval("--pairs", str(pairs))
    assert result.exit_code == 0, result.output
    assert "conversations" not in _rows(result.output, "totals"), result.output


def test_one_scope_counts_the_answers_another_cached_prompt_served(tmp_path):
    """The per-pair report asks about each pair's own first prompt only; a cache holding every
    pair's first prompt serves the nearest that passes, which may be another's: ``--one-scope``
    counts those apart (a wrong answer the per-pair figures never see), and a second prompt that
    is some pair's first (an exact hit at the gateway) not at all."""
    crowded = [
        {
            "a": "Where can I download my invoice?",
            "b": "Where do I download my invoice?",
            "same_answer": True,
            "category": "crowded",
        },
        {
            "a": "Is this jacket waterproof?",
            "b": "Is this jacket not waterproof?",
            "same_answer": False,
            "category": "crowded",
        },
        # Retypings of those second prompts, cached as other pairs' first: nearer than their own.
        {
            "a": "where do i download my invoice",
            "b": "Where can I download my invoice?",  # (the first pair's first: exact)
            "same_answer": True,
            "category": "other",
        },
        {
            "a": "is this jacket not waterproof",
            "b": "What is the capital of France?",
            "same_answer": False,
            "category": "other",
        },
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in crowded))
    out = eval_semantic(pairs, "--one-scope")
    per_pair, one_scope = out.split("one scope:")
    rows = {line.split()[0]: line.split()[1:] for line in per_pair.splitlines() if line.strip()}
    assert rows["crowded"] == ["1", "100.0%", "1", "0.0%"]  # (each against its own first)
    rows = {line.split()[0]: line.split()[1:] for line in one_scope.splitlines() if line.strip()}
    # should-hit, own, other, should-miss, own, other
    assert rows["crowded"] == ["1", "0.0%", "100.0%", "1", "0.0%", "100.0%"]
    assert rows["other"] == ["0", "-", "-", "1", "0.0%", "0.0%"]
    assert rows["all"] == ["1", "0.0%", "100.0%", "2", "0.0%", "50.0%"]


def test_sides_with_the_same_exact_key_are_served_as_the_gateways_exact_cache_serves_them(
    tmp_path,
):
    """The gateway answers a second request the same as the first from its exact cache, whether
    or not the text has a semantic view ("?", a German question, a zero-width space)."""
    same = ["?", "Wie spät ist es?", "pay\u200bpal login help", "How do I reset my router?"]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"a": t, "b": t, "same_answer": True}) + "\n" for t in same)
    )
    decisions = tmp_path / "decisions.jsonl"
    eval_semantic(pairs, "--decisions", str(decisions))
    rows = [json.loads(line) for line in decisions.read_text().splitlines()]
    assert [(r["decision"], r["reason"]) for r in rows] == [("hit", "exact")] * 4


def test_one_scope_keeps_a_category_named_all_apart_and_counts_what_is_not_an_exact_hit(
    tmp_path,
):
    """As the per-pair report: a category named like the total is its own row; a second prompt
    the same by meaning (its text as content parts) but not by exact key is a lookup counted."""
    row = {
        "a": "Where can I download my invoice?",
        "b": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Where can I download my invoice?"}],
            }
        ],
        "same_answer": True,
        "category": "all",
    }
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(row) + "\n")
    one_scope = eval_semantic(pairs, "--one-scope").split("one scope:")[1]
    rows = [line.split() for line in one_scope.splitlines() if line.split()[:1] == ["all"]]
    # (the category's row, then the total's: one lookup each, served its own pair's answer)
    assert rows == [["all", "1", "100.0%", "0.0%", "0", "-", "-"]] * 2


def test_pairs_the_exact_cache_answers_make_no_judge_lookup(tmp_path):
    """An exact hit never reaches the semantic cache: the judge's calls per lookup count the
    lookups the gateway makes, not the pairs."""
    rows = [
        {"a": "How do I reset my router?", "b": "How can I reset my router?", "same_answer": True}
    ]
    rows += [{"a": t, "b": t, "same_answer": True} for t in ("Who wrote Hamlet?", "Is it cold?")]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = eval_semantic(pairs, "--labeled-judge", "0.3", "1.0", "--judge-verifier-band", "0", "1")
    assert "labeled judge: 1.000 calls per lookup" in out


def test_one_scope_says_it_is_measured_without_the_labelled_judge(tmp_path):
    """A labelled judge answers from a pair's own label: one scope's lookups (another prompt's
    entry has none) are the guard's alone, and the report says so beside the judge's table."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    out = eval_semantic(pairs, "--one-scope", "--labeled-judge", "0.3", "1.0")
    assert out.rstrip().endswith(
        "(one scope without the labeled judge: another prompt's entry has no label)"
    )
    assert "labeled judge" not in eval_semantic(pairs, "--one-scope").split("one scope:")[1]


def test_weights_not_found_say_how_to_get_them_not_that_the_extra_is_missing(tmp_path, monkeypatch):
    """The semantic extra installed, the model's files nowhere carpool looks: the command says
    where they come from (``carpool fetch-model``), not "needs the semantic extra"."""
    from click.testing import CliRunner

    from carpool.cli import main
    from carpool.semantic.embed import weights

    monkeypatch.setattr(weights, "MODEL_PACKAGES", (("carpool_no_such_weights_pkg", "model"),))
    monkeypatch.setattr(weights, "_hub_cache_dir", lambda: None)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(PAIRS[0]) + "\n")
    result = CliRunner().invoke(main, ["eval-semantic", "--pairs", str(pairs)])
    assert result.exit_code == 2
    assert "weights are not here" in result.output and "carpool fetch-model" in result.output
    assert "needs the semantic extra" not in result.output
