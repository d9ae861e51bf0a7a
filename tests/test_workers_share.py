"""`carpool serve --workers 2` without Redis: the workers share through each other
(``carpool.peers``). A real process in front of the counting fake upstream; a new connection
per request, so that the kernel spreads them over both workers (``/stats`` says which one
answered: ``pid``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fakes.instances import free_port, serve_env, start_serve
from test_distributed import until_serving

ADMIN_TOKEN = "admin-secret"
QUESTIONS = [f"What do the workers share, part {i}?" for i in range(4)]
# Enough tries for a new connection to land on each of two workers (each lands on one at random
# or in turn: missing one worker 60 times running does not happen).
TRIES = 60


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        **extra,
    }


@dataclass
class Workers:
    """The ``carpool serve --workers 2`` process and what the tests saw of it."""

    base: str
    proc: subprocess.Popen[bytes]
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)  # pid -> its last /stats
    n: int = 2  # the workers serving

    async def once(
        self, send: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]
    ) -> tuple[httpx.Response, int]:
        """``send`` on a new connection, then ``/stats`` on it: the response and its worker."""
        async with httpx.AsyncClient(base_url=self.base, timeout=20) as client:
            response = await send(client)
            await response.aread()
            snapshot = (await client.get("/stats", headers=ADMIN)).json()
        self.stats[snapshot["pid"]] = snapshot
        return response, snapshot["pid"]

    async def until_both_serve(self) -> None:
        """Until both workers have answered (each then listens for its peers too)."""
        for _ in range(TRIES):
            await self.once(lambda client: client.get("/healthz"))
            if len(self.stats) == 2:
                return
        raise AssertionError("every request landed on one worker")

    async def until_serving(self, n: int, slots: list[int | None], gone: set[int]) -> None:
        """Until ``n`` workers, none of the pids ``gone``, have answered, their slots ``slots``
        (``None``: a worker without one); ``stats`` then holds only theirs (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while loop.time() < deadline:
            with contextlib.suppress(httpx.TransportError):  # (a worker stopping)
                await self.once(lambda client: client.get("/healthz"))
            live = {pid: s for pid, s in self.stats.items() if pid not in gone}
            held = sorted((s.get("peers", {}).get("worker") for s in live.values()), key=str)
            if len(live) == n and held == sorted(slots, key=str):
                self.stats, self.n = live, n
                return
        seen = {pid: s.get("peers", {}).get("worker") for pid, s in self.stats.items()}
        raise AssertionError(f"never {n} workers holding {slots} (pid: slot): {seen}")

    async def spread(
        self, send: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]], at_least: int = 6
    ) -> list[tuple[httpx.Response, int]]:
        """``send`` on new connections until both workers answered it, ``at_least`` times."""
        answered: list[tuple[httpx.Response, int]] = []
        for _ in range(TRIES * self.n):
            answered.append(await self.once(send))
            if len({pid for _, pid in answered}) == self.n and len(answered) >= at_least:
                return answered
        raise AssertionError("every request landed on one worker")


ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@contextlib.asynccontextmanager
async def workers(
    upstream_url: str,
    tmp_path,
    settings: dict[str, Any] | None = None,
    temporary: Path | None = None,
) -> AsyncIterator[Workers]:
    """``carpool serve --workers 2`` with ``--upstream upstream_url``; ``settings``: more
    ``CARPOOL_*`` variables; ``temporary``: its ``TMPDIR``."""
    port = free_port()
    env = serve_env({"admin_token": ADMIN_TOKEN, **(settings or {})})
    if temporary is not None:
        env["TMPDIR"] = str(temporary)
    log = tmp_path / "workers.log"
    proc = start_serve(
        [
            "--upstream",
            upstream_url,
            "--port",
            str(port),
            "--workers",
            "2",
        ],
        env,
        log,
    )
    try:
        served = Workers(f"http://127.0.0.1:{port}", proc)
        async with httpx.AsyncClient(base_url=served.base, timeout=10) as probe:
            await until_serving(probe, proc, log)
        await served.until_both_serve()
        yield served
    finally:
        proc.terminate()
        proc.wait(15)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def content(response: httpx.Response) -> str:
    return response.json()["choices"][0]["message"]["content"]


async def test_identical_requests_on_both_workers_make_one_upstream_call_per_key(fake, tmp_path):
    async with workers(fake.url, tmp_path) as served:
        for n, question in enumerate(QUESTIONS, 1):
            answered = await served.spread(
                lambda client, q=question: client.post("/v1/chat/completions", json=chat(q))
            )
            assert all(r.status_code == 200 for r, _ in answered)
            outcomes = [r.headers["x-carpool"] for r, _ in answered]
            # The first is the call (made by its owner, whichever worker it landed on); every
            # other is a hit where it landed: the answer was kept on both workers.
            assert outcomes[0] == "miss" and set(outcomes[1:]) == {"hit"}, outcomes
            assert {content(r) for r, _ in answered} == {f"answer {n} to {question}"}
            assert fake.count() == n
        # The workers' upstream calls add up to the engine's: a peer's ask is not one.
        await served.until_both_serve()
        assert sum(s["upstream_calls"] for s in served.stats.values()) == len(QUESTIONS)
        assert sum(s["peer_calls"] for s in served.stats.values()) >= 1
        assert sorted(s["peers"]["worker"] for s in served.stats.values()) == [0, 1]


async def test_streams_on_both_workers_make_one_upstream_call_per_key(fake, tmp_path):
    async with workers(fake.url, tmp_path) as served:
        for n, question in enumerate(QUESTIONS[:2], 1):
            body = chat(question, stream=True)
            answered = await served.spread(
                lambda client, b=body: client.post("/v1/chat/completions", json=b)
            )
            texts = set()
            for response, _ in answered:
                assert response.status_code == 200
                assert response.text.endswith("data: [DONE]\n\n"), response.text
                texts.add(_streamed_text(response.text))
            assert texts == {f"answer {n} to {question}"}
            assert fake.count() == n


async def test_a_burst_on_both_workers_makes_one_upstream_call_per_key(fake, tmp_path):
    async with workers(fake.url, tmp_path) as served:
        fake.gate = asyncio.Event()
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=served.base, timeout=60, limits=limits) as client:
            # 200 connections at once: the kernel spreads them over both workers.
            burst = [
                asyncio.create_task(
                    client.post(
                        "/v1/chat/completions",
                        json=chat(QUESTIONS[i % len(QUESTIONS)], stream=i % 2 == 0),
                    )
                )
                for i in range(200)
            ]
            await fake.wait_for_calls(len(QUESTIONS), timeout=30)
            await _until_waiting(served, 200)
            fake.gate.set()
            responses = await asyncio.gather(*burst)
        assert fake.count() == len(QUESTIONS)
        assert all(r.status_code == 200 for r in responses)
        outcomes = collections.Counter(r.headers["x-carpool"] for r in responses)
        # One call per key, and one client of each key saw it as its own.
        assert outcomes["miss"] == len(QUESTIONS), outcomes
        assert set(outcomes) <= {"miss", "coalesced", "hit"}, outcomes
        for i, response in enumerate(responses):
            question = QUESTIONS[i % len(QUESTIONS)]
            text = _streamed_text(response.text) if i % 2 == 0 else content(response)
            assert text.endswith(f"to {question}")


async def test_an_invalidation_on_one_worker_reaches_the_other(fake, tmp_path):
    async with workers(fake.url, tmp_path) as served:
        send = lambda client: client.post(  # noqa: E731
            "/v1/chat/completions", json=chat(QUESTIONS[0])
        )
        answered = await served.spread(send)
        assert {r.headers["x-carpool"] for r, _ in answered[1:]} == {"hit"}
        response, _ = await served.once(
            lambda client: client.post("/admin/invalidate", json={"all": True}, headers=ADMIN)
        )
        assert response.status_code == 200
        assert response.json()["invalidated"] == 2  # one copy on each worker
        answered = await served.spread(send)
        # No worker serves what was invalidated: one new call, its answer everywhere.
        assert {content(r) for r, _ in answered} == {f"answer 2 to {QUESTIONS[0]}"}
        assert fake.count() == 2


async def test_an_idempotency_key_retry_on_the_other_worker_replays(fake, tmp_path):
    async with workers(fake.url, tmp_path) as served:
        headers = {"Idempotency-Key": "order-42"}
        send = lambda client: client.post(  # noqa: E731
            "/v1/chat/completions", json=chat(QUESTIONS[0]), headers=headers
        )
        first, first_pid = await served.once(send)
        assert first.status_code == 200 and "idempotent-replayed" not in first.headers
        retries = await served.spread(send)
        assert {pid for _, pid in retries} | {first_pid} == set(served.stats)
        for retry, _ in retries:
            assert retry.status_code == 200
            assert retry.headers["idempotent-replayed"] == "true"
            assert retry.json() == first.json()
        assert fake.count() == 1
        # The same key with another request is refused wherever it lands.
        other = lambda client: client.post(  # noqa: E731
            "/v1/chat/completions", json=chat(QUESTIONS[1]), headers=headers
        )
        assert {r.status_code for r, _ in await served.spread(other, at_least=2)} == {422}


async def test_keyed_requests_make_no_second_call_for_an_answer_another_worker_holds(
    fake, tmp_path
):
    # A keyed request runs on the worker owning its record, which took it for a flight's call
    # another worker had asked of it: led there, alone (no ask of the key's owner) and without
    # a semantic lookup. Where the answer was only on the other worker (the first request
    # landed on the key's owner), a new Idempotency-Key made a second upstream call for it.
    questions = [f"Which worker holds answer {i}?" for i in range(8)]
    async with workers(fake.url, tmp_path) as served:
        for n, question in enumerate(questions, 1):
            first, _ = await served.once(
                lambda client, q=question: client.post("/v1/chat/completions", json=chat(q))
            )
            assert first.headers["x-carpool"] == "miss"
            for k in range(10):  # (each key's record owned by either worker, at random)
                keyed, _ = await served.once(
                    lambda client, q=question, k=k: client.post(
                        "/v1/chat/completions",
                        json=chat(q),
                        headers={"Idempotency-Key": f"{q}-{k}"},
                    )
                )
                assert keyed.status_code == 200 and keyed.headers["x-carpool"] == "hit"
                assert keyed.json() == first.json()
            assert fake.count() == n


async def test_keyed_requests_past_the_peer_connections_never_wait_on_each_other(fake, tmp_path):
    # A keyed request passed on whole to its record's owner held a connection of the pool to
    # that worker while its flight asked the key's owner, the first worker, through the same
    # kind of pool: with both pools full of such requests each waited for the other's until
    # the owner's read timeout, then failed with a 503 ("took the request and did not
    # answer"). A flight's ask has connections of its own.
    settings = {
        "limits": {"upstream_max_connections": 2, "upstream_timeout": 2},
        "coalesce": {"join_timeout_ms": 1000},
    }
    async with workers(fake.url, tmp_path, settings) as served:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=served.base, timeout=60, limits=limits) as client:
            replies = await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json=chat(f"A question of its own, number {i}?"),
                        headers={"Idempotency-Key": f"key-{i}"},
                    )
                    for i in range(60)
                )
            )
        assert collections.Counter(r.status_code for r in replies) == {200: 60}
        assert fake.count() == 60


async def test_a_clients_peer_header_is_not_trusted(fake, tmp_path):
    async with workers(fake.url, tmp_path) as served:
        forged = {"x-carpool-peer": "guessed"}
        answered = await served.spread(
            lambda client: client.post(
                "/v1/chat/completions", json=chat(QUESTIONS[0]), headers=forged
            )
        )
        # Trusted, it would make the worker that does not own the key call the upstream itself.
        assert fake.count() == 1
        assert [r.headers["x-carpool"] for r, _ in answered][1:] == ["hit"] * (len(answered) - 1)
        assert "x-carpool-peer" not in fake.calls[0].headers
        assert sum(s["peers"]["served"] for s in served.stats.values()) <= 1


async def test_a_worker_killed_fails_no_request_and_its_successor_takes_its_slot(fake, tmp_path):
    async with workers(fake.url, tmp_path) as served:
        before = dict(served.stats)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        # Every request is answered, whatever became of the worker that owns its key, until
        # uvicorn's new worker answers too.
        for i in range(10 * TRIES):
            response, pid = await served.once(
                lambda client, i=i: client.post(
                    "/v1/chat/completions", json=chat(f"While a worker is down, {i}")
                )
            )
            assert response.status_code == 200
            if pid not in before:
                break
        else:
            raise AssertionError("the killed worker was not replaced")
        # It took the dead worker's slot: the keys it owns are led there again.
        assert served.stats[pid]["peers"]["worker"] == before[victim]["peers"]["worker"]


async def test_keyed_requests_while_their_owner_is_replaced_run_once_and_replay_after(
    fake, tmp_path
):
    """A key's record lives with the worker owning it. Sent while that worker was dead, its
    replacement starting, a keyed request ran where it landed and was recorded there; its
    retries, sent to the replacement once up, found no record there and ran it again. The
    owner out of reach is waited for (``peers.workers.OWNER_RETURN_S``)."""
    async with workers(fake.url, tmp_path) as served:
        before = dict(served.stats)
        victim = min(before)
        keys = [f"order-{n}" for n in range(12)]  # (about half of them the victim's)

        def keyed(key: str) -> Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]:
            return lambda client: client.post(
                "/v1/chat/completions",
                json=chat(f"charge {key}"),
                headers={"Idempotency-Key": key},
            )

        os.kill(victim, signal.SIGKILL)
        first = await asyncio.gather(*(served.once(keyed(key)) for key in keys))
        assert {response.status_code for response, _ in first} == {200}
        await served.until_serving(2, [0, 1], {victim})
        retries = [await served.once(keyed(key)) for key in keys for _ in range(2)]
        assert {response.status_code for response, _ in retries} == {200}
        assert all(response.headers["idempotent-replayed"] == "true" for response, _ in retries)
        assert fake.count() == len(keys)


@pytest.fixture
def temporary() -> Iterator[Path]:
    """A ``TMPDIR`` of the test's own (other runs write theirs meanwhile, pytest -n), short
    enough for the workers' Unix sockets to be made in it."""
    made = Path(tempfile.mkdtemp(prefix="cp-"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def clean_as_tmpfiles_does(top: Path) -> None:
    """What an age-based cleaner of the temporary directory removes of a run old enough
    (systemd-tmpfiles' ``q /tmp 1777 root root 10d``, every file here past its age): every
    file but the sockets in use, but for a directory it cannot lock, which it skips whole."""
    for entry in top.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            if not entry.is_socket():
                entry.unlink()
            continue
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            clean_as_tmpfiles_does(entry)
        except BlockingIOError:
            pass  # (in use: skipped)
        finally:
            os.close(fd)


async def test_a_worker_killed_after_a_tmp_cleaner_ran_is_replaced_and_the_run_stops_cleanly(
    fake, tmp_path, temporary
):
    """An age-based cleaner of the temporary directory deleted a long run's resolved config,
    secret and slot locks, which every worker reads as it starts: a worker that died then was
    never replaced (ConfigError, retried for ever), and at SIGTERM the parent's cleanup raised
    FileNotFoundError (status 1). The run's files are in one directory the run locks."""
    async with workers(fake.url, tmp_path, temporary=temporary) as served:
        clean_as_tmpfiles_does(temporary)
        victim = min(served.stats)
        os.kill(victim, signal.SIGKILL)
        # A new worker serves, in the dead one's slot (it read the config, the secret, its lock),
        await served.until_serving(2, [0, 1], gone={victim})
        answered = await served.spread(
            lambda client: client.post("/v1/chat/completions", json=chat(QUESTIONS[0]))
        )
        assert {response.status_code for response, _ in answered} == {200}
        assert fake.count() == 1  # and shares with the other: one upstream call for the key
        served.proc.terminate()
        assert served.proc.wait(15) == 0
    assert list(temporary.iterdir()) == []


async def test_a_run_whose_files_a_cleaner_took_despite_its_lock_stops_with_status_0(
    fake, tmp_path, temporary
):
    """A cleaner that ignores locks (tmpwatch, a hand's ``rm``) took the run's files: its stop
    at SIGTERM still ends in status 0 (the parent's cleanup raised FileNotFoundError: 1)."""
    async with workers(fake.url, tmp_path, temporary=temporary) as served:
        for left in temporary.iterdir():
            if left.is_dir():
                shutil.rmtree(left)
            else:
                left.unlink()
        served.proc.terminate()
        assert served.proc.wait(15) == 0
    assert list(temporary.iterdir()) == []


async def test_after_a_sighup_reload_the_new_workers_take_the_slots_and_share(fake, tmp_path):
    """uvicorn's SIGHUP starts each new worker while the old one still holds its slot, and stops
    the old one once the new one serves: the new one takes the slot as it frees. (It found none
    and shared nothing, for good: an Idempotency-Key ran once per worker, identical requests
    made one call per worker, an invalidation did not reach it.)"""
    async with workers(fake.url, tmp_path) as served:
        os.kill(served.proc.pid, signal.SIGHUP)
        await served.until_serving(2, [0, 1], gone=set(served.stats))
        await _share_one_call_per_key(served, fake)


async def test_a_worker_sigttin_adds_asks_the_owners_and_takes_invalidations(fake, tmp_path):
    """A worker beyond N (SIGTTIN) finds every slot held: it owns nothing and asks the owners,
    keyed requests included, and the invalidations passed on reach it. (It shared nothing: an
    Idempotency-Key ran once per worker.)"""
    async with workers(fake.url, tmp_path) as served:
        os.kill(served.proc.pid, signal.SIGTTIN)
        await served.until_serving(3, [0, 1, None], gone=set())
        await _share_one_call_per_key(served, fake)


async def _share_one_call_per_key(served: Workers, fake: Any) -> None:
    """One Idempotency-Key sent on every worker runs once; identical requests make one call; an
    invalidation on one worker reaches all: after it, one new call, its answer everywhere."""
    headers = {"Idempotency-Key": "after-the-change"}
    keyed = await served.spread(
        lambda client: client.post("/v1/chat/completions", json=chat("Charge me"), headers=headers)
    )
    assert all(r.status_code == 200 for r, _ in keyed)
    assert {content(r) for r, _ in keyed} == {"answer 1 to Charge me"}
    assert fake.count() == 1
    send = lambda client: client.post(  # noqa: E731
        "/v1/chat/completions", json=chat(QUESTIONS[0])
    )
    assert {content(r) for r, _ in await served.spread(send)} == {f"answer 2 to {QUESTIONS[0]}"}
    assert fake.count() == 2
    response, _ = await served.once(
        lambda client: client.post("/admin/invalidate", json={"all": True}, headers=ADMIN)
    )
    assert response.status_code == 200
    assert {content(r) for r, _ in await served.spread(send)} == {f"answer 3 to {QUESTIONS[0]}"}
    assert fake.count() == 3


async def test_audit_reset_reaches_every_worker(fake, tmp_path):
    """Each worker keeps its own audits (an error budget is per process): the reset, and a
    report of a wrong hit, landed on one worker and said it was done. Both are passed on now."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("usearch")
    semantic = {"semantic": {"enabled": True, "audit_rate": 1.0, "max_wrong_rate": 0.05}}
    paraphrases = ["how can i reset my router", "How can I reset my router?"]
    # Every audit finds the hit right. (With the fake's numbered answers each found it wrong,
    # and a worker refused the pair from then on: its next miss stored the paraphrase's own
    # answer, an exact hit on both workers, so a worker that had served no semantic hit by
    # then never audited one: the test failed by the order of the two workers' audits.)
    fake.answer_text = lambda n, body: "Hold the reset button for ten seconds."
    async with workers(fake.url, tmp_path, semantic) as served:
        for question in ("How do I reset my router?", *paraphrases):
            await served.spread(lambda c, q=question: c.post("/v1/chat/completions", json=chat(q)))

        async def audited() -> dict[int, dict[str, Any]]:
            """Each worker's ``GET /admin/semantic/audit``."""
            seen = await served.spread(lambda c: c.get("/admin/semantic/audit", headers=ADMIN))
            return {pid: response.json() for response, pid in seen}

        # Until each worker has audited a semantic hit it served.
        for _ in range(TRIES):
            if all("" in report for report in (await audited()).values()):
                break
            await served.spread(lambda c: c.post("/v1/chat/completions", json=chat(paraphrases[0])))
        else:
            pytest.fail(f"a worker audited nothing: {await audited()}")
        response, _ = await served.once(
            lambda c: c.post("/admin/semantic/audit/reset", json={}, headers=ADMIN)
        )
        assert response.json() == {"reset": 2}  # one budget on each worker
        assert list((await audited()).values()) == [{}, {}]
        # A report of a wrong hit, sent to the worker that did not serve it (a wording not asked
        # before: a pair an audit found wrong is refused from then on).
        hit, holder = await served.once(
            lambda c: c.post("/v1/chat/completions", json=chat("how do I reset my router?"))
        )
        assert hit.headers["x-carpool"] == "semantic-hit"
        entry = hit.headers["x-carpool-entry"]
        for _ in range(TRIES):
            async with httpx.AsyncClient(base_url=served.base, timeout=20) as client:
                if (await client.get("/stats", headers=ADMIN)).json()["pid"] == holder:
                    continue  # (the next connection may land on the other one)
                reported = await client.post(
                    "/admin/semantic/feedback", json={"entry": entry}, headers=ADMIN
                )
                assert reported.status_code == 200, reported.text
                assert reported.json()["dropped"] is True and reported.json()["namespace"] == ""
                break
        else:
            pytest.fail("every connection landed on the worker that served the hit")


def _streamed_text(sse: str) -> str:
    import json

    text = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


async def _until_waiting(served: Workers, n: int) -> None:
    """Until the two workers' flights hold at least ``n`` waiting requests between them (bounded:
    a request that joins later is a hit or joins a lingering answer, never another call)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while loop.time() < deadline:
        waiting: dict[int, int] = {}
        for _ in range(TRIES):
            _, pid = await served.once(lambda client: client.get("/healthz"))
            waiting[pid] = served.stats[pid]["waiters"]
            if len(waiting) == 2:
                break
        if sum(waiting.values()) >= n:
            return
    pytest.fail(f"the workers never held {n} waiting requests")


async def test_the_workers_take_the_flags_over_the_environment_as_one_process_does(fake, tmp_path):
    # Each worker loaded the resolved config file and then the environment again: a
    # CARPOOL_UPSTREAMS beat --upstream in every worker (a 502 from a dead replica).
    dead = {"upstreams": ["http://127.0.0.1:9/v1"]}
    async with workers(fake.url, tmp_path, dead) as served:
        answered = await served.spread(
            lambda client: client.post("/v1/chat/completions", json=chat("flags first?"))
        )
        assert [r.status_code for r, _ in answered] == [200] * len(answered)
