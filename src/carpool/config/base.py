"""What every configuration section shares: strict keys, and the error a bad value raises.

Contract: a section forbids unknown keys (a typo must not silently keep a default) and validates
assignments too (``config.distributed.cluster = True`` is checked like a loaded value); a number
is finite (``.inf`` seconds overflowed Redis's expiry at the first put). ``OnOff``: a key of
``auto``/``on``/``off`` that takes YAML's booleans for the words (``tracing: off`` written
bare is YAML 1.1's false).
``ConfigError`` is what ``Config.load`` raises for any invalid source; its message names the
field and what is allowed, and the CLI turns it into exit status 2. ``header_name``: the one check
of a header name in the config (RFC 9110's token characters, ASCII), so that a name that could
never be sent (``Bad Header``, ``""``) is refused rather than never matched.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

from .. import http_syntax

# The longest an answer or a record may be kept (100 years): "for ever" in practice, and within
# what Redis takes as an expiry (past ~292 million years every put there failed, silently: no
# answer was shared, no record kept).
LONGEST_TTL = 100 * 365 * 86400


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


class Section(BaseModel):
    """A part of the configuration: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _words(value: Any) -> Any:
    return ("on" if value else "off") if isinstance(value, bool) else value


OnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_words)]


def header_name(name: str) -> str:
    """``name`` lower-cased, or a ``ValueError`` when it is no header name (a name a request
    could never carry, so a setting naming it would never apply)."""
    lowered = name.lower()  # (ASCII only: the Kelvin sign lower-cases to a "k")
    if not name.isascii() or not http_syntax.TOKEN.fullmatch(lowered):
        raise ValueError(f"{name!r} is not a header name (RFC 9110 token characters)")
    return lowered
