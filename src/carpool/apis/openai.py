"""OpenAI's classic endpoints: chat completions, completions, embeddings.

Contract (``apis.base.Api``; the stream logic itself is ``carpool.sse``):
- Streams are ``data:`` chunks ending with ``data: [DONE]``; the usage comes in a last chunk of
  its own (``"choices": []``) only when ``stream_options.include_usage`` asks for it, and the
  gateway asks for it on the streams it shares (``upstream.stream_usage``), hiding it from the
  clients that did not (``usage_asked``: a stream asked without it is an answer other shapes
  of its request may not get, ``exchange.without_usage``).
- A stream is whole when it ended with [DONE] (``upstream.base``) and every choice in it
  finished: anything less fails the flight (``judge_stream`` raises), and so does a chunk the
  assembly cannot read (``chunks.MALFORMED_CHUNK``: ``tool_calls: 5``...). A whole stream or body
  with fewer choices than asked for (``n`` per prompt: an engine that ignores ``n``, as
  Ollama's) is served as it came, but not stored (``complete``; ``judge_stream``'s False).
- Validation: ``model`` a string; ``messages`` a non-empty list of objects (chat); ``prompt`` /
  ``input`` a string, a list of strings or token lists (completions, embeddings; a completion's
  ``prompt`` may be null, OpenAI's default prompt, left to the upstream); and, except
  for embeddings, ``stream`` a boolean (null is no stream: ``request.parse``),
  ``temperature``/``top_p`` numbers, ``top_k``/``seed``/``n`` integers. Embeddings are always
  deterministic and have no stream.
- The semantic view: the last user message (chat; plain text only) or a string prompt's
  finished sentences (completions: what follows its last sentence end, the unfinished text its
  answer continues, is in the scope, exact: :func:`unfinished`; a prompt without a sentence end
  has none); embeddings have none, nor has a request whose answer repeats its prompt
  (``echo``, vLLM's ``prompt_logprobs``: :func:`echoes_prompt`). An answer that carries its
  prompt whatever asked for it (vLLM's ``prompt_token_ids``, ``prompt_logprobs``, its
  Responses ``input_messages``: :func:`answer_repeats_prompt`) gets no semantic entry.
- Sharing (chat): ``web_search_options`` never shares (``server_tools``): the answer is made of
  a live web search, as with the Responses and Messages search tools. Audio (``modalities``
  with ``audio``, an ``audio`` output, or an assistant message naming an earlier one by its
  ``audio.id``) binds a request to its tenant (``tenant_bound``): the answer's audio id names
  audio the upstream keeps for the account that asked, which a later turn refers to and
  another account could not.
- State (chat only): a chat completion asked with ``store: true`` is kept upstream under its
  answer's ``id`` (a whole body's, every stream chunk's), which ``GET``/``POST``/``DELETE
  /v1/chat/completions/{id}`` and ``.../messages`` name: ``keeps_state`` is that request's,
  ``state_made`` its answer's id. Its follow-ups go to the replica that made it, its answers
  are tagged with it and a 2xx ``DELETE`` of it drops them, as a stored response's
  (``apis.responses``). Without ``store: true`` the id names nothing kept: no state.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..chunks import MALFORMED_CHUNK, Assembly
from ..errors import CarpoolError, RequestError, UpstreamStreamBroken, error_event
from ..sse import (
    assemble,
    expected_choices,
    frame,
    is_complete,
    synthesize,
    usage_tokens,
    well_formed,
)
from .base import (
    Api,
    Collector,
    check_fields,
    check_messages,
    last_user_turn,
    names_tenant_state,
    require_model,
    text_parts,
)


class _Assembling(Collector):
    """A classic stream assembled as it comes (``chunks.Assembly``): its text chunks taken by
    their payload alone once one like them was parsed."""

    def __init__(self, api: _Classic) -> None:
        super().__init__(api)
        self.classic = api  # (its ``judged``)
        self.assembly = Assembly(api.kind)
        self.add = self.assembly.add  # type: ignore[method-assign]  # (the same, one call less)
        self.add_texts = self.assembly.add_texts  # type: ignore[method-assign]

    def judge(self, asked: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
        return self.classic.judged(self.assembly.body(), asked)


class _Classic(Api):
    """What chat and completions share: [DONE] streams of choices."""

    usage_asked = True
    request_id_fields = frozenset({"request_id", "rid"})  # (vLLM's, SGLang's: ``canonical``)

    def never_shared(self, body: dict[str, Any]) -> str | None:
        # vLLM's disaggregated prefill (its proxies send it to ``/v1/completions``, or chat):
        # the answer names this request's KV blocks, held for its own decode
        # (``remote_block_ids``); another client's decode would read them.
        # (And its encoder cache's, ``ec_transfer_params``, alike: when unsure, not shared.)
        if body.get("kv_transfer_params") is not None or body.get("ec_transfer_params") is not None:
            return "engine_state"
        return super().never_shared(body)

    def streamed(self, body: dict[str, Any], ask_usage: bool) -> dict[str, Any]:
        body = {**body, "stream": True}
        if ask_usage:
            options = body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            # (The engines read it only beside include_usage, which this client did not ask:
            # alone it changes no frame, and asked beside the usage it would put one in every
            # chunk; its stream is keyed apart all the same, ``canonical``.)
            options.pop("continuous_usage_stats", None)
            body["stream_options"] = {**options, "include_usage": True}
        return body

    def usage_only(self, chunk: dict[str, Any]) -> bool:
        return not chunk.get("choices") and chunk.get("usage") is not None

    def one_line_frames(self, payloads: list[bytes]) -> list[bytes]:
        # (``frame`` of a one-line payload, without a call for each: a stream's text chunks)
        return [b"data: " + payload + b"\n\n" for payload in payloads]

    def judge_stream(
        self, chunks: list[dict[str, Any]], asked: dict[str, Any] | None
    ) -> tuple[dict[str, Any], bool]:
        try:
            body = assemble(self.kind, chunks)
        except MALFORMED_CHUNK:
            # (As ``exchange._publish`` tells it of a stream as it comes: a recorded stream a
            # bypass relayed as it came is judged so, ``idempotency.final``.)
            raise UpstreamStreamBroken("the upstream sent a malformed stream chunk") from None
        return self.judged(body, asked)

    def judged(
        self, body: dict[str, Any], asked: dict[str, Any] | None
    ) -> tuple[dict[str, Any], bool]:
        """``judge_stream`` of the assembled ``body``."""
        if not is_complete(self.kind, body) and not _spoken(self.kind, body):
            # (A choice begun that never finished: cut short.)
            raise UpstreamStreamBroken("the upstream stream ended before every choice finished")
        # A choice asked for that never began, in a stream that ended with [DONE]: the engine
        # answered fewer (it ignores ``n``); its client would have got this, so it is served.
        return body, is_complete(self.kind, body, expected_choices(self.kind, asked))

    def collector(self) -> Collector:
        return _Assembling(self)

    def complete(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        return is_complete(self.kind, body, expected_choices(self.kind, asked))

    def answer_missing(self, body: Any) -> bool:
        # (Empty too: the stream made of it would be ``data: [DONE]`` alone.)
        return isinstance(body, dict) and not body.get("choices")

    def answer_malformed(self, body: Any) -> bool:
        return not well_formed(self.kind, body)

    def usage_tokens(self, body: Any) -> int:
        return usage_tokens(body)

    def synthesize(self, body: dict[str, Any], include_usage: bool) -> list[bytes]:
        return [
            frame(orjson.dumps(chunk))
            for chunk in synthesize(self.kind, body, include_usage=include_usage)
        ]

    def error_event(self, error: CarpoolError, sent: int | None = 0) -> bytes:
        return error_event(error)


def _spoken(kind: str, body: dict[str, Any]) -> bool:
    """Whether the choices of a chat stream that ended ([DONE]) without a finish reason are all
    whole spoken answers, each then given "stop": OpenAI's audio models end such a stream on the
    audio's ``expires_at`` delta and never say one (openai-node #1206), and their whole answer
    says "stop". A spoken choice without that delta was cut short (as openai-node infers "stop"
    only with it). The body is then complete (true), or not (false: cut short)."""
    choices = body.get("choices")
    if kind != "chat" or not isinstance(choices, list):
        return False
    unfinished = [c for c in choices if isinstance(c, dict) and c.get("finish_reason") is None]
    if not unfinished or not all(
        isinstance(c.get("message"), dict)
        and isinstance(audio := c["message"].get("audio"), dict)
        and audio.get("expires_at") is not None
        for c in unfinished
    ):
        return False
    for choice in unfinished:
        choice["finish_reason"] = "stop"
    return is_complete(kind, body)


class ChatApi(_Classic):
    kind, path, upstream_path = "chat", "/v1/chat/completions", "/chat/completions"

    def validate(self, body: dict[str, Any]) -> None:
        check_messages(body)

    def never_shared(self, body: dict[str, Any]) -> str | None:
        # A search or a code run the upstream makes itself reads a web, an index or a machine
        # that changes: two identical requests are not the same request (as Responses' and
        # Messages' server tools). Said by a field (OpenAI's ``web_search_options``, Azure's
        # ``data_sources``, xAI's ``search_parameters``, Alibaba's ``enable_search``, Baidu's
        # ``web_search``, OpenRouter's web plugin: each unless turned off), a tool of a type of
        # the engine's own (Groq's ``browser_search``, ``code_interpreter``; one without a type:
        # not a ``function`` the client runs), or the model (OpenAI's search models, Perplexity's,
        # Groq's Compound, an OpenRouter slug ending ``:online``).
        if not _LIVE_NAMES.isdisjoint(body) and any(
            live(body.get(field)) for field, live in _LIVE_FIELDS.items()
        ):
            return "server_tools"
        plugins = body.get("plugins")  # (OpenRouter's: its web search, not every plugin)
        if isinstance(plugins, list) and any(
            not isinstance(plugin, dict) or plugin.get("id") == "web" for plugin in plugins
        ):
            return "server_tools"
        tools = body.get("tools")
        if isinstance(tools, list) and any(
            isinstance(tool, dict) and _engines_own(tool) for tool in tools
        ):
            return "server_tools"
        model = body.get("model")
        if isinstance(model, str) and _searches(model):
            return "server_tools"
        return super().never_shared(body)

    def tenant_bound(self, body: dict[str, Any]) -> bool:
        return names_tenant_state(body) or _audio(body)

    def input_texts(self, body: dict[str, Any]) -> list[str]:
        # (Content as a string or as parts: the SDKs send either for the same text.)
        return [
            text
            for m in body["messages"]
            if isinstance(m, dict)
            for text in text_parts(m.get("content"))
        ]

    def answer_texts(self, answer: dict[str, Any]) -> list[str]:
        message = _first_choice(answer).get("message")
        return text_parts(message.get("content")) if isinstance(message, dict) else []

    def expires_at(self, answer: dict[str, Any]) -> float | None:
        # (Each choice's audio: the earliest to go; a value that is no number, now.)
        choices = answer.get("choices")
        times: list[float] = []
        for choice in choices if isinstance(choices, list) else ():
            message = choice.get("message") if isinstance(choice, dict) else None
            audio = message.get("audio") if isinstance(message, dict) else None
            if isinstance(audio, dict) and "expires_at" in audio:
                when = audio["expires_at"]
                number = isinstance(when, (int, float)) and not isinstance(when, bool)
                times.append(when if number else 0.0)
        return min(times, default=None)

    def keeps_state(self, body: dict[str, Any]) -> bool:
        return body.get("store") is True  # (OpenAI's default is false: nothing kept)

    def state_made(self, answer: dict[str, Any]) -> str | None:
        made = answer.get("id")  # (a whole body's, or a stream chunk's: the same)
        return made if isinstance(made, str) and made else None

    def semantic_split(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        if echoes_prompt(body) or body.get("store") is True:
            # (Stored, the answer's id names the completion kept for this prompt: a paraphrase
            # would be handed an id whose messages are another prompt's.)
            return None
        return last_user_turn(body)


class CompletionApi(_Classic):
    kind, path, upstream_path = "completion", "/v1/completions", "/completions"

    def validate(self, body: dict[str, Any]) -> None:
        require_model(body)
        # ``"prompt": null`` is OpenAI's (its default prompt, ``<|endoftext|>``), and what the
        # SDK sends for ``prompt=None``: the upstream's to answer or refuse, not the gateway's.
        prompt = body.get("prompt", ...)
        if prompt is not None and not is_text_or_tokens(prompt):
            raise RequestError(
                "'prompt' must be a string, a list of strings or token lists", param="prompt"
            )
        check_fields(body)

    def input_texts(self, body: dict[str, Any]) -> list[str]:
        return _texts(body.get("prompt"))

    prompt_goes_on = True

    def answer_texts(self, answer: dict[str, Any]) -> list[str]:
        text = _first_choice(answer).get("text")
        return [text] if isinstance(text, str) else []

    def semantic_split(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or echoes_prompt(body):
            return None  # token ids and list prompts: exact only
        # The answer continues the prompt's very words: "...? Answer: You" was continued with
        # "can reset it...", served to "...? Answer:". Only its finished sentences are compared
        # by meaning; what follows them must be the same.
        cut = unfinished(prompt)
        if cut == 0:
            return None  # no sentence ends: all of it is continued
        return prompt[:cut], {**body, "prompt": prompt[cut:]}


class EmbeddingApi(Api):
    kind, path, upstream_path = "embedding", "/v1/embeddings", "/embeddings"
    answer_field = "data"
    streams = False
    request_id_fields = frozenset({"request_id", "rid"})  # (vLLM's, SGLang's: ``canonical``)

    def validate(self, body: dict[str, Any]) -> None:
        require_model(body)
        if not is_text_or_tokens(body.get("input")):
            raise RequestError(
                "'input' must be a string, a list of strings or token lists", param="input"
            )

    def deterministic(self, body: dict[str, Any], engine: str = "generic") -> bool:
        return True

    def input_texts(self, body: dict[str, Any]) -> list[str]:
        return _texts(body.get("input"))

    def complete(self, body: Any, asked: dict[str, Any] | None = None) -> bool:
        # One vector per input of the request ``asked``: one short of some is not complete.
        return is_complete(self.kind, body, expected_choices(self.kind, asked))

    def usage_tokens(self, body: Any) -> int:
        return usage_tokens(body)

    def error_event(self, error: CarpoolError, sent: int | None = 0) -> bytes:
        return error_event(error)


def _audio(body: dict[str, Any]) -> bool:
    """Whether a chat asks for an audio answer (whose ``audio.id`` the upstream keeps for the
    account, for later turns) or names one in an assistant message."""
    modalities = body.get("modalities")
    if body.get("audio") is not None or (isinstance(modalities, list) and "audio" in modalities):
        return True
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("audio") is not None for m in messages
    )


def echoes_prompt(body: Mapping[str, Any]) -> bool:
    """Whether the answer carries the request's own prompt: ``echo`` (the text is the prompt
    and then the completion; vLLM's chat prepends the last message), vLLM's
    ``prompt_logprobs`` (the prompt's tokens, any value but null: 0 asks for them too), its
    ``return_token_ids`` (``prompt_token_ids``: the prompt as token ids, which decode to it) or
    ``return_prompt_text`` (``prompt_text``: the prompt as the chat template rendered it, system
    prompt and all), or SGLang's ``return_prompt_token_ids``. Served to a paraphrase, such an
    answer would hand it another request's prompt word for word."""
    echo = body.get("echo")
    return (
        (echo is not None and echo is not False)
        or body.get("prompt_logprobs") is not None
        or any(body.get(name) not in (None, False) for name in _PROMPT_ASKED)
    )


#: Fields that ask an engine to send the prompt back (vLLM's, SGLang's).
_PROMPT_ASKED = ("return_token_ids", "return_prompt_text", "return_prompt_token_ids")


# The answer's own copy of its prompt, whichever request field asked for it (vLLM's
# ``prompt_token_ids`` and ``prompt_logprobs``, top level or per choice; its Responses
# ``input_messages``, the whole prompt as messages), with a value: an engine may write them as
# null when not asked.
#: Where a sentence ends: a stop, question or exclamation mark before white space (or the
#: end), or a line break ("3.5", "e.g.x" go on).
_SENTENCE_END = re.compile(r"[.?!…][\"'”’)\]]*(?=\s|$)|\n")


def unfinished(prompt: str) -> int:
    """Where the text after a completion prompt's last sentence end starts (0: none ends)."""
    ends = [match.end() for match in _SENTENCE_END.finditer(prompt)]
    return ends[-1] if ends else 0


_PROMPT_IN_ANSWER = re.compile(
    rb'"(?:prompt_(?:token_ids|logprobs|text)|input_messages)"\s*:\s*[^\sn]'
)


def answer_repeats_prompt(body: bytes) -> bool:
    """Whether a JSON answer body carries its prompt (``echoes_prompt`` reads the request; this
    reads what came back, whatever field of the request or default of the engine asked for
    it): such an answer is never served to a paraphrase. (A bare-quoted name is a key: in a
    JSON string its quotes are escaped.)"""
    return (
        body.find(b'"prompt_') != -1 or body.find(b'"input_messages"') != -1
    ) and _PROMPT_IN_ANSWER.search(body) is not None


def is_text_or_tokens(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    if isinstance(first, str):
        return all(isinstance(item, str) for item in value)
    # (``type(...) is int``: a JSON ``true`` is no token id, though Python's bool is an int:
    # ``[true]`` would have met ``[1]``'s answer, in a batch's slot or a flight.)
    if type(first) is int:
        return all(type(item) is int for item in value)
    return all(isinstance(item, list) and all(type(t) is int for t in item) for item in value)


def _texts(value: Any) -> list[str]:
    """The texts of a prompt or an input: itself, or the strings of a list (token ids have
    none), in order."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str)]
    return []


def _first_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer's first choice (``{}`` where it has none it can read)."""
    choices = answer.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) else {}


# Chat fields with which the upstream answers from what it reads at call time (``never_shared``).
# Each with what asks for the search (its default where a value leaves it out).
_LIVE_FIELDS: dict[str, Callable[[Any], bool]] = {
    "web_search_options": lambda value: value is not None,  # (OpenAI's: any asks)
    "data_sources": lambda value: bool(value),  # (Azure's: a list of sources)
    # (xAI's: "auto" by default, "off" turns it off)
    "search_parameters": lambda value: isinstance(value, dict) and value.get("mode") != "off",
    "enable_search": lambda value: bool(value),  # (Alibaba's: off by default)
    # (Baidu's: ``{"enable": true}``, off by default)
    "web_search": lambda value: isinstance(value, dict) and value.get("enable") is True,
}


_LIVE_NAMES = frozenset(_LIVE_FIELDS)


@functools.lru_cache(maxsize=256)  # (a few model names, each asked for on every first sight)
def _searches(model: str) -> bool:
    return _SEARCH_MODEL.search(model) is not None


def _engines_own(tool: dict[str, Any]) -> bool:
    """Whether a chat tool is one the engine runs itself: of a ``type`` but a function's (the
    client runs those), or of none and no ``function`` (LiteLLM's Gemini ``{"googleSearch":
    {}}``; a typeless one with a ``function`` is a function's, as vLLM and SGLang read it)."""
    kind = tool.get("type")
    if kind is None:
        return not isinstance(tool.get("function"), dict)
    return kind not in ("function", "custom")


# Models that search the web (or run code) on every call: OpenAI's ``gpt-4o-search-preview``,
# ``gpt-5-search-api``; Perplexity's ``sonar`` family; Groq's ``compound`` ones
# (``groq/compound-mini``, ``compound-beta``); any OpenRouter slug ending ``:online`` (its web
# plugin). A provider's prefix before them too.
_SEARCH_MODEL = re.compile(
    r"(?:^|[-/_.:])(?:search-preview|search-api|sonar)(?:$|[-/_.:])"
    r"|(?:^|/)compound(?:-beta)?(?:-mini)?$"
    r"|:online$",
    re.I,
)
