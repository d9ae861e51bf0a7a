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


def missing_extra_said(what: str, extra: str, error: Exception) -> str:
    """That ``what`` needs the ``extra`` and how to install it, ``error`` said after; or, for
    an error that is no missing extra (``needs_extra`` false: the model's files not found),
    what it says alone (it read "needs the semantic extra" with the extra installed)."""
    if not getattr(error, "needs_extra", True):
        return str(error)
    return f"{what} needs the {extra} extra: {install_hint(extra)} ({error})"
