"""Which signals stop a command: SIGTERM, and SIGINT unless the process started with it ignored.

Contract: ``stopping()`` is ``(SIGINT, SIGTERM)``, without SIGINT while it is ignored
(``SIG_IGN``, ``sigint_ignored()``). A shell starts a background job so (``carpool serve &`` in
a script), so that the terminal's Ctrl-C, which reaches the whole process group, stops the script
and not the job; each command that set its own SIGINT handler (uvicorn's server and supervisor,
the simulated engine's, the benchmark's) made it a stop again. Read before a command sets any.
``keeping_sigint_ignored(capture)``: uvicorn's server's ``capture_signals()``, SIGINT ignored
again inside it where it was ignored as it began (uvicorn puts it back as it was after).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager


def sigint_ignored() -> bool:
    """Whether SIGINT is ignored in this process (as its parent started it)."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def stopping() -> tuple[signal.Signals, ...]:
    """The signals that stop a command: SIGTERM, and SIGINT unless it is ignored."""
    return (signal.SIGTERM,) if sigint_ignored() else (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def keeping_sigint_ignored(capture: AbstractContextManager[None]) -> Iterator[None]:
    """``capture`` (uvicorn's ``Server.capture_signals()``), SIGINT kept ignored in it if it was
    (uvicorn's handles it whatever it was: a background job's Ctrl-C stopped it)."""
    ignored = sigint_ignored()
    with capture:
        if ignored and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        yield
