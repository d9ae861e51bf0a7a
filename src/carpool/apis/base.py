"""``Api``: what the gateway must know of one API it caches, behind one set of methods.

Contract:
- One ``Api`` object per cached endpoint (its ``kind``): the three OpenAI classics
  (``apis.openai``: "chat", "completion", "embedding"), OpenAI's Responses API
  (``apis.responses``) and Anthropic's Messages API (``apis.messages``). Everything that differs
  between them is answered here: how a request is validated, whether it may be shared, what its
  input text is, how its stream ends, how a stream is framed, judged and assembled into the
  non-streaming answer, how an answer is synthesized into a stream, and how an error is shaped.
  The layers (``pipeline``, ``answer``, ``idempotency``, ``fingerprint``, ``server``) ask
  ``apis.api_of(kind)`` for all of it rather than test the kind (what stays kind-specific there
  belongs to the classics alone: the embeddings batcher, list inputs, white-space rules).
- Two stream families. OpenAI's classic streams are ``data:`` chunks ending with ``data: [DONE]``
  (``stream_end`` is ``DONE``; ``last_event`` is None: the upstream's iterator ends at [DONE]).
  Typed streams (Responses, Messages) are ``event: TYPE`` + ``data: {"type": TYPE, ...}`` events
  with no [DONE]: they end after their last event (``last_event`` recognises it;
  ``stream_end`` is empty). Every payload of a typed stream names its own type, so the event
  name is always recoverable from the data alone (``frame``).
- ``collector()`` gathers one stream's chunks as they come (a ``Collector``: by default a list
  that ``judge_stream`` judges at the end); an API may take some chunks by their raw payload
  alone (``Collector.add_texts``: the classics' text chunks, ``chunks.Assembly``), framed
  as one-line payloads (``one_line_frames``).
- State the upstream keeps between calls (Responses: a stored response; chat: a completion
  asked with ``store: true``): ``keeps_state(body)`` says whether a request may continue or
  make any; ``state_continued`` names what it continues and ``state_made`` what its answer
  made (asked only where ``keeps_state`` said so), so that follow-ups go to the replica holding
  it (``routing.state``) and a ``DELETE`` of it drops its answers (``state_index``). The
  files a request's input names (``named_files``: any ``file_id`` in its items, every API,
  state kept or not) are such state too: a ``DELETE /files/{id}`` drops the answers naming it.
- Methods never raise on a malformed answer (they judge it incomplete), except ``validate``
  (``RequestError``) and ``judge_stream`` (``UpstreamStreamBroken`` for a stream that did not end
  whole).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson

from .. import exact_json
from ..errors import CarpoolError, RequestError, UpstreamStatusError
from ..sse import DONE, SSEDecoder, event_frame


class Collector:
    """One stream's chunks as they come (``Api.collector``): ``add`` each parsed one (with its
    raw payload), or first offer the payloads from it on to ``add_texts``, which takes those it
    knows without parsing them, one after the other, and says how many (0: none);
    ``judge`` as ``Api.judge_stream`` judges them all."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.chunks: list[dict[str, Any]] = []

    def add(self, chunk: dict[str, Any], payload: bytes) -> None:
        self.chunks.append(chunk)

    def add_texts(self, payloads: list[bytes], start: int) -> int:
        return 0

    def judge(self, asked: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        return self.api.judge_stream(self.chunks, asked)


class Api:
    """The default behaviour of an API; each API overrides what differs."""

    kind: str = ""
    path: str = ""  # the gateway's path, e.g. "/v1/responses"
    upstream_path: str = ""  # relative to the upstream's /v1 base, e.g. "/responses"
    streams: bool = True  # the API has a stream form (``stream: true``)
    stream_end: bytes = DONE  # what ends a stream sent to a client (b"": its last event)
    # For a typed stream: tells whether a payload is the stream's last event (the upstream's
    # iterator ends after it). None: the stream ends with ``data: [DONE]``.
    last_event: Callable[[bytes], bool] | None = None
    # Whether its streams carry the usage only when asked (``stream_options.include_usage``):
    # then a stream asked without it is an answer without the usage its other shapes have.
    usage_asked: bool = False
    # The field of a whole 2xx body that holds the answer (``answer_missing``).
    answer_field: str = "choices"
    # The body fields in which a client names its request (vLLM's ``request_id``), which the
    # key leaves out: never sent upstream (``request.parse`` takes them out), as an engine
    # names its answer after them and that answer is served to other clients. (None for
    # Responses, whose ``request_id``, vLLM's, is the id of the response it stores, and is in
    # its key; nor for Messages, which defines none and keys every field.)
    request_id_fields: frozenset[str] = frozenset()

    # --------------------------------------------------------------------------- the request

    def validate(self, body: dict[str, Any]) -> None:
        """Raise ``RequestError`` (400) for a field of the wrong type where the layers depend on
        it; the upstream validates the rest."""
        check_fields(body)

    def never_shared(self, body: dict[str, Any]) -> str | None:
        """Why this request may never be shared, whatever the sampling controls say (a reason
        for ``bypass``), or None. (Each API's adds its own reasons to these.)"""
        return latest_template(body)

    def runs_detached(self, body: dict[str, Any]) -> bool:
        """Whether the upstream runs the request to its end whether its client stays or not
        (a Responses ``background`` job, resumed by its id): a keyed one is then finished and
        kept when its client leaves (``idempotency.once``), or its retry runs it again."""
        return False

    def tenant_bound(self, body: dict[str, Any]) -> bool:
        """Whether the request or its answer names state the upstream keeps for the requester's
        own tenant (a stored answer's id, an uploaded file, an earlier response): then it is
        never shared across tenants, shared namespace or not (``names_tenant_state``)."""
        return names_tenant_state(body)

    def deterministic(self, body: dict[str, Any], engine: str = "generic") -> bool:
        """Whether the upstream gives the same output every time (CONTRACT.md "Sampling
        policy"): ``temperature`` 0, ``top_k`` 1 or a ``seed``; absent = the upstream's default,
        which samples (Anthropic's default temperature is 1). ``engine``: the upstream's
        (``upstream.engine``), where it samples past that rule (``is_deterministic``)."""
        return is_deterministic(body, engine)

    def client_usage(self, body: dict[str, Any], stream: bool) -> bool:
        """Whether a streaming client gets the usage in its stream (``include_usage``)."""
        options = body.get("stream_options")
        return stream and isinstance(options, dict) and options.get("include_usage") is True

    def streamed(self, body: dict[str, Any], ask_usage: bool) -> dict[str, Any]:
        """``body`` as asked of the upstream as a stream; ``ask_usage``: with its usage, when
        the API makes that optional."""
        return {**body, "stream": True}

    def input_texts(self, body: dict[str, Any]) -> list[str]:
        """The request's input text as the engine reads it, system prompt first: for routing
        (the prefix cache) and for invalidation by prompt prefix."""
        return []

    def expires_at(self, answer: dict[str, Any]) -> float | None:
        """When what a 2xx ``answer`` names upstream stops being there (a chat's audio:
        ``message.audio.expires_at``, seconds since the epoch), or None: the answer is kept no
        longer (``lead``), or a hit would hand out an id the upstream no longer knows."""
        return None

    # Whether the next request's prompt goes on with an answer's text (a completion's), rather
    # than holding it as a turn of its own, joined to the others as ``input_texts`` are.
    prompt_goes_on: bool = False

    def answer_texts(self, answer: dict[str, Any]) -> list[str]:
        """The texts a 2xx ``answer`` adds to its conversation, as ``input_texts`` reads them
        in the next turn's request: routing records them with the prompt, as the engine that
        made them holds them in its prefix cache (``exchange.send``)."""
        return []

    def keeps_state(self, body: dict[str, Any]) -> bool:
        """Whether this request may continue state the upstream keeps, or its answer make some
        (``state_continued``, ``state_made``): only then are they asked (an answer of no such
        request is not even parsed for them)."""
        return False

    def state_continued(self, body: dict[str, Any]) -> str | None:
        """The id of state the upstream keeps that this request continues (a stored response),
        which only the replica that made it holds; or None."""
        return None

    def semantic_split(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """(the text compared by meaning: the last user input, the rest of the body: compared
        exactly, in the scope), or None when the request has no semantic view."""
        return None

    # --------------------------------------------------------------------------- the stream

    def failure(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The error object of a stream event that reports a failure, or None: ``{"error":
        obj}`` (OpenAI, vLLM; ``upstream.http`` wraps a payload sent as ``event: error`` so) ->
        obj; a typed error event, ``{"type": "error", "error": obj}`` (Messages, Responses) ->
        obj, or ``{"type": "error", "code", "message", "param"}`` (Responses) -> those as an
        OpenAI error object; an engine's bare error object, ``{"object": "error", "message",
        "type", "code"}`` (vLLM's ``ErrorResponse`` unwrapped) -> the same."""
        error = chunk.get("error")
        if error is not None:  # (some servers write every field, ``"error": null`` too)
            if isinstance(error, dict):
                return self.failure(error) if error.get("type") == "error" else error
            return {"message": str(error), "type": "error", "code": None}
        if chunk.get("object") == "error":
            return {
                "message": chunk.get("message") or "the upstream stream failed",
                "type": chunk.get("type") or "server_error",
                "code": chunk.get("code"),
                "param": chunk.get("param"),
            }
        if chunk.get("type") == "error":
            return {
                "message": chunk.get("message") or "the upstream stream failed",
                "type": "server_error",
                "code": chunk.get("code"),
                "param": chunk.get("param"),
            }
        return None

    def frame(self, payload: bytes, chunk: dict[str, Any] | None = None) -> bytes:
        """One SSE event carrying ``payload`` (``chunk``: parsed, when the caller has it)."""
        # (``find``, not ``in``: CPython's bytes ``in`` first tries its argument as an integer,
        # and makes and drops a TypeError; this runs for every frame of every stream.)
        if payload.find(b"\n") != -1:  # a multi-line data field
            if chunk is None:
                return data_lines(payload)
            payload = orjson.dumps(chunk)  # one line
        return b"data: " + payload + b"\n\n"

    def one_line_frames(self, payloads: list[bytes]) -> list[bytes]:
        """``frame`` of each of ``payloads``, known to be one line each (taken by a
        ``Collector.add_texts``)."""
        return [self.frame(payload) for payload in payloads]

    def usage_only(self, chunk: dict[str, Any]) -> bool:
        """Whether ``chunk`` carries only the usage, for clients that did not ask for it."""
        return False

    def judge_stream(
        self, chunks: list[dict[str, Any]], asked: dict[str, Any] | None
    ) -> tuple[dict[str, Any], bool]:
        """(the non-streaming answer the stream's ``chunks`` make, whether it is complete:
        storable). Raises ``UpstreamStreamBroken`` when the stream did not end whole: the flight
        fails. ``asked``: the request body sent."""
        raise NotImplementedError

    def collector(self) -> Collector:
        """What gathers a stream's chunks as they come, to judge them at its end."""
        return Collector(self)

    def stream_chunks(self, raw: bytes) -> list[dict[str, Any]] | None:
        """The chunks of a whole SSE body as a client received it, or None unless it ended as
        the API's streams end (with ``[DONE]``, or for a typed stream with anything: its end
        is judged by ``judge_stream``) and no event in it reports a failure."""
        decoder = SSEDecoder()
        events = decoder.feed(raw)
        decoder.close()
        if decoder.truncated or not events:
            return None
        if self.stream_end == DONE:
            if events[-1][1] != b"[DONE]":
                return None
            events = events[:-1]
        chunks = []
        for event, payload in events:
            try:
                chunk = exact_json.loads(payload) if event != "error" else None
            except orjson.JSONDecodeError:
                return None
            if not isinstance(chunk, dict) or self.failure(chunk) is not None:
                return None
            chunks.append(chunk)
        return chunks

    # --------------------------------------------------------------------------- the answer

    def complete(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        """Whether a whole answer is complete and successful, worth storing."""
        return isinstance(body, dict) and "error" not in body

    def answer_missing(self, body: Any) -> bool:
        """Whether a 2xx body lacks the answer's field ``answer_field`` (absent, or null): a
        streaming client is told so as its stream's failure, not sent a stream with no answer
        in it that ends as if all went well (``reply.whole``)."""
        return isinstance(body, dict) and body.get(self.answer_field) is None

    def answer_malformed(self, body: Any) -> bool:
        """Whether a 2xx body's answer is not of the shape a stream is made of (chat and
        completions: ``completeness.well_formed``): never complete, so never stored, and a
        streaming client is told so as its stream's failure (``reply.whole``), not sent a
        stream made of what could be made of it."""
        return False

    def final(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        """Whether a 2xx answer means the upstream executed the request ``asked`` (``idempotency``:
        a retry replays it rather than running again). The default: a complete answer."""
        return self.complete(body, asked)

    def usage_tokens(self, body: Any) -> int:
        """Input (the whole prompt, however the API splits its count) + output tokens the
        upstream reported for ``body``; 0 for what is absent."""
        return 0

    # The key every stream payload that ``state_made`` reads has (``exchange``'s filter, before
    # a payload is parsed).
    state_field: bytes = b'"id"'

    def state_made(self, answer: dict[str, Any]) -> str | None:
        """The id of the state that ``answer`` (a whole body, or a stream event) of a request
        that ``keeps_state`` says the upstream now keeps, for later calls (``state_continued``,
        a pass-through call on it); or None."""
        return None

    def synthesize(self, body: dict[str, Any], include_usage: bool) -> list[bytes]:
        """The SSE frames a server could have streamed for ``body`` (without ``stream_end``)."""
        raise NotImplementedError

    def error_event(self, error: CarpoolError, sent: int | None = 0) -> bytes:
        """The SSE event that tells a streaming client its stream failed. ``sent``: the events
        of the stream its client was sent before it (a typed stream that numbers its events
        numbers this one after them: Responses' ``sequence_number``); None if not known."""
        return b"data: " + orjson.dumps({"error": error.error_object()}) + b"\n\n"

    def error_body(self, error: CarpoolError) -> bytes:
        """The body of an error reply (the gateway's own errors; an upstream's as it came)."""
        return error.body()


class TypedApi(Api):
    """An API whose streams are typed events with no ``[DONE]`` (Responses, Messages), whose
    usage counts ``input_tokens`` and ``output_tokens`` (and ``prompt_apart``)."""

    stream_end = b""
    # Prompt tokens the API's usage counts apart from ``input_tokens`` (Messages: its prompt
    # cache's): part of the prompt all the same, so part of ``usage_tokens``.
    prompt_apart: tuple[str, ...] = ()

    def events(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of a stream that makes ``body``."""
        raise NotImplementedError

    def usage_tokens(self, body: Any) -> int:
        return tokens(
            body.get("usage") if isinstance(body, dict) else None,
            "input_tokens",
            *self.prompt_apart,
            "output_tokens",
        )

    def synthesize(self, body: dict[str, Any], include_usage: bool) -> list[bytes]:
        return [
            event_frame(event["type"].encode(), orjson.dumps(event)) for event in self.events(body)
        ]


def check_messages(body: dict[str, Any]) -> None:
    """``model`` and a non-empty list of message objects (chat, Messages)."""
    require_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "'messages' must be a non-empty list of message objects", param="messages"
        )
    if not all(isinstance(message, dict) for message in messages):
        raise RequestError("each item of 'messages' must be an object", param="messages")
    check_fields(body)


def last_user_turn(body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """A ``messages`` body's semantic split: the last user turn's plain text, and the body
    without it (its other fields kept, in the scope); None when it is not a user's plain text."""
    last = body["messages"][-1]
    if last.get("role") != "user":
        return None
    text = plain_text(last.get("content"))
    if text is None:
        return None
    return text, {
        **body,
        "messages": [*body["messages"][:-1], {k: v for k, v in last.items() if k != "content"}],
    }


# The seeds engines read as "pick one at random": llama.cpp's default -1 (LLAMA_DEFAULT_SEED,
# 0xFFFFFFFF), Ollama's -1. Any negative seed or one past 32 bits is taken so (when unsure, a
# seed does not make a request shareable): its "regenerate" must not get the cached text.
_RANDOM_SEEDS_FROM = 2**32 - 1


# What names an object the upstream keeps for one account: an uploaded file (chat's file
# parts, Responses' input_file/input_image/computer screenshots, Messages' file sources), an
# earlier response, a stored item. Another tenant's request naming it would have been refused
# (404): in a shared namespace it must not read the answer the owner got. Any ``file_id`` in an
# input item counts, at any depth (a Messages tool_result's content, a document's content
# source, a Responses function or computer call's output: shapes the APIs add), but in a tool
# call's arguments (``input``, ``arguments``: what the model wrote, no file of the account's);
# schemas and metadata are outside the items. Parts nested deeper than anything the APIs
# define are taken as naming one (when unsure, a request is not shared).
_TOOL_ARGUMENTS = frozenset({"input", "arguments"})
_DEEPEST_PART = 16


def names_tenant_state(body: Any) -> bool:
    """Whether ``body`` names an object the upstream keeps for one account (a
    ``previous_response_id``, an ``item_reference``, a ``file_id``, an item's
    ``encrypted_content``, which only that account's organization can send back, a template
    or a context cache: ``_names_account_config``), or asks it to keep the answer
    (``store: true``). Read only for a shared namespace's requests."""
    if not isinstance(body, dict):
        return False
    if body.get("store") is True or body.get("previous_response_id") is not None:
        return True
    if _names_account_config(body):
        return True
    for field in ("messages", "input"):
        items = body.get(field)
        if isinstance(items, list) and any(_names_state(item) for item in items):
            return True
    return False


# What a request names of the configuration an account keeps upstream, the same name in two
# accounts naming two different ones (each account picks its names): OpenRouter's presets (a
# model ``@preset/<slug>``, alone or after a model, or a ``preset`` field: a system prompt,
# models, parameters, tools), LiteLLM's stored prompts (``prompt_id``, its ``prompt_version``
# or its latest), Gemini's context caches (``cached_content``, at the top or in the
# ``extra_body.google`` its OpenAI-compatible API reads).
_PRESET_MODEL = "@preset/"


def _names_account_config(body: dict[str, Any]) -> bool:
    """Whether ``body`` names a template, preset or context cache of the account's."""
    if _names_preset(body) or any(
        body.get(name) is not None for name in ("prompt_id", "cached_content")
    ):
        return True
    extra = body.get("extra_body")
    google = extra.get("google") if isinstance(extra, dict) else None
    return isinstance(google, dict) and google.get("cached_content") is not None


def latest_template(body: dict[str, Any]) -> str | None:
    """``prompt_latest`` when ``body`` names a template of the account's that is edited in
    place (an OpenRouter preset: its designated version, whichever that is now; a LiteLLM
    ``prompt_id`` without a ``prompt_version``), as a Responses stored ``prompt`` without a
    ``version``: two identical requests need not read the same template. Else None."""
    if _names_preset(body):
        return "prompt_latest"
    if body.get("prompt_id") is not None and body.get("prompt_version") is None:
        return "prompt_latest"
    return None


def _names_preset(body: dict[str, Any]) -> bool:
    """Whether ``body`` names an OpenRouter preset: by its model or its ``preset`` field."""
    model = body.get("model")
    return (isinstance(model, str) and _PRESET_MODEL in model) or body.get("preset") is not None


def _names_state(item: Any) -> bool:
    """Whether an input item or anything in it names an account's object."""
    return any(part is None or _names_object(part) for part in _input_parts(item, 0))


def _names_object(part: dict[str, Any]) -> bool:
    """Whether one object of an input item names an account's object itself."""
    return (
        # (Anthropic's signed compaction block, round-tripped verbatim; reasoning or a
        # compaction encrypted for one organization: OpenAI's Responses.)
        part.get("type") in ("item_reference", "compaction")
        or part.get("file_id") is not None
        or part.get("encrypted_content") is not None
    )


def named_files(body: Any) -> list[str]:
    """The ``file_id``s ``body``'s input items name (``messages``, ``input``, and a Responses
    stored prompt's ``variables``, whose values may be input items), each once, as
    ``names_tenant_state`` walks them: at any depth but a tool call's arguments, and no deeper
    than ``_DEEPEST_PART`` (no API defines a part that deep). Their answers are the files' to
    drop: a 2xx ``DELETE /files/{id}`` drops them (``state_index``)."""
    if not isinstance(body, dict):
        return []
    prompt = body.get("prompt")
    variables = prompt.get("variables") if isinstance(prompt, dict) else None
    files: dict[str, None] = {}
    for items in (
        body.get("messages"),
        body.get("input"),
        list(variables.values()) if isinstance(variables, dict) else None,
    ):
        if not isinstance(items, list):
            continue
        for item in items:
            for part in _input_parts(item, 0):
                if part is not None and isinstance(named := part.get("file_id"), str) and named:
                    files[named] = None
    return list(files)


def _input_parts(part: Any, depth: int) -> Iterator[dict[str, Any] | None]:
    """Each object in an input item ``part`` (itself first), but inside a tool call's arguments
    (``_TOOL_ARGUMENTS``); None where parts nest deeper than ``_DEEPEST_PART``, not walked
    further (``names_tenant_state`` takes them as naming an account's object)."""
    if isinstance(part, list):
        inner = [value for value in part if isinstance(value, (dict, list))]
    elif isinstance(part, dict):
        yield part
        inner = [
            value
            for name, value in part.items()
            if name not in _TOOL_ARGUMENTS and isinstance(value, (dict, list))
        ]
    else:
        return
    if inner and depth >= _DEEPEST_PART:
        yield None
        return
    for value in inner:
        yield from _input_parts(value, depth + 1)


def is_deterministic(body: Any, engine: str = "generic") -> bool:
    """``temperature`` 0, ``top_k`` 1 or a ``seed`` (CONTRACT.md "Sampling policy"): a seed in
    [0, 2**32 - 1), not one an engine reads as random (-1); ``top_k`` 1 unless the engine
    samples past it: llama-cpp-python's sampler draws from the whole distribution at a negative
    temperature, mirostat takes top-k's place, and llama.cpp's ``samplers`` may leave top-k
    out of its chain (a list of names, or a string of letters, top-k's ``k``); ``temperature``
    0 unless llama.cpp samples past it: its chain is ``samplers`` then a draw, so without the
    temperature sampler (``t``) the draw samples, a ``dynatemp_range`` makes 0 a positive
    temperature, and XTC (``xtc_probability``, past top-k too) draws whether to cut the top
    tokens. Never a request with a time budget (llama.cpp's ``t_max_predict_ms``): where its
    answer stops depends on the machine's speed, seed or not. ``engine`` (``upstream.engine``):
    TGI's and Ollama's OpenAI routes drop ``top_k``, so ``top_k`` 1 is nothing there; TGI
    samples whenever ``top_p`` is under 1, temperature 0 or not (``typical_p`` it drops)."""
    # (llama.cpp's own fields are rare: looked for once, their rules read only if one is there;
    # this runs on every request's first sight.)
    llama = not _LLAMA_CPP_FIELDS.isdisjoint(body)
    if llama and _positive(body.get("t_max_predict_ms")):
        return False
    seed = body.get("seed")
    if type(seed) is int and 0 <= seed < _RANDOM_SEEDS_FROM:
        return True
    if llama and _positive(body.get("xtc_probability")):
        return False
    if engine == "tgi" and _under_1(body.get("top_p")):
        return False
    temperature = body.get("temperature")
    samplers = body.get("samplers") if llama else None
    if body.get("top_k") == 1 and engine not in ("tgi", "ollama"):
        negative = isinstance(temperature, (int, float)) and temperature < 0
        mirostat = body.get("mirostat_mode") or body.get("mirostat")
        if not negative and not mirostat and _in_chain(samplers, "top_k", "k"):
            return True
    if temperature is None or temperature != 0:
        return False
    return not llama or (
        _in_chain(samplers, "temperature", "t") and not _positive(body.get("dynatemp_range"))
    )


# The fields by which llama.cpp samples past ``temperature`` 0 (``is_deterministic``).
_LLAMA_CPP_FIELDS = frozenset({"t_max_predict_ms", "xtc_probability", "samplers", "dynatemp_range"})


def _in_chain(samplers: Any, name: str, letter: str) -> bool:
    """Whether llama.cpp's ``samplers`` (none: its default chain, which has every one) holds a
    sampler: by name in a list, by letter in a string."""
    return samplers is None or (
        (isinstance(samplers, list) and name in samplers)
        or (isinstance(samplers, str) and letter in samplers)
    )


def _under_1(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1


def _positive(value: Any) -> bool:
    # (``true`` too: llama.cpp reads a JSON boolean as a number, 1.)
    return isinstance(value, (int, float)) and value > 0


def typed_frame(payload: bytes, chunk: dict[str, Any] | None = None) -> bytes:
    """One event of a typed stream: its name is the payload's own ``type``."""
    if chunk is None:
        try:
            chunk = exact_json.loads(payload)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            return data_lines(payload)  # not an event of the API: relayed as it came
    if payload.find(b"\n") != -1:  # (``find``: see ``Api.frame``)
        payload = orjson.dumps(chunk)
    name = chunk.get("type")
    if not (isinstance(name, str) and name and name.isprintable() and name.isascii()):
        return b"data: " + payload + b"\n\n"
    return event_frame(name.encode(), payload)


def data_lines(payload: bytes) -> bytes:
    """An event whose data is ``payload`` as it is, a ``data:`` line per line of it."""
    return b"data: " + payload.replace(b"\n", b"\ndata: ") + b"\n\n"


def ends_with(types: frozenset[str]) -> Callable[[bytes], bool]:
    """A ``last_event`` test: the payload is an event of one of ``types``. A cheap byte search
    first, so that only a candidate is parsed (the test runs on every payload)."""
    needles = tuple(t.encode() for t in types)

    def last(payload: bytes) -> bool:
        if not any(needle in payload for needle in needles):
            return False
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return False
        return isinstance(chunk, dict) and chunk.get("type") in types

    return last


def tokens(usage: Any, *names: str) -> int:
    """The sum of the non-negative int counts ``names`` of a usage object; never raises."""
    if not isinstance(usage, dict):
        return 0
    total = 0
    for name in names:
        value = usage.get(name)
        if type(value) is int and value >= 0:
            total += value
    return total


def plain_text(content: Any, part_types: frozenset[str] = frozenset({"text"})) -> str | None:
    """A message content as one text: a string, or a list of text parts only (joined by
    newlines); None when it holds anything else (an image, a tool result...)."""
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, dict) and p.get("type") in part_types and isinstance(p.get("text"), str)
            for p in content
        )
    ):
        return "\n".join(p["text"] for p in content)
    return None


def text_parts(content: Any) -> list[str]:
    """Every text in a message content (a string, or the ``text`` of each part)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    return []


def check_fields(body: dict[str, Any]) -> None:
    """The fields the fingerprint and the flights read, on every API that generates text."""
    if "stream" in body and not isinstance(body["stream"], bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if (
            value is not None
            and (not isinstance(value, (int, float)) or isinstance(value, bool))
            and not exact_json.is_big(value)  # (a number: the upstream judges its range)
        ):
            raise RequestError(f"'{name}' must be a number", param=name)
    # (An integer past 64 bits is refused here, as the float it was once parsed as was: no
    # engine takes a seed, a count or a top-k that large.)
    for name in ("top_k", "seed", "n"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise RequestError(f"'{name}' must be an integer", param=name)


def require_model(body: dict[str, Any]) -> None:
    if not isinstance(body.get("model"), str):
        raise RequestError("'model' is required and must be a string", param="model")


def passed_through(error: CarpoolError) -> bool:
    """An error whose body is not the gateway's to shape: the upstream's own, as it came (or
    its words taken out, in the shape it came in), or an idempotency problem (RFC 9457
    problem+json on every endpoint)."""
    return (isinstance(error, UpstreamStatusError) and not error.rewritten) or error.headers().get(
        "content-type"
    ) == "application/problem+json"
