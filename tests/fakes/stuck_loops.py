"""``carpool serve`` whose workers' event loops get stuck on SIGUSR2 (a handler that never
returns, run by the main thread: the event loop's), the process alive and its other threads
running (uvicorn's health-check thread among them), as a worker stuck in a long computation or
a blocking call is. Each worker, as it starts, writes a file named by its pid in the directory
``STUCK_DIR`` names."""

import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__mp_main__":

    def _stuck(signum: int, frame: object) -> None:
        while True:  # (the GIL let go now and then, as a computation does)
            time.sleep(0)

    signal.signal(signal.SIGUSR2, _stuck)
    (Path(os.environ["STUCK_DIR"]) / str(os.getpid())).touch()
else:
    from carpool.cli import main

    sys.argv = ["carpool", *sys.argv[1:]]
    sys.exit(main())
