"""carpool's logs (``carpool.logs``) and what ``carpool serve`` says when it starts."""

from __future__ import annotations

import io
import json
import logging
import socket
import subprocess
import sys

import pytest

from carpool import logs
from carpool.request_id import CURRENT
from fakes.instances import free_port, serve_log


@pytest.fixture
def restored():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_every_line_names_its_layer_and_request(restored, fmt, monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure("info", fmt)
    token = CURRENT.set("req-7")
    try:
        logging.getLogger("carpool.routing").warning("upstream %s failed", "vllm-0")
    finally:
        CURRENT.reset(token)
    logging.getLogger("carpool.cli").debug("not at info")
    (line,) = stream.getvalue().splitlines()
    if fmt == "json":
        record = json.loads(line)
        assert record["level"] == "warning" and record["logger"] == "carpool.routing"
        assert record["request_id"] == "req-7" and record["message"] == "upstream vllm-0 failed"
        assert record["time"].endswith("Z")
    else:
        assert "WARNING carpool.routing [req-7] upstream vllm-0 failed" in line


class Kept(logging.Handler):
    """Keeps the records it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_clients_request_ids_reach_the_text_log_escaped_and_cut_short(
    restored, monkeypatch, fake, gateway_with
):
    """The debug line of an upstream call names the client ids it serves (its ``x-request-id``,
    its body's ``request_id``), the client's own text: escaped as JSON only, NEL, LINE SEPARATOR
    (a line break to a log viewer) and RIGHT-TO-LEFT OVERRIDE went to the text log raw, and a
    1,000,000-character id made a megabyte line."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure("debug", "text")
    kept = Kept()
    restored.addHandler(kept)
    forged = "r1\n2026 FORGED\x1b[31m\u0085NEL-FORGED\u2028LS-FORGED\u202eDELROW"
    async with gateway_with() as gw:
        assert (await gw.chat("forged id", request_id=forged)).status_code == 200
        assert (await gw.chat("long id", request_id="L" * 1_000_000)).status_code == 200
    calls = [r.getMessage() for r in kept.records if r.getMessage().startswith("upstream call")]
    assert len(calls) == 2, calls
    text = stream.getvalue()
    # (str.splitlines breaks at NEL and LINE SEPARATOR, as log viewers do.)
    assert len(text.splitlines()) == len(kept.records)
    for raw in ("\x1b", "\u0085", "\u2028", "\u202e"):
        assert raw not in text, ascii(raw)
    lines = [line for line in text.splitlines() if " upstream call " in line]
    assert len(lines) == 2 and all(len(line) < 1000 for line in lines), [len(x) for x in lines]
    assert "FORGED" in lines[0] and "DELROW" in lines[0]  # still there to be matched
    assert "L" * 100 in lines[1] and "999,872 more" in lines[1]


def test_a_port_in_use_is_said_before_anything_says_listening():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "listening" not in result.stderr + result.stdout


def test_the_start_up_lines_are_true_and_not_repeated():
    log = serve_log("--port", str(free_port()))
    assert "carpool.cli" in log and "carpool carpool" not in log and "carpool: " not in log
    pytest.importorskip("onnxruntime")  # the semantic extra is installed here: not "needs" it
    assert "semantic cache off" in log and "needs the semantic extra" not in log


def test_with_log_format_json_every_line_of_serve_is_json(monkeypatch):
    # uvicorn's own lines ("INFO:     Started server process") stayed text among the JSON.
    monkeypatch.setenv("CARPOOL_LOG_FORMAT", "json")
    log = serve_log("--port", str(free_port()))
    lines = [line for line in log.splitlines() if line.strip()]
    assert any("Uvicorn running on" in line for line in lines)
    for line in lines:
        assert isinstance(json.loads(line), dict), line


def test_a_throttled_line_is_written_at_once_then_once_per_interval_saying_how_many_it_held():
    throttle = logs.Throttle(30.0)
    assert throttle.due(100.0) == 0  # (the first: at once)
    assert [throttle.due(now) for now in (101.0, 110.0, 129.9)] == [None, None, None]
    assert throttle.due(130.0) == 3  # (three held back since the line before)
    assert throttle.due(131.0) is None
    assert throttle.due(200.0) == 1
