"""How to install one of carpool's extras (``semantic``, ``redis``, ``bench``, ``otel``), in the
words of every message that names a missing one: carpool installs from its repository or from a
wheel built from it, not from a package index (a ``carpool`` there is someone else's)."""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The command that installs ``extra``, for a checkout and for a wheel."""
    return (
        f"pip install '.[{extra}]' in carpool's checkout "
        f"(from a wheel: pip install 'carpool-VERSION-py3-none-any.whl[{extra}]')"
    )
