"""``carpool serve`` whose workers' health-check threads stall at their first ping and never
answer it (as one whose thread gets no turn: a call holding the GIL, a stalled machine), so
that uvicorn's supervisor waits on that answer. Each worker, as it starts, writes a file named
by its pid in the directory ``STALLED_DIR`` names, and ``PID.pinged`` there once it has read
its first ping: the supervisor is then waiting on it. With ``STALL_WHEN_ASKED`` set, only the
workers started once a file named ``stall.asked`` is there stall (those of a SIGHUP's restart); the
others answer as uvicorn's do.

A spawned worker runs this script as its main module (``__mp_main__``) before it unpickles
what it runs: uvicorn's ``Process.pong`` is replaced there, in the workers only."""

import os
import sys
import threading
from pathlib import Path

_stalled = Path(os.environ["STALLED_DIR"])

if __name__ == "__mp_main__":
    from uvicorn.supervisors import multiprocess

    def _stalled_pong(self: multiprocess.Process) -> None:
        self.child_conn.recv()
        (_stalled / f"{os.getpid()}.pinged").touch()
        threading.Event().wait()  # (never answered; a daemon thread: the worker still exits)

    (_stalled / str(os.getpid())).touch()
    if not os.environ.get("STALL_WHEN_ASKED") or (_stalled / "stall.asked").exists():
        multiprocess.Process.pong = _stalled_pong
else:
    from carpool.cli import main

    sys.argv = ["carpool", *sys.argv[1:]]
    sys.exit(main())
