"""The fake upstream's ``n`` and its completeness controls: ``omit_done``, ``drop_choices``,
``unfinished_choices`` (see the docstring of ``tests/fakes/upstream.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from .serving import serve_app
from .test_fakes import CHAT, chat_body, read_sse
from .upstream import FakeUpstream


@pytest.fixture
async def served() -> AsyncIterator[tuple[FakeUpstream, httpx.AsyncClient]]:
    upstream = FakeUpstream()
    async with serve_app(upstream) as url:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            yield upstream, client


async def test_n_choices_per_prompt_indexed_prompt_major(served) -> None:
    _, client = served
    chat = (await client.post(CHAT, json=chat_body("x", n=3))).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    completion = (
        await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "n": 2})
    ).json()
    assert [(c["index"], c["text"]) for c in completion["choices"]] == [
        (0, "answer 2 to a"),
        (1, "answer 2 to a"),
        (2, "answer 2 to b"),
        (3, "answer 2 to b"),
    ]


async def test_dropped_and_unfinished_choices(served) -> None:
    upstream, client = served
    upstream.drop_choices, upstream.unfinished_choices = {1}, {2}
    body = (await client.post(CHAT, json=chat_body("x", n=3))).json()
    assert [(c["index"], c["finish_reason"]) for c in body["choices"]] == [(0, "stop"), (2, None)]
    async with client.stream("POST", CHAT, json=chat_body("x", n=3, stream=True)) as r:
        events = await read_sse(r)
    assert events[-1] == "[DONE]"
    seen = {c["index"] for e in events[:-1] for c in e["choices"]}
    finished = {c["index"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]}
    assert (seen, finished) == ({0, 2}, {0})


async def test_omit_done_ends_the_stream_cleanly_after_the_finish(served) -> None:
    upstream, client = served
    upstream.omit_done = True
    async with client.stream("POST", CHAT, json=chat_body("x", stream=True)) as r:
        events = await read_sse(r)
    assert "[DONE]" not in events
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert upstream.completed == 1
