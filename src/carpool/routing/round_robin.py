"""``round-robin``: each miss goes to the next eligible replica in turn.

No affinity and no load signal: the baseline the other policies are measured against, and the
right choice when prompts share nothing and requests cost about the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from carpool.routing import Decision, RoutingPolicy
from carpool.routing.replicas import ReplicaState


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def select(
        self, text: str, replicas: Sequence[ReplicaState], scope: bytes = b""
    ) -> tuple[ReplicaState, Decision]:
        # A counter over the eligible replicas: when one is down, its turns go to the others.
        replica = replicas[self._turn % len(replicas)]
        self._turn += 1
        return replica, Decision.ROUND_ROBIN
