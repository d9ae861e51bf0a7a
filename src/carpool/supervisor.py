"""The supervisor of ``carpool serve --workers N``: uvicorn's, its health checks cut short.

Contract: ``Supervisor`` is uvicorn's ``Multiprocess`` (either of its APIs: given the function
each worker runs, up to some version, or building the workers' servers itself), but a health
check (a worker's answer to a ping, awaited up to ``timeout_worker_healthcheck``: 30 s in
``carpool serve``) stops waiting as soon as
- the worker exits: it is dead, and uvicorn replaces it (or stops the run, as it does for a
  worker that failed to start), at once;
- another worker exits: no verdict on this one (its ping waited for at the next round, to the
  same deadline), and uvicorn replaces the one that exited at once (checked one after another,
  it waited for a stalled worker's whole timeout first: 30 s without a worker);
- a SIGINT or SIGTERM reaches the supervisor: no verdict on the worker, and the supervisor
  handles the signal right after, stopping the run as it does after start-up.
uvicorn waited the whole timeout on the pipe, which a signal does not end (the call is resumed
once the handler has queued it) and a dead worker does not either (the supervisor holds the
pipe's other end too): a Ctrl-C as the workers started, killing each in its imports before
its health-check thread ran, stopped the run 30 s later, after starting new workers.

A SIGHUP's restart (uvicorn's, one worker at a time, each new one awaited until it is ready, up
to that same timeout) ends as soon as a SIGINT or SIGTERM reaches the supervisor, as it does
when the run's exit flag is set: the worker awaited is killed, the old ones left to the stop.
uvicorn's restart looked at that flag only, which the signal sets once handled, after the
restart: a stop during it waited for it.

A stop waits for each worker to end for the grace period and ``STOP_MARGIN_S`` at most, then kills
it, and so does a SIGHUP's restart (or a SIGTTOU) for each old worker it stops, until a stop comes,
which then waits for it with the others: uvicorn waited without limit, and a worker whose event
loop was stuck hung the run (in a restart, the supervisor: no health checks, no worker replaced, no
signal read).

Each worker starts with SIGINT ignored and blocked (``_Worker``; importing this module makes it
uvicorn's worker class, ``uvicorn.supervisors.multiprocess.Process``, for the process): the
terminal's Ctrl-C, which reaches the whole group, is the supervisor's alone to read, and a worker
importing its modules prints no KeyboardInterrupt traceback; the worker sets its handler and
unblocks it (``server``). A supervisor started with SIGINT ignored (a background job) keeps
ignoring it and has its workers do so (``CARPOOL_SIGINT_IGNORED``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from typing import Any

from uvicorn.supervisors import Multiprocess, multiprocess
from uvicorn.supervisors.multiprocess import Process

from .config.loader import SIGINT_IGNORED_VARIABLE
from .signals import sigint_ignored

# The signals that stop the run (uvicorn's supervisor stops on both; SIGINT not where it is
# ignored, a background job's).
STOPPING = frozenset({signal.SIGINT, signal.SIGTERM})

# How often a health check's wait looks whether a stopping signal has come meanwhile.
GLANCE_S = 0.1
# How long past the grace period a stop waits for a worker before it kills it (``join_all``):
# the lifespan's close, after the requests (the upstream clients, Redis).
STOP_MARGIN_S = 15.0

log = logging.getLogger("carpool.supervisor")


class _Worker(Process):
    """uvicorn's worker process, started with SIGINT ignored: a Ctrl-C reaches every process of
    the terminal's group, and a worker still importing its modules (seconds on a slow machine)
    printed a KeyboardInterrupt traceback (or died in its site import). An ignored signal stays
    ignored across the exec, until the worker sets its own handler (``server``'s
    ``_sigint_left_to_the_supervisor``, which only says it came): the supervisor alone stops the
    run. Its own SIGINT is blocked meanwhile, so that one sent in those milliseconds waits for
    its handler (Linux keeps a blocked signal even while it is ignored), and one pending as it
    is ignored (which that discards) is raised again after; the worker starts with it blocked
    too, and unblocks it with its handler. multiprocessing's resource tracker is started first:
    starting, it unblocks SIGINT."""

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            super().start()  # (no handler to set there; uvicorn starts its workers on the main one)
            return
        resource_tracker.ensure_running()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pending = signal.SIGINT in signal.sigpending()
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            super().start()
        finally:
            signal.signal(signal.SIGINT, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if pending and handler not in (signal.SIG_IGN, signal.SIG_DFL):
            signal.raise_signal(signal.SIGINT)  # (to its handler: the supervisor's queue)


# uvicorn's supervisor makes each worker (at the start, in a dead one's place, on SIGHUP and
# SIGTTIN) by this module-level name.
multiprocess.Process = _Worker  # type: ignore[misc]


class Supervisor(Multiprocess):
    """uvicorn's supervisor, whose health checks end early on a worker's exit or a stop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ignored = sigint_ignored()  # (uvicorn's handles every signal it knows)
        super().__init__(*args, **kwargs)
        if ignored:  # (a background job's: ``signals``; its workers are told to ignore it too)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.environ[SIGINT_IGNORED_VARIABLE] = "1"
        # Each worker's ping not answered yet, and when its wait ends (``_answers``).
        self._pinged: dict[Process, float] = {}
        # Old workers a restart (or SIGTTOU) stopped and left when a stop came, each with
        # when it is killed: the stop waits for them too (``join_all``).
        self._retiring: list[tuple[Process, float | None]] = []

    def keep_subprocess_alive(self) -> None:
        # uvicorn's round of health checks, each worker asked through ``_answers``: set on each
        # round, as the workers started in the last one (in place of dead ones) are new.
        for worker in self.processes:
            worker.is_alive = functools.partial(self._answers, worker)  # type: ignore[method-assign]
        # (The pings unanswered yet, of the workers still there: ``_answers``.)
        self._pinged = {w: at for w, at in self._pinged.items() if w in self.processes}
        super().keep_subprocess_alive()

    def join_all(self) -> None:
        # uvicorn waits for each worker to end, without limit: one whose event loop is stuck
        # never ends its graceful shutdown, and the run hung for ever (a second signal read by
        # nothing). Each gets the grace period and a margin, then is killed.
        deadline = self._stop_deadline()
        # (The earliest deadline first: a retired worker's, kept, before the others'.)
        stopping = [*self._retiring, *((w, deadline) for w in self.processes)]
        for worker, by in sorted(
            stopping, key=lambda pair: math.inf if pair[1] is None else pair[1]
        ):
            self._join_by(worker, by)

    def handle_ttou(self) -> None:
        # uvicorn's, the worker it stops (the last) waited for as a restart's old one is (it
        # joined it without limit, no signal read meanwhile).
        if self.processes:
            self._retire_on_join(self.processes[-1])
        super().handle_ttou()

    def _retire_on_join(self, worker: Process) -> None:
        """``worker``'s join, once uvicorn stopped it, waits as ``_retired`` does."""
        worker.join = functools.partial(self._retired, worker)  # type: ignore[method-assign]

    def restart_all(self) -> None:
        # uvicorn's restart reads ``should_exit``, which a stop queued meanwhile has not set yet.
        run_exit = self.should_exit
        self.should_exit = _ExitOrStop(run_exit, self._stopping)
        # It stops each old worker once its replacement is ready and joins it without limit.
        for worker in self.processes:
            self._retire_on_join(worker)
        try:
            super().restart_all()
        finally:
            self.should_exit = run_exit

    def _retired(self, worker: Process) -> None:
        """Wait for an old worker a restart has just stopped, as a stop waits for each, or
        until a stop comes: then the stop waits for it (its requests finishing meanwhile; a
        Ctrl-C reaches the workers only through the supervisor, ``server``'s
        ``_sigint_left_to_the_supervisor``)."""
        deadline = self._stop_deadline()
        while worker.process.is_alive() and (deadline is None or time.monotonic() < deadline):
            if self._stopping():
                self._retiring.append((worker, deadline))  # (its own deadline kept)
                return
            worker.process.join(GLANCE_S)
        self._join_by(worker, deadline)

    def _stop_deadline(self) -> float | None:
        """When workers stopped now are killed if still running: none without a grace period."""
        grace = self.config.timeout_graceful_shutdown
        return None if grace is None else time.monotonic() + grace + STOP_MARGIN_S

    def _join_by(self, worker: Process, deadline: float | None) -> None:
        """Wait for ``worker`` to end, killing it at ``deadline``."""
        if deadline is not None:
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                log.warning("worker [%s] did not stop in its grace period: killed", worker.pid)
                worker.kill()
        Process.join(worker)

    def _stopping(self) -> bool:
        """Whether a stopping signal is queued, for the supervisor to handle after this round."""
        return any(signum in STOPPING for signum in self.signal_queue)

    def _answers(self, worker: Process, timeout: float = 5) -> bool:
        """As uvicorn's ``Process.is_alive``: whether ``worker`` runs and answers a ping within
        ``timeout`` (uvicorn's default when it passes none); True when stopping, whatever the
        worker (a False had uvicorn start a new one first). A ping a round left unanswered
        (another worker exited: no verdict) is waited for still, to its own deadline: a new
        ping each round began the timeout again, and a worker hung while others kept dying was
        never replaced (its peers' requests for its keys held meanwhile)."""
        if self._stopping():
            return True
        pinged = self._pinged
        if not worker.process.is_alive():
            pinged.pop(worker, None)
            return False
        pipe = worker.parent_conn
        deadline = pinged.get(worker)
        if deadline is None:
            try:
                pipe.send(b"ping")
            except OSError:
                return False
            deadline = pinged[worker] = time.monotonic() + timeout
        # (uvicorn checks the workers one after another: another's exit meanwhile waited for
        # this one's verdict, up to the whole timeout for a stalled one.)
        others = [other.process.sentinel for other in self.processes if other is not worker]
        while not self._stopping():
            left = deadline - time.monotonic()
            # (Its answer may have come while no round read the pipe: past the deadline now,
            # but in time.)
            if left <= 0 and not _answered(pipe):
                pinged.pop(worker, None)
                return False  # (hung: uvicorn kills it)
            # The pipe or the worker's exit, whichever first; a signal does not end the wait.
            ready = wait([pipe, worker.process.sentinel, *others], max(0.0, min(left, GLANCE_S)))
            if pipe in ready:
                pinged.pop(worker, None)
                try:
                    pipe.recv()  # (what it says, started or not, is for a restart's readiness)
                except (OSError, EOFError, pickle.UnpicklingError):
                    return False
                return True
            if self._stopping():
                # (A Ctrl-C reaches the whole group: its workers die of it in this very wait,
                # and a False would start another before the stop is handled.)
                return True
            if worker.process.sentinel in ready:
                pinged.pop(worker, None)
                return False  # (exited while checked)
            if ready:
                # Another worker exited: no verdict on this one now (its ping waited for at the
                # next round), so that uvicorn replaces that one at once.
                return True
        return True


def _answered(pipe: Any) -> bool:
    """Whether a worker's answer waits in its ``pipe``."""
    try:
        return bool(pipe.poll(0))
    except (OSError, EOFError):
        return False


class _ExitOrStop(threading.Event):
    """The run's exit flag as a restart reads it: set, or a stop queued (``is_set`` only)."""

    def __init__(self, run_exit: threading.Event, stopping: Callable[[], bool]) -> None:
        super().__init__()
        self._run_exit = run_exit
        self._stopping = stopping

    def is_set(self) -> bool:
        return self._run_exit.is_set() or self._stopping()
