"""carpool: an OpenAI-compatible gateway that never computes the same answer twice.

The public surface is this sorted list; everything else is an implementation module. Each name
is imported when first used (PEP 562): ``import carpool`` alone loads nothing, so the command
line (``carpool.__main__``) can start, and be interrupted, before the gateway's modules load.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Each public name, and the module it is imported from.
_FROM = {
    "BodyTooLarge": ".errors",
    "CarpoolError": ".errors",
    "Config": ".config",
    "ConfigError": ".config",
    "FlightAbandoned": ".errors",
    "FunctionUpstream": ".upstream.function",
    "Gateway": ".pipeline",
    "Outcome": ".outcome",
    "Reply": ".pipeline",
    "RequestError": ".errors",
    "UpstreamError": ".errors",
    "UpstreamStatusError": ".errors",
    "UpstreamStreamBroken": ".errors",
    "UpstreamTimeout": ".errors",
    "UpstreamUnreachable": ".errors",
    "build_gateway": ".wiring",
    "create_app": ".server",
}

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


def __getattr__(name: str) -> Any:
    if name == "__version__":  # (the installed distribution's, as ``carpool --version`` says)
        from importlib.metadata import version

        return version("carpool")
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'carpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # (once: the next use is a plain attribute)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})
