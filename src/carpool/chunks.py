"""OpenAI stream bodies: assembling a stream's chunks into a body, synthesizing chunks from one.

Pure functions; no I/O. The SSE framing those chunks travel in is :mod:`carpool.sse`.

Contract:

- ``assemble(kind, chunks)`` turns the parsed chunks of one OpenAI stream (``kind`` "chat" or
  "completion") into the equivalent non-streaming body; ``synthesize(kind, body, include_usage=)``
  does the reverse. ``assemble(kind, synthesize(kind, body, include_usage=True)) == body`` holds for
  bodies of the usual shape, i.e. when:
    * every choice has ``index``, ``finish_reason`` and ``logprobs`` (None or a dict), and chat
      choices a ``message`` with a ``role``;
    * a chat message's ``content`` is a string, or None only alongside non-empty ``tool_calls``,
      a ``function_call``, a non-empty ``refusal`` or reasoning text (``reasoning_content``,
      ``reasoning``), or ``audio`` (a bare None comes back as ``""``, the text of a stream that
      sent none);
    * tool calls have ``id``, ``type`` and ``function`` {``name``, ``arguments``} (or, for
      another type of call, its own object: a custom tool's ``custom``), and appear in index
      order; ``function_call`` has ``name`` and ``arguments``;
    * ``usage`` is a dict or absent (``"usage": None`` comes back absent); ``object`` is the
      standard one ("chat.completion" / "text_completion").
  Any other top-level, choice or message field survives as well: top-level ones keep their first
  non-null value (``id``, ``model``, ``created`` and ``system_fingerprint`` their first
  non-blank one: Azure OpenAI opens its streams with a chunk that has ``""`` and ``0`` there,
  before the real ones), choice ones their last non-null value (an object updating the one
  held, key by key: Azure's ``content_filter_results``; and vLLM's ``token_ids``,
  the ids of each chunk's new tokens, whose lists concatenate into the whole answer's, and its
  ``prompt_token_ids``, said once, which keep their first); message ones (``refusal``,
  ``reasoning_content``, ``audio``, ``annotations``...) merge as the SDKs accumulate deltas:
  strings concatenate, objects merge key by key (an ``index`` or ``type`` in them is replaced,
  not added to), list items with an ``index`` merge with the earlier item of that index, other
  lists extend, and other values keep their last non-null value. OpenAI's per-chunk
  ``obfuscation`` padding is the stream's alone: no level of the body keeps it.
  Logprobs keep exactly the keys the chunks sent (lists concatenate).
- Assembly is the engine's non-streaming answer for the stream shapes real servers send, not
  only for ``synthesize``'s: a tool call's (or legacy ``function_call``'s) ``id`` and ``type``
  are kept from their first delta, and its ``name`` is sent once (OpenAI, vLLM), in pieces, or
  repeated whole in every delta (llama-cpp-python's server, which repeats ``id``, ``type`` and ``name``
  with each piece of the arguments): a name delta equal to the whole name so far is a repeat,
  not more of the name (so a name streamed as two equal halves, ``"ab"`` + ``"ab"``, reads as
  ``"ab"``: no engine is known to split names so). ``arguments`` always concatenate. A call's
  other keys (a custom tool's ``custom``, Gemini's ``extra_content``) merge as message fields
  do, and it has a ``function`` only where a delta carried one (or nothing else). A stream
  without a usage chunk (an engine that ignores ``stream_options.include_usage``) assembles
  without ``usage``: nothing is invented.
  The chunks and bodies returned share nested values (usage, logprobs entries, ...) with their
  input: copy before mutating those.
- ``synthesize`` never raises on a body whose choices are odd (a choice that is no object, a
  ``message`` that is none, ``tool_calls`` that are no list of objects): those parts are left
  out. No complete answer has them (``completeness.is_complete``), and an incomplete one that
  does reaches a streaming client as its stream's failure instead (``reply.whole``); but an
  answer stored before they were judged so is still served.
- ``Assembly(kind)`` is ``assemble`` one chunk at a time (``add``; ``body()``), for a stream as it
  comes. Its ``add_texts(payloads, start)`` takes chat text chunks by their raw payloads alone,
  from ``start`` on, without parsing them into dicts, while each payload is that of the last
  text chunk ``add``ed with its payload but for its text (``TextTemplate``); the body is the
  same as if they had been parsed and ``add``ed. It returns how many it took (0: none, nothing
  done).
- A chunk that is not an object, or a choice that is not one, is passed over; a chunk whose
  fields are of a shape no server sends where the assembly reads them (``tool_calls: 5``, a
  choice ``index`` that is a list...) raises one of ``MALFORMED_CHUNK``, which callers tell as
  the upstream's malformed stream.
"""

from __future__ import annotations

from typing import Any

from .text_template import TextTemplate

# What assembling a chunk of the wrong shape raises (a choice index that is a list,
# ``tool_calls: 5``, a ``function`` that is a string...): the caller's to tell as the upstream's
# malformed stream (``exchange._publish``, ``apis.openai``), not to check field by field on the
# hot path.
MALFORMED_CHUNK = (TypeError, AttributeError, ValueError, KeyError)

# Top-level fields every chunk repeats (synthesize copies them into each chunk).
_IDENTITY = ("id", "created", "model", "system_fingerprint", "service_tier")
_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}


class _Merged:
    """Values of one field seen over many chunks, merged as the SDKs accumulate a stream's
    deltas (openai-python's ``ChatCompletionStreamState``, openai-node's): strings
    concatenate, objects merge key by key (OpenAI streams ``audio`` as ``{id, transcript}``,
    ``{data}``..., then ``{expires_at}``), list items that carry an ``index`` merge with the
    item of that index from earlier chunks, other lists extend, and anything else keeps its
    last non-null value."""

    __slots__ = ("texts", "last", "fields", "items", "indexed")

    def __init__(self) -> None:
        self.texts: list[str] | None = None
        self.last: Any = None
        self.fields: dict[str, _Merged] | None = None  # an object's, key by key
        self.items: list[Any] | None = None  # a list's: values, or ``_Merged`` indexed items
        self.indexed: dict[int, _Merged] | None = None  # those items by their index

    def add(self, value: Any) -> None:
        # Strings first: nearly every value a stream repeats is a piece of text.
        if isinstance(value, str):
            if self.texts is None:
                self.texts = []
            self.texts.append(value)
        elif value is None:
            return
        elif isinstance(value, dict):
            if self.fields is None:
                self.fields = {}
            _merge_object(self.fields, value)
        elif isinstance(value, list):
            self._extend(value)
        else:
            self.last = value

    def _extend(self, values: list[Any]) -> None:
        if self.items is None:
            self.items = []
        items, indexed = self.items, self.indexed
        # An item merges with the one of its index from an earlier chunk only: within one
        # list, each is an item of its own (as the SDKs take a list first seen whole).
        fresh: dict[int, _Merged] = {}
        for item in values:
            index = item.get("index") if type(item) is dict else None
            merged = indexed.get(index) if indexed and type(index) is int else None
            if merged is None and type(index) is int:
                merged = _Merged()
                items.append(merged)
                fresh.setdefault(index, merged)
            if merged is None:
                items.append(item)
            else:
                merged.add(item)
        if fresh:
            self.indexed = {**(indexed or {}), **fresh}

    def value(self) -> Any:
        if self.texts is not None:
            return "".join(self.texts)
        if self.fields is not None:
            return {key: merged.value() for key, merged in self.fields.items()}
        if self.items is not None:
            return [item.value() if type(item) is _Merged else item for item in self.items]
        return self.last


# Keys that name what an object is rather than carry a piece of it (a list item's ``index``,
# the ``type`` of a tagged union): a later value replaces the earlier, never adds to it.
_NAMING = frozenset(("index", "type"))


def _merge_object(fields: dict[str, _Merged], source: dict[str, Any]) -> None:
    """``source``, one chunk's piece of an object, merged into the object's ``fields`` (but
    the padding, ``_TOP_SKIP``)."""
    for key, value in source.items():
        if key == "obfuscation":
            continue
        merged = fields.get(key)
        if merged is None or (key in _NAMING and value is not None):
            merged = fields[key] = _Merged()
        merged.add(value)


def _merge_into(fields: dict[str, _Merged], source: dict[str, Any], skip: frozenset[str]) -> None:
    for key, value in source.items():
        if key not in skip:
            merged = fields.get(key)
            if merged is None:
                merged = fields[key] = _Merged()
            merged.add(value)


# Choice fields that carry a piece of the answer in each chunk, as its text does: vLLM's
# ``return_token_ids`` gives each chunk's choice the ids of its new tokens, and its whole answer
# the ids of all of them. Their lists concatenate.
_CONCATENATED = frozenset(("token_ids",))
# Choice fields said once, in a choice's first chunk (vLLM's completions ``prompt_token_ids``):
# the first non-null value is the answer's.
_FIRST = frozenset(("prompt_token_ids",))


def _keep_last(fields: dict[str, Any], source: dict[str, Any], skip: frozenset[str]) -> None:
    """The last non-null value of each field (a field only ever null is kept as None), but
    ``_CONCATENATED`` lists, which concatenate, ``_FIRST`` fields, whose first one is kept, and
    objects, which update the object held key by key (Azure's ``content_filter_results``, said
    with each content chunk, then ``{}`` with the finish: its whole answer has the results)."""
    for key, value in source.items():
        if key in skip or (value is None and key in fields):
            continue
        if type(value) is dict and type(held := fields.get(key)) is dict:
            fields[key] = {**held, **value}
        elif key in _CONCATENATED and type(value) is list:
            held = fields.get(key)
            if type(held) is list:
                held.extend(value)  # (a copy of its own: made below)
            else:
                fields[key] = list(value)  # (not the chunk's: the next ones extend it)
        elif key not in _FIRST or fields.get(key) is None:
            fields[key] = value


def _merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Logprobs of one choice: lists (tokens, content, ...) concatenate, others keep the last."""
    if not parts:
        return None
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                prior = merged.get(key)
                merged[key] = (prior if isinstance(prior, list) else []) + value
            elif value is not None or key not in merged:
                merged[key] = value
    return merged


# A tool call's keys read by ``_ToolCall`` itself, and the padding (``_TOP_SKIP``); any other (a
# custom tool's ``custom``, whose ``input`` OpenAI streams in pieces; Gemini's
# ``extra_content``, the thought signature its next turn must send back) merges as a message's
# fields do.
_TOOL_CALL_OWN = frozenset(("index", "id", "type", "function", "obfuscation"))


class _ToolCall:
    __slots__ = ("id", "type", "name", "arguments", "function", "fields")

    def __init__(self) -> None:
        self.id: str | None = None
        self.type: str | None = None
        self.name = ""
        self.arguments: list[str] = []
        self.function = False  # whether a delta carried a ``function``
        self.fields: dict[str, _Merged] = {}

    def add(self, delta: dict[str, Any]) -> None:
        # id and type come in the first delta of a call (some engines repeat them: the first
        # is kept). The name comes once, whole, from OpenAI and vLLM; llama-cpp-python's server
        # repeats it whole in every delta, with each piece of the arguments: a piece equal to
        # the whole name so far is that repeat, not more of the name.
        if self.id is None:
            self.id = delta.get("id")
        if self.type is None:
            self.type = delta.get("type")
        function = delta.get("function")
        if function is not None:
            self.function = True
            name = function.get("name")
            if isinstance(name, str) and name and name != self.name:
                self.name += name
            if function.get("arguments"):
                self.arguments.append(function["arguments"])
        if not _TOOL_CALL_OWN.issuperset(delta):
            _merge_into(self.fields, delta, _TOOL_CALL_OWN)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": self.type or "function"}
        if self.function or not self.fields:  # (a call that said nothing else: a function's)
            out["function"] = {"name": self.name, "arguments": "".join(self.arguments)}
        for key, merged in self.fields.items():
            out[key] = merged.value()
        return out


class _Choice:
    """One choice's state while its chunks are assembled."""

    # (``obfuscation``: see ``_TOP_SKIP``.)
    _CHAT_SKIP = frozenset(
        ("index", "delta", "message", "logprobs", "finish_reason", "obfuscation")
    )
    _COMPLETION_SKIP = frozenset(("index", "text", "logprobs", "finish_reason", "obfuscation"))
    _DELTA_SKIP = frozenset(("role", "content", "tool_calls", "function_call", "obfuscation"))

    def __init__(self, index: Any) -> None:
        self.index = index
        self.finish_reason: Any = None
        self.logprobs: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}  # other choice fields (vLLM's stop_reason, ...)
        # chat
        self.role: str | None = None
        self.content: list[str] | None = None  # None: no content string ever came
        self.fields: dict[str, _Merged] = {}  # other message fields (refusal, ...)
        self.tool_calls: dict[Any, _ToolCall] | None = None
        self.function_call: _ToolCall | None = None
        # completion
        self.text: list[str] = []

    def add(self, kind: str, choice: dict[str, Any]) -> None:
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if isinstance(choice.get("logprobs"), dict):
            self.logprobs.append(choice["logprobs"])
        if kind == "chat":
            _keep_last(self.extra, choice, self._CHAT_SKIP)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._add_delta(delta)
        else:
            _keep_last(self.extra, choice, self._COMPLETION_SKIP)
            if choice.get("text"):
                self.text.append(choice["text"])

    def _add_delta(self, delta: dict[str, Any]) -> None:
        if self.role is None:
            self.role = delta.get("role")
        content = delta.get("content")
        if isinstance(content, str):
            if self.content is None:
                self.content = []
            self.content.append(content)
        if delta.get("tool_calls") is not None:
            self._add_tool_calls(delta["tool_calls"])
        if delta.get("function_call") is not None:
            if self.function_call is None:
                self.function_call = _ToolCall()
            self.function_call.add({"function": delta["function_call"]})
        for key in ("tool_calls", "function_call"):
            if key in delta and delta[key] is None:
                self.fields.setdefault(key, _Merged())  # "tool_calls": null is kept as null
        _merge_into(self.fields, delta, self._DELTA_SKIP)

    def _add_tool_calls(self, deltas: Any) -> None:
        if self.tool_calls is None:
            self.tool_calls = {}
        for delta in deltas:
            if not isinstance(delta, dict):
                continue
            index = delta.get("index")
            if index is None:
                # Some servers omit the index and send whole calls: a new id starts a new call.
                last = next(reversed(self.tool_calls.values()), None)
                fresh = last is None or (delta.get("id") not in (None, last.id))
                index = len(self.tool_calls) if fresh else next(reversed(self.tool_calls))
            call = self.tool_calls.get(index)
            if call is None:
                call = self.tool_calls[index] = _ToolCall()
            call.add(delta)

    def body(self, kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if kind == "chat":
            out["message"] = self._message()
        else:
            out["text"] = "".join(self.text)
        # Exactly the keys the engine sent: OpenAI sends "content" and "refusal" in every
        # chunk (and in its non-streaming answer), vLLM "content" only.
        out["logprobs"] = _merge_logprobs(self.logprobs)
        out["finish_reason"] = self.finish_reason
        out.update(self.extra)
        return out

    def _message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role or "assistant"}
        fields = {key: merged.value() for key, merged in self.fields.items()}
        if self.content is not None:
            message["content"] = "".join(self.content)
        elif (
            self.tool_calls
            or self.function_call
            or any(
                fields.get(key) for key in ("refusal", "reasoning_content", "reasoning", "audio")
            )
        ):
            # What a non-streaming answer says when something else is the answer (calls, a
            # refusal, spoken audio, a reasoning model cut off before its answer): no text.
            message["content"] = None
        else:
            message["content"] = ""
        message.update(fields)
        if self.tool_calls is not None:
            message["tool_calls"] = [
                self.tool_calls[i].body() for i in sorted(self.tool_calls, key=_sort_key)
            ]
        if self.function_call is not None:
            call = self.function_call.body()["function"]
            message["function_call"] = call
        return message


# A chat chunk's choice that only adds text (nearly every chunk of a stream): its keys (its
# delta's: "content" alone). ``assemble`` takes it in one step, with the same result as
# ``_Choice.add``.
_PLAIN_CHOICE = frozenset(("index", "delta", "logprobs", "finish_reason"))
# ``obfuscation``: OpenAI's random padding of each chunk (``stream_options.include_obfuscation``,
# on by default), against length side channels; it belongs to the stream, and no
# non-streaming answer has it. (Skipped, it costs the hot path nothing: a chunk whose keys
# are all seen or skipped takes the fast path.)
_TOP_SKIP = frozenset(("object", "choices", "usage", "obfuscation"))
# Identity fields a stream may open with blank, before every other chunk says them: Azure
# OpenAI's first chunk (its prompt's content-filter results) has id "", model "", created 0.
# Blank there is "not said yet", as null is: a later value takes its place.
_BLANKABLE = frozenset(("id", "model", "created", "system_fingerprint"))
_BLANK = ("", 0)


def _unset(key: str, held: Any) -> bool:
    """Whether the top-level ``held`` value of ``key`` is still to be said by a later chunk."""
    return held is None or (key in _BLANKABLE and held in _BLANK)


def _takes(key: str, held: Any, value: Any) -> bool:
    """Whether ``value`` (a chunk's) replaces ``held`` (the top-level value so far)."""
    return held is None or (
        value is not None and key in _BLANKABLE and held in _BLANK and value not in _BLANK
    )


def assemble(kind: str, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streaming body equivalent to the parsed chunks of one "chat"/"completion" stream."""
    assembly = Assembly(kind)
    for chunk in chunks:
        assembly.add(chunk)
    return assembly.body()


class Assembly:
    """``assemble`` one chunk at a time: ``add`` them, ``body()`` is ``assemble`` of those so far.

    A chat stream's text chunks (all but a few) differ from each other only in their text. Once
    one was added with its raw ``payload``, those whose payload is its payload with another
    text in place (a ``TextTemplate``) are taken without parsing them into dicts:
    ``add_texts(payloads, start)`` is then ``add(parsed payload)`` of each, up to the first
    payload that is not such.
    """

    __slots__ = ("kind", "chat", "top", "seen", "nulls", "choices", "usage", "template", "_idle")

    def __init__(self, kind: str) -> None:
        self.kind, self.chat = kind, kind == "chat"
        self.top: dict[str, Any] = {}
        # The top-level keys seen (and those skipped): a chunk with no other key has nothing
        # more to say there (the usual case), but for a first value of a key only null (or
        # blank: ``_BLANKABLE``) so far.
        self.seen = set(_TOP_SKIP)
        self.nulls: list[str] = []  # the keys of ``top`` still unset (``_unset``)
        self.choices: dict[Any, _Choice] = {}
        self.usage: Any = None
        self.template: TextTemplate | None = None
        self._idle = 0  # templates made that took no chunk (two, and no more are made)

    def add(self, chunk: dict[str, Any], payload: bytes | None = None) -> None:
        """One parsed chunk; ``payload``: its raw text, to take the next ones like it by."""
        if not isinstance(chunk, dict):
            return
        top = self.top
        if not chunk.keys() <= self.seen:
            for key, value in chunk.items():
                if key in _TOP_SKIP:
                    continue
                # The first non-null (non-blank) value; the key kept if ever seen.
                if key not in top or _takes(key, top[key], value):
                    top[key] = value
                    self.seen.add(key)
            self.nulls = [key for key, value in top.items() if _unset(key, value)]
        elif self.nulls:  # (the same, for the only keys it can change)
            filled = False
            for key in self.nulls:
                value = chunk.get(key)
                if value is not None and _takes(key, top[key], value):
                    top[key], filled = value, True
            if filled:
                self.nulls = [key for key in self.nulls if _unset(key, top[key])]
        usage = chunk.get("usage")
        if usage is not None:
            self.usage = usage  # the last one: vLLM's continuous usage is cumulative
        choices_in = chunk.get("choices")
        if not isinstance(choices_in, list):
            return
        choices = self.choices
        for choice in choices_in:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            state = choices.get(index)
            if state is None:
                state = choices[index] = _Choice(index)
            if self.chat and state.content is not None and choice.keys() <= _PLAIN_CHOICE:
                delta = choice.get("delta")
                if (
                    type(delta) is dict
                    and len(delta) == 1
                    and type(text := delta.get("content")) is str
                    and choice.get("finish_reason") is None
                    and choice.get("logprobs") is None
                ):
                    state.content.append(text)  # (all ``_Choice.add`` would do with it)
                    if payload is not None and usage is None and len(choices_in) == 1:
                        self._learn(payload, chunk, text, state.content)
                    continue
            state.add(self.kind, choice)

    def add_texts(self, payloads: list[bytes], start: int) -> int:
        """How many of ``payloads`` from ``start`` on, one after the other, are text chunks
        like the last one ``add``ed with its payload (taken: as ``add`` would have taken
        them); 0: nothing was done."""
        template = self.template
        return 0 if template is None else template.take_many(payloads, start)

    def _learn(self, payload: bytes, chunk: dict[str, Any], text: str, content: list[str]) -> None:
        # A text chunk that did not fit the template: a new one from it, unless two templates
        # in a row took nothing (chunks that differ in more than their text: a stream that
        # gains nothing here, and should not pay for trying).
        old = self.template
        if old is not None and not old.took:
            self._idle += 1
        if self._idle < 2:
            self.template = TextTemplate.of(payload, chunk, text, content)

    def body(self) -> dict[str, Any]:
        top, choices = dict(self.top), self.choices
        body: dict[str, Any] = {
            "id": top.pop("id", None),
            "object": _OBJECT[self.kind],
            "created": top.pop("created", None),
            "model": top.pop("model", None),
            "choices": [choices[i].body(self.kind) for i in sorted(choices, key=_sort_key)],
        }
        body.update(top)
        if self.usage is not None:
            body["usage"] = self.usage
        return body


def _sort_key(index: Any) -> tuple[int, Any]:
    # Indices are ints; anything else sorts after them, by its text, instead of raising.
    return (0, index) if isinstance(index, int) else (1, str(index))


# ---------------------------------------------------------------------------------------------
# synthesize: non-streaming body -> stream chunks


def synthesize(kind: str, body: dict[str, Any], *, include_usage: bool) -> list[dict[str, Any]]:
    """Chunks a server could have streamed for ``body``: per choice a content chunk (a chat
    choice with logprobs: a role-only chunk, then its content), then per choice a finish chunk,
    then (``include_usage`` and the body has usage) a usage chunk."""
    identity = {key: body[key] for key in _IDENTITY if key in body}
    # Other top-level fields (vLLM's prompt_logprobs, ...) go once, in the first chunk.
    extra = {
        key: value
        for key, value in body.items()
        if key not in _IDENTITY and key not in ("object", "choices", "usage")
    }
    head = {**identity, "object": _CHUNK_OBJECT[kind]}
    if include_usage:
        head["usage"] = None  # as OpenAI does: null on all but the last chunk
    # Only objects: a stored answer the gateway judged complete before it asked for well-formed
    # choices (``completeness.is_complete``) may hold others, and no client's stream may fail
    # for them (what else is odd in it goes out as it is).
    found = body.get("choices")
    choices = [choice for choice in found if type(choice) is dict] if type(found) is list else []
    content = [part for choice in choices for part in _content_choices(kind, choice)]
    finish = [_finish_choice(kind, choice) for choice in choices]
    chunks = [{**head, "choices": [choice]} for choice in content + finish]
    if chunks:
        chunks[0].update(extra)
    if include_usage and body.get("usage") is not None:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks


def _content_choices(kind: str, choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A choice's content chunk; a chat choice with logprobs opens with a role-only chunk first,
    as vLLM and OpenAI send: the openai SDK's stream helper appends the logprobs of a choice's
    first chunk twice when it is not the stream's first (choices 1 and up, each token twice)."""
    content = _content_choice(kind, choice)
    if kind != "chat" or content["logprobs"] is None:
        return [content]
    delta = content["delta"]
    opening = {key: delta.pop(key) for key in ("role",) if key in delta}
    return [{**content, "delta": opening, "logprobs": None}, content]


def _content_choice(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    index = choice.get("index", 0)
    logprobs = choice.get("logprobs")
    if kind != "chat":
        return {
            "index": index,
            "text": choice.get("text") or "",
            "logprobs": logprobs,
            "finish_reason": None,
        }
    message = choice.get("message")
    if type(message) is not dict:
        message = {}  # (see ``synthesize``: never one of a complete answer)
    delta = {key: value for key, value in message.items() if key != "tool_calls"}
    calls = message.get("tool_calls")
    if type(calls) is list:
        calls = [call for call in calls if type(call) is dict]
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    elif "tool_calls" in message and calls is None:
        delta["tool_calls"] = None
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}


def _finish_choice(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    skip = ("index", "message", "text", "logprobs", "finish_reason")
    out: dict[str, Any] = {"index": choice.get("index", 0)}
    if kind == "chat":
        out["delta"] = {}
    else:
        out["text"] = ""
    out["logprobs"] = None
    out["finish_reason"] = choice.get("finish_reason")
    out.update((key, value) for key, value in choice.items() if key not in skip)
    return out
