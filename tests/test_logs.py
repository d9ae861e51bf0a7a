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
