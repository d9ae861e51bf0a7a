"""The workers' meeting place: a private directory, one slot per worker, a secret per run.

Contract:
- ``prepare(directory)`` (the parent, ``carpool serve --workers N`` without Redis): writes the
  run's secret (``secret``, 0600, random) into the run's directory (``carpool.rundir``: 0700,
  locked for the run, removed when it ends), whose path goes to the workers in
  ``CARPOOL_PEERS`` (``config.loader.PEERS_VARIABLE``). ``parent_directory(count)`` is where
  that directory goes: the temporary directory (``TMPDIR``), or ``/tmp`` when a socket's path
  there would be longer than a Unix socket's may be (``MAX_SOCKET_PATH``: 107 bytes on Linux).
- ``claim(directory, count)`` (each worker, as it starts, and a worker without a slot until it
  has one): the first free index 0..N-1, held by an exclusive ``flock`` on ``peer-<i>.lock``
  for the process's life. The kernel releases the lock of a process that dies, however it
  dies, so the worker uvicorn starts in its place takes its slot over; no two live workers ever
  hold one index (a stale socket file says nothing about its owner being alive; a lock does).
  Never blocks: None when every slot is held (uvicorn's SIGHUP starts each new worker while
  the old one still holds its slot; SIGTTIN adds a worker beyond N). Such a worker holds the
  run's ``meeting(directory, count)`` instead, and tries again (``Peers``).
- ``socket_path(directory, i)``: where worker ``i`` listens for its peers (``server.py``); a
  stale file there (its worker died) is replaced by the slot's next holder.
- ``spare_path(directory)``: where a worker without a slot listens, a new name each time
  (``spare-<random>.sock``), for the invalidations the others pass on (it keeps answers too);
  ``spares(directory)``: those sockets now, a dead worker's stale file among them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..rundir import PREFIX as RUN_PREFIX

SECRET_FILE = "secret"
SPARE_PREFIX = "spare-"
SPARE_NAME = 16  # hex digits of a spare socket's random name
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (Linux's sun_path, less its NUL)


@dataclass(frozen=True, slots=True)
class Meeting:
    """The run's meeting place as a worker without a slot sees it: ``count`` slots, the
    ``secret``."""

    directory: Path
    count: int
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class Slot:
    """This worker's place among ``count``: its ``index``, and the run's ``secret``."""

    index: int
    count: int
    directory: Path
    secret: bytes = field(repr=False)
    lock_fd: int  # held open for the process's life: closing it would free the slot

    def socket_path(self, index: int) -> Path:
        return socket_path(self.directory, index)


def prepare(directory: Path) -> None:
    """The run's ``directory`` made a meeting place: a new secret in it."""
    fd = os.open(directory / SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32))


def parent_directory(count: int) -> str:
    """Where the run's directory goes: the temporary directory if the last worker's socket path
    fits in a Unix socket's (mkdtemp adds 8 characters to the prefix), else ``/tmp``."""
    parent = tempfile.gettempdir()
    name = max(f"peer-{count - 1}.sock", SPARE_PREFIX + "x" * SPARE_NAME + ".sock", key=len)
    longest = os.path.join(parent, RUN_PREFIX + "x" * 8, name)
    if len(os.fsencode(longest)) > MAX_SOCKET_PATH and os.path.isdir("/tmp"):
        return "/tmp"
    return parent


def remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def meeting(directory: Path, count: int) -> Meeting:
    """The run of ``directory`` with ``count`` slots, without one."""
    return Meeting(directory, count, _secret(directory))


def claim(directory: Path, count: int) -> Slot | None:
    """The first free slot of ``directory`` for this process, or None when all are held."""
    secret = _secret(directory)
    for index in range(count):
        fd = os.open(directory / f"peer-{index}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # Ours now: whatever socket file is there was its previous holder's, who is dead.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path(directory, index))
        return Slot(index, count, directory, secret, fd)
    return None


def socket_path(directory: Path, index: int) -> Path:
    return directory / f"peer-{index}.sock"


def spare_path(directory: Path) -> Path:
    return directory / f"{SPARE_PREFIX}{secrets.token_hex(SPARE_NAME // 2)}.sock"


def spares(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{SPARE_PREFIX}*.sock"))


def _secret(directory: Path) -> bytes:
    return (directory / SECRET_FILE).read_bytes().strip()
