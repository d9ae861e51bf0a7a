"""The private directory of one ``carpool serve --workers N`` run, in the temporary directory.

Contract:
- ``run_directory(parent)`` (the parent process, as it starts the workers): first removes the
  directories dead runs left in ``parent`` (``sweep``), then makes this run's,
  ``carpool-run-XXXXXXXX`` (0700: ``tempfile.mkdtemp``), and holds a shared ``flock`` on it
  until the context exits, when it removes the directory (whatever in it is gone already),
  a stop that comes as it is made included (SIGTERM and SIGINT are noted until then).
  A file system that refuses ``flock`` (NFS without lockd) leaves it unlocked, with a warning
  (with Redis the run needs no other lock: it started there before the directory had one).
  It holds what every worker reads as it starts, for the whole run (uvicorn starts one in
  place of one that died, and all of them again at SIGHUP): the resolved config (a 0600 file
  with the run's keys, ``cli``) and, without Redis, the peers' meeting files
  (``carpool.peers.slots``).
- The lock keeps them from age-based cleaners of the temporary directory: systemd-tmpfiles
  (``q /tmp 1777 root root 10d``) skips a directory it cannot lock. Before, it deleted a long
  run's config, secret and slot locks, and no worker could be started again.
- ``sweep(parent)``: a ``carpool-run-*`` directory of this user that is neither locked nor
  empty is a dead run's (its parent and workers killed together: SIGKILL to the process
  group, an OOM kill of the cgroup), which nothing else would remove: it is removed, and the
  copy of that run's keys with it. The kernel frees a dead process's lock, however it died.
  An empty one is left alone: it may be a run's between ``mkdtemp`` and its lock, and holds
  nothing (a cleaner takes it once old).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PREFIX = "carpool-run-"

# The signals that stop a run, noted while its directory is made (``run_directory``).
_STOPS = frozenset({signal.SIGTERM, signal.SIGINT})

log = logging.getLogger("carpool.rundir")


@contextlib.contextmanager
def run_directory(parent: str) -> Iterator[Path]:
    """This run's directory in ``parent``, locked while the context lasts, then removed."""
    sweep(parent)
    # A stop (SIGTERM, Ctrl-C) is only noted while the directory is made, and comes once the
    # ``try`` that removes it is entered: one that came right after ``mkdtemp`` left it (and
    # the run's keys, later). Its handlers are swapped, not the signals masked: a mask is one
    # thread's, and the process's other threads would take the signal for it.
    noted: list[int] = []
    handlers = _noting(noted)
    try:
        directory = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        try:
            lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except BaseException:
            os.rmdir(directory)
            raise
    except BaseException:
        _restored(handlers, noted)
        raise
    try:
        _restored(handlers, noted)  # (a stop noted comes here, with its own handler)
        try:
            # (Blocking: a sweep of another run starting now may hold it for a moment; it
            # leaves an empty directory alone, and this one is empty until locked.)
            fcntl.flock(lock, fcntl.LOCK_SH)
        except OSError as refused:  # (ENOLCK, ENOSYS, EINVAL: no flock on this file system)
            log.warning(
                "%s refuses flock (%s): the run's directory %s goes unlocked, so cleaners of "
                "the temporary directory are not kept from it (docs/scaling.md)",
                parent,
                os.strerror(refused.errno or 0),
                directory.name,
            )
        yield directory
    finally:
        # Removed while still locked: no sweep takes it for a dead run's meanwhile. What a
        # cleaner that ignores locks took already is no error (the run ends as it should).
        shutil.rmtree(directory, ignore_errors=True)
        os.close(lock)


@contextlib.contextmanager
def stops_noted() -> Iterator[None]:
    """SIGTERM and SIGINT only noted while the context lasts, then raised again, each to its
    own handler: for a step a stop must not cut in two (a file made, then removed)."""
    noted: list[int] = []
    handlers = _noting(noted)
    try:
        yield
    finally:
        _restored(handlers, noted)


def _noting(noted: list[int]) -> dict[int, Any]:
    """The stop signals' handlers, swapped for ones that note them in ``noted`` (none swapped
    outside the main thread, where no handler can be set: there none runs either)."""
    handlers: dict[int, Any] = {}
    with contextlib.suppress(ValueError):
        for signum in _STOPS:
            handlers[signum] = signal.signal(signum, lambda signum, frame: noted.append(signum))
    return handlers


def _restored(handlers: dict[int, Any], noted: list[int]) -> None:
    """The handlers ``_noting`` swapped put back, and the signals noted meanwhile raised again,
    each now to its own handler."""
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    for signum in dict.fromkeys(noted):
        signal.raise_signal(signum)


def sweep(parent: str) -> list[Path]:
    """Remove the directories of this user's dead runs in ``parent``: those removed."""
    removed: list[Path] = []
    try:
        names = [name for name in os.listdir(parent) if name.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = Path(parent, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # (gone, another user's, or not a directory)
        try:
            if os.fstat(fd).st_uid != os.getuid() or not stat.S_ISDIR(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                # A live run's (or another start sweeping it now); or no flock on this file
                # system, where a live run's cannot be told from a dead one's: left.
                continue
            if not os.listdir(fd):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.warning(
            "removed what %d earlier run(s) killed with their workers left in %s: %s",
            len(removed),
            parent,
            ", ".join(path.name for path in removed),
        )
    return removed
