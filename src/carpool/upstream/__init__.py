"""Upstream replicas: real ones over HTTP, or the embedded simulated engine."""

from __future__ import annotations

from ..config import Config
from .base import PassthroughResponse, Upstream, UpstreamRequest, UpstreamResponse


def build_upstreams(config: Config) -> list[Upstream]:
    """One ``Upstream`` per configured URL; none configured = the simulated engine's replicas."""
    if config.upstreams:
        from .http import HttpUpstream, replica_names
        from .proxy import usable_proxy

        names = replica_names(config.upstreams, config.upstream_names)
        return [
            HttpUpstream(
                url,
                config.limits,
                name,
                label,
                config.upstream.key_of(i),
                [config.tenant.header, *config.tenant.credential_headers],
                usable_proxy(url, config.upstream.proxy),
            )
            for i, (url, (name, label)) in enumerate(zip(config.upstreams, names, strict=True))
        ]
    from . import sim

    return list(sim.build_upstreams(config.sim))


__all__ = [
    "PassthroughResponse",
    "Upstream",
    "UpstreamRequest",
    "UpstreamResponse",
    "build_upstreams",
]
