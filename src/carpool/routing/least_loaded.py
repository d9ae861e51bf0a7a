"""``least-loaded``: each miss goes to the replica with the fewest requests in flight.

Ties go to the replica with fewer calls so far, then to the first listed, so an idle gateway
still spreads its requests. Adapts to slow replicas and long generations; ignores prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence

from carpool.routing import Decision, RoutingPolicy
from carpool.routing.replicas import ReplicaState


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The replica with the fewest requests in flight (ties: fewest calls, then list order)."""
    return min(replicas, key=lambda r: (r.in_flight, r.calls))


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def select(
        self, text: str, replicas: Sequence[ReplicaState], scope: bytes = b""
    ) -> tuple[ReplicaState, Decision]:
        return least_loaded(replicas), Decision.LEAST_LOADED
