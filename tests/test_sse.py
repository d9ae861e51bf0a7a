"""carpool.sse: the SSE decoder and framing; carpool.chunks: the stream <-> body conversions;
carpool.completeness: judging bodies."""

from __future__ import annotations

import copy
import itertools
import json

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool import sse, text_template
from carpool.chunks import Assembly, assemble, synthesize
from carpool.completeness import is_complete, usage_tokens
from carpool.sse import DONE, SSEDecoder, frame

# A stream exercising most of the format: a BOM, comments, ignored fields, multi-line data, a
# payload without the optional space, a named error event, a split UTF-8 character, [DONE].
STREAM = (
    "\ufeff: keep-alive\n"
    "id: 1\nretry: 100\n"
    'data: {"a": 1}\n\n'
    "data:line one\ndata: line two\n\n"
    ": comment between events\n"
    "event: error\n"
    'data: {"error": {"message": "boom"}}\n\n'
    'data: {"text": "h\u00e9llo \u2603 \U0001f600"}\n\n'
    "event: \ndata\n\n"
    "data: [DONE]\n\n"
).encode()

EXPECTED = [
    (None, b'{"a": 1}'),
    (None, b"line one\nline two"),
    ("error", b'{"error": {"message": "boom"}}'),
    (None, '{"text": "h\u00e9llo \u2603 \U0001f600"}'.encode()),
    (None, b""),
    (None, b"[DONE]"),
]


def decode(*pieces: bytes) -> list:
    decoder = SSEDecoder()
    events = []
    for piece in pieces:
        events += decoder.feed(piece)
    events += decoder.close()
    assert not decoder.truncated
    return events


# --- decoder ------------------------------------------------------------------------------------


def test_decoder_returns_event_name_and_payload_pairs_of_a_whole_stream():
    assert decode(STREAM) == EXPECTED


def test_decoder_gives_the_same_events_whatever_byte_the_stream_is_split_at():
    for cut in range(len(STREAM) + 1):
        assert decode(STREAM[:cut], STREAM[cut:]) == EXPECTED, cut


def test_decoder_gives_the_same_events_when_fed_one_byte_at_a_time():
    assert decode(*(STREAM[i : i + 1] for i in range(len(STREAM)))) == EXPECTED


def test_decoder_handles_crlf_line_ends_split_at_every_byte_including_between_cr_and_lf():
    stream = STREAM.replace(b"\n", b"\r\n")
    assert decode(stream) == EXPECTED
    for cut in range(len(stream) + 1):
        assert decode(stream[:cut], stream[cut:]) == EXPECTED, cut


def test_decoder_keeps_a_cr_and_lf_split_by_an_empty_read_one_line_end():
    # An empty feed between them forgot the "\r": the "\n" was a second line end, which
    # ended the event early.
    stream = b"data: a\r\ndata: b\r\n\r\n"
    for cut in (i + 1 for i in range(len(stream)) if stream[i : i + 1] == b"\r"):
        assert decode(stream[:cut], b"", stream[cut:]) == [(None, b"a\nb")], cut


def test_decoder_handles_bare_cr_line_ends_split_at_every_byte():
    stream = STREAM.replace(b"\n", b"\r")
    for cut in range(len(stream) + 1):
        assert decode(stream[:cut], stream[cut:]) == EXPECTED, cut


def test_decoder_handles_mixed_line_ends_in_three_pieces():
    stream = b"data: a\r\n\rdata: b\n\r\ndata: c\r\r"
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1):
            assert decode(stream[:i], stream[i:j], stream[j:]) == [
                (None, b"a"),
                (None, b"b"),
                (None, b"c"),
            ], (i, j)


def test_decoder_ignores_comments_and_events_without_data():
    assert decode(b": ping\n\n:\n\nevent: ping\n\nid: 3\n\ndata: x\n\n") == [(None, b"x")]


def test_decoder_keeps_colons_and_extra_spaces_inside_payloads():
    assert decode(b"data:  two spaces: kept\n\n") == [(None, b" two spaces: kept")]


def test_decoder_names_error_events_and_forgets_the_name_after_the_event():
    events = decode(b'event: error\ndata: {"e": 1}\n\ndata: {"ok": 1}\n\n')
    assert events == [("error", b'{"e": 1}'), (None, b'{"ok": 1}')]


def test_decoder_discards_an_unterminated_final_event_and_says_so():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: one\n\ndata: cut of") == [(None, b"one")]
    assert decoder.close() == []
    assert decoder.truncated
    decoder = SSEDecoder()
    decoder.feed(b"data: one\n\ndata: two\n")  # a whole line, but no blank line after it
    assert decoder.close() == [] and decoder.truncated


def _spec_events(text: bytes) -> list:
    """The SSE spec's reading of ``text`` (lines ending in ``\\n``), line by line: the reference
    the decoder's whole-event path must agree with."""
    events, data, name = [], [], None
    for line in text.split(b"\n")[:-1]:  # (the last piece is not a whole line)
        if not line:
            if data:
                events.append((name, b"\n".join(data)))
            data, name = [], None
            continue
        field, colon, value = line.partition(b":")
        if not colon or field == b"":
            if not colon and field == b"data":
                data.append(b"")
            continue  # a comment, or a field without a value
        value = value[1:] if value[:1] == b" " else value
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value.decode() or None
    return events


_SSE_LINES = st.sampled_from(
    [
        b"data: {}",
        b'data: {"a": 1}',
        b"data:no space",
        b"data:  two spaces",
        b"data",
        b"data: x\ndata: y",
        b"event: error",
        b"event: ",
        b": comment",
        b"id: 7",
        b"",
        b"",
    ]
)


# Lines of events of one line each (the usual stream, mostly), or of any lines.
_SSE_TEXTS = st.lists(_SSE_LINES.filter(bool), max_size=30).map(
    lambda lines: b"".join(line + b"\n\n" for line in lines)
) | st.lists(_SSE_LINES, max_size=30).map(lambda lines: b"".join(line + b"\n" for line in lines))


@given(_SSE_TEXTS, st.lists(st.integers(0, 400), max_size=4))
def test_decoder_reads_any_sequence_of_lines_as_the_spec_does_wherever_it_is_cut(text, cuts):
    pieces, start = [], 0
    for cut in sorted(min(cut, len(text)) for cut in cuts):
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    decoder = SSEDecoder()
    events = [event for piece in pieces for event in decoder.feed(piece)]
    assert events == _spec_events(text)


def test_frame_and_done_are_decodable_sse_events():
    payload = orjson.dumps({"x": "\u2603"})
    assert frame(payload) == b"data: " + payload + b"\n\n"
    assert decode(frame(payload) + DONE) == [(None, payload), (None, b"[DONE]")]


# --- assemble -----------------------------------------------------------------------------------

HEAD = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1700000000,
    "model": "m",
    "system_fingerprint": "fp_1",
}


def chunk(choices, **extra):
    return {**HEAD, "choices": choices, **extra}


def test_assemble_builds_the_non_streaming_body_of_a_realistic_chat_stream():
    chunks = [
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "", "refusal": None},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            usage=None,
        ),
        chunk(
            [{"index": 0, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}],
            usage=None,
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "lo \u2603"},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            usage=None,
        ),
        chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}], usage=None),
        chunk([], usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}),
    ]
    assert assemble("chat", chunks) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": "fp_1",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello \u2603", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }


def test_assemble_without_a_usage_chunk_leaves_usage_out():
    body = assemble(
        "chat", [chunk([{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}])]
    )
    assert "usage" not in body
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "x"}
    assert body["choices"][0]["logprobs"] is None


def test_a_tool_calls_other_fields_assemble_as_the_engine_answers_them():
    """A custom tool's call (OpenAI streams ``custom.input`` in pieces) came back as an empty
    function call, and Gemini's ``extra_content`` (the thought signature its next turn must
    send back) was dropped: a call kept only ``id``, ``type`` and ``function``. Its other
    fields merge as a message's do; ``function`` only where a delta carried one."""

    def call(**fields):
        delta = {"tool_calls": [{"index": 0, **fields}]}
        return chunk([{"index": 0, "delta": delta, "finish_reason": None}])

    custom = [
        call(id="call_c", type="custom", custom={"name": "shell", "input": ""}),
        call(custom={"input": "echo"}),
        call(custom={"input": " hello"}),
        chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
    ]
    signed = {"google": {"thought_signature": "SIG_A"}}
    gemini = [
        call(
            id="fc-1",
            type="function",
            function={"name": "f", "arguments": '{"a":1}'},
            extra_content=signed,
        ),
        chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
    ]
    calls = [assemble("chat", c)["choices"][0]["message"]["tool_calls"] for c in (custom, gemini)]
    assert calls == [
        [{"id": "call_c", "type": "custom", "custom": {"name": "shell", "input": "echo hello"}}],
        [
            {
                "id": "fc-1",
                "type": "function",
                "function": {"name": "f", "arguments": '{"a":1}'},
                "extra_content": signed,
            }
        ],
    ]
    for body in (assemble("chat", custom), assemble("chat", gemini)):
        assert assemble("chat", synthesize("chat", body, include_usage=True)) == body


def test_assemble_merges_tool_call_deltas_split_over_chunks_into_whole_arguments():
    def call(index, **fields):
        return chunk(
            [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": index, **fields}]},
                    "finish_reason": None,
                }
            ]
        )

    chunks = [
        chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]
        ),
        call(0, id="call_a", type="function", function={"name": "get_", "arguments": ""}),
        call(0, function={"name": "weather", "arguments": '{"ci'}),
        call(1, id="call_b", type="function", function={"name": "now", "arguments": "{}"}),
        call(0, function={"arguments": 'ty": "Par'}),
        call(0, function={"arguments": 'is"}'}),
        chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
    ]
    message = assemble("chat", chunks)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    }


def test_assemble_merges_legacy_function_call_deltas():
    chunks = [
        chunk(
            [
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "function_call": {"name": "f", "arguments": '{"a"'},
                    },
                    "finish_reason": None,
                }
            ]
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"function_call": {"arguments": ": 1}"}},
                    "finish_reason": "function_call",
                }
            ]
        ),
    ]
    message = assemble("chat", chunks)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "f", "arguments": '{"a": 1}'},
    }


def test_assemble_orders_interleaved_choices_and_concatenates_chat_logprobs():
    def lp(token):
        return {
            "content": [{"token": token, "logprob": -0.1, "bytes": None, "top_logprobs": []}],
            "refusal": None,
        }

    chunks = [
        chunk(
            [
                {
                    "index": 1,
                    "delta": {"role": "assistant", "content": "B"},
                    "logprobs": lp("B"),
                    "finish_reason": None,
                }
            ]
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "A"},
                    "logprobs": lp("A"),
                    "finish_reason": None,
                }
            ]
        ),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "a"},
                    "logprobs": lp("a"),
                    "finish_reason": "length",
                }
            ]
        ),
        chunk([{"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}]),
    ]
    choices = assemble("chat", chunks)["choices"]
    assert [c["message"]["content"] for c in choices] == ["Aa", "B"]
    assert [c["finish_reason"] for c in choices] == ["length", "stop"]
    assert [t["token"] for t in choices[0]["logprobs"]["content"]] == ["A", "a"]
    assert choices[0]["logprobs"]["refusal"] is None


def test_assemble_builds_a_completion_body_with_merged_logprobs():
    def piece(text, offset, finish=None):
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "finish_reason": finish,
                    "logprobs": {
                        "tokens": [text],
                        "token_logprobs": [-1.0],
                        "top_logprobs": [{text: -1.0}],
                        "text_offset": [offset],
                    },
                }
            ],
        }

    body = assemble("completion", [piece("Hel", 0), piece("lo", 3, "length")])
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "Hello",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["Hel", "lo"],
                    "token_logprobs": [-1.0, -1.0],
                    "top_logprobs": [{"Hel": -1.0}, {"lo": -1.0}],
                    "text_offset": [0, 3],
                },
            }
        ],
    }


def chat_answer(choices: list[dict], completion_tokens: int) -> dict:
    """A whole chat answer of ``choices`` (their message and logprobs; index, finish added)."""
    return {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": i, **c, "finish_reason": "stop"} for i, c in enumerate(choices)],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": completion_tokens,
            "total_tokens": 1 + completion_tokens,
        },
    }


def test_synthesize_streams_usage_only_in_a_final_chunk_without_choices():
    body = chat_answer([{"message": {"role": "assistant", "content": "hi"}, "logprobs": None}], 1)
    chunks = synthesize("chat", body, include_usage=True)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    plain = synthesize("chat", body, include_usage=False)
    assert all("usage" not in c for c in plain) and all(c["choices"] for c in plain)


def test_the_openai_sdk_stream_helper_reads_a_synthesized_stream_with_logprobs_once_per_choice():
    """The SDK's ``ChatCompletionStreamState`` copies the logprobs of a choice's first chunk and
    then appends them again when the choice first appears after the stream's first chunk: each
    choice opens with a role-only chunk, as vLLM and OpenAI send, so that they count once."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    def logprobs(*tokens: str) -> list[dict]:
        return [{"token": t, "logprob": -1.0, "bytes": None, "top_logprobs": []} for t in tokens]

    body = chat_answer(
        [
            {
                "message": {"role": "assistant", "content": f"answer {i}"},
                "logprobs": {"content": logprobs("answer", f" {i}"), "refusal": None},
            }
            for i in range(3)
        ],
        6,
    )
    chunks = synthesize("chat", body, include_usage=True)
    assert assemble("chat", chunks) == body
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion()
    for i, choice in enumerate(final.choices):
        assert choice.message.content == f"answer {i}" and choice.message.role == "assistant"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [t.token for t in choice.logprobs.content] == ["answer", f" {i}"], i


# --- round trip (property) ----------------------------------------------------------------------

text = st.text(max_size=12)
finish = st.sampled_from(["stop", "length", "tool_calls", "content_filter"])
usage = st.fixed_dictionaries(
    {
        "prompt_tokens": st.integers(0, 10**6),
        "completion_tokens": st.integers(0, 10**6),
        "total_tokens": st.integers(0, 10**6),
    }
)
tool_call = st.fixed_dictionaries(
    {
        "id": text,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": text, "arguments": text}),
    }
)
top_logprob = st.fixed_dictionaries(
    {
        "token": text,
        "logprob": st.floats(-50, 0),
        "bytes": st.none() | st.lists(st.integers(0, 255)),
    }
)
chat_logprobs = st.none() | st.fixed_dictionaries(
    {
        "content": st.lists(
            st.fixed_dictionaries(
                {
                    "token": text,
                    "logprob": st.floats(-50, 0),
                    "bytes": st.none(),
                    "top_logprobs": st.lists(top_logprob, max_size=2),
                }
            ),
            max_size=3,
        ),
        "refusal": st.none(),
    }
)


@st.composite
def chat_message(draw):
    message = {"role": "assistant"}
    calls = draw(st.none() | st.lists(tool_call, min_size=1, max_size=3))
    refusal = draw(st.sampled_from(["absent", "null", "text"]))
    if refusal == "null":
        message["refusal"] = None
    elif refusal == "text":
        message["refusal"] = draw(st.text(min_size=1, max_size=12))
    reasoning = draw(st.booleans())
    if reasoning:  # a reasoning model's separate text (vLLM, DeepSeek)
        message["reasoning_content"] = draw(st.text(min_size=1, max_size=12))
    audio = draw(st.booleans())
    if audio:  # OpenAI's modalities ["text", "audio"]
        message["audio"] = {
            "id": draw(text),
            "data": draw(text),
            "expires_at": draw(st.integers(0, 2**31)),
            "transcript": draw(text),
        }
    # content may be None only where a non-streaming answer would say so: beside calls, a
    # refusal, reasoning or audio.
    may_be_null = calls is not None or refusal == "text" or reasoning or audio
    message["content"] = draw(st.none() | text) if may_be_null else draw(text)
    if calls is not None:
        message["tool_calls"] = calls
    return message


@st.composite
def completion_logprobs(draw):
    tokens = draw(st.lists(text, max_size=3))
    return {
        "tokens": tokens,
        "token_logprobs": [draw(st.floats(-50, 0)) for _ in tokens],
        "top_logprobs": [
            draw(st.none() | st.dictionaries(text, st.floats(-50, 0), max_size=2)) for _ in tokens
        ],
        "text_offset": [draw(st.integers(0, 100)) for _ in tokens],
    }


@st.composite
def bodies(draw):
    kind = draw(st.sampled_from(["chat", "completion"]))
    n = draw(st.integers(1, 3))
    if kind == "chat":
        choices = [
            {
                "index": i,
                "message": draw(chat_message()),
                "logprobs": draw(chat_logprobs),
                "finish_reason": draw(finish),
            }
            for i in range(n)
        ]
    else:
        choices = [
            {
                "index": i,
                "text": draw(text),
                "logprobs": draw(st.none() | completion_logprobs()),
                "finish_reason": draw(finish),
            }
            for i in range(n)
        ]
    body = {
        "id": draw(text),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": draw(st.integers(0, 2**31)),
        "model": draw(text),
        "choices": choices,
    }
    if draw(st.booleans()):
        body["system_fingerprint"] = draw(st.none() | text)
    if draw(st.booleans()):
        body["usage"] = draw(usage)
    return kind, body


@settings(max_examples=300, deadline=None)
@given(bodies(), st.booleans())
def test_assembling_a_synthesized_stream_gives_back_the_original_body(kind_body, include_usage):
    kind, body = kind_body
    original = copy.deepcopy(body)
    chunks = synthesize(kind, body, include_usage=include_usage)
    # The chunks survive the wire: JSON-encode them, frame, decode, parse.
    wire = b"".join(frame(orjson.dumps(c)) for c in chunks) + DONE
    payloads = [payload for _, payload in decode(wire)]
    assert payloads[-1] == b"[DONE]"
    parsed = [orjson.loads(p) for p in payloads[:-1]]
    expected = dict(original)
    if not include_usage:
        expected.pop("usage", None)
    assert assemble(kind, parsed) == expected
    assert body == original  # neither function mutates its input
    assert is_complete(kind, assemble(kind, parsed))


# --- streams as engines send them (issue 15): the assembled body is the engine's own -------------

call_name = st.text(min_size=1, max_size=12)
arguments = st.text(max_size=24)


@st.composite
def pieces(draw, value: str) -> list[str]:
    """``value`` cut at arbitrary points (one piece, maybe empty, at least)."""
    cuts = (
        sorted(draw(st.sets(st.integers(1, max(1, len(value) - 1)), max_size=4)))
        if len(value) > 1
        else []
    )
    bounds = [0, *cuts, len(value)]
    return [value[a:b] for a, b in itertools.pairwise(bounds) if b > a] or [""]


def finish_chunk(reason: str, delta: dict | None = None) -> dict:
    return chunk([{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": reason}])


def delta_chunk(delta: dict) -> dict:
    return chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])


def non_streaming(message: dict, reason: str = "tool_calls", **extra) -> dict:
    return {
        "id": HEAD["id"],
        "object": "chat.completion",
        "created": HEAD["created"],
        "model": "m",
        "system_fingerprint": "fp_1",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reason}],
        **extra,
    }


@settings(max_examples=200, deadline=None)
@given(st.data(), st.lists(st.tuples(call_name, arguments), min_size=1, max_size=3))
def test_tool_calls_assemble_to_the_engines_answer_whether_the_name_comes_once_or_every_chunk(
    data, calls
):
    # OpenAI and vLLM: id, type and the whole name once, in a call's first delta, then the
    # arguments in pieces. Other engines repeat id, type and name whole in every delta.
    repeat = data.draw(st.booleans(), label="repeat id, type and name in every delta")
    chunks = [delta_chunk({"role": "assistant", "content": None})]
    for i, (name, args) in enumerate(calls):
        for n, piece in enumerate(data.draw(pieces(args), label=f"arguments {i}")):
            call = {"index": i, "function": {"arguments": piece}}
            if repeat or n == 0:
                call = {
                    "index": i,
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": piece},
                }
            chunks.append(delta_chunk({"tool_calls": [call]}))
    chunks.append(finish_chunk("tool_calls"))
    expected = non_streaming(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                for i, (name, args) in enumerate(calls)
            ],
        }
    )
    assert assemble("chat", chunks) == expected


@settings(max_examples=200, deadline=None)
@given(st.data(), call_name, arguments)
def test_a_llama_cpp_tool_call_stream_assembles_to_its_non_streaming_answer(data, name, args):
    """llama-cpp-python's server on a forced tool choice: every chunk repeats the call's id,
    type and name, and the legacy function_call's name, beside a piece of the arguments;
    role and content are null after the first chunk, all four null in the last one."""
    nulls = {"role": None, "content": None, "function_call": None, "tool_calls": None}
    chunks = [delta_chunk({**nulls, "role": "assistant"})]
    for piece in data.draw(pieces(args)):
        chunks.append(
            delta_chunk(
                {
                    "role": None,
                    "content": None,
                    "function_call": {"name": name, "arguments": piece},
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call__0_f_cmpl-1",
                            "type": "function",
                            "function": {"name": name, "arguments": piece},
                        }
                    ],
                }
            )
        )
    chunks.append(finish_chunk("tool_calls", dict(nulls)))
    assert assemble("chat", chunks) == non_streaming(
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": name, "arguments": args},
            "tool_calls": [
                {
                    "id": "call__0_f_cmpl-1",
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
            ],
        }
    )


def test_a_name_streamed_in_pieces_is_joined_and_a_repeated_whole_name_is_not():
    def call(**fields):
        return delta_chunk({"tool_calls": [{"index": 0, **fields}]})

    split = [
        call(id="c", type="function", function={"name": "get_", "arguments": ""}),
        call(function={"name": "weather", "arguments": "{}"}),
    ]
    repeated = [
        call(id="c", type="function", function={"name": "get_weather", "arguments": "{"}),
        call(id="c", type="function", function={"name": "get_weather", "arguments": "}"}),
    ]
    for chunks in (split, repeated):
        message = assemble("chat", [*chunks, finish_chunk("tool_calls")])["choices"][0]["message"]
        assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}


def test_chat_logprobs_keep_exactly_the_keys_the_engine_sent():
    def token(t):
        return {"token": t, "logprob": -0.5, "bytes": None, "top_logprobs": []}

    # vLLM: "content" only, in its non-streaming answer too.
    vllm = [
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": t},
                    "logprobs": {"content": [token(t)]},
                    "finish_reason": None,
                }
            ]
        )
        for t in ("a", "b")
    ] + [finish_chunk("stop")]
    assert assemble("chat", vllm)["choices"][0]["logprobs"] == {"content": [token("a"), token("b")]}
    # OpenAI: "content" and "refusal" in every chunk and in its non-streaming answer.
    openai = [
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": t},
                    "logprobs": {"content": [token(t)], "refusal": None},
                    "finish_reason": None,
                }
            ]
        )
        for t in ("a", "b")
    ] + [finish_chunk("stop")]
    assert assemble("chat", openai)["choices"][0]["logprobs"] == {
        "content": [token("a"), token("b")],
        "refusal": None,
    }


def test_reasoning_streamed_apart_is_kept_in_the_message_as_the_engine_answers_it():
    # vLLM / DeepSeek: the reasoning comes in its own delta field, then the answer.
    chunks = [
        delta_chunk({"role": "assistant", "content": ""}),
        delta_chunk({"reasoning_content": "Two and "}),
        delta_chunk({"reasoning_content": "two: four."}),
        delta_chunk({"content": "4"}),
        finish_chunk("stop"),
    ]
    assert assemble("chat", chunks)["choices"][0]["message"] == {
        "role": "assistant",
        "content": "4",
        "reasoning_content": "Two and two: four.",
    }
    # Cut off while reasoning: no answer text at all, as the non-streaming answer says (null).
    cut = [
        delta_chunk({"role": "assistant"}),
        delta_chunk({"reasoning_content": "Hmm"}),
        finish_chunk("length"),
    ]
    assert assemble("chat", cut)["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Hmm",
    }


def test_a_refusal_streamed_in_pieces_is_whole_and_content_null():
    chunks = [
        delta_chunk({"role": "assistant", "content": None, "refusal": None}),
        delta_chunk({"refusal": "I can't "}),
        delta_chunk({"refusal": "help with that."}),
        finish_chunk("stop"),
    ]
    assert assemble("chat", chunks)["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": "I can't help with that.",
    }


def test_audio_streamed_in_pieces_assembles_whole_with_content_null():
    # OpenAI with modalities ["text", "audio"]: the audio comes in pieces (its id with the
    # first piece of its transcript, then data, then expires_at alone); the non-streaming
    # answer has one whole message.audio and content null.
    chunks = [
        delta_chunk(
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "audio": {"id": "audio_1", "transcript": "Hel"},
            }
        ),
        delta_chunk({"audio": {"transcript": "lo"}}),
        delta_chunk({"audio": {"data": "AAAA"}}),
        delta_chunk({"audio": {"data": "BBBB"}}),
        delta_chunk({"audio": {"expires_at": 1700000000}}),
        finish_chunk("stop"),
    ]
    assert assemble("chat", chunks)["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "audio": {
            "id": "audio_1",
            "transcript": "Hello",
            "data": "AAAABBBB",
            "expires_at": 1700000000,
        },
    }


def test_message_fields_in_pieces_merge_as_the_sdks_accumulate_them():
    # Objects merge key by key (a "type" is replaced, not added to), list items with an index
    # merge with the earlier item of that index, other lists extend; the chunks are not changed.
    citation = {"type": "url_citation", "url_citation": {"url": "https://a", "title": "A"}}
    chunks = [
        delta_chunk({"role": "assistant", "content": "See A."}),
        delta_chunk({"annotations": [citation]}),
        delta_chunk({"annotations": [{**citation, "url_citation": {"url": "https://b"}}]}),
        delta_chunk({"details": [{"index": 0, "type": "text", "text": "th"}, {"index": 0}]}),
        delta_chunk({"details": [{"index": 0, "type": "text", "text": "ink"}]}),
        delta_chunk({"tags": ["a"], "meta": {"kind": "x", "n": 1}}),
        delta_chunk({"tags": ["b"], "meta": {"n": 2}}),
        finish_chunk("stop"),
    ]
    before = copy.deepcopy(chunks)
    message = assemble("chat", chunks)["choices"][0]["message"]
    assert chunks == before
    assert message == {
        "role": "assistant",
        "content": "See A.",
        "annotations": [citation, {**citation, "url_citation": {"url": "https://b"}}],
        "details": [{"index": 0, "type": "text", "text": "think"}, {"index": 0}],
        "tags": ["a", "b"],
        "meta": {"kind": "x", "n": 2},
    }


def test_the_streams_obfuscation_padding_is_not_in_the_assembled_answer():
    # OpenAI pads each chunk with a random "obfuscation" (stream_options.include_obfuscation,
    # on by default): the stream's alone, in no non-streaming answer.
    chunks = [
        chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            obfuscation="Zx9",
        ),
        chunk([{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}], obfuscation="q1"),
        chunk(
            [
                {
                    "index": 0,
                    "delta": {"content": "!", "obfuscation": "a"},
                    "finish_reason": None,
                    "obfuscation": "b",
                }
            ]
        ),
        chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}], obfuscation="p"),
    ]
    body = assemble("chat", chunks)
    assert "obfuscation" not in body
    assert body["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "Hi!"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    completion = assemble(
        "completion",
        [
            {
                **HEAD,
                "choices": [{"index": 0, "text": "Hi", "obfuscation": "x"}],
                "obfuscation": "y",
            },
            {**HEAD, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
        ],
    )
    assert "obfuscation" not in completion and "obfuscation" not in completion["choices"][0]


def test_the_streams_obfuscation_padding_is_in_no_tool_call_nor_object_of_the_answer():
    # A tool call's keys but its own merge as a message's fields do, and an object's key by
    # key: padding there was concatenated into the stored answer ("yy2"), served on every hit.
    def call(**fields):
        return {"index": 0, "delta": {"tool_calls": [{"index": 0, **fields}]}}

    chunks = [
        chunk([call(id="t", type="function", function={"name": "f"}, obfuscation="y")]),
        chunk([call(function={"arguments": "{}"}, obfuscation="y2")]),
        chunk([{"index": 0, "delta": {"audio": {"id": "a", "obfuscation": "z"}}}]),
        chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]),
    ]
    message = assemble("chat", chunks)["choices"][0]["message"]
    assert message["tool_calls"] == [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]
    assert message["audio"] == {"id": "a"}


def test_a_stream_assembled_from_azure_keeps_the_real_id():
    # Azure OpenAI opens its streams with its prompt's content-filter results, in a chunk whose
    # id and model are "" and created 0; its non-streaming answer has the real ones.
    filtered = [{"prompt_index": 0, "content_filter_results": {"hate": {"filtered": False}}}]
    opening = {
        "id": "",
        "choices": [],
        "created": 0,
        "model": "",
        "object": "",
        "system_fingerprint": None,
        "prompt_filter_results": filtered,
    }
    azure = {**HEAD, "id": "chatcmpl-AZ1", "model": "gpt-4o-2024-08-06", "created": 1756938296}
    chunks = [
        opening,
        {**azure, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**azure, "choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {**azure, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    body = assemble("chat", chunks)
    assert (body["id"], body["model"], body["created"]) == (
        "chatcmpl-AZ1",
        "gpt-4o-2024-08-06",
        1756938296,
    )
    assert body["system_fingerprint"] == "fp_1" and body["prompt_filter_results"] == filtered
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    # Taken one at a time, with their payloads (as a flight's stream is), the same.
    assembly = Assembly("chat")
    for one in chunks:
        assembly.add(one, orjson.dumps(one))
    assert assembly.body() == body
    # Blank all along: blank it stays (nothing is made up).
    blank = [{**c, "id": "", "created": 0} for c in chunks]
    assert (assemble("chat", blank)["id"], assemble("chat", blank)["created"]) == ("", 0)


def test_a_choices_content_filter_results_from_azure_survive_its_empty_last_say():
    # Azure sends a choice's content-filter results with each content chunk and ``{}`` with its
    # finish chunk; its whole answer has the results. The last non-null value kept was ``{}``:
    # a client reading ["hate"]["filtered"] got a KeyError.
    results = {"hate": {"filtered": False, "severity": "safe"}}
    chunks = [
        {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {
            **HEAD,
            "choices": [
                {"index": 0, "delta": {"content": "Hi"}, "content_filter_results": results}
            ],
        },
        {
            **HEAD,
            "choices": [
                {"index": 0, "delta": {}, "finish_reason": "stop", "content_filter_results": {}}
            ],
        },
    ]
    assert assemble("chat", chunks)["choices"][0]["content_filter_results"] == results


def test_a_stream_without_usage_assembles_without_usage_and_the_last_usage_wins():
    text = [delta_chunk({"role": "assistant", "content": "hi"}), finish_chunk("stop")]
    assert "usage" not in assemble("chat", text)  # none invented
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    # vLLM's continuous usage: every chunk carries the usage so far; the last is the total.
    running = [
        {**c, "usage": {**usage, "completion_tokens": i, "total_tokens": 3 + i}}
        for i, c in enumerate(text)
    ] + [chunk([], usage=usage)]
    assert assemble("chat", running)["usage"] == usage


# --- text chunks taken by their payload (chunks.Assembly.add_texts) --------------------------


def _collected(payloads: list[bytes], reads: list[int] | None = None) -> tuple[dict, int]:
    """The body a stream's payloads make as the exchange gathers them (``exchange._publish``),
    in reads of ``reads[i]`` payloads (one read of all by default; the rest in one): offered
    to ``add_texts`` first, parsed and ``add``ed (with the payload) otherwise; and how many
    ``add_texts`` took."""
    assembly, taken, start = Assembly("chat"), 0, 0
    for size in [*(reads or []), len(payloads)]:
        read, start = payloads[start : start + size], start + size
        at = 0
        while at < len(read):
            took = assembly.add_texts(read, at)
            taken += took
            at += took
            if at < len(read):
                assembly.add(orjson.loads(read[at]), read[at])
                at += 1
    return assembly.body(), taken


def _taken_alone(assembly: Assembly, payload: bytes) -> bool:
    return assembly.add_texts([payload], 0) == 1


def _chat_chunk(index: int, delta: dict, finish=None, **top) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        **top,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }


_texts = st.text(alphabet=st.sampled_from('ab \\"\n\t/é😀{}:,content'), max_size=8)
_writers = st.sampled_from(
    [
        orjson.dumps,
        lambda o: json.dumps(o).encode(),  # ", " and ": "
        lambda o: json.dumps(o, ensure_ascii=False).encode(),
        lambda o: json.dumps(o, separators=(",", ":")).encode(),
    ]
)


_USAGES = [{"prompt_tokens": 1, "completion_tokens": k, "total_tokens": k + 1} for k in (1, 2)]


@st.composite
def _chat_streams(draw) -> list[bytes]:
    """A chat stream's payloads as engines write them: a role chunk, text chunks (one or two
    choices), maybe tool calls, finish chunks, maybe a usage chunk; ids, ``created``, usage per
    chunk, extra fields (one with a "content" of its own) and key spellings vary, and so does
    the JSON writer."""
    write = draw(_writers)
    n = draw(st.sampled_from([1, 1, 1, 2]))
    # vLLM's continuous usage: in every chunk, growing; or one of a few values, coming back.
    usages = draw(st.sampled_from(["none", "none", "growing", "some"]))
    per_chunk_id = draw(st.booleans()) and draw(st.booleans())
    extra = draw(st.sampled_from([{}, {}, {"system_fingerprint": "fp"}, {"model": "content"}]))

    def usage_of(step: int) -> dict:
        if usages == "growing":
            return {"usage": {"prompt_tokens": 1, "completion_tokens": step, "total_tokens": 9}}
        if usages == "some":
            return draw(st.sampled_from([{}, {"usage": None}, *({"usage": u} for u in _USAGES)]))
        return {}

    payloads = [
        write(_chat_chunk(i, {"role": "assistant", "content": ""}, **extra)) for i in range(n)
    ]
    step = 0
    for text in draw(st.lists(_texts, max_size=12)):
        step += 1
        top = {**extra, **usage_of(step)}
        if per_chunk_id:
            top["id"] = f"chatcmpl-{step}"
        if draw(st.integers(0, 9)) == 0:
            top["created"] = 7 + step  # (llama.cpp: the second it was sent)
        index = draw(st.integers(0, n - 1))
        chunk = _chat_chunk(index, {"content": text}, **top)
        if draw(st.integers(0, 8)) == 0:
            chunk["meta"] = {"content": draw(_texts)}  # a "content" after the text's
        payload = write(chunk)
        if draw(st.integers(0, 12)) == 0:  # a key twice: the last one counts
            payload = payload.replace(b'"delta":{', b'"delta":{"content":"x",', 1)
        payloads.append(payload)
        if draw(st.integers(0, 10)) == 0:
            call = {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": "{}"},
            }
            payloads.append(write(_chat_chunk(index, {"tool_calls": [call]}, **usage_of(step))))
    for i in range(n):
        payloads.append(write(_chat_chunk(i, {}, "stop", **extra, **usage_of(step))))
    if draw(st.booleans()):
        payloads.append(write({**_chat_chunk(0, {}), "choices": [], "usage": _USAGES[1]}))
    return payloads


@settings(max_examples=500)
@given(_chat_streams(), st.lists(st.integers(1, 6), max_size=6))
def test_text_chunks_taken_by_their_payload_assemble_as_the_parsed_chunks_do(payloads, reads):
    body, _ = _collected(payloads, reads)
    assert body == assemble("chat", [orjson.loads(p) for p in payloads])


def test_a_usual_streams_text_chunks_but_the_first_are_taken_by_their_payload():
    texts = ["Hel", "lo", ' "quoted"', " back\\slash", " é😀", "\n"]
    payloads = [orjson.dumps(_chat_chunk(0, {"role": "assistant", "content": ""}))]
    payloads += [orjson.dumps(_chat_chunk(0, {"content": text})) for text in texts]
    payloads.append(orjson.dumps(_chat_chunk(0, {}, "stop")))
    body, taken = _collected(payloads)
    assert taken == len(texts) - 1
    assert body["choices"][0]["message"]["content"] == "".join(texts)


def test_a_payload_that_is_not_one_string_in_the_texts_place_is_not_taken():
    first = orjson.dumps(_chat_chunk(0, {"content": "a"}))
    assembly = Assembly("chat")
    assembly.add(orjson.loads(orjson.dumps(_chat_chunk(0, {"role": "assistant", "content": ""}))))
    assembly.add(orjson.loads(first), first)
    for text in (b'"b","role":"tool"', b'"b" "c"', b"1", b'"b', b'b"', b"", b' "b"'):
        assert not _taken_alone(assembly, first.replace(b'"a"', text)), text
    assert _taken_alone(assembly, first.replace(b'"a"', b'"b\\u00e9"'))
    assert assembly.body()["choices"][0]["message"]["content"] == "abé"


def _templated(text: str = "a") -> tuple[Assembly, bytes]:
    """An assembly that has learnt the template of a text chunk, and that chunk's payload."""
    first = orjson.dumps(_chat_chunk(0, {"content": text}))
    assembly = Assembly("chat")
    assembly.add(orjson.loads(orjson.dumps(_chat_chunk(0, {"role": "assistant", "content": ""}))))
    assembly.add(orjson.loads(first), first)
    return assembly, first


def test_text_chunks_read_together_are_taken_together_in_order_up_to_one_that_is_not_such():
    assembly, first = _templated()
    texts = ["b", ' "q"', "\\", "é😀", "\n", ""]
    read = [orjson.dumps(_chat_chunk(0, {"content": t})) for t in texts]
    read.append(orjson.dumps(_chat_chunk(0, {}, "stop")))
    read.append(orjson.dumps(_chat_chunk(0, {"content": "after"})))
    assert assembly.add_texts(read, 0) == len(texts)
    assert assembly.add_texts(read, len(texts)) == 0
    assert assembly.add_texts(read, len(texts) + 1) == 1
    assert assembly.body()["choices"][0]["message"]["content"] == "a" + "".join(texts) + "after"


def test_strings_that_parse_only_when_joined_are_not_taken_together():
    """Read together, the strings are parsed as one array, and then each must be written back
    as it came: two strings that are not one string each, but a pair of them joined, would
    otherwise pass for two texts."""
    assembly, first = _templated()
    strings = [b'"x\\"', b'","y"']  # the first escapes its own closing quote
    assert orjson.loads(b"[" + b",".join(strings) + b"]") == ['x",', "y"]  # (the trap)
    read = [first.replace(b'"a"', string) for string in strings]
    assert assembly.add_texts(read, 0) == 0
    assert assembly.body()["choices"][0]["message"]["content"] == "a"


def test_texts_spelled_with_escapes_are_taken_one_by_one_as_they_read():
    assembly, first = _templated()
    read = [first.replace(b'"a"', b'"\\u00e9"'), first.replace(b'"a"', b'"\\/"'), first]
    read.append(first.replace(b'"a"', b'"b","role":"tool"'))
    assert assembly.add_texts(read, 0) == 3
    assert assembly.body()["choices"][0]["message"]["content"] == "aé/a"


def test_a_content_after_the_text_with_the_same_string_is_not_taken_for_the_text():
    """The text's string is found as the last "content": a field after it with the same
    string would be cut around instead, were another string in its place not checked to
    change only the text."""

    def chunk(text: str, meta: str) -> bytes:
        return orjson.dumps({**_chat_chunk(0, {"content": text}), "meta": {"content": meta}})

    payloads = [
        orjson.dumps(_chat_chunk(0, {"role": "assistant", "content": ""})),
        chunk("same", "same"),
        chunk("same", "other"),
        orjson.dumps(_chat_chunk(0, {}, "stop")),
    ]
    body, _ = _collected(payloads)
    assert body == assemble("chat", [orjson.loads(p) for p in payloads])
    assert body["choices"][0]["message"]["content"] == "samesame"


def test_an_empty_text_with_an_empty_content_after_it_is_not_cut_around_that_content():
    """The template's check puts another text in the string's place: for an empty text it
    must not be the empty text again, or a later "content" field of the same (empty) value
    would pass for the text's, and a later chunk's value there would be taken as its text."""

    def chunk(meta: str) -> bytes:
        return orjson.dumps({**_chat_chunk(0, {"content": ""}), "meta": {"content": meta}})

    payloads = [
        orjson.dumps(_chat_chunk(0, {"role": "assistant", "content": ""})),
        chunk(""),
        chunk(":"),
        orjson.dumps(_chat_chunk(0, {}, "stop")),
    ]
    body, taken = _collected(payloads)
    assert body == assemble("chat", [orjson.loads(p) for p in payloads])
    assert body["choices"][0]["message"]["content"] == "" and taken == 0


def test_a_text_chunk_that_says_its_usage_again_after_another_usage_makes_that_usage_the_last():
    """vLLM may send usage with text chunks: the last usage sent wins, even when a text chunk
    like an earlier one repeats an earlier usage."""
    one, two = _USAGES
    payloads = [
        orjson.dumps(_chat_chunk(0, {"role": "assistant", "content": ""})),
        orjson.dumps(_chat_chunk(0, {"content": "a"}, usage=one)),
        orjson.dumps(_chat_chunk(0, {"content": "b"}, usage=one)),
        orjson.dumps({**_chat_chunk(0, {}), "choices": [], "usage": two}),
        orjson.dumps(_chat_chunk(0, {"content": "c"}, usage=one)),
        orjson.dumps(_chat_chunk(0, {}, "stop")),
    ]
    body, _ = _collected(payloads)
    assert body == assemble("chat", [orjson.loads(p) for p in payloads])
    assert body["usage"] == one and body["choices"][0]["message"]["content"] == "abc"


def test_chunks_that_differ_in_more_than_their_text_stop_templates_being_made(monkeypatch):
    made = []
    make = text_template.TextTemplate.of
    monkeypatch.setattr(
        text_template.TextTemplate,
        "of",
        classmethod(lambda cls, *args: made.append(1) or make(*args)),
    )
    payloads = [orjson.dumps(_chat_chunk(0, {"role": "assistant", "content": ""}))]
    payloads += [orjson.dumps(_chat_chunk(0, {"content": "t"}, id=f"c{i}")) for i in range(10)]
    body, taken = _collected(payloads)
    assert taken == 0 and len(made) == 2  # (two that took nothing: then no more)
    assert body == assemble("chat", [orjson.loads(p) for p in payloads])


def test_round_trip_keeps_extra_fields_of_other_servers():
    body = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "prompt_logprobs": None,
        "service_tier": "default",
        "choices": [
            {
                "index": 0,
                "stop_reason": None,
                "logprobs": None,
                "finish_reason": "stop",
                "message": {
                    "role": "assistant",
                    "content": "hi",
                    "tool_calls": [],
                    "reasoning_content": "think",
                    "annotations": [],
                },
            }
        ],
    }
    assert assemble("chat", synthesize("chat", body, include_usage=True)) == body


# --- is_complete, usage_tokens ------------------------------------------------------------------


def test_token_ids_concatenate_and_a_choices_prompt_token_ids_are_its_first():
    # vLLM's return_token_ids on completions: each chunk's choice the ids of its new tokens,
    # its first the prompt's too.
    chunks = [
        {"choices": [{"index": 0, "text": "a", "token_ids": [1], "prompt_token_ids": [7, 8]}]},
        {"choices": [{"index": 0, "text": "b", "token_ids": [2, 3], "prompt_token_ids": [9]}]},
        {"choices": [{"index": 0, "text": "", "token_ids": None, "prompt_token_ids": None}]},
        {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "stop"}]},
    ]
    original = copy.deepcopy(chunks)
    choice = assemble("completion", chunks)["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == (
        "ab",
        [1, 2, 3],
        [7, 8],
    )
    assert chunks == original  # (the first chunk's list is not the one extended)


def test_is_complete_requires_every_choice_to_have_finished():
    done = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}
    assert is_complete("chat", {"choices": [done]})
    said = {"index": 0, "text": "x", "finish_reason": "stop"}
    assert is_complete("completion", {"choices": [said, {**said, "index": 1}]})
    assert not is_complete("chat", {"choices": [done, {**done, "index": 1, "finish_reason": None}]})
    assert not is_complete("chat", {"choices": [{"index": 0, "message": done["message"]}]})
    assert not is_complete("chat", {"choices": []})
    assert not is_complete("chat", {})


def test_is_complete_requires_choices_a_stream_can_be_made_of():
    # A chat message an object, its calls a list of objects; a completion's text a string.
    message = {"role": "assistant", "content": None}
    for kind, choice in (
        ("chat", {"message": {**message, "tool_calls": [{"id": "t"}], "function_call": None}}),
        ("chat", {"message": {**message, "function_call": {"name": "f"}, "tool_calls": None}}),
        ("completion", {"text": ""}),
    ):
        assert is_complete(kind, {"choices": [{**choice, "finish_reason": "stop"}]})
    for kind, choice in (
        ("chat", {}),
        ("chat", {"message": None}),
        ("chat", {"message": "hi"}),
        ("chat", {"message": {**message, "tool_calls": {"id": "t"}}}),
        ("chat", {"message": {**message, "tool_calls": [{"id": "t"}, None]}}),
        ("chat", {"message": {**message, "function_call": "f"}}),
        ("completion", {}),
        ("completion", {"text": None}),
        ("completion", {"text": ["x"]}),
    ):
        assert not is_complete(kind, {"choices": [{**choice, "finish_reason": "stop"}]}), choice


def test_is_complete_rejects_aborted_and_errored_choices():
    assert not is_complete("chat", {"choices": [{"finish_reason": "abort"}]})
    assert not is_complete("completion", {"choices": [{"finish_reason": "error"}]})


def test_is_complete_requires_a_non_empty_list_of_embeddings():
    assert is_complete("embedding", {"data": [{"embedding": [0.1, 0.2]}, {"embedding": [0, 1]}]})
    assert is_complete(
        "embedding", {"data": [{"embedding": "AAAAAA=="}, {"embedding": "AACAPw=="}]}
    )
    assert not is_complete("embedding", {"data": []})
    assert not is_complete("embedding", {"data": [{"embedding": [0.1]}, {"index": 1}]})
    assert not is_complete("embedding", {"data": {"embedding": [0.1]}})


def test_is_complete_is_false_for_garbage_and_never_raises():
    garbage = [
        None,
        3,
        "x",
        b"x",
        [],
        {"choices": None},
        {"choices": "stop"},
        {"choices": [None]},
        {"choices": [["finish_reason"]]},
        {"choices": {"0": 1}},
        {"choices": [{"finish_reason": ["unhashable"]}]},
        {"data": None},
        {"data": [None]},
        {"data": "embedding"},
    ]
    for body in garbage:
        for kind in ("chat", "completion", "embedding", "unknown"):
            assert is_complete(kind, body) is False, (kind, body)


def test_usage_tokens_adds_prompt_and_completion_tokens():
    assert (
        usage_tokens({"usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}})
        == 12
    )
    assert usage_tokens({"usage": {"prompt_tokens": 7, "total_tokens": 7}}) == 7  # embeddings


def test_usage_tokens_is_zero_for_garbage_and_never_raises():
    garbage = [
        None,
        1,
        "usage",
        [],
        {},
        {"usage": None},
        {"usage": "10"},
        {"usage": [1, 2]},
        {"usage": {"prompt_tokens": "3", "completion_tokens": None}},
        {"usage": {"prompt_tokens": True, "completion_tokens": -4}},
        {"usage": {"prompt_tokens": 1.5}},
    ]
    for body in garbage:
        assert usage_tokens(body) == 0, body


def test_the_stream_body_functions_are_still_importable_from_sse() -> None:
    # They moved to carpool.chunks and carpool.completeness; carpool.sse re-exports them.
    assert (sse.assemble, sse.synthesize) == (assemble, synthesize)
    assert (sse.is_complete, sse.usage_tokens) == (is_complete, usage_tokens)


def test_a_complete_answer_with_its_own_frames_is_streamable_unread(monkeypatch):
    # Every streaming hit of a streamed answer asks (``reply.unstreamable``): its frames, but
    # the usage one for a client that did not ask for it, were filtered for the question, then
    # again for the reply. Nothing in them can fail: they are not looked at.
    from carpool.answer import Answer
    from carpool.reply import unstreamable

    def unread(self: Answer, include_usage: bool) -> list[bytes]:
        raise AssertionError("the frames were made for the question")

    monkeypatch.setattr(Answer, "sse", unread)
    streamed = Answer("chat", b"{}", True, frames=[b"data: {}\n\n", b"data: {}\n\n"], usage_frame=1)
    assert unstreamable(streamed, include_usage=False) is None
    assert unstreamable(streamed, include_usage=True) is None
