"""What the path answers: a ``Reply``, and how it is made of an answer or of an error.

Contract:
- A ``Reply`` is a status, headers (raw ASGI pairs; ``x-carpool`` on every cached endpoint's) and
  a body or an SSE stream. Its headers never frame its body (no ``content-length`` nor
  ``transfer-encoding``): the transports write their own beside them without a look at each
  (no hit pays for one), so headers taken from outside the gateway's code are filtered where
  they are taken in (another worker's answer: ``peers.workers``; an idempotency record keeps
  none: ``idempotency.records.replayable``). A streaming one holds its request's place in its flight until
  ``Reply.close()``, which the transport calls when the stream ends or the client goes.
- A long body need not be one piece: a ``Reply.parted``'s ``parts`` are the runs of pieces it
  is made of (a streamed hit's frames, shared with its answer), joined only if its ``body`` is
  read. ``slices`` gives any body in pieces of about ``SLICE_BYTES`` (views of its bytes, or a
  few parts joined), for a transport to write one at a time as its client reads: a client that
  stops reading then holds a slice of an answer, never its own copy of the whole. Every other
  reply's ``body`` is a plain attribute: a hit reads it at no cost.
- ``Reply.with_usage``: a streaming client's reply without the usage chunk it did not ask
  for (``whole``'s, a flight's ``Relay``, a bypassed stream asked with it) gives its stream
  with that chunk at its place, once it ended whole: what an idempotency record keeps.
  ``Reply.answered``: the answer such a stream makes (a flight's, assembled once for all its
  clients; a whole answer's own), by which that record judges it without parsing it again.
- ``whole``: a whole answer as JSON, or as SSE for a streaming client (with the final usage
  chunk if it asked for it; an answer whose frames are longer than a slice as ``parts``, its
  own frames, not joined, however short its body), ``age`` on a hit, ``Cache-Control:
  no-store`` on an answer the upstream said no shared cache may store; an incomplete 2xx body
  that reports an error, lacks the answer's field (no choices) or holds a malformed one (a
  choice that is no object, a chat message that is none, tool calls that are no list of
  objects) reaches a streaming client as its stream's failure (an error event, no end), as it
  came a client asking JSON (the error's words only to the request whose call it was:
  ``Answer.for_others``, ``pipeline``); an answer
  whose body has no ``usage`` because the engine reported none carries
  ``x-carpool-usage: missing`` (nothing is invented); one whose ``usage`` is its share of a
  merged embeddings call's (``Answer.usage_apportioned``) carries
  ``x-carpool-usage: apportioned``, whoever it is served to (a hit, a joiner, a replay too).
- ``unstreamable``: why ``whole`` could not make an answer's stream (a stored body that no
  carpool wrote: something else wrote where a store keeps it), before a reply is made of it:
  such an answer is a miss to a streaming client, never a 500 (``lead.unservable``).
- ``age_header(seconds)``: a hit's ``age`` (whole seconds, never negative), however the hit
  came: a stored answer, another worker's, an idempotent replay.
- ``error_reply``: an error as its API shapes it (Anthropic's for Messages, OpenAI's otherwise);
  ``refusal``: the gateway's own (``Reply.rejected``: counted in ``rejected``, under no outcome).
- A semantic hit names the entry it was served from by its opaque id only (``similarity``);
  ``semantic.mode: mark`` says what would have been served (``nearest``), never the entry's
  text, which another request sent.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, Any

import orjson

from . import exact_json
from .answer import Answer
from .apis import Api, api_of
from .broadcast import JOINED_BYTES
from .errors import CarpoolError, UpstreamStreamBroken
from .outcome import Outcome

if TYPE_CHECKING:
    from .semantic.cache import Candidate

log = logging.getLogger("carpool.reply")

JSON = (b"content-type", b"application/json")
SSE = (b"content-type", b"text/event-stream")
# A live stream's head. ``X-Accel-Buffering: no``, as the engines' SSE servers say it
# (sse-starlette): nginx buffers what it proxies by default, and a stream through carpool came
# in one read at its end behind it (its first token at the last).
SSE_HEADERS = [SSE, (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
# On an answer the upstream said no shared cache may store (``Answer.no_store``).
NO_STORE = (b"cache-control", b"no-store")
# On an answer whose body has no usage because the engine reported none (README, Streaming).
USAGE_MISSING = (b"x-carpool-usage", b"missing")
# On an answer whose usage is a share of a merged embeddings call's: an estimate, not the
# engine's own count for this input (``carpool.batching.embeddings``).
USAGE_APPORTIONED = (b"x-carpool-usage", b"apportioned")
# On a semantic hit's answer: its usage (in the body, or the usage chunk a stream may be asked
# for) is the stored prompt's, another prompt than the one asked (its tokens counted).
USAGE_OTHER_PROMPT = (b"x-carpool-usage", b"other-prompt")


# The most a whole reply is written in at a time (``Reply.slices``), with a wait for the client
# to read between two: a client that stops reading holds about one slice (beyond the transport's
# own buffer), never a copy of its whole answer. Broadcast's joined pieces are as big.
SLICE_BYTES = JOINED_BYTES


@dataclass(slots=True)
class Reply:
    """What the transport sends back: a complete body, or an SSE stream of frames. A long body
    may be kept as the runs of pieces it is made of (``parted``: a streamed hit's frames, its
    answer's own), not joined: a transport writes them a slice at a time (``slices``), and
    ``body`` joins them only if it is read."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    outcome: Outcome | None = None
    on_close: Callable[[], None] | None = field(default=None, repr=False)
    # The gateway's own refusal (``refusal``): counted in ``rejected``, under no outcome.
    rejected: bool = False
    # The body as runs of pieces, in order, shared with its answer: set by ``parted`` only;
    # None once joined, or for a body made whole.
    parts: tuple[Sequence[bytes], ...] | None = field(default=None, repr=False)
    # A streaming client's reply without the usage chunk it did not ask for: its stream with
    # it, as a client that asked for it gets it, once the stream ended whole (None if it did
    # not). What an idempotency record keeps (``idempotency.once``): a retry may ask for the
    # usage, or for JSON, which has it. None: the reply is all there is of its answer. (A
    # flight's relay gives it to a client that asked for the usage too: its own stream, which
    # its record then need not copy as it is sent.)
    with_usage: Callable[[], bytes | None] | None = field(default=None, repr=False)
    # The answer a streaming client's stream makes, once it ended whole (None before, or if it
    # failed): the one its flight assembled for all its clients as the chunks came (``Relay``),
    # or the whole answer its SSE was made of (``whole``). An idempotency record judges the
    # stream by it (``final.answer_is_final``), not by parsing every chunk again, once for
    # each keyed client of the flight.
    answered: Callable[[], Answer | None] | None = field(default=None, repr=False)

    @classmethod
    def parted(
        cls,
        status: int,
        headers: list[tuple[bytes, bytes]],
        parts: tuple[Sequence[bytes], ...],
        outcome: Outcome | None = None,
    ) -> Reply:
        """A whole reply whose body is ``parts``, joined only if ``body`` is read."""
        return _Parted(status, headers, outcome=outcome, parts=parts)

    @property
    def size(self) -> int:
        """The body's length in bytes, without joining it."""
        parts = self.parts
        if parts is None:
            return len(self.body)
        return sum(len(part) for run in parts for part in run)

    def slices(self, size: int = SLICE_BYTES) -> Iterator[bytes | memoryview]:
        """The body in pieces of about ``size`` bytes, made as they are asked for: views of a
        body's bytes, or ``parts`` joined a few at a time (a part longer than ``size``: in views
        of it). A body no longer than ``size`` is one piece, itself."""
        parts = self.parts
        if parts is None:
            yield from sliced(self.body, size)
            return
        pending: list[bytes] = []
        held = 0
        for part in chain.from_iterable(parts):
            if pending and held + len(part) > size:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, held = [], 0
            if len(part) > size:
                yield from sliced(part, size)
                continue
            pending.append(part)
            held += len(part)
        if pending:
            yield pending[0] if len(pending) == 1 else b"".join(pending)

    def close(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()

    def json(self) -> Any:
        return orjson.loads(self.body)


def sliced(data: bytes, size: int) -> Iterator[bytes | memoryview]:
    """``data`` in views of ``size`` bytes (the last shorter); itself if no longer than that."""
    if len(data) <= size:
        yield data
        return
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield view[start : start + size]


# The slot that holds a reply's body (a ``_Parted`` one's once joined).
_BODY: Any = vars(Reply)["body"]


class _Parted(Reply):
    """A ``Reply.parted``: its ``body`` a property that joins its parts when first read. Only
    such a reply pays for one: every other's ``body`` is a plain slot (a hit reads it at no
    cost)."""

    __slots__ = ()

    @property
    def body(self) -> bytes:
        parts = self.parts
        if parts is not None:
            _BODY.__set__(self, b"".join(chain.from_iterable(parts)))
            self.parts = None
        return _BODY.__get__(self)  # type: ignore[no-any-return]

    @body.setter
    def body(self, body: bytes) -> None:
        _BODY.__set__(self, body)
        self.parts = None


def age_header(seconds: float) -> tuple[bytes, bytes]:
    """The ``age`` header of an answer ``seconds`` old (0 for a clock that went back)."""
    return (b"age", str(int(max(0.0, seconds))).encode())


def whole(
    outcome: Outcome,
    answer: Answer,
    stream: bool,
    include_usage: bool,
    extra: Sequence[tuple[bytes, bytes]] = (),
    *,
    now: float,
) -> Reply:
    """A reply carrying a whole answer, as JSON or (for a streaming client, ``stream``) as
    SSE, with the final usage chunk if it asked for it (``include_usage``). ``now``: the
    wall-clock time its ``age`` counts to (the gateway's clock)."""
    headers = [JSON, outcome.header, *extra]
    if outcome is Outcome.HIT or outcome is Outcome.SEMANTIC_HIT:
        headers.append(age_header(answer.age(now)))
    said = usage_said(answer, stream, include_usage, other_prompt=outcome is Outcome.SEMANTIC_HIT)
    if said is not None:
        headers.append(said)
    if answer.no_store:
        # What the upstream said, passed on to the caches past this one: another worker that
        # asked this one for it (``peers.ask``) stores nothing either, nor does a proxy.
        headers.append(NO_STORE)
    if not stream:
        return Reply(200, headers, answer.body, outcome=outcome)
    headers[0] = SSE
    api = api_of(answer.kind)
    if (
        not answer.complete
        and (failed := failure_of(api, exact_json.loads(answer.body))) is not None
    ):
        return Reply(200, headers, api.error_event(failed), outcome=outcome)
    frames = answer.sse(include_usage)
    # Measured by its frames, not its body: a token stream's are many times the body they
    # assemble to (each chunk repeats the id, the model, the choice around a few characters).
    # Stored ones are summed once per answer; synthesized ones are a few.
    size = answer.frames_size if answer.frames is not None else sum(len(f) for f in frames)
    if size <= SLICE_BYTES:  # (the usual hit: one small piece, one write)
        reply = Reply(200, headers, b"".join(frames) + api.stream_end, outcome=outcome)
    else:
        # A long one is written a slice at a time from the answer's own frames
        # (``Reply.slices``), not copied whole for each request: many clients of one answer
        # hold it once.
        reply = Reply.parted(200, headers, (frames, (api.stream_end,)), outcome)
    if not include_usage:
        reply.with_usage = partial(_with_usage, answer)
    reply.answered = lambda: answer  # (a stream of a whole answer; not of a failure, above)
    return reply


def unstreamable(answer: Answer, include_usage: bool) -> str | None:
    """Why ``whole`` cannot make the stream of ``answer`` for a streaming client (``include_usage``
    as it asked): what its body raised, which its API could not make a stream of; None: it can.
    What is synthesized is kept (``Answer.sse``): the reply made next makes it not again. An
    answer with its own frames that is complete is not looked at (every streaming hit of a
    streamed answer, the usual one: its frames without the usage one were filtered twice)."""
    if answer.complete and answer.frames is not None:
        return None  # (its frames, or them but its usage one: nothing to fail; made by ``whole``)
    try:
        if not answer.complete:
            if failure_of(api_of(answer.kind), exact_json.loads(answer.body)) is not None:
                return None  # (``whole`` sends its failure: an error event)
        answer.sse(include_usage)
    except Exception as error:  # (whatever the API meets in a body it never made)
        return f"{type(error).__name__}: {error}"
    return None


def _with_usage(answer: Answer) -> bytes:
    """The stream of ``answer`` a client that did not ask for the usage receives, with the usage
    chunk added at its place (``Reply.with_usage``): the answer's own frames, that one among
    them; or, for a stream synthesized from its body, the one that body makes without the
    usage (``Answer.sse``), the usage chunk last, as a stream synthesized with it ends
    (``chunks.synthesize``; which also writes ``"usage": null`` on every other chunk, which
    this client was not sent)."""
    if answer.frames is not None:
        return sse_of(answer, True)
    frames, full = answer.sse(False), answer.sse(True)
    if len(full) == len(frames) + 1:  # (a usage chunk: the body has one)
        frames = [*frames, full[-1]]
    return b"".join(frames) + api_of(answer.kind).stream_end


def sse_of(answer: Answer, include_usage: bool) -> bytes:
    """``answer`` as the whole SSE body a streaming client receives (``Answer.sse``, then the
    API's ``stream_end``), with the final usage chunk if it asked for it (``include_usage``)."""
    return b"".join(answer.sse(include_usage)) + api_of(answer.kind).stream_end


def usage_said(
    answer: Answer, stream: bool, include_usage: bool, *, other_prompt: bool = False
) -> tuple[bytes, bytes] | None:
    """What a reply of ``answer`` says of its usage (``x-carpool-usage``), if anything: as JSON,
    or as SSE to a client that asked for the usage chunk (``include_usage``), ``missing`` when
    the engine reported none; ``apportioned`` when its usage is a share of a merged embeddings
    call's; else ``other-prompt`` when ``answer`` was made for another prompt (``other_prompt``:
    a semantic hit's)."""
    if (not stream or include_usage) and answer.usage_missing:
        # The engine reported no usage for this answer (it ignored include_usage on the
        # stream it was assembled from): said so, rather than dropped silently or invented.
        return USAGE_MISSING
    if answer.usage_apportioned:
        # Its usage is its share of a merged embeddings call's, an estimate: said so, on every
        # copy (the mark is in the body, which every layer keeps as it is).
        return USAGE_APPORTIONED
    if other_prompt:
        # No count of this prompt's was made: said, not made up; on every form (a stream
        # without its usage chunk too), so that a keyed retry's replay in another says it.
        return USAGE_OTHER_PROMPT
    return None


def failure_of(api: Api, body: Any) -> UpstreamStreamBroken | None:
    """What a streaming client is told of an incomplete 2xx body (never stored, so never a
    hit) that is no answer: one reporting an error (the engine's error object, beside choices
    too), one without the answer's field (``Api.answer_missing``: no choices), or one whose
    answer is malformed (``Api.answer_malformed``: a choice that is no object...), as a
    stream's failure (the API's error event, no end), not a stream that ends as if all went
    well; None for an answer, however incomplete. A client asking JSON gets the body as it
    came."""
    reported = body.get("error") if isinstance(body, dict) else None
    if reported is not None:
        # Instead of an answer (some servers and proxies answer 200 so; Anthropic's ``{"type":
        # "error", "error": obj}``), or beside one (not complete: ``completeness``), as the
        # same error in a stream's chunk fails the flight: a streamed retry is not replayed as
        # final what a JSON one is not.
        error = reported if isinstance(reported, dict) else {"message": str(reported)}
        return UpstreamStreamBroken("the upstream answered with an error", error)
    if api.answer_missing(body):
        return UpstreamStreamBroken(f"the upstream answered with no {api.answer_field}")
    if api.answer_malformed(body):
        # (A choice that is no object, a chat message that is none...: no stream is made of
        # it but by leaving parts out, which would end as if it were the whole answer.)
        return UpstreamStreamBroken(f"the upstream answered with malformed {api.answer_field}")
    return None


def error_reply(error: CarpoolError, outcome: Outcome | None, api: Api | None = None) -> Reply:
    """An error as its API shapes it (Anthropic's for Messages; OpenAI's otherwise)."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in error.headers().items()]
    if outcome is not None:
        headers.append(outcome.header)
    body = api.error_body(error) if api is not None else error.body()
    return Reply(error.status, headers, body, outcome=outcome)


def refusal(error: CarpoolError, api: Api) -> Reply:
    """The gateway's own refusal of a request to a cached endpoint (bad input, a key it cannot
    honour): ``x-carpool: bypass``, as every answer there says what it was (shared with none);
    ``rejected``: its caller counts it in ``rejected``, not under that outcome, so it is not
    timed under it either (``Gateway.observe``)."""
    reply = error_reply(error, Outcome.BYPASS, api)
    reply.rejected = True
    return reply


def similarity(candidate: Candidate) -> list[tuple[bytes, bytes]]:
    """A semantic hit's own headers: its score and the opaque id of the entry it was served from
    (``SemanticEntry.public_id``; never the entry's text, which another request sent)."""
    return [
        (b"x-carpool-similarity", f"{candidate.similarity:.4f}".encode()),
        (b"x-carpool-entry", candidate.entry.public_id.encode()),
    ]


def nearest(candidate: Candidate) -> list[tuple[bytes, bytes]]:
    """``semantic.mode: mark``: what would have been served, and why not if it would not.

    The nearest entry is named by its opaque id only: its text is another request's prompt
    (another tenant's, in a shared namespace), so it goes to the debug log, never to the client.
    """
    verdict = "serve" if candidate.verdict.ok else f"guard:{candidate.verdict.reason}"
    nearest = candidate.entry.public_id
    log.debug(
        "semantic mark: nearest entry %s (similarity %.4f, %s): %r",
        nearest,
        candidate.similarity,
        verdict,
        candidate.entry.text[:200],
    )
    return [
        (b"x-carpool-similarity", f"{candidate.similarity:.4f}".encode()),
        (b"x-carpool-semantic-nearest", nearest.encode()),
        (b"x-carpool-semantic-verdict", verdict.encode()),
    ]
