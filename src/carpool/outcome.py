"""What the gateway did with a request: one value for the header, the metrics and the tests."""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    HIT = "hit"                       # served from the exact cache
    SEMANTIC_HIT = "semantic-hit"     # served from the semantic cache
    COALESCED = "coalesced"           # shared an identical request's upstream call
    MISS = "miss"                     # led an upstream call
    BYPASS = "bypass"                 # not eligible for sharing; sent upstream on its own

    @property
    def header(self) -> tuple[bytes, bytes]:
        return _HEADERS[self]

    @property
    def saved(self) -> bool:
        """The request did not cost an upstream call of its own."""
        return self in (Outcome.HIT, Outcome.SEMANTIC_HIT, Outcome.COALESCED)


_HEADERS = {outcome: (b"x-carpool", outcome.value.encode()) for outcome in Outcome}
