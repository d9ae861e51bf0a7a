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
