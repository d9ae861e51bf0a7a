"""``carpool`` (the console script) and ``python -m carpool``: the command line, whose modules
(``carpool.cli``: the config's models, the commands) take seconds to import on a slow machine.
A Ctrl-C meanwhile exits 130 (the shell's status for it) at once, with no message; once a
command runs, click's rule holds ("Aborted!", status 1; under ``python -m``, one in a command's
own imports may then end the process by SIGINT, CPython's reading below), but where the command
stops on it as on a stop (``serve``'s server, 0; ``bench``, 130), and a SIGINT ignored as the
process started stays ignored (``carpool.signals``). ``import carpool`` before it loads nothing
(the package's names are lazy)."""

from __future__ import annotations

import os
import signal
from types import FrameType


def main() -> None:
    # A Ctrl-C while the modules load ends the process from a handler rather than as a
    # KeyboardInterrupt: raised in the middle of an import, the exception came out as another
    # (pydantic-core's SchemaError, a RuntimeError from __set_name__, with a traceback), and
    # under ``python -m`` CPython counts one raised inside code run by exec() of a string
    # (pydantic and dataclasses make methods so) as unhandled even once caught, killing the
    # process by SIGINT at exit whatever status it gave. (An ignored SIGINT stays ignored.)
    loading = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if loading:
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    from .cli import main as command_line

    if loading:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    command_line()


def _interrupted_while_loading(signum: int, frame: FrameType | None) -> None:
    os._exit(130)  # (nothing is open yet that the interpreter's own exit would close)


if __name__ == "__main__":
    main()
