"""The command line: `carpool serve` on the embedded simulator, and config errors exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fakes.instances import (
    free_port,
    ignoring_sigint,
    interrupt_when_imported,
    serve_log,
    signal_handled,
)


def carpool(*args: str, **kw) -> subprocess.Popen:
    kw.setdefault("env", {**os.environ, "PYTHONUNBUFFERED": "1"})
    return subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def answers_on(port: int, host: str = "127.0.0.1") -> None:
    """Returns once a gateway answers ``/healthz`` on ``port`` (within 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            assert httpx.get(f"http://{host}:{port}/healthz").status_code == 200
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"nothing answers on port {port}"
            time.sleep(0.05)


def a_miss_then_a_hit(base: str) -> None:
    """The same chat request twice to the gateway at ``base``: a miss, then a hit."""
    body = {
        "model": "m",
        "temperature": 0,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    url = f"{base}/v1/chat/completions"
    assert httpx.post(url, json=body, timeout=10).headers["x-carpool"] == "miss"
    assert httpx.post(url, json=body, timeout=10).headers["x-carpool"] == "hit"


def test_serve_without_upstream_says_first_that_it_uses_the_simulated_engine():
    port = free_port()
    process = carpool("serve", "--port", str(port))
    try:
        first_line = process.stdout.readline()
        assert "SIMULATED" in first_line
        for line in process.stdout:  # the server's own log says when it is up
            if "Uvicorn running on" in line:
                break
        else:
            raise AssertionError("carpool serve exited before listening")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        a_miss_then_a_hit(f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_port_0_says_the_port_the_system_chose(workers):
    # "listening on http://127.0.0.1:0/v1": the configured port, logged before the socket was
    # bound, with one worker or several.
    process = carpool("serve", "--port", "0", "--workers", workers)
    try:
        for line in process.stdout:
            if "listening on http://" in line:
                break
        else:
            raise AssertionError("carpool serve exited before saying where it listens")
        port = int(line.split("listening on http://127.0.0.1:")[1].split("/")[0])
        assert port != 0, line
        answers_on(port)  # (with workers, the socket is bound before they start)
    finally:
        process.terminate()
        process.wait(10)


def ipv6_loopback() -> None:
    """Skips the test on a machine without IPv6 (a container may have it turned off)."""
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6):
            pass
    except OSError as error:
        pytest.skip(f"no IPv6 loopback here ({error})")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_listens_on_an_ipv6_address_and_says_its_url_in_brackets(workers):
    # Every IPv6 address was refused before start-up ("cannot listen on ::1:0: Address family
    # for hostname not supported": the check bound it as IPv4), "::" too, which the docs give
    # for every interface; and the line said http://::1:PORT/v1, which is no URL.
    ipv6_loopback()
    process = carpool("serve", "--host", "::1", "--port", "0", "--workers", workers)
    try:
        for line in process.stdout:
            if "listening on http://" in line or "cannot listen" in line:
                break
        assert "listening on http://[::1]:" in line, line
        port = int(line.split("listening on http://[::1]:")[1].split("/")[0])
        answers_on(port, "[::1]")
        a_miss_then_a_hit(f"http://[::1]:{port}")
    finally:
        process.terminate()
        process.wait(10)


def test_sim_on_an_ipv6_address_announces_a_url_in_brackets():
    ipv6_loopback()
    process = carpool("sim", "--host", "::1", "--port", "0")
    try:
        line = next(line for line in process.stdout if "replica sim-0 on" in line)
        assert "on http://[::1]:" in line, line
        port = int(line.split("http://[::1]:")[1].split("/")[0])
        assert httpx.get(f"http://[::1]:{port}/v1/models", timeout=10).status_code == 200
    finally:
        process.terminate()
        process.wait(10)


def test_a_bad_config_value_exits_2_naming_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("coalesce:\n  window_ms: -5\n")
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "coalesce.window_ms" in result.stderr and "greater than or equal to 0" in result.stderr


@pytest.mark.parametrize(
    "text, field",
    [
        ("port: true\n", "port"),  # (it listened on port 1)
        ("coalesce:\n  window_ms: false\n", "coalesce.window_ms"),  # (0: no window)
        ("upstreams: ['http://llm host:8000/v1']\n", "upstreams"),  # (a host no lookup finds)
    ],
)
def test_check_config_refuses_a_boolean_for_a_number_and_a_url_with_white_space(
    text, field, tmp_path
):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    result = _check_config(path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"{field}:" in result.stderr


def test_a_verifier_folder_without_a_verifier_exits_2_saying_so(tmp_path):
    pytest.importorskip("onnxruntime")
    path = tmp_path / "c.yaml"
    path.write_text(f"semantic:\n  enabled: true\n  verifier_dir: {tmp_path}\n")
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and f"no verifier in {tmp_path}" in result.stderr


@pytest.mark.parametrize("folder", ["model", "verifier"])
def test_a_model_folder_missing_a_file_or_setting_exits_2_naming_it(folder, tmp_path):
    # A FileNotFoundError (no tokenizer.json) or a KeyError (verifier.json without its threshold)
    # was a traceback (exit 1).
    pytest.importorskip("onnxruntime")
    import json

    from carpool.semantic import embed
    from carpool.semantic.verifier import PACKAGED

    if folder == "model":
        try:
            weights = embed.find_model_dir()
        except embed.SemanticDependencyError as error:
            pytest.skip(str(error))
        (tmp_path / "model.safetensors").symlink_to(weights / "model.safetensors")
        said = ("tokenizer.json",)
    else:
        for name in ("model.onnx", "tokenizer.json"):
            (tmp_path / name).symlink_to(PACKAGED / name)
        meta = json.loads((PACKAGED / "verifier.json").read_text())
        del meta["threshold"]
        (tmp_path / "verifier.json").write_text(json.dumps(meta))
        said = ("verifier.json", "threshold")
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "CARPOOL_SEMANTIC__ENABLED": "true",
            f"CARPOOL_SEMANTIC__{folder.upper()}_DIR": str(tmp_path),
        },
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert str(tmp_path) in result.stderr and all(s in result.stderr for s in said)


def test_a_bad_environment_value_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "CARPOOL_SAMPLING": "x"},
    )
    assert result.returncode == 2 and "sampling" in result.stderr


def test_serve_fronts_the_one_replica_named_by_carpool_upstreams(monkeypatch):
    # Every option can come from a CARPOOL_* variable: one URL, as --upstream takes it.
    monkeypatch.setenv("CARPOOL_UPSTREAMS", "http://127.0.0.1:9/v1")
    log = serve_log("--port", str(free_port()))
    assert "fronting 1 upstream replica(s): http://127.0.0.1:9/v1" in log


def test_carpool_upstream_holding_a_url_exits_2_saying_carpool_upstreams():
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "CARPOOL_UPSTREAM": "http://127.0.0.1:9/v1"},
    )
    assert result.returncode == 2 and "did you mean CARPOOL_UPSTREAMS" in result.stderr


def test_serve_never_logs_the_credentials_in_a_redis_or_upstream_url():
    log = serve_log(
        "--port",
        str(free_port()),
        "--redis",
        f"redis://:s3cret-pass@127.0.0.1:{free_port()}/0",
        "--upstream",
        "http://user:s3cret-up@127.0.0.1:9/v1",
    )
    assert "s3cret" not in log and "redis://***@127.0.0.1:" in log


def test_serve_warns_when_it_holds_the_upstream_key_for_anyone_who_asks(monkeypatch, tmp_path):
    monkeypatch.setenv("CARPOOL_UPSTREAM__API_KEY", "sk-held")
    args = ("--port", str(free_port()), "--upstream", "http://127.0.0.1:9/v1")
    warning = "auth.client_keys_file is not set: anyone who can reach this port spends that key"
    assert warning in serve_log(*args)
    keys = tmp_path / "keys.txt"
    keys.write_text("client-a\n")
    monkeypatch.setenv("CARPOOL_AUTH__CLIENT_KEYS_FILE", str(keys))
    log = serve_log(*args)
    assert "sk-held" not in log and warning not in log


def test_fetch_model_prints_the_checked_directory_and_fails_clearly(monkeypatch, tmp_path):
    pytest.importorskip("numpy")
    from click.testing import CliRunner

    from carpool import cli
    from carpool.semantic import embed

    monkeypatch.setattr(embed, "fetch_model", lambda cache_dir=None: tmp_path)
    result = CliRunner().invoke(cli.main, ["fetch-model"])
    assert result.exit_code == 0 and str(tmp_path) in result.output

    def tampered(cache_dir=None):
        raise ValueError("tokenizer.json: SHA-256 differs from the pinned digest; removed")

    monkeypatch.setattr(embed, "fetch_model", tampered)
    result = CliRunner().invoke(cli.main, ["fetch-model"])
    assert result.exit_code == 1 and "SHA-256 differs" in result.output

    def offline(cache_dir=None):
        raise OSError("no network")

    monkeypatch.setattr(embed, "fetch_model", offline)
    result = CliRunner().invoke(cli.main, ["fetch-model"])
    assert result.exit_code == 1 and "could not fetch the model" in result.output


def test_a_redis_url_that_cannot_be_read_exits_2_without_its_credentials():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "carpool.cli",
            "serve",
            "--redis",
            "redis://:s3cret@localhost:notaport/0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # (Refused when the config loads, as check-config refuses it: named by its key.)
    assert result.returncode == 2 and "invalid config: redis:" in result.stderr
    assert "s3cret" not in result.stderr


def test_flags_win_over_the_environment_over_the_file_named_by_carpool_config(
    monkeypatch, tmp_path
):
    from carpool.commands.common import load_config

    path = tmp_path / "c.yaml"
    path.write_text("port: 1000\nhost: 0.0.0.0\nsim:\n  replicas: 2\n")
    monkeypatch.setenv("CARPOOL_CONFIG", str(path))
    assert load_config(None, {"port": None}).port == 1000  # a flag not given
    monkeypatch.setenv("CARPOOL_PORT", "2000")
    monkeypatch.setenv("CARPOOL_SIM__MAX_CONCURRENCY", "4")
    config = load_config(None, {"port": None, "sim": {"replicas": 3}})
    assert config.port == 2000 and config.host == "0.0.0.0"
    assert config.sim.replicas == 3 and config.sim.max_concurrency == 4
    assert load_config(None, {"port": 3000}).port == 3000


def test_the_help_shows_the_defaults_the_config_model_owns():
    from click.testing import CliRunner

    from carpool import cli
    from carpool.config import Config, SimConfig

    serve = CliRunner().invoke(cli.main, ["serve", "--help"]).output
    assert f"[{Config().host}]" in serve and f"[{Config().port}]" in serve
    assert f"[{Config().workers}]" in serve
    sim = CliRunner().invoke(cli.main, ["sim", "--help"]).output
    assert f"replicas [{SimConfig().replicas}]" in sim


def test_a_port_out_of_range_is_a_usage_error_not_a_traceback():
    # carpool sim --port 70000 was an OverflowError traceback.
    for command in (["sim"], ["serve"]):
        done = subprocess.run(
            [sys.executable, "-m", "carpool.cli", *command, "--port", "70000"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "70000" in done.stderr


def two_free_ports_in_a_row() -> int:
    for _ in range(50):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free ports in a row")


def test_sim_replicas_n_listen_on_port_plus_i():
    port = two_free_ports_in_a_row()
    process = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "sim", "--port", str(port), "--replicas", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for replica in (port, port + 1):
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, "carpool sim exited"
                try:
                    answer = httpx.post(
                        f"http://127.0.0.1:{replica}/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    )
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, f"replica on {replica} never answered"
                    time.sleep(0.05)
            assert answer.status_code == 200 and answer.json()["choices"], answer.text
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_sim_replicas_past_the_last_port_are_a_usage_error_before_any_starts():
    # carpool sim --port 65535 --replicas 2: replica 0 came up, then an OverflowError traceback.
    done = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "sim", "--port", "65535", "--replicas", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "65536" in done.stderr and "replica sim-0" not in done.stdout + done.stderr


def test_sim_that_cannot_listen_exits_2_naming_host_and_port_before_any_replica_starts():
    # It exited 3 with uvicorn's bare "error while attempting to bind", replica sim-0 already
    # announced when it was replica sim-1's port that was taken; `carpool serve` exits 2.
    port = two_free_ports_in_a_row()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + 1))
        held.listen()
        for args in (
            ["--host", "no-such-host.invalid", "--port", "0"],  # (a name no lookup finds)
            ["--port", str(port + 1)],
            ["--port", str(port), "--replicas", "2"],
        ):
            done = subprocess.run(
                [sys.executable, "-m", "carpool.cli", "sim", *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr)
            assert "'--host' / '--port'" in done.stderr and "cannot listen on" in done.stderr
            assert "replica sim-0" not in done.stdout, args


def test_ctrl_c_while_the_command_line_loads_exits_130_without_a_traceback():
    # `import carpool` loaded the whole gateway (~2 s on a slow machine), and an interrupt
    # then was a KeyboardInterrupt traceback. The interrupt is sent as the import goes on:
    # once `-X importtime` has said that pydantic (which the config's models need) loaded.
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "carpool", "sim", "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen, rest = interrupt_when_imported(proc, "pydantic")
        assert proc.wait(60) == 130, seen[-500:] + rest
        assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
        assert "carpool.server" not in rest  # (interrupted while loading: not served)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_inside_code_the_import_execs_still_exits_130(tmp_path):
    # Under `python -m`, CPython remembers a KeyboardInterrupt raised inside code run by
    # exec() of a string (pydantic and dataclasses make their methods so) as unhandled even
    # when caught, and at exit kills the process by SIGINT instead of exiting with the
    # status given (status -2, no output: the flake of the test above). Here the command
    # line's import is that exec, interrupted as it runs.
    (tmp_path / "interrupted_load.py").write_text(
        "import os, signal, sys, types\n"
        "cli = types.ModuleType('carpool.cli')\n"
        "def loading(name):\n"
        "    exec('os.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(10**8): pass',\n"
        "         {'os': os, 'signal': signal})\n"
        "cli.__getattr__ = loading\n"
        "sys.modules['carpool.cli'] = cli\n"
        "from carpool.__main__ import main\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "interrupted_load"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr


def _sigint_ignored_in(pid: int) -> bool:
    return signal_handled(pid, signal.SIGINT)


@pytest.mark.parametrize(
    "args, started, times",
    [
        (["serve", "--workers", "1"], "Application startup complete", 1),
        (["serve", "--workers", "2"], "Application startup complete", 2),  # (the workers':
        # after the supervisor set its handlers)
        (["sim"], "replica sim-0 on", 1),
    ],
)
def test_a_command_started_with_sigint_ignored_keeps_ignoring_it(args, started, times):
    # A shell starts a background job with SIGINT ignored (`carpool serve &` in a script), so
    # that the terminal's Ctrl-C stops the script and not the job: the handlers of uvicorn's
    # server and supervisor and of the simulated engine made it a stop again (and each worker
    # said it left one to its supervisor, which ignored it).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CARPOOL_LOG_LEVEL": "info"}
    process = carpool(*args, "--port", str(free_port()), preexec_fn=ignoring_sigint, env=env)
    try:
        assert process.stdout is not None
        seen = 0
        for line in process.stdout:
            seen += started in line
            if seen == times:
                break
        assert _sigint_ignored_in(process.pid)
        workers = [
            kid
            for task in os.listdir(f"/proc/{process.pid}/task")
            for kid in map(int, open(f"/proc/{process.pid}/task/{task}/children").read().split())
            if b"resource_tracker" not in open(f"/proc/{kid}/cmdline", "rb").read()
        ]
        assert len(workers) == (times if "--workers" in args and times > 1 else 0), workers
        assert all(_sigint_ignored_in(pid) for pid in workers)
    finally:
        process.terminate()
        assert process.wait(30) == 0


def test_an_empty_host_exits_2_naming_host():
    # Empty, it was every interface (uvicorn and the socket check read it so), unsaid.
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--host", "", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "host" in result.stderr and "0.0.0.0" in result.stderr


def test_a_config_file_that_is_not_utf8_exits_2_naming_the_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b'port: 8080\nadmin_token: "\xff\xfe"\n')
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"config file {path}: not UTF-8 text (byte 25" in result.stderr


def test_serve_warns_when_the_admin_surfaces_are_open_beyond_loopback(monkeypatch):
    warning = "admin_token is not set and the gateway listens on 0.0.0.0, beyond loopback"
    log = serve_log("--host", "0.0.0.0", "--port", str(free_port()))
    assert log.count(warning) == 1 and "/stats, /metrics and /dashboard are open" in log
    assert "admin_token is not set" not in serve_log("--port", str(free_port()))  # (loopback)
    # (127.1 is 127.0.0.1 to the socket calls: loopback, not warned of as beyond it)
    assert "admin_token is not set" not in serve_log("--host", "127.1", "--port", str(free_port()))
    monkeypatch.setenv("CARPOOL_ADMIN_TOKEN", "admin-secret")
    log = serve_log("--host", "0.0.0.0", "--port", str(free_port()))
    assert "admin_token is not set" not in log and "admin-secret" not in log


def test_serve_warns_once_naming_an_upstream_whose_path_does_not_end_in_v1():
    # Used as given (a provider's /v1beta/openai is right), but said: /v1 may have been left out.
    log = serve_log(
        "--port",
        str(free_port()),
        "--upstream",
        "http://user:s3cret-up@127.0.0.1:9/v1beta/openai?key=s3cret-q",
        "--upstream",
        "http://127.0.0.1:9/v1/",
    )
    said = [line for line in log.splitlines() if "does not end in /v1" in line]
    assert len(said) == 1 and "http://***@127.0.0.1:9/v1beta/openai " in said[0]
    assert "s3cret" not in log


def test_serve_never_starts_workers_that_could_not_load_their_config(tmp_path):
    """A worker that cannot load the config written for it (here: one written wrong on
    purpose) was restarted by uvicorn for ever, the port never served: the parent loads it
    back first, and exits 2 saying why."""
    parent = (
        "from carpool.config import Config\n"
        "given = Config.with_secrets\n"
        "def written_wrong(self):\n"
        "    data = given(self)\n"
        "    data.setdefault('coalesce', {})['window_ms'] = 5000  # (above max_window_ms)\n"
        "    return data\n"
        "Config.with_secrets = written_wrong\n"
        "from carpool.cli import main\n"
        "main()\n"
    )
    port = str(free_port())
    result = subprocess.run(
        [sys.executable, "-c", parent, "serve", "--workers", "2", "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the workers could not load the config written for them" in result.stderr
    assert "coalesce.window_ms" in result.stderr and "Traceback" not in result.stderr


def _served_log(*args: str, env: dict[str, str]) -> str:
    """``carpool serve ARGS`` run until ``/healthz`` answers, then stopped: all it wrote
    (whatever its log level: ``serve_log`` waits for a line logged at info)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # (No drain on the SIGTERM that stops it, unless ``env`` sets one: ``serve_log``.)
        env={**os.environ, "PYTHONUNBUFFERED": "1", "CARPOOL_SHUTDOWN__DRAIN_S": "0", **env},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "carpool serve never served"
                time.sleep(0.05)
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    return output


@pytest.mark.parametrize("level, log_format", [("warning", "text"), ("error", "json")])
def test_serve_says_simulated_engine_first_at_any_log_level(level, log_format):
    # Logged at info, it was never said at warning or error: nothing told the operator that the
    # answers were synthetic text.
    log = _served_log(env={"CARPOOL_LOG_LEVEL": level, "CARPOOL_LOG_FORMAT": log_format})
    assert "SIMULATED" in log.splitlines()[0], log


def _check_config(path, *, hidden: str | None = None) -> subprocess.CompletedProcess[str]:
    """``carpool check-config PATH``, the module ``hidden`` made not installed (find_spec of
    a name whose ``sys.modules`` entry is None answers None)."""
    code = "import sys\n"
    if hidden is not None:
        code += f"sys.modules[{hidden!r}] = None\n"
    code += "from carpool.cli import main\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_check_config_refuses_a_model_folder_without_its_files(tmp_path):
    # check-config said ok to a semantic.model_dir or verifier_dir that was a folder without the
    # model's files, or to semantic.enabled without the semantic extra: serve refused them all.
    path = tmp_path / "c.yaml"
    folder = tmp_path / "folder"
    folder.mkdir()
    for key, lacking in (("model_dir", "model.safetensors"), ("verifier_dir", "verifier.json")):
        path.write_text(f"semantic:\n  enabled: true\n  {key}: {folder}\n")
        result = _check_config(path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"semantic.{key}" in result.stderr and lacking in result.stderr
    path.write_text("semantic:\n  enabled: true\n")
    result = _check_config(path, hidden="usearch")
    assert result.returncode == 2 and "needs the semantic extra" in result.stderr, result.stderr
    path.write_text("tracing: on\n")
    result = _check_config(path, hidden="opentelemetry")
    assert result.returncode == 2 and "needs the otel extra" in result.stderr, result.stderr
    assert _check_config(path).returncode == 0  # (installed here)


@pytest.mark.parametrize("host", ["a\\0b", "\\udc80", "\\u00e4..b"])
def test_a_host_no_socket_can_take_exits_2_not_a_traceback(host, tmp_path):
    # check-config said ok; serve then failed with a TypeError or UnicodeError traceback.
    path = tmp_path / "c.yaml"
    path.write_text(f'host: "{host}"\n')
    for command in (["check-config", str(path)], ["serve", "--config", str(path)]):
        result = subprocess.run(
            [sys.executable, "-m", "carpool.cli", *command],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=60,
        )
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "host" in result.stderr
    # (No argument can hold a NUL: another control character stands for it.)
    text = {"a\\0b": "a\x01b", "\\udc80": "\udc80", "\\u00e4..b": "\u00e4..b"}[host]
    result = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "sim", "--host", text, "--port", "1"],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--host" in result.stderr


def test_an_empty_carpool_config_variable_means_no_file():
    # CARPOOL_CONFIG= (as a template leaves it) was the file "": "[Errno 21] Is a directory".
    log = _served_log(env={"CARPOOL_CONFIG": ""})
    assert "SIMULATED" in log and "config file" not in log


def test_serve_refuses_a_held_key_ending_in_a_newline_naming_it_never_its_value(tmp_path):
    # `HELD=$(cat key)` keeps no newline, a Kubernetes secret mounted as a variable may: serve
    # started, and every call then failed (a 502 "internal error while calling upstream",
    # /v1/models a 500 with a traceback: "Forbidden control character detected in headers").
    path = tmp_path / "c.yaml"
    path.write_text('upstream: {api_key: "${HELD}"}\n')
    env = {**os.environ, "HELD": "sk-HELD-VALUE\n"}
    for command in (
        ["serve", "--config", str(path), "--port", str(free_port())],
        ["check-config", str(path)],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "carpool.cli", *command],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert result.returncode == 2, result.stderr
        assert "upstream.api_key" in result.stderr and "${HELD}" in result.stderr
        assert (
            "sk-HELD-VALUE" not in result.stdout + result.stderr
            and "Traceback" not in result.stderr
        )


def test_an_empty_config_path_exits_2_never_all_defaults_nor_another_file(tmp_path):
    # `carpool check-config "$CONFIG"` with the variable unset said "ok: " (or validated the
    # file CARPOOL_CONFIG named), and `serve --config ""` started on every default.
    other = tmp_path / "other.yaml"
    other.write_text("port: 1234\n")
    for env in ({}, {"CARPOOL_CONFIG": str(other)}):
        for command in (
            ["check-config", ""],
            ["serve", "--config", "", "--port", str(free_port())],
        ):
            result = subprocess.run(
                [sys.executable, "-m", "carpool.cli", *command],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, **env},
            )
            assert result.returncode == 2, (command, env, result.stdout, result.stderr)
            assert "config file '': an empty path names no file" in result.stderr
            assert "1234" not in result.stdout + result.stderr


def test_an_idle_client_connection_outlives_the_sdks_own_keep_alive():
    # The SDKs close a connection idle for 5 s (httpx's keepalive_expiry); the gateway closed
    # one idle for 5 s too (uvicorn's default), so a request sent as it closed it was reset.
    import anthropic._constants
    import openai._constants

    from carpool.config import Config

    kept = Config().limits.client_keepalive
    for sdk in (openai._constants, anthropic._constants):
        assert kept > sdk.DEFAULT_CONNECTION_LIMITS.keepalive_expiry


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_idle_client_connection_is_closed_after_limits_client_keepalive(workers):
    # The setting reaches the server, one process or several: set far below uvicorn's 5 s, an
    # idle connection is closed well before them (the read waits up to 4 s).
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CARPOOL_LIMITS__CLIENT_KEEPALIVE": "0.2"}
    process = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", str(port), "--workers", workers],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        answers_on(port)
        with socket.create_connection(("127.0.0.1", port), timeout=4) as connection:
            connection.sendall(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
            received = b""
            while chunk := connection.recv(65536):  # (closed once idle: no timeout)
                received += chunk
        assert received.startswith(b"HTTP/1.1 200")
    finally:
        process.terminate()
        process.wait(10)


def test_serve_says_which_proxy_an_upstream_is_reached_through_and_warns_of_one_it_cannot_use(
    monkeypatch,
):
    # An upstream reached only through the proxy would otherwise fail with no hint; the
    # proxy's password is never written.
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):  # (a CI host's)
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    upstreams = ["--upstream", "https://api.example.test/v1", "--upstream", "http://127.0.0.1:9/v1"]
    assert "proxy" not in serve_log("--port", str(free_port()), *upstreams)
    monkeypatch.setenv("HTTPS_PROXY", "http://user:s3cret@proxy.internal:3128")
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    log = serve_log("--port", str(free_port()), *upstreams)
    said = [line for line in log.splitlines() if "proxy" in line]
    assert len(said) == 1, log  # (127.0.0.1: loopback, reached directly)
    assert (
        "https://api.example.test/v1 is reached through the proxy "
        "http://***@proxy.internal:3128 (HTTPS_PROXY)"
    ) in said[0]
    monkeypatch.setenv("HTTPS_PROXY", "socks5://user:s3cret@proxy.internal:1080")
    log = serve_log("--port", str(free_port()), *upstreams)
    said = [line for line in log.splitlines() if "proxy" in line]
    assert len(said) == 1 and "WARNING" in said[0], log
    assert (
        "HTTPS_PROXY (socks5://***@proxy.internal:1080) is not an http:// proxy, the only kind "
        "carpool uses: https://api.example.test/v1 is reached directly"
    ) in said[0]
    assert "s3cret" not in log
    assert "proxy" not in serve_log("--port", str(free_port()))  # (the simulator: no call out)


@pytest.mark.skipif(not os.path.exists("/proc/self/limits"), reason="reads /proc/PID/limits")
@pytest.mark.parametrize(("hard", "warned"), [(8192, False), (512, True)])
def test_serve_raises_its_file_limit_to_the_hard_one_and_warns_when_that_is_low(hard, warned):
    """Started with the usual soft limit (here 256), a burst of clients took every descriptor
    and left none for the upstream calls: the soft limit is raised to the hard one, and a hard
    one under ``FILE_LIMIT_WARN`` is said."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip(f"this machine's hard file limit is under {hard}")
    held = []

    def limits(pid: int) -> None:
        with open(f"/proc/{pid}/limits") as rows:
            held.extend(next(r.split()[3:5] for r in rows if r.startswith("Max open files")))

    log = serve_log(
        "--port",
        str(free_port()),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
        on_listening=limits,
    )
    assert held == [str(hard), str(hard)], log
    assert ("the file descriptor limit is 512" in log) is warned, log


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_on_loopback_refuses_a_host_name_other_than_localhost(workers):
    """DNS rebinding: a web page's own name, made to resolve to 127.0.0.1, reached the gateway
    on loopback (open /stats, /v1 from the operator's browser). ``carpool serve`` there takes
    ``localhost`` alone by name (every worker: the file the parent writes them says so)."""
    port = free_port()
    process = carpool("serve", "--port", str(port), "--workers", workers)
    try:
        answers_on(port)
        base = f"http://127.0.0.1:{port}"
        for _ in range(4):  # (several connections: with workers, each may take one)
            rebound = httpx.get(f"{base}/stats", headers={"host": f"rebind.example:{port}"})
            assert rebound.status_code == 403, rebound.text
            assert rebound.json()["error"]["code"] == "host_not_allowed"
            named = httpx.get(f"{base}/stats", headers={"host": f"localhost:{port}"})
            assert named.status_code == 200
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize(
    "text, shared",
    [
        ("port: 8080\n", "shared through this process;"),
        ("workers: 3\n", "shared through its 3 workers;"),  # (each key's owner: not one process)
        (
            "workers: 3\nredis: redis://u:secret@cache:6379/0\n",
            "shared through Redis redis://***@cache:6379/0;",
        ),
    ],
)
def test_check_config_says_what_the_cache_is_shared_through(text, shared, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    result = _check_config(path)
    assert result.returncode == 0, result.stderr
    assert shared in result.stdout and "secret" not in result.stdout, result.stdout
