"""What every configuration section shares: strict keys, and the error a bad value raises.

Contract: a section forbids unknown keys (a typo must not silently keep a default) and validates
assignments too (``config.distributed.cluster = True`` is checked like a loaded value); a number
is finite (``.inf`` seconds overflowed Redis's expiry at the first put) and never a boolean,
in a list or tuple of numbers too (pydantic reads ``port: true`` as 1 and ``window_ms: false`` as
0: a slip taken as a setting); an integer is at most ``MOST_INTEGER`` (2**53); a variable's string is still read by its key's type
(``CARPOOL_PORT=1``). ``OnOff``: a key of
``auto``/``on``/``off`` that takes YAML's booleans for the words (``tracing: off`` written
bare is YAML 1.1's false).
``ConfigError`` is what ``Config.load`` raises for any invalid source; its message names the
field and what is allowed, and the CLI turns it into exit status 2. ``header_name``: the one check
of a header name in the config (RFC 9110's token characters, ASCII), so that a name that could
never be sent (``Bad Header``, ``""``) is refused rather than never matched; ``header_value_name``
likewise of a name a client sends as a header's value (a namespace, a request type).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo, field_validator

from .. import http_syntax

# The longest an answer or a record may be kept (100 years): "for ever" in practice, and within
# what Redis takes as an expiry (past ~292 million years every put there failed, silently: no
# answer was shared, no record kept).
LONGEST_TTL = 100 * 365 * 86400


# The largest integer a key takes: one a double holds exactly (2**53), far past any size,
# count or port a deployment needs.
MOST_INTEGER = 2**53


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


class Section(BaseModel):
    """A part of the configuration: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _boolean_for_a_number(field.annotation, value):
            raise ValueError("a boolean is not a number (true is not 1, false is not 0)")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _an_integer_a_double_holds(cls, value: Any) -> Any:
        # A byte budget of 2**64 was taken, then every /stats (which reports it) was a 500:
        # its JSON writer takes 64 bits at most, and the dashboard's JavaScript holds 2**53.
        if type(value) is int and abs(value) > MOST_INTEGER:
            raise ValueError(f"at most {MOST_INTEGER} (2**53)")
        return value


def _takes_a_number(annotation: Any) -> bool:
    """``int`` or ``float``, alone or in a union that has no ``bool`` (``float | None``)."""
    if annotation in (int, float):
        return True
    origin = get_origin(annotation)
    if origin is Annotated:
        return _takes_a_number(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        arms = get_args(annotation)
        return bool not in arms and any(_takes_a_number(arm) for arm in arms)
    return False


def _boolean_for_a_number(annotation: Any, value: Any) -> bool:
    """Whether ``value`` holds a boolean where ``annotation`` takes a number (at its top, or as
    an item of a list, tuple or set, or a value of a mapping; a section checks its own keys)."""
    if isinstance(value, bool):
        return _takes_a_number(annotation)
    origin, args = get_origin(annotation), [a for a in get_args(annotation) if a is not ...]
    if origin in (Union, types.UnionType):
        return any(_boolean_for_a_number(arm, value) for arm in args)
    if origin in (list, tuple, set, frozenset) and isinstance(value, list | tuple) and args:
        fixed = origin is tuple and len(args) == len(value)
        return any(
            _boolean_for_a_number(args[i] if fixed else args[0], item)
            for i, item in enumerate(value)
        )
    if origin is dict and isinstance(value, Mapping) and len(args) == 2:
        return any(_boolean_for_a_number(args[1], item) for item in value.values())
    return False


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


def header_value_name(name: str, header: str, what: str) -> None:
    """A ``ValueError`` unless ``name`` is one a client can send in ``header`` as a request's is
    read (stripped, 1-256 printable characters, not empty): a setting under another name (a
    namespace, a request type) would never apply, silently."""
    from ..errors import RequestError
    from ..request import MAX_HEADER_TOKEN, header_token

    try:
        named = header_token(name, header) == name != ""
    except RequestError:
        named = False
    if not named:
        raise ValueError(
            f"{name!r} is no {what} a client can name in {header}: "
            f"1-{MAX_HEADER_TOKEN} printable characters, no white space around them"
        )
