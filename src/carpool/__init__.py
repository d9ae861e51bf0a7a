"""carpool: an OpenAI-compatible gateway that never computes the same answer twice.

The public surface is this sorted list; everything else is an implementation module.
"""

from .config import Config, ConfigError
from .errors import (
    BodyTooLarge,
    CarpoolError,
    FlightAbandoned,
    RequestError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamStreamBroken,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from .outcome import Outcome
from .pipeline import Gateway, Reply
from .server import create_app
from .upstream.function import FunctionUpstream
from .wiring import build_gateway

__all__ = [
    "BodyTooLarge",
    "CarpoolError",
    "Config",
    "ConfigError",
    "FlightAbandoned",
    "FunctionUpstream",
    "Gateway",
    "Outcome",
    "Reply",
    "RequestError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamStreamBroken",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "build_gateway",
    "create_app",
]
