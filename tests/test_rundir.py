"""The run's directory of ``serve --workers N`` (``carpool.rundir``) on a file system that
refuses ``flock`` (NFS without its lock daemon: ENOLCK), which a test machine has not: the
refusal is made by replacing ``fcntl.flock`` in that module only. The locked cases, with real
runs, are in tests/test_workers.py and tests/test_workers_share.py."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from carpool import rundir


def _refuse(fd: int, operation: int) -> None:
    raise OSError(errno.ENOLCK, "No locks available")


def test_a_run_directory_where_flock_is_refused_goes_unlocked_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With Redis a run needs no other lock, and started on such a file system before its
    directory had one: it still does, said once (it was an OSError traceback, status 1)."""
    monkeypatch.setattr(rundir.fcntl, "flock", _refuse)
    caplog.set_level(logging.WARNING, logger="carpool.rundir")
    with rundir.run_directory(str(tmp_path)) as directory:
        (directory / "config.yaml").write_text("workers: 2\n")
        assert directory.is_dir()
    assert not directory.exists()
    assert any("refuses flock" in r.getMessage() for r in caplog.records), caplog.text


def test_a_sweep_where_flock_is_refused_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live run's directory cannot be told from a dead one's without the lock: left."""
    live = tmp_path / (rundir.PREFIX + "abcdefgh")
    live.mkdir(mode=0o700)
    (live / "config.yaml").write_text("workers: 2\n")
    monkeypatch.setattr(rundir.fcntl, "flock", _refuse)
    assert rundir.sweep(str(tmp_path)) == []
    assert (live / "config.yaml").is_file()


def test_a_stop_the_moment_the_runs_directory_is_made_still_removes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A SIGTERM (the run's start-up handler raises SystemExit) that came right after mkdtemp,
    # before the context's ``try``, left the directory behind (a CI run's
    # test_a_sigterm_as_the_run_starts_its_workers_leaves_nothing, which aims at that moment).
    import os
    import signal
    import tempfile

    made = tempfile.mkdtemp

    def made_then_stopped(**where: str) -> str:
        directory = made(**where)
        os.kill(os.getpid(), signal.SIGTERM)  # (its handler runs as soon as it may)
        return directory

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    monkeypatch.setattr(rundir.tempfile, "mkdtemp", made_then_stopped)
    before = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit), rundir.run_directory(str(tmp_path)):
            pass
    finally:
        signal.signal(signal.SIGTERM, before)
    assert list(tmp_path.iterdir()) == []


def test_a_stop_while_the_temporary_directory_is_first_looked_at_leaves_no_file_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``tempfile.gettempdir()``'s first call writes a file in it and removes it; a SIGTERM in
    # between (the run's start-up handler raises SystemExit) left that 8-character file (a
    # loaded run of test_a_sigterm_as_the_run_starts_its_workers_leaves_nothing). The run looks
    # at it with stops only noted (``rundir.stops_noted``), the stop coming after.
    import os
    import signal
    import tempfile

    from carpool.peers import parent_directory

    opened = os.open

    def opened_then_stopped(path: str, *args: object, **kwargs: object) -> int:
        fd = opened(path, *args, **kwargs)  # type: ignore[arg-type]
        if os.path.dirname(path) == str(tmp_path):
            os.kill(os.getpid(), signal.SIGTERM)  # (its handler runs as soon as it may)
        return fd

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # (its first look again)
    monkeypatch.setattr(tempfile._os, "open", opened_then_stopped)  # type: ignore[attr-defined]
    before = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(SystemExit), rundir.stops_noted():
            assert parent_directory(2) == str(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert list(tmp_path.iterdir()) == []
