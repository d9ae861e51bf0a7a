"""Which replica a miss is sent to: one small interface, one file per policy, one factory.

Only real misses reach routing: exact/semantic caching and coalescing happen before it. A
request that continues a stored response (and a pass-through call on one) goes to the replica
that made it, before any policy is asked (``state``: only that replica holds it).

    RoutingPolicy       ``select(text, replicas) -> (replica, Decision)`` + optional hooks
    ├── round_robin.RoundRobin       ``round-robin``: cycle through the healthy replicas
    ├── least_loaded.LeastLoaded     ``least-loaded``: fewest requests in flight
    └── cache_aware.CacheAware       ``cache-aware``: SGLang-style prefix affinity under a load guard
    replicas.ReplicaSet              health, back-off, probing, one failover, in-flight accounting
    state.StateHolders               which replica keeps a stored response, file, batch

The ``Decision`` a request was routed by is both a metric label and what the tests assert.

``text`` is the prompt as the engine will see it, in order (system prompt first): only its
prefix structure matters to ``cache-aware``; the other policies ignore it. ``scope`` (a chain
root, ``prefix.root_of``; ``b""``: none) is whose prefixes it may share: ``cache-aware``
matches a prompt only against the prompts of the same scope (one tenant, or one shared
namespace; one model; one ``cache_salt``).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from carpool.config import RoutingConfig

if TYPE_CHECKING:
    from carpool.routing.replicas import ReplicaState

__all__ = ["POLICIES", "Decision", "RoutingPolicy", "RoutingSettings", "build_policy"]


class Decision(StrEnum):
    """How one request's replica was chosen (a metric label and a test assertion)."""

    PREFIX_MATCH = "prefix_match"  # cache-aware: the best prefix match, load balanced
    LEAST_LOADED = "least_loaded"  # fewest in flight (least-loaded, or cache-aware with no match)
    IMBALANCED = "imbalanced"  # cache-aware: a prefix match overruled by the load guard
    ROUND_ROBIN = "round_robin"  # the next replica in turn
    ONLY_HEALTHY = "only_healthy"  # a single replica was eligible: no choice was made
    PROBE = "probe"  # a downed replica tried again (back-off over, or none healthy)
    FAILOVER = "failover"  # the retry on another replica after a failed attempt
    STATE_HOLDER = "state_holder"  # the replica holding the stored response it continues


class RoutingPolicy(Protocol):
    """Picks one of the eligible replicas for a request.

    ``replicas`` is never empty and holds only replicas the policy may pick (``ReplicaSet`` has
    already removed the ones in back-off). ``select`` must not block or await: it runs on the
    request path for every miss. The hooks do nothing unless a policy overrides them; policies
    subclass this class explicitly to inherit the defaults.
    """

    name: str

    def select(
        self, text: str, replicas: Sequence[ReplicaState], scope: bytes = b""
    ) -> tuple[ReplicaState, Decision]: ...

    def on_sent(self, text: str, replica: ReplicaState, scope: bytes = b"") -> None:
        """The request with ``text`` is being sent to ``replica`` (also a failover's retry)."""
        return None

    def on_done(self, replica: ReplicaState) -> None:
        """A request to ``replica`` finished (answered, failed, cancelled, or its stream closed)."""
        return None

    def on_lost(self, replica: ReplicaState) -> None:
        """``replica`` could not be reached (refused, reset): it comes back, if it does, with
        nothing cached."""
        return None

    # Whether ``on_answered`` is to be told (reading an answer's text costs a miss that much).
    learns_answers: bool = False

    def on_answered(self, text: str, replica: ReplicaState, scope: bytes = b"") -> None:
        """``replica`` answered: ``text`` is the prompt it was sent followed by the answer's
        text, as the next turn's prompt begins (what the engine's prefix cache now holds)."""
        return None


# The tunables live in the one typed config (``config.RoutingConfig``).
RoutingSettings = RoutingConfig


POLICIES = ("cache-aware", "round-robin", "least-loaded")


def build_policy(name: str, **settings: Any) -> RoutingPolicy:
    """The policy called ``name`` (``config.routing.policy``), tuned by ``RoutingSettings`` fields.

    Settings a policy does not use are accepted and ignored; unknown ones are an error. A
    ``policy`` key (as in a dumped ``RoutingConfig``) is ignored too.
    """
    settings.pop("policy", None)
    tuned = RoutingSettings(**settings)
    key = name.replace("_", "-").lower()
    if key == "round-robin":
        from carpool.routing.round_robin import RoundRobin

        return RoundRobin()
    if key == "least-loaded":
        from carpool.routing.least_loaded import LeastLoaded

        return LeastLoaded()
    if key == "cache-aware":
        from carpool.routing.cache_aware import CacheAware

        return CacheAware(
            cache_threshold=tuned.cache_threshold,
            balance_abs_threshold=tuned.balance_abs_threshold,
            balance_rel_threshold=tuned.balance_rel_threshold,
            tree_budget_chars=tuned.tree_budget_chars,
            block_chars=tuned.block_chars,
        )
    raise ValueError(f"unknown routing policy {name!r}; expected one of {', '.join(POLICIES)}")
