"""store.packed: one entry as one bytes object, back to an equal entry; its expiry, its tail and
the invalidation selectors read without unpacking (the usual entry)."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.answer import Answer
from carpool.apis import APIS
from carpool.store import Entry, packed
from carpool.store.base import Selector

TEXT = st.text(st.characters(blacklist_categories=()), max_size=40)  # lone surrogates too
KINDS = st.sampled_from([*APIS, "not-an-api"])


def same(a: Entry, b: Entry) -> bool:
    x, y = a.answer, b.answer
    return (
        (x.kind, x.body, x.complete, x.tokens, x.created, x.frames, x.usage_frame)
        == (y.kind, y.body, y.complete, y.tokens, y.created, y.frames, y.usage_frame)
        and (a.expires, a.tags, a.namespace, a.prompt_prefix)
        == (b.expires, b.tags, b.namespace, b.prompt_prefix)
        and type(x.body) is bytes
        and type(x.created) is float
    )


entries = st.builds(
    lambda kind, body, complete, tokens, created, frames, usage_frame, expires, tags, ns, prefix: (
        Entry(
            Answer(kind, body, complete, tokens, created, frames, usage_frame),
            expires,
            tuple(tags),
            ns,
            prefix,
        )
    ),
    KINDS,
    st.binary(max_size=300),
    st.booleans(),
    st.integers(0, 2**70),
    st.floats(allow_nan=False),
    st.none() | st.lists(st.binary(max_size=20), max_size=4),
    st.none() | st.integers(0, 3),
    st.floats(allow_nan=False),
    st.lists(TEXT, max_size=3),
    st.just("") | TEXT,
    st.just("") | TEXT,
)


@settings(max_examples=300, deadline=None)
@given(entry=entries, tail=st.binary(max_size=20))
def test_unpack_gives_back_an_equal_entry_and_reads_its_expiry_and_tail(entry, tail):
    blob = packed.pack(entry, tail)
    assert type(blob) is bytes and same(packed.unpack(blob), entry)
    assert packed.expires(blob) == entry.expires
    assert packed.has_tail(blob, tail)
    assert not packed.has_tail(blob, tail + b"x") and not packed.has_tail(blob, b"x" + tail)


@settings(max_examples=300, deadline=None)
@given(
    entry=entries,
    tag=st.none() | TEXT,
    namespace=st.none() | st.just("") | TEXT,
    prefix=st.none() | st.just("") | TEXT,
    everything=st.booleans(),
)
def test_the_matcher_picks_what_the_selector_picks(entry, tag, namespace, prefix, everything):
    selector = Selector(tag, namespace, prefix, everything)
    blob = packed.pack(entry)
    assert packed.matcher(selector)(blob) == selector.picks(entry)


def test_a_prompt_prefix_is_matched_on_the_bytes_of_the_usual_entry():
    for prompt in ("How do I", "ünïcödé \ud800 日本語🙂", ""):
        blob = packed.pack(Entry(Answer("chat", b"{}", True, 7, 1.0), 2.0, (), "", prompt))
        assert packed.usual(blob)
        for n in range(len(prompt) + 1):
            assert packed.matcher(Selector(prefix=prompt[:n]))(blob)
        assert not packed.matcher(Selector(prefix=prompt + "x"))(blob)
        assert not packed.matcher(Selector(prefix="x" + prompt))(blob)
        assert packed.matcher(Selector(namespace=""))(blob)
        assert not packed.matcher(Selector(namespace="a"))(blob)
        assert not packed.matcher(Selector(tag=""))(blob)


def test_the_usual_entry_is_one_object_of_its_payload_and_a_small_head():
    body, prompt = b"x" * 200, "What is the capital of country 123456?"
    entry = Entry(Answer("chat", body, True, 300, 1.7e9), 1.7e9 + 3600, (), "", prompt)
    blob = packed.pack(entry, b"123456789")
    assert packed.usual(blob)
    assert len(blob) == 24 + 9 + len(body) + len(prompt)
    assert sys.getsizeof(blob) <= 304  # (with the bytes object's own 33: one 304-byte block)
    streamed = Entry(Answer("chat", body, True, 300, 1.7e9, [b"a", b"b"], 1), 2e9, ("t",))
    assert not packed.usual(packed.pack(streamed))


def test_an_unpacked_answer_computes_again_what_it_computes_on_demand():
    answer = Answer("chat", b'{"choices": []}', True, 0, 1.0)
    assert answer.usage_missing and answer.sse(True) is answer.sse(True)
    unpacked = packed.unpack(packed.pack(Entry(answer, 2.0))).answer
    assert unpacked.usage_missing and unpacked._synthesized == {}
    assert unpacked.sse(True) == answer.sse(True)


@settings(max_examples=200, deadline=None)
@given(entry=entries, tail=st.binary(max_size=20), prefix=st.none() | TEXT)
def test_the_mark_of_a_use_changes_nothing_else_a_blob_answers(entry, tail, prefix):
    blob = packed.pack(entry, tail)
    assert packed.unmarked(blob) is blob  # pack leaves it cleared
    marked = packed.marked(blob)
    assert marked is not blob and marked[0] & packed.USED and not blob[0] & packed.USED
    assert packed.marked(marked) is marked and packed.unmarked(marked) == blob
    assert same(packed.unpack(marked), entry) and packed.expires(marked) == entry.expires
    assert packed.has_tail(marked, tail) and packed.usual(marked) == packed.usual(blob)
    assert packed.size(marked) == packed.size(blob) and len(marked) == len(blob)
    selector = Selector(namespace="") if prefix is None else Selector(prefix=prefix)
    assert packed.matcher(selector)(marked) == packed.matcher(selector)(blob)
