"""What every configuration section shares: strict keys, and the error a bad value raises.

Contract: a section forbids unknown keys (a typo must not silently keep a default) and validates
assignments too (``config.distributed.cluster = True`` is checked like a loaded value).
``ConfigError`` is what ``Config.load`` raises for any invalid source; its message names the
field and what is allowed, and the CLI turns it into exit status 2.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


class Section(BaseModel):
    """A part of the configuration: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
