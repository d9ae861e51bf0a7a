"""`carpool serve --workers N`: several processes on one port, sharing one Redis (issue 9)."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import pytest

from fakes.instances import free_port, interrupt_when_imported, serve_env, start_serve
from test_distributed import STEADY_LINK, until_serving

QUESTION = "What do the workers share?"


async def test_workers_on_one_port_share_the_cache_through_redis(fake, shared_redis, tmp_path):
    """On a cluster too: `carpool serve` sees a cluster node and takes a cluster client."""
    port = free_port()
    env = serve_env({"distributed": STEADY_LINK})  # (a store past 0.5 s: the other missed)
    log = tmp_path / "workers.log"
    proc = start_serve(
        [
            "--upstream",
            fake.url,
            "--redis",
            shared_redis.url,
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        env,
        log,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as probe:
            await until_serving(probe, proc, log)
        body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0}
        pids, outcomes = set(), []
        # A new connection per request, so the kernel spreads them over both workers.
        for _ in range(200):
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                outcomes.append(response.headers["x-carpool"])
                pids.add((await client.get("/stats")).json()["pid"])
            if len(pids) == 2 and len(outcomes) >= 20:
                break
        assert len(pids) == 2, "every request landed on one worker"
        assert outcomes[0] == "miss" and set(outcomes[1:]) == {"hit"}
        assert fake.count() == 1  # one upstream call for both workers
    finally:
        proc.terminate()
        proc.wait(10)


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie no longer does: its reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def test_workers_stop_when_carpool_serve_is_killed(fake, tmp_path):
    """Killed (SIGKILL, the OOM killer), the parent cannot stop its workers: they served the
    port on, orphans, and the next `carpool serve` on it found it in use. Each stops itself."""
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    from fakes.waiting import eventually

    port = free_port()
    log = tmp_path / "workers.log"
    # What the killed parent left for its workers, which they remove as they stop: in a
    # temporary folder of this run's own (other tests' runs write theirs meanwhile, pytest -n),
    # short enough for the workers' Unix sockets to be made in it too.
    temporary = Path(tempfile.mkdtemp(prefix="cp-"))
    proc = start_serve(
        ["--upstream", fake.url, "--port", str(port), "--workers", "2"],
        {**serve_env(), "TMPDIR": str(temporary)},
        log,
    )
    workers: set[int] = set()
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as probe:
            await until_serving(probe, proc, log)
        for _ in range(200):  # a new connection each: the kernel spreads them over both
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                workers.add((await client.get("/stats")).json()["pid"])
            if len(workers) == 2:
                break
        assert len(workers) == 2
        # (Made there: what is looked for below is what the run leaves.)
        assert [path.name.split("-")[1] for path in temporary.iterdir()] == ["run"]
        proc.kill()
        proc.wait(10)
        await eventually(
            lambda: not any(_running(pid) for pid in workers),
            timeout=30,
            what="the orphaned workers to stop",
        )
        assert list(temporary.glob("carpool-run-*")) == []  # (its config holds the run's keys)
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(temporary, ignore_errors=True)


async def test_every_config_check_config_accepts_is_served_by_its_workers(fake, tmp_path):
    """`max_window_ms: 500` alone (the default window_ms held to it) passed check-config and
    one process, but every worker refused the config the parent wrote, every default written
    out as if given: restarted for ever, the port never served."""
    import subprocess
    import sys

    config = tmp_path / "carpool.yaml"
    config.write_text("coalesce:\n  max_window_ms: 500\n")
    checked = subprocess.run(
        [sys.executable, "-m", "carpool.cli", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stderr
    port = free_port()
    log = tmp_path / "workers.log"
    args = ["--config", str(config), "--upstream", fake.url, "--port", str(port), "--workers", "2"]
    proc = start_serve(args, serve_env(), log)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await until_serving(client, proc, log)
            body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}]}
            answer = await client.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert "Traceback" not in log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


async def test_text_outside_the_bmp_reaches_every_worker_intact(fake, tmp_path):
    """The config the workers load was JSON with ASCII escapes, which YAML read back as lone
    surrogates: an emoji admin token made /stats and /admin/invalidate a bare 500 in every
    worker, an emoji replica name a config every worker refused."""
    token, name = "tok-\U0001f600", "模型-\U0001f600"
    config = tmp_path / "carpool.yaml"
    config.write_text(f'admin_token: "{token}"\nupstream_names: ["{name}"]\n', encoding="utf-8")
    port = free_port()
    log = tmp_path / "workers.log"
    args = ["--config", str(config), "--upstream", fake.url, "--port", str(port), "--workers", "2"]
    proc = start_serve(args, serve_env(), log)
    admin = [(b"authorization", f"Bearer {token}".encode())]  # (its UTF-8 bytes, as sent)
    workers: set[int] = set()
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as probe:
            await until_serving(probe, proc, log)
            assert name in (await probe.get("/healthz")).json()["replicas"]
        for _ in range(200):  # a new connection each: the kernel spreads them over both
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                stats = await client.get("/stats", headers=admin)
                assert stats.status_code == 200, stats.text
                workers.add(stats.json()["pid"])
                invalidated = await client.post(
                    "/admin/invalidate", json={"all": True}, headers=admin
                )
                assert invalidated.status_code == 200, invalidated.text
            if len(workers) == 2:
                break
        assert len(workers) == 2
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_held_key_whose_value_looks_like_a_variable_reaches_the_upstream_from_workers(
    fake, tmp_path
):
    """`upstream.api_key: ${MYKEY}` with MYKEY='${OTHER}': check-config and one process took the
    key `${OTHER}`, but the parent wrote it to the workers' file and they read it as a variable's
    name again: "environment variable OTHER ... is not set", exit 2, no worker started."""
    config = tmp_path / "w.yaml"
    config.write_text("upstream:\n  api_key: ${TEST_HELD_MYKEY}\n")
    env = {**serve_env(), "TEST_HELD_MYKEY": "${TEST_HELD_OTHER}"}
    env.pop("TEST_HELD_OTHER", None)
    port = free_port()
    log = tmp_path / "workers.log"
    args = ["--config", str(config), "--upstream", fake.url, "--port", str(port), "--workers", "2"]
    proc = start_serve(args, env, log)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await until_serving(client, proc, log)
            body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}]}
            answer = await client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert fake.calls[-1].headers["authorization"] == "Bearer ${TEST_HELD_OTHER}"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_bench_against_workers_reports_the_runs_upstream_calls_not_one_workers(
    fake, tmp_path
):
    """`carpool bench --url` read the /stats of whichever worker answered: its upstream calls
    only, while each key's call is made by the worker that owns it (119 counted, 238 made)."""
    import asyncio
    import json

    from click.testing import CliRunner

    from carpool.cli import main

    port = free_port()
    log = tmp_path / "workers.log"
    proc = start_serve(
        ["--upstream", fake.url, "--port", str(port), "--workers", "2"], serve_env(), log
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            await until_serving(client, proc, log)
        before = fake.count()
        out = tmp_path / "bench"
        args = ["bench", "--url", f"http://127.0.0.1:{port}", "--requests", "120"]
        args += ["--rate", "300", "--out", str(out), "--no-progress"]
        result = await asyncio.to_thread(CliRunner().invoke, main, args)
        assert result.exit_code == 0, result.output
        report = json.loads((out / "report.json").read_text())
        made = fake.count() - before
        assert made > 0 and report["upstream_calls"] == made, (report["upstream_calls"], made)
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_run_killed_with_its_workers_leaves_its_keys_until_the_next_run_starts(
    fake, tmp_path
):
    """Killed together (SIGKILL to the process group, an OOM kill of the cgroup), the parent
    and its workers removed nothing: a 0600 copy of the run's keys stayed in the temporary
    directory, one per such run, for good. The next run removes a dead run's directory."""
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    temporary = Path(tempfile.mkdtemp(prefix="cp-"))
    env = {**serve_env(), "TMPDIR": str(temporary)}
    args = ["--upstream", fake.url, "--port", str(free_port()), "--workers", "2"]
    proc = start_serve(args, env, tmp_path / "killed.log", own_group=True)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args[3]}") as probe:
            await until_serving(probe, proc, tmp_path / "killed.log")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        left = set(temporary.iterdir())
        assert left  # (what the killed run left: its config, its meeting place)
        args[3] = str(free_port())
        proc = start_serve(args, env, tmp_path / "next.log")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args[3]}") as probe:
            await until_serving(probe, proc, tmp_path / "next.log")
        assert left & set(temporary.iterdir()) == set()
        proc.terminate()
        assert proc.wait(15) == 0
        assert list(temporary.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(temporary, ignore_errors=True)


async def test_a_sigterm_as_the_run_starts_its_workers_leaves_nothing(fake, tmp_path):
    """A SIGTERM in the moments between the run's files being written and uvicorn's supervisor
    taking the signals over (a service manager stopping it as it starts) killed the parent at
    once: status -15, and the 0600 copy of the run's keys stayed. Now a stop, as later."""
    import shutil
    import tempfile
    from pathlib import Path

    from fakes.waiting import eventually

    temporary = Path(tempfile.mkdtemp(prefix="cp-"))
    env = {**serve_env(), "TMPDIR": str(temporary)}
    args = ["--upstream", fake.url, "--port", str(free_port()), "--workers", "2"]
    proc = start_serve(args, env, tmp_path / "workers.log")
    try:
        await eventually(
            lambda: any(temporary.iterdir()) or proc.poll() is not None,
            what="the run's files",
        )
        proc.terminate()
        assert proc.wait(15) == 0, (tmp_path / "workers.log").read_text()[-2000:]
        assert list(temporary.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(temporary, ignore_errors=True)


def _stalled_workers(stalled) -> tuple[list[int], list[int]]:
    """The workers ``stalled_health_checks.py`` started, and those of them pinged (their
    health-check thread stalled on the ping: the supervisor waits on their answer)."""
    started = [int(path.name) for path in stalled.iterdir() if path.suffix == ""]
    return started, [int(path.stem) for path in stalled.glob("*.pinged")]


def _ended_at_once(proc, log, stalled, temporary, workers: int) -> None:
    """After a stop: the run ended with status 0 before the health check's wait
    (``WORKER_HEALTHCHECK_S``) could have ended, the ``workers`` workers it started in all
    ended, and its directory gone."""
    import subprocess

    from carpool.cli import WORKER_HEALTHCHECK_S

    try:  # (a wait, not a timing: it ends when the run does)
        assert proc.wait(WORKER_HEALTHCHECK_S / 2) == 0, log.read_text()[-2000:]
    except subprocess.TimeoutExpired:
        pytest.fail("still running, as if it waited on a stalled worker's health check")
    started, _ = _stalled_workers(stalled)
    assert len(started) == workers, started
    assert not any(_running(pid) for pid in started)
    assert list(temporary.iterdir()) == []


async def _waiting_on_a_health_check(proc, stalled, log, workers: int) -> int:
    """Once ``workers`` workers have started and the supervisor waits on one's health check:
    that one."""
    from fakes.waiting import eventually

    def waiting() -> bool:
        started, pinged = _stalled_workers(stalled)
        return len(started) == workers and len(pinged) == 1

    await eventually(
        lambda: waiting() or proc.poll() is not None,
        what="the supervisor waiting on a worker's health check",
        state=lambda: _stalled_workers(stalled),
    )
    assert proc.poll() is None, log.read_text()[-2000:]
    return _stalled_workers(stalled)[1][0]


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
async def test_a_stop_while_the_supervisor_waits_on_a_health_check_ends_the_run_at_once(
    fake, tmp_path, stop
):
    """uvicorn's supervisor waited up to WORKER_HEALTHCHECK_S (30 s) for a worker's answer to
    its health check, and a signal did not end that wait: a Ctrl-C as the workers started
    (each killed in its imports, never answering) stopped the run 30 s later, after starting
    new workers. Now a Ctrl-C (SIGINT to the process group) or a SIGTERM to the parent stops
    it at once, as after start-up: status 0, every worker ended, the run's directory gone."""
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    temporary = Path(tempfile.mkdtemp(prefix="cp-"))
    stalled = tmp_path / "stalled"
    stalled.mkdir()
    env = {**serve_env(), "TMPDIR": str(temporary)}
    args = ["--upstream", fake.url, "--port", str(free_port()), "--workers", "2"]
    log = tmp_path / "workers.log"
    proc = start_serve(args, env, log, own_group=True, stalled=stalled)
    try:
        await _waiting_on_a_health_check(proc, stalled, log, workers=2)
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.terminate()
        # (None started in place of one the signal ended.)
        _ended_at_once(proc, log, stalled, temporary, workers=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temporary, ignore_errors=True)


@pytest.mark.parametrize("dies", ["the one checked", "another"])
async def test_a_worker_that_dies_while_a_health_check_is_awaited_is_replaced_at_once(
    fake, tmp_path, dies
):
    """A worker that died while the supervisor waited on its health check was seen dead only
    when the wait ended, WORKER_HEALTHCHECK_S (30 s) later: one worker fewer on the port
    meanwhile; and uvicorn checks the workers one after another, so one that died while
    another's check was awaited (a worker stalled, not answering) waited for that one's whole
    wait. Either exit now ends the wait: it is replaced at once."""
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    from carpool.cli import WORKER_HEALTHCHECK_S
    from fakes.waiting import eventually

    temporary = Path(tempfile.mkdtemp(prefix="cp-"))
    stalled = tmp_path / "stalled"
    stalled.mkdir()
    env = {**serve_env({"log_level": "info"}), "TMPDIR": str(temporary)}
    args = ["--upstream", fake.url, "--port", str(free_port()), "--workers", "2"]
    log = tmp_path / "workers.log"
    proc = start_serve(args, env, log, own_group=True, stalled=stalled)
    try:
        checked = await _waiting_on_a_health_check(proc, stalled, log, workers=2)
        (other,) = [pid for pid in _stalled_workers(stalled)[0] if pid != checked]
        victim = checked if dies == "the one checked" else other
        os.kill(victim, signal.SIGKILL)
        await eventually(
            lambda: f"Child process [{victim}] died" in log.read_text(),
            timeout=WORKER_HEALTHCHECK_S / 2,  # (well under the wait, which is what it took)
            what="the supervisor to see the worker died",
        )
        await eventually(
            lambda: len(_stalled_workers(stalled)[0]) == 3, what="the worker in its place"
        )
        if victim == other:
            assert _running(checked)  # (no verdict on the stalled one meanwhile)
        proc.terminate()
        assert proc.wait(WORKER_HEALTHCHECK_S * 2) == 0, log.read_text()[-2000:]
        assert list(temporary.iterdir()) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temporary, ignore_errors=True)


async def test_a_stop_during_a_sighups_restart_ends_the_run_at_once(fake, tmp_path):
    """A SIGHUP restarts the workers one by one, each new one awaited until it is ready (up to
    WORKER_HEALTHCHECK_S, 30 s). A SIGTERM meanwhile waited for that restart: uvicorn's
    restart looks at its exit flag, which the signal sets only once handled, after the restart.
    Now the stop ends the restart at once: status 0, every worker ended (the one awaited too),
    the run's directory gone."""
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    from fakes.waiting import eventually

    temporary = Path(tempfile.mkdtemp(prefix="cp-"))
    stalled = tmp_path / "stalled"
    stalled.mkdir()
    env = {**serve_env({"log_level": "info"}), "TMPDIR": str(temporary), "STALL_WHEN_ASKED": "1"}
    args = ["--upstream", fake.url, "--port", str(free_port()), "--workers", "2"]
    log = tmp_path / "workers.log"
    proc = start_serve(args, env, log, own_group=True, stalled=stalled)
    try:
        await eventually(
            lambda: (
                log.read_text().count("Application startup complete") == 2
                or proc.poll() is not None
            ),
            what="both workers serving",
        )
        assert proc.poll() is None, log.read_text()[-2000:]
        (
            stalled / "stall.asked"
        ).touch()  # (the workers the restart starts never say they are ready)
        os.kill(proc.pid, signal.SIGHUP)
        await eventually(
            lambda: len(_stalled_workers(stalled)[1]) == 1 or proc.poll() is not None,
            what="the restart awaiting its first new worker",
            state=lambda: _stalled_workers(stalled),
        )
        assert proc.poll() is None, log.read_text()[-2000:]
        proc.terminate()
        # (The restart's wait for its new worker is what it took; it started no other.)
        _ended_at_once(proc, log, stalled, temporary, workers=3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temporary, ignore_errors=True)


class _Worker:
    """A process and its health-check pipe, as the supervisor reads uvicorn's ``Process``."""

    def __init__(self, target: Any, *args: Any) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.process = context.Process(target=target, args=args, daemon=True)
        self.process.start()
        self.parent_conn, self.child_conn = context.Pipe()


def test_a_hung_worker_is_given_up_on_in_its_timeout_while_other_workers_keep_dying():
    """Another worker's exit ends a health check's wait (no verdict on the one checked): its
    next round sent a new ping with a new deadline, so a hung worker was never given up on
    while others kept dying (a crash loop), its peers' requests for its keys held meanwhile.
    Its ping is waited for to its first deadline now."""
    import time

    from carpool.supervisor import Supervisor

    hung = _Worker(time.sleep, 60)  # (never answers its ping)
    supervisor = Supervisor.__new__(Supervisor)
    supervisor.signal_queue, supervisor._pinged = [], {}
    try:
        began = time.monotonic()
        verdicts = []
        while time.monotonic() - began < 10 and not (verdicts and verdicts[-1] is False):
            dying = _Worker(time.sleep, 0)  # (another worker dying meanwhile, each round)
            dying.process.join()
            supervisor.processes = [hung, dying]
            verdicts.append(supervisor._answers(hung, timeout=1.0))
        # (Given up on, uvicorn kills it; were its deadline moved each round, the wait of 10 s
        # would end without it.)
        assert verdicts[-1] is False, verdicts
    finally:
        hung.process.kill()


def test_a_worker_that_answered_a_ping_left_from_a_round_cut_short_is_kept():
    """A round cut short (another worker exited) leaves a worker's ping waiting; it answered
    in time, but the next round came after the deadline and gave up on it unread: a healthy
    worker killed with every request in flight on it."""
    import time

    from carpool.supervisor import Supervisor

    healthy, dead = _Worker(time.sleep, 60), _Worker(time.sleep, 0)
    dead.process.join()
    supervisor = Supervisor.__new__(Supervisor)
    supervisor.signal_queue, supervisor._pinged = [], {}
    try:
        supervisor.processes = [healthy, dead]
        assert supervisor._answers(healthy, timeout=1.0) is True  # (no verdict: one exited)
        assert healthy.child_conn.recv() == b"ping"
        healthy.child_conn.send(b"pong")  # (in time)
        time.sleep(1.2)  # (the next round comes after the ping's deadline: the subject)
        supervisor.processes = [healthy]
        assert supervisor._answers(healthy, timeout=1.0) is True
    finally:
        healthy.process.kill()


async def test_a_worker_whose_event_loop_is_stuck_is_replaced_after_its_health_check(
    fake, tmp_path
):
    """uvicorn's health check is answered by a thread of the worker's: a worker whose event loop
    was stuck (a long computation, a blocking call), its process alive, answered on and was
    never replaced, and its peers' requests for the keys it owns waited for it up to the join
    and upstream timeouts (630 s). The answer waits for the loop now: unanswered, the worker
    is killed and replaced after the check's timeout."""
    import os
    import signal

    from carpool.cli import WORKER_HEALTHCHECK_S
    from fakes.waiting import eventually

    async with _stuck_loops_run(fake, tmp_path) as (proc, log, stuck):
        victim = min(int(path.name) for path in stuck.iterdir())
        os.kill(victim, signal.SIGUSR2)
        await eventually(
            lambda: f"Child process [{victim}] died" in log.read_text(),
            timeout=WORKER_HEALTHCHECK_S * 2,  # (a check's round, then its timeout)
            what="the supervisor to give the stuck worker up",
        )
        await eventually(lambda: len(list(stuck.iterdir())) == 3, what="the worker in its place")
        proc.terminate()
        assert proc.wait(WORKER_HEALTHCHECK_S * 2) == 0, log.read_text()[-2000:]


@contextlib.asynccontextmanager
async def _stuck_loops_run(fake, tmp_path, **settings: Any):
    """``carpool serve --workers 2`` whose workers' event loops get stuck on SIGUSR2
    (``stuck_loops.py``), once both serve: the process, its log and the directory where each
    worker wrote its pid; killed if still running at the end."""
    import os
    import shutil
    import signal
    import tempfile
    from pathlib import Path

    from fakes.waiting import eventually

    temporary = Path(tempfile.mkdtemp(prefix="cp-"))
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    env = {**serve_env({"log_level": "info", **settings}), "TMPDIR": str(temporary)}
    args = ["--upstream", fake.url, "--port", str(free_port()), "--workers", "2"]
    log = tmp_path / "workers.log"
    proc = start_serve(args, env, log, own_group=True, stuck=stuck)
    try:
        await eventually(lambda: len(list(stuck.iterdir())) == 2, what="both workers started")
        await eventually(lambda: log.read_text().count("Application startup complete") == 2)
        yield proc, log, stuck
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temporary, ignore_errors=True)


async def test_a_starting_worker_answers_its_health_check_while_its_app_is_built():
    """The health check waits for the event loop once the worker serves; starting, uvicorn
    builds the app on that loop, which does not turn meanwhile: a worker whose build (a large
    model) took past the check's timeout was killed, and its replacement, for ever."""
    import asyncio
    import multiprocessing
    import threading
    from types import SimpleNamespace

    from uvicorn.supervisors import multiprocess

    from carpool.server import _health_checks_answered_by_the_loop

    uvicorns = multiprocess.Process.pong
    _health_checks_answered_by_the_loop()
    try:
        for started in (False, True):
            parent, child = multiprocessing.Pipe()
            worker = SimpleNamespace(child_conn=child, server=SimpleNamespace(started=started))
            answering = threading.Thread(target=multiprocess.Process.pong, args=(worker,))
            answering.start()
            parent.send(b"ping")
            # (The loop held by this very wait: starting, answered at once; serving, not.)
            answered_while_stuck = parent.poll(1.0)
            assert answered_while_stuck == (not started)
            await asyncio.sleep(0.01)  # (the loop turns: the serving one's answer comes)
            assert parent.poll(5.0) and parent.recv() is started
            answering.join(5)
    finally:
        multiprocess.Process.pong = uvicorns


async def test_a_stop_kills_a_worker_whose_event_loop_is_stuck_after_its_grace_period(
    fake, tmp_path
):
    """uvicorn's supervisor waits for each worker to end, without limit: a worker whose event
    loop was stuck never ended its graceful shutdown, and the run hung for ever."""
    import os
    import signal

    from carpool.supervisor import STOP_MARGIN_S

    grace = 1
    async with _stuck_loops_run(fake, tmp_path, shutdown={"grace_s": grace}) as (proc, log, stuck):
        os.kill(min(int(path.name) for path in stuck.iterdir()), signal.SIGUSR2)
        proc.terminate()
        assert proc.wait(grace + STOP_MARGIN_S + 15) == 0, log.read_text()[-2000:]
        assert "did not stop in its grace period: killed" in log.read_text()


async def test_a_sighups_restart_kills_an_old_worker_stuck_in_its_grace_period(fake, tmp_path):
    """A SIGHUP's restart (uvicorn's) stops each old worker once its replacement is ready and
    waited for it to end without limit: an old worker whose event loop was stuck never ended
    its graceful shutdown, and the supervisor hung in the restart for ever (no health checks,
    no worker replaced, a stop read by nothing). It gets the grace period and STOP_MARGIN_S,
    then is killed, and the restart goes on."""
    import os
    import signal

    from carpool.cli import WORKER_HEALTHCHECK_S
    from carpool.supervisor import STOP_MARGIN_S
    from fakes.waiting import eventually

    grace = 1
    async with _stuck_loops_run(fake, tmp_path, shutdown={"grace_s": grace}) as (proc, log, stuck):
        old = sorted(int(path.name) for path in stuck.iterdir())
        os.kill(proc.pid, signal.SIGHUP)
        # (The restart's first new worker started: no health check runs until it ends.)
        await eventually(lambda: len(list(stuck.iterdir())) == 3, what="the first new worker")
        os.kill(old[0], signal.SIGUSR2)
        await eventually(
            lambda: (
                log.read_text().count("Application startup complete") == 4
                and not any(_running(pid) for pid in old)
            ),
            timeout=grace + STOP_MARGIN_S + WORKER_HEALTHCHECK_S,
            what="both old workers replaced, the stuck one killed",
        )
        assert f"worker [{old[0]}] did not stop in its grace period: killed" in log.read_text()
        proc.terminate()
        assert proc.wait(WORKER_HEALTHCHECK_S) == 0, log.read_text()[-2000:]


@pytest.mark.parametrize("change", ["rewritten", "removed"])
async def test_a_worker_started_during_the_run_admits_the_client_keys_the_run_started_with(
    fake, tmp_path, change
):
    """``auth.client_keys_file`` is read at start-up, for the run: a worker started in place
    of one that died read the file as it was then, so a key removed from it since was
    refused by that worker only (200 or 401 by the worker a connection landed on), and a
    file gone meanwhile (a secret being rotated) failed each replacement, restarted for ever.
    Every worker reads the run's own copy now."""
    import os
    import re
    import signal

    from fakes.waiting import eventually

    keys = tmp_path / "keys.txt"
    keys.write_text("key-one\nkey-two\n")
    port = free_port()
    env = serve_env({"log_level": "info", "auth": {"client_keys_file": str(keys)}})
    args = ["--upstream", fake.url, "--port", str(port), "--workers", "2"]
    log = tmp_path / "workers.log"
    proc = start_serve(args, env, log, own_group=True)

    def started() -> list[int]:
        return [int(p) for p in re.findall(r"Started server process \[(\d+)\]", log.read_text())]

    try:
        await eventually(lambda: log.read_text().count("Application startup complete") == 2)
        if change == "rewritten":
            keys.write_text("key-two\n")
        else:
            keys.unlink()
        os.kill(started()[0], signal.SIGKILL)
        await eventually(
            lambda: log.read_text().count("Application startup complete") == 3,
            what="a worker in the killed one's place",
        )
        replacement = started()[-1]
        seen: dict[int, set[int]] = {}
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):  # (a new connection each: the kernel spreads them)
            async with httpx.AsyncClient(base_url=base, timeout=10) as client:
                asked = await client.get("/v1/models", headers={"Authorization": "Bearer key-one"})
                pid = (await client.get("/stats")).json()["pid"]
                seen.setdefault(pid, set()).add(asked.status_code)
            if replacement in seen and len(seen) == 2:
                break
        assert seen == {pid: {200} for pid in seen} and replacement in seen, seen
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_while_the_workers_load_stops_the_run_without_a_traceback():
    """A Ctrl-C reaches every process of the group, and a worker still importing its modules
    (seconds on a slow machine) printed a KeyboardInterrupt traceback each (or "Fatal Python
    error" in its site import). The supervisor starts each with SIGINT ignored, so the
    supervisor alone reads it and stops them (status 0). The interrupt is sent once a
    worker's `-X importtime` says it imported carpool.peers, the parent having done so once."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "carpool", "serve", "--workers", "2"]
        + ["--port", str(free_port())],
        env=serve_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, rest = interrupt_when_imported(proc, "carpool.peers", nth=2, group=True)
        assert proc.wait(60) == 0, rest[-3000:]
        assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest[-3000:]
        assert "Fatal Python error" not in rest, rest[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_ctrl_c_as_the_supervisor_starts_its_first_worker_stops_the_run(tmp_path):
    """The supervisor ignores SIGINT while it starts a worker (which inherits that), blocked so
    that one sent meanwhile waits; but multiprocessing's resource tracker, started with the
    first worker, unblocked it, and a Ctrl-C then was lost: the run served on. Here the
    supervisor sends itself SIGINT as it spawns its first worker (a sitecustomize wraps
    multiprocessing's spawn)."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import os, signal\n"
        "from multiprocessing import util\n"
        "spawn = util.spawnv_passfds\n"
        "def interrupted(path, args, passfds):\n"
        "    if any('spawn_main' in str(a) for a in args) and not os.environ.get('SENT'):\n"
        "        os.environ['SENT'] = '1'  # (once; its workers inherit it)\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return spawn(path, args, passfds)\n"
        "util.spawnv_passfds = interrupted\n"
    )
    env = serve_env({"log_level": "info"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "carpool", "serve", "--workers", "2", "--port", str(free_port())],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Received SIGINT, exiting" in done.stderr, done.stderr[-3000:]


async def test_ctrl_c_twice_lets_the_workers_requests_finish_as_one_process_does(fake, tmp_path):
    """A Ctrl-C reaches every process of the group: each worker had the terminal's SIGINT and
    its supervisor's SIGTERM, and a second Ctrl-C was uvicorn's force quit in every worker: the
    requests in progress cut without an answer, the lifespan skipped (a Redis idempotency record
    left processing until its lease ran out). A worker leaves SIGINT to its supervisor, which
    stops it with a SIGTERM: Ctrl-C twice lets the requests finish (status 0, the layers
    closed)."""
    import asyncio
    import os
    import signal

    from fakes.waiting import eventually

    async with _two_workers_serving(fake, tmp_path, grace_s=60) as (proc, log, base):
        fake.gate = asyncio.Event()  # each upstream call waits for it
        clients = [httpx.AsyncClient(base_url=base, timeout=60) for _ in range(4)]
        requests = [
            asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "temperature": 0,
                        "messages": [{"role": "user", "content": f"{QUESTION} {i}"}],
                    },
                )
            )
            for i, client in enumerate(clients)
        ]
        await eventually(lambda: len(fake.calls) == 4, what="the four calls in progress")
        for presses in (1, 2):
            os.killpg(proc.pid, signal.SIGINT)
            await eventually(
                lambda presses=presses: (
                    log.read_text().count("SIGINT left to the supervisor") >= 2 * presses
                    or proc.poll() is not None
                ),
                what=f"Ctrl-C {presses} read by both workers",
            )
        assert proc.poll() is None, log.read_text()[-3000:]
        fake.gate.set()
        answers = await asyncio.gather(*requests)
        assert [answer.status_code for answer in answers] == [200] * 4, [
            answer.text for answer in answers
        ]
        assert await asyncio.to_thread(proc.wait, 30) == 0
        text = log.read_text()
        assert text.count("Application shutdown complete") == 2, text[-3000:]
        assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
        for client in clients:
            await client.aclose()


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
@pytest.mark.parametrize("retire", ["SIGHUP", "SIGTTOU"])
async def test_a_stop_while_a_restart_waits_for_a_retired_worker_is_handled_at_once(
    fake, tmp_path, stop, retire
):
    """A SIGHUP's restart stops each old worker once its replacement serves, and a SIGTTOU
    one worker, and each waited for it to end (its requests' grace period; SIGTTOU without
    limit): a stop meanwhile was handled only after that, the other workers serving on for up
    to `shutdown.grace_s`. Now the stop ends the wait: the run stops at once, the retired
    worker still let finish its request (status 0)."""
    import asyncio
    import os
    import signal

    from fakes.waiting import eventually

    async with _two_workers_serving(fake, tmp_path, grace_s=120) as (proc, log, base):
        fake.gate = asyncio.Event()  # each upstream call waits for it
        client = httpx.AsyncClient(base_url=base, timeout=120)
        requests: list[asyncio.Task[httpx.Response]] = []

        async def leading() -> set[int]:
            """The workers leading a flight (each key is led by one of them)."""
            pids = set()
            for _ in range(40):  # a new connection each: the kernel spreads them over both
                async with httpx.AsyncClient(base_url=base, timeout=10) as probe:
                    stats = (await probe.get("/stats")).json()
                if stats["flights"]:
                    pids.add(stats["pid"])
            return pids

        # Calls in progress led by both workers, so that whichever the restart retires first
        # holds one.
        while len(await leading()) < 2:
            body = {
                "model": "m",
                "temperature": 0,
                "messages": [{"role": "user", "content": f"{QUESTION} {len(requests)}"}],
            }
            requests.append(asyncio.create_task(client.post("/v1/chat/completions", json=body)))
            await eventually(lambda: len(fake.calls) == len(requests), what="the call made")
        os.kill(proc.pid, getattr(signal, retire))
        await eventually(
            lambda: "Terminated child process" in log.read_text() or proc.poll() is not None,
            what="an old worker retired, waited for as it finishes its call",
            state=lambda: log.read_text()[-3000:],
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.terminate()
        name = "SIGINT" if stop == "ctrl-c" else "SIGTERM"
        await eventually(
            lambda: f"Received {name}, exiting" in log.read_text() or proc.poll() is not None,
            what="the stop handled while the retired worker finishes",
        )
        assert not any(request.done() for request in requests)
        fake.gate.set()
        answers = await asyncio.gather(*requests)
        assert {answer.status_code for answer in answers} == {200}, [a.text for a in answers]
        assert await asyncio.to_thread(proc.wait, 60) == 0, log.read_text()[-3000:]
        await client.aclose()


@contextlib.asynccontextmanager
async def _two_workers_serving(fake, tmp_path, grace_s: float):
    """``carpool serve --workers 2`` in a process group of its own (a Ctrl-C reaches all of
    it), both workers serving (each handles SIGINT its way: one still starting dies of it):
    the process, its log and its URL; killed if still running at the end."""
    import os
    import signal

    from fakes.waiting import eventually

    port = free_port()
    log = tmp_path / "workers.log"
    settings = {"log_level": "info", "shutdown": {"drain_s": 0, "grace_s": grace_s}}
    proc = start_serve(
        ["--upstream", fake.url, "--port", str(port), "--workers", "2"],
        serve_env(settings),
        log,
        own_group=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=10) as probe:
            await until_serving(probe, proc, log)
        await eventually(
            lambda: (
                log.read_text().count("Application startup complete") == 2
                or proc.poll() is not None
            ),
            what="both workers serving",
        )
        yield proc, log, base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
