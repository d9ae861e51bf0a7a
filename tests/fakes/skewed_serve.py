"""``carpool serve`` on a machine whose wall clock is ``SKEW_S`` seconds off (``time.time``
shifted before carpool is imported; monotonic time, asyncio's, as it is): an instance of a fleet
whose clocks disagree (``fakes.instances.instances(skews=...)``)."""

import os
import sys
import time

_skew = float(os.environ["SKEW_S"])
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _skew
time.time_ns = lambda: _time_ns() + int(_skew * 1e9)

from carpool.cli import main  # noqa: E402  (after the clock is shifted)

sys.argv = ["carpool", *sys.argv[1:]]
sys.exit(main())
