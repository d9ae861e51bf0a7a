"""A tool or fixture a test needs that this machine lacks: skipped, or failed where it must be.

``.ci/run`` installs what the tests need and sets ``REQUIRE_CHROMIUM``, ``REQUIRE_WRK``,
``REQUIRE_OPENSSL`` and ``REQUIRE_ENGINE``: there a missing one fails the test; elsewhere (the
README's test command on a machine without it) it skips.

- ``required(variable)``: whether the environment sets ``variable`` (anything but empty or 0).
- ``missing(message, variable)``: ``pytest.fail`` if it does, else ``pytest.skip``, each saying
  ``message`` and the variable; never returns.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def required(variable: str) -> bool:
    return os.environ.get(variable, "") not in ("", "0")


def missing(message: str, variable: str) -> NoReturn:
    if required(variable):
        pytest.fail(f"{message}, and {variable} is set")
    pytest.skip(f"{message}; set {variable}=1 to make this a failure")
