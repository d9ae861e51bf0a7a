"""``carpool`` (the console script) and ``python -m carpool``: the command line, whose modules
(``carpool.cli``: the config's models, the commands) take seconds to import on a slow machine.
A Ctrl-C meanwhile exits 130 (the shell's status for it), not with a KeyboardInterrupt
traceback; once a command runs, click's rule holds ("Aborted!", status 1), but where the command
stops on it as on a stop (``serve``'s server, 0; ``bench``, 130). ``import carpool`` before it
loads nothing (the package's names are lazy)."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from .cli import main as command_line
    except KeyboardInterrupt:
        sys.exit(130)
    command_line()


if __name__ == "__main__":
    main()
