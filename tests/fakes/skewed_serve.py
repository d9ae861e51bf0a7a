"""``carpool serve`` on a machine whose wall clock is ``SKEW_S`` seconds off (``time.time``
shifted before carpool is imported; monotonic time, asyncio's, as it is): an instance of a fleet
whose clocks disagree (``fakes.instances.instances(skews=...)``). ``SKEW_S`` may name a file
holding the seconds instead: written again while the instance runs, it steps the clock then
(read again as its modification time changes: at the instance's next reading of the clock)."""

import os
import sys
import time

_source = os.environ["SKEW_S"]
_time, _time_ns = time.time, time.time_ns
_read: list = [None, 0.0]  # (the file's modification time as last read, its seconds)


def _skew() -> float:
    if not _source.startswith("/"):
        return float(_source)
    stamp = os.stat(_source).st_mtime_ns
    if stamp != _read[0]:
        with open(_source) as file:
            _read[:] = [stamp, float(file.read())]
    return _read[1]


time.time = lambda: _time() + _skew()
time.time_ns = lambda: _time_ns() + int(_skew() * 1e9)

from carpool.cli import main  # noqa: E402  (after the clock is shifted)

sys.argv = ["carpool", *sys.argv[1:]]
sys.exit(main())
