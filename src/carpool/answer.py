"""An answer produced by one upstream call, in the form every layer shares and stores.

Contract:
- ``kind`` is its API's (``carpool.apis``). ``body`` is the complete response as a non-streaming
  client receives it, as bytes ready to send (assembled from the chunks when the upstream
  streamed). ``frames`` are the SSE frames as the upstream streamed them (``None`` if it did not
  stream); a streaming client is served those, or frames synthesized once from ``body`` by its
  API (``Api.synthesize``: chat chunks, or the typed events of Responses and Messages).
- ``complete`` is true only for a 2xx answer its API judges complete (``Api.complete``: every
  choice has a finish reason; embeddings: one vector per input; Responses: status
  ``completed``; Messages: a ``stop_reason``).
- ``no_store`` says that the upstream's ``Cache-Control`` forbids a shared cache to store it
  (``no-store`` or ``private``: ``http_syntax.shared_cache_may_store``), read from a whole
  answer's head only: an answer assembled from an upstream's stream is never ``no_store``, as
  SSE servers say ``no-store`` on every event stream by default (sse-starlette,
  llama-cpp-python's server), of the live feed, not of the answer (an owner worker's stream
  says it of the answer: ``reply.whole``). ``storable``: complete and not ``no_store``. Only
  storable answers are stored (exact and semantic cache, in-process and Redis) or kept
  joinable after their flight; one that is not is still its flight's clients' (the joiners of
  its call included: coalescing is not storing), and an idempotency record keeps it (the same
  client's retry).
- ``created`` is the wall-clock time the answer was produced: the ``age`` header counts from it.
- ``tokens`` is prompt + completion tokens of the call: what a hit or a joiner did not recompute,
  as the upstream reported them (``usage``); 0 when it reported none. ``usage_missing`` says
  that the body has no ``usage`` at all (e.g. assembled from the stream of an engine that
  ignores ``stream_options.include_usage``): nothing is invented in its place.
  ``usage_apportioned`` says that its ``usage`` is not the upstream's figure for it but a share
  of a merged embeddings call's (``batching.embeddings``), which its body says itself: its
  ``usage`` object ends with ``"apportioned": true`` (``APPORTIONED``), so every copy of it
  (stored, lingering, another worker's, another instance's) says so too.
- ``requester`` is whose call made an incomplete answer (``request.requester_digest`` of the
  body sent; None: not known, or complete). A body that reports an error (a 2xx some servers and
  proxies answer a failure with) may quote that request, as an error status's body may: a client
  of another request gets ``for_others``, the error's type and code without its words, as
  ``UpstreamError.for_others`` tells an error (``pipeline._own_call`` says who is which).
- Frames synthesized for streaming clients are made once each way (with the usage chunk and
  without) and kept in the answer (``sse``, ``synthesized``); ``on_synthesized``, if set, is
  called with the answer each time it keeps some: the in-process store counts them against its
  budget for the entries it keeps (``store.memory``), and the semantic cache for its entries
  (``semantic.cache``: every hit of an entry is served its answer, frames made once).
- An ``Answer`` is immutable once built; many clients read it at once. Its ``body`` is a copy
  of exactly its length (see ``__post_init__``; ``restored`` is given one), so ``size`` is what
  it really holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from . import exact_json
from .apis import api_of
from .errors import scrubbed

# How the body of an answer whose usage is apportioned ends (``usage_apportioned``): the
# batcher writes ``usage`` last, with ``apportioned`` its last key (orjson: no spaces).
APPORTIONED = b',"apportioned":true}}'


@dataclass(slots=True, eq=False)
class Answer:
    kind: str
    body: bytes
    complete: bool
    tokens: int = 0
    created: float = field(default_factory=time.time)
    frames: list[bytes] | None = None
    usage_frame: int | None = None  # index in frames of the usage-only chunk, if any
    _synthesized: dict[bool, list[bytes]] = field(default_factory=dict)
    _usage_missing: bool | None = None  # computed on first use (``usage_missing``)
    requester: str | None = None  # (an incomplete answer's: whose call it was)
    no_store: bool = False  # the upstream said no shared cache may store it (``storable``)
    _frames_size: int | None = None  # computed on first use (``frames_size``)
    # Told of frames ``sse`` synthesized and kept (the in-process store, for its budget).
    on_synthesized: Callable[[Answer], None] | None = None

    def __post_init__(self) -> None:
        # A copy holds exactly its length. orjson (>= 3.12) returns bytes whose buffer is at
        # least 4 KB whatever their length, and never shrinks it: kept in the cache, a 300-byte
        # answer built by orjson.dumps (an assembled stream, an embeddings batch's share) would
        # hold over ten times what the cache's byte budget counts (``size``).
        self.body = bytes(memoryview(self.body))

    @classmethod
    def restored(
        cls,
        kind: str,
        body: bytes,
        complete: bool,
        tokens: int,
        created: float,
        frames: list[bytes] | None = None,
        usage_frame: int | None = None,
    ) -> Answer:
        """An answer rebuilt from a store's copy of one (``store.packed``). ``body`` is a bytes
        object of exactly its length already (a slice): taken as it is, not copied again, and
        without the dataclass's ``__init__`` (a third of the time: a hit pays it)."""
        answer = cls.__new__(cls)
        answer.kind = kind
        answer.body = body
        answer.complete = complete
        answer.tokens = tokens
        answer.created = created
        answer.frames = frames
        answer.usage_frame = usage_frame
        answer._synthesized = {}
        answer._usage_missing = None
        answer.requester = None  # (only storable answers are stored or linger)
        answer.no_store = False
        answer._frames_size = None
        answer.on_synthesized = None
        return answer

    def served_copy(self) -> Answer:
        """This answer with a memo of its own (``sse``) and no ``on_synthesized``, its body and
        frames shared, not copied: what a holder that counts the frames its answer keeps takes
        of an answer others hold too (the semantic cache, of the one it inserts), so that its
        hook hears of those frames only, and no other holder's are kept in it uncounted."""
        return Answer.restored(
            self.kind,
            self.body,
            self.complete,
            self.tokens,
            self.created,
            self.frames,
            self.usage_frame,
        )

    @property
    def storable(self) -> bool:
        """Whether a cache may keep it: complete, and not ``no_store``."""
        return self.complete and not self.no_store

    @classmethod
    def from_body(cls, kind: str, parsed: dict[str, Any], raw: bytes, complete: bool) -> Answer:
        return cls(kind, raw, complete, api_of(kind).usage_tokens(parsed))

    def for_others(self) -> Answer:
        """This answer as told to a client of another request than ``requester``'s: itself,
        but for an incomplete one whose body reports an error (``error``), which becomes the
        upstream's type and code without its words (``errors.scrubbed``): in place beside an
        answer (choices), else the whole body, in the shape it came in (Anthropic's ``{"type":
        "error", "error": ...}``, else OpenAI's ``{"error": ...}``)."""
        if self.complete:
            return self
        try:
            body = exact_json.loads(self.body)
        except orjson.JSONDecodeError:
            return self
        reported = body.get("error") if isinstance(body, dict) else None
        if reported is None:
            return self
        error = scrubbed(reported if isinstance(reported, dict) else {})
        if not api_of(self.kind).answer_missing(body):
            told = {**body, "error": error}
        elif body.get("type") == "error":
            told = {"type": "error", "error": error}
        else:
            told = {"error": error}
        return Answer(self.kind, orjson.dumps(told), False, self.tokens, self.created)

    @property
    def usage_missing(self) -> bool:
        """Whether the body has no ``usage`` object (the upstream reported none)."""
        if self.tokens > 0:  # the usual case, without parsing the body
            return False
        missing = self._usage_missing
        if missing is None:
            try:
                parsed = orjson.loads(self.body)
                missing = not (isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict))
            except orjson.JSONDecodeError:
                missing = False
            self._usage_missing = missing
        return missing

    @property
    def usage_apportioned(self) -> bool:
        """Whether the body's ``usage`` is a share of a merged call's, not the upstream's own
        figure for it (``carpool.batching.embeddings``). Read from the body's end: no parse."""
        return self.kind == "embedding" and self.body.endswith(APPORTIONED)

    @property
    def frames_size(self) -> int:
        """The length of its frames (0 for none), summed once: a streamed hit is served them
        in slices or in one piece by it (``reply.whole``), and the cache counts it (``size``)."""
        size = self._frames_size
        if size is None:
            size = self._frames_size = sum(len(f) for f in self.frames or ())
        return size

    @property
    def size(self) -> int:
        """Bytes this answer holds, for the cache budget."""
        return len(self.body) + self.frames_size + 200

    def sse(self, include_usage: bool) -> list[bytes]:
        """The frames a streaming client receives (without the API's ``stream_end``, the final
        ``[DONE]`` of OpenAI's classic streams)."""
        if self.frames is not None:
            if include_usage or self.usage_frame is None:
                return self.frames
            return [f for i, f in enumerate(self.frames) if i != self.usage_frame]
        cached = self._synthesized.get(include_usage)
        if cached is None:
            cached = self._synthesized[include_usage] = api_of(self.kind).synthesize(
                exact_json.loads(self.body), include_usage
            )
            if self.on_synthesized is not None:
                self.on_synthesized(self)  # (kept: counted by whoever keeps this answer)
        return cached

    @property
    def synthesized(self) -> Mapping[bool, list[bytes]]:
        """The frames ``sse`` synthesized and keeps, by ``include_usage`` (none yet: empty)."""
        return self._synthesized

    def age(self, now: float) -> float:
        """Seconds since it was made, at ``now`` on the clock that made ``created`` (the
        gateway's: never the system's, which a test's or a skewed instance's is not)."""
        return max(0.0, now - self.created)
