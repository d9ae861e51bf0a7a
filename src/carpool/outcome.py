"""What the gateway did with a request: one value for the header, the metrics and the tests."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    HIT = "hit"  # served from the exact cache
    SEMANTIC_HIT = "semantic-hit"  # served from the semantic cache
    COALESCED = "coalesced"  # shared an identical request's upstream call
    MISS = "miss"  # led an upstream call
    BYPASS = "bypass"  # not eligible for sharing; sent upstream on its own

    header: tuple[bytes, bytes]  # the ``x-carpool`` response header saying it
    saved: bool  # the request did not cost an upstream call of its own

    def __init__(self, value: str) -> None:
        # Plain attributes, not properties: every reply reads them.
        self.header = (b"x-carpool", value.encode())
        self.saved = value in ("hit", "semantic-hit", "coalesced")


def list_outcome(outcomes: set[Outcome]) -> Outcome:
    """What a list request was, from what its items were: a miss if any item was computed, a
    bypass if any was not shared (sampled), a hit if every one was served from the cache or
    its record, else coalesced."""
    if Outcome.MISS in outcomes:
        return Outcome.MISS
    if Outcome.BYPASS in outcomes:
        return Outcome.BYPASS
    return Outcome.HIT if outcomes == {Outcome.HIT} else Outcome.COALESCED
