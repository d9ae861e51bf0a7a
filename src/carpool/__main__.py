"""``carpool`` (the console script) and ``python -m carpool``: the command line, whose modules
(``carpool.cli``: the config's models, the commands) take seconds to import on a slow machine.
A Ctrl-C meanwhile exits 130 like one during a command, not with a KeyboardInterrupt
traceback; ``import carpool`` before it loads nothing (the package's names are lazy)."""

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
