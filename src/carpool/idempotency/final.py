"""Final or retryable (``is_final``; the table is its docstring; ``answer_is_final``: a stream
judged by the answer its flight assembled), the replay's format (``replay_as``), and the tokens
a replay saved (``saved_tokens``; both at once, from one parse: ``replayed``).

Final or retryable
- Only a request the upstream executed is frozen as its final answer (the draft's and Stripe's
  rule: a result is saved only once the request began executing): a complete 2xx answer, or an
  error of the upstream for a request it executed and refused or failed (most 4xx, 500). The
  caller ``finish``es with those only. A 500 is final as Stripe keeps it: the engine ran the
  request and failed on it, and the contract replays "success or upstream error"; a client that
  wants another try after one uses a new key.
- Everything else is retryable, and the caller ``abandon``s the record, so that a retry with the
  same key runs again: the gateway's own refusals, an unreachable upstream (502), a timeout
  (504), 408/409/425/429, a proxy's 502/503/504, a flight abandoned (499), a 200 that is not a
  complete answer (an error body, a body cut or not JSON, a stream that ended with an error
  event or without ``[DONE]``). A timeout is retryable although the engine may have run the
  request: the gateway has no answer to replay, freezing the 504 for the retention would turn a
  slow moment into a day-long failure, and running an LLM call twice costs tokens but has no
  other effect; so a timed-out request is run at least once, not at most once.
- A record is taken before the request runs, so the gateway's refusals of a request as sent
  (400 bad body or fields, 413, 431, an invalid key: ``parse``/``parse_key``) never reach it.
- A list input (the caller's ``list_items``) has one record for the list and one per item
  (``key`` + ``"\\n"`` + index): an item's record is finished only with a complete 2xx answer,
  and the list's only when every item has one; otherwise the list's record is released (kept
  with its fingerprint, while any item's is kept) or dropped, and a retry recomputes just the
  items without an answer (``carpool.idempotency.once``).

The format
- ``StoredResponse.streamed`` is the format of the request that made the record (``stream``
  is outside the request digest, so a retry may ask for the other one; and so is
  ``stream_options.include_usage``). ``replay_as`` gives the stored response as a retry asks
  for it: a 2xx answer of an API with streams as a hit of it is served (``reply.whole``): a
  stored stream (kept with its usage chunk: ``once``) its frames as they were sent, but the
  usage chunk only for a retry that asks for it, or assembled into the JSON body; a stored
  JSON body as it is, or, complete, synthesized into the API's stream; with ``x-carpool-usage:
  missing`` where the retry asks for a usage the engine did not report. An error is replayed
  as it is in its own format (an embedding's only format is JSON: ``Request.stream`` is False
  for every embeddings request); in the other, None, and the caller answers
  ``IdempotencyFormatMismatch`` (422): it is never replayed in the other format, and a client
  never gets JSON on a stream or SSE for a non-streaming request.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..answer import Answer
from ..apis import APIS, Api
from ..errors import UpstreamStreamBroken
from ..reply import JSON, SSE, USAGE_OTHER_PROMPT, sse_of, usage_said
from .records import StoredResponse

SSE_TYPE = b"text/event-stream"
_RETRY_MEANT = frozenset((408, 409, 425, 429, 499))
_NOT_REACHED = frozenset((502, 503, 504))


def is_final(kind: str, response: StoredResponse, asked: dict[str, Any] | None = None) -> bool:
    """Whether ``response`` (to a request of ``kind``: "chat", "responses"..., ``carpool.apis``;
    ``asked``: its body, whose ``n`` says how many choices make it whole) is the request's final answer, kept for the retention and replayed; if not, it is retryable and a
    retry with the same key runs again.

        status            final  why
        2xx, complete     yes    executed and answered (JSON: ``Api.complete``; a stream:
                                 it ended whole ([DONE] or its last event), no error event,
                                 complete)
        2xx, incomplete   no     not an answer: an error body, a body cut or not JSON, a stream
                                 that failed part-way (error event) or was cut (no [DONE],
                                 no last event)
        4xx but below     yes    executed and refused by the upstream (400 bad parameters,
                                 401/403, 404 no such model, 413, 422...): the same request is
                                 refused again, so replaying the error is the answer
        408 409 425 429   no     not executed, the upstream asks for a retry (request timeout,
                                 conflict, too early, rate limited); 409 is also the gateway's
                                 "an item is still processing"
        499               no     the flight was abandoned: every client left, the call was
                                 cancelled
        500 501 505-511   yes    executed and failed in the engine: replayed, as Stripe does
                                 (it keeps 500s); a client that wants another try uses a new key
        502 503 504       no     not reached or not executed: the gateway's own "unreachable",
                                 "stream broken", "malformed answer" (502), "store unavailable"
                                 (503), "timeout" (504: see the module docstring), or a proxy in
                                 front of the engine saying the same
        other (1xx, 3xx,  no     not an answer of the engine (512-599: proxies' own codes such
        512-599)                 as 520-524)

    The gateway's own refusals of a request as sent (400, 413, 431, an invalid key) come before
    its record is begun; what it answers after that (409, 499, 502, 503, 504) is in the "no"
    rows. Never raises.
    """
    status = response.status
    if 200 <= status < 300:
        return _answered(kind, response, asked)
    if 400 <= status < 500:
        return status not in _RETRY_MEANT
    return 500 <= status <= 511 and status not in _NOT_REACHED


def answer_is_final(kind: str, answer: Answer, asked: dict[str, Any] | None = None) -> bool:
    """``is_final`` of a 2xx stream that ended whole (``[DONE]`` or its last event, no error
    event) and made ``answer``: as its flight assembled it once for all its clients, which
    judged its chunks as they came (``exchange``) or a whole answer's body (``reply.whole``).
    Judged by that answer, not by parsing the stream again: complete, or else an answer the
    upstream executed (``Api.final`` of its body, one JSON object, not one a chunk). Its
    ``complete`` was judged against its flight's request, which asked as ``asked`` does (one
    key, one ``n``)."""
    if answer.complete:
        return True
    api = APIS.get(kind)
    body = _json_body(answer.body)
    return api is not None and body is not None and api.final(body, asked)


def replay_as(
    response: StoredResponse, kind: str, stream: bool, include_usage: bool
) -> StoredResponse | None:
    """``response`` as a retry asks for it (``stream``, ``include_usage``), or None when it has
    no faithful form in that format (then: ``IdempotencyFormatMismatch``): ``replayed``'s."""
    return replayed(response, kind, stream, include_usage)[0]


def replayed(
    response: StoredResponse, kind: str, stream: bool, include_usage: bool
) -> tuple[StoredResponse | None, int | None]:
    """(``response`` as a retry asks for it, or None; the tokens the replay saved:
    ``saved_tokens``), from one parse of the stored answer: a long stream's is most of what a
    replay costs (every chunk parsed and assembled), and both are read from it.

    A 2xx answer of an API with streams (``carpool.apis``: chat, completions, Responses,
    Messages) is served as a hit of it would be (``reply.whole``: ``Answer.sse``, ``usage_said``):
    a stored stream is its frames as they were sent, with the usage chunk only if the retry
    asks for it (``include_usage``), or its body assembled for JSON; a stored JSON body is that
    body as it is, or synthesized into the API's stream, if complete; ``x-carpool-usage:
    missing`` on what asks for a usage the engine did not report, ``other-prompt`` where its
    record says it (a semantic hit's). Anything else (an error, an
    embedding) is as it is in its own format, and has no form in the other: the upstream might
    have answered the other format differently."""
    api = APIS.get(kind)
    same = response if response.streamed == stream else None
    if not 200 <= response.status < 300 or api is None or not api.streams:
        return same, saved_tokens(kind, response) if same is not None else None
    if response.streamed:
        answer = _stream_answer(api, kind, response.body)
    elif stream:
        answer = _json_answer(api, kind, response.body)
    else:
        # (Its body as it is, and what it said of its usage; its tokens: one JSON body's.)
        return response, saved_tokens(kind, response)
    if answer is None:  # (a stream not whole, a body not complete: as it is, if at all)
        # (No answer, no tokens: ``saved_tokens`` finds none in it either.)
        return same, 0 if same is not None else None
    headers = [SSE if stream else JSON]
    # (A semantic hit's record says it in its headers: no mark in the body does.)
    said = usage_said(
        answer, stream, include_usage, other_prompt=USAGE_OTHER_PROMPT in response.headers
    )
    if said is not None:
        headers.append(said)
    return StoredResponse(
        response.status, headers, sse_of(answer, include_usage) if stream else answer.body, stream
    ), answer.tokens


def saved_tokens(kind: str, response: StoredResponse) -> int | None:
    """The tokens the upstream reported for a stored answer (its usage: what a replay did not
    recompute), 0 when it reported none; None for an error (no answer, no tokens)."""
    api = APIS.get(kind)
    if not 200 <= response.status < 300 or api is None:
        return None
    body = _assembled(api, response.body) if response.streamed else _json_body(response.body)
    return api.usage_tokens(body) if body is not None else 0


def _answered(kind: str, response: StoredResponse, asked: dict[str, Any] | None) -> bool:
    """A 2xx response is a complete answer (see ``is_final``) to ``asked`` (the request's body:
    a chat with ``n`` 2 is answered by two choices, not one)."""
    api = APIS.get(kind)
    if any(
        name == b"content-type" and value.startswith(SSE_TYPE) for name, value in response.headers
    ):
        if api is None or not api.streams:
            return False
        return _assembled(api, response.body, asked) is not None
    body = _json_body(response.body)
    if body is None:
        return False
    if api is not None:
        return api.final(body, asked)
    return "error" not in body  # another endpoint: its shape is unknown here


def _assembled(api: Api, raw: bytes, asked: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The complete answer a whole SSE body makes: None unless it ended as the API's streams
    end (``[DONE]``, or its last event), no event in it is an error, and it is complete."""
    judged = _judged(api, raw, asked)
    return None if judged is None else judged[1]


def _judged(
    api: Api, raw: bytes, asked: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any], bool] | None:
    """(the chunks of a whole SSE body, the answer they make, whether it is complete), or None
    (``_assembled``)."""
    chunks = api.stream_chunks(raw)
    if chunks is None:
        return None
    try:
        body, complete = api.judge_stream(chunks, asked)
    except UpstreamStreamBroken:
        return None
    return (chunks, body, complete) if complete or api.final(body, asked) else None


def _json_answer(api: Api, kind: str, raw: bytes) -> Answer | None:
    """The answer a stored JSON body holds (``Answer``: its stream synthesized from it), if it
    is complete; None otherwise."""
    body = _json_body(raw)
    if body is None or not api.complete(body):
        return None
    return Answer(kind, raw, True, api.usage_tokens(body))


def _stream_answer(api: Api, kind: str, raw: bytes) -> Answer | None:
    """The answer a stored whole stream holds, as a streamed answer is cached (``Answer``): its
    frames as they were sent, the usage chunk's index among them, its body assembled; None
    unless it ended whole (``_assembled``)."""
    judged = _judged(api, raw)
    if judged is None:
        return None
    chunks, body, complete = judged
    end = api.stream_end
    sent = raw[: len(raw) - len(end)] if end and raw.endswith(end) else raw
    # The gateway wrote it (``Api.frame``, its synthesized chunks): every event ends with a
    # blank line, which no event holds within (a blank line ends an SSE event), one a chunk.
    frames = [event + b"\n\n" for event in sent.split(b"\n\n")[:-1]]
    usage: int | None = None
    if len(frames) == len(chunks) and b"".join(frames) == sent:
        usage = next((i for i, chunk in enumerate(chunks) if api.usage_only(chunk)), None)
    else:  # (not one event a chunk: sent as it is, usage chunk or not)
        frames = [sent]
    return Answer(
        kind, orjson.dumps(body), complete, api.usage_tokens(body), frames=frames, usage_frame=usage
    )


def _json_body(raw: bytes) -> dict[str, Any] | None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None
