"""The semantic cache over HTTP: near-duplicates served, meaning changes and other scopes refused."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import threading
import time
from typing import Any

import orjson
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("usearch")

from carpool.apis import api_of  # noqa: E402
from carpool.clock import SYSTEM_CLOCK  # noqa: E402
from carpool.fingerprint import fingerprint, requester, semantic_view  # noqa: E402
from carpool.request import ClientRequest, parse  # noqa: E402
from carpool.store.base import Selector, state_tag, synthesized_held  # noqa: E402
from fakes.waiting import eventually  # noqa: E402

SEMANTIC = {"semantic": {"enabled": True}}


async def ask(gw, content, *, system=None, history=(), headers=None, **body):
    messages = (
        ([{"role": "system", "content": system}] if system else [])
        + list(history)
        + [{"role": "user", "content": content}]
    )
    response = await gw.client.post(
        "/v1/chat/completions",
        headers=headers,
        json={"model": "m", "temperature": 0, "messages": messages, **body},
    )
    assert response.status_code == 200, response.text
    return response


async def stored(gw, n=1):
    await eventually(lambda: gw.gateway.semantic.entries >= n, what="the semantic insert")


def semantic_view_of(gw, content):
    """The semantic cache's view of asking ``content`` (as ``ask`` asks it) of ``gw``."""
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}]}
    request = parse(ClientRequest("/v1/chat/completions", orjson.dumps(body), {}), 1 << 20)
    config = gw.gateway.config
    return semantic_view(request, fingerprint(request, config), config)


async def served_again(gw, first, second):
    """``second`` asked after ``first``'s answer is stored: a semantic hit, that answer."""
    answer = await ask(gw, first)
    await stored(gw)
    again = await ask(gw, second)
    assert again.headers["x-carpool"] == "semantic-hit" and again.json() == answer.json()


async def test_a_semantic_hit_says_its_usage_counts_another_prompt(sgw, fake):
    """The answer served is another prompt's, its usage too: the stored prompt's tokens, not
    the paraphrase's (6 for 9 here). Said, as an estimate or a missing count is, never
    made up; an exact hit's usage is its own request's."""
    first = await ask(sgw, "How do I reset my password?")
    assert "x-carpool-usage" not in first.headers
    await stored(sgw)
    again = await ask(sgw, "I need to know how to reset my password?")
    assert again.headers["x-carpool"] == "semantic-hit"
    assert again.json()["usage"] == first.json()["usage"]
    assert again.headers["x-carpool-usage"] == "other-prompt"
    async with sgw.client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "m",
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "I need to know how to reset my password?"}],
        },
    ) as streamed:
        await streamed.aread()
    assert streamed.headers["x-carpool"] == "semantic-hit"
    assert streamed.headers["x-carpool-usage"] == "other-prompt"
    exact = await ask(sgw, "How do I reset my password?")
    assert exact.headers["x-carpool"] == "hit" and "x-carpool-usage" not in exact.headers


@pytest.mark.parametrize(
    ("first", "retry"),
    [
        ((False, False), (False, False)),
        ((False, False), (True, True)),
        ((True, True), (False, False)),
        ((True, True), (True, True)),
        ((True, False), (False, False)),
    ],
    ids=["json-json", "json-sse", "sse-json", "sse-sse", "sse-without-usage-json"],
)
async def test_a_keyed_semantic_hit_replayed_in_any_format_says_its_usage_is_another_prompts(
    sgw, fake, first, retry
):
    # A replay re-formed from its record (a stream as JSON, JSON as a stream) said only what
    # the body says of its usage (missing, apportioned): the mark that it is another prompt's
    # was lost, or never kept (a stream without the usage chunk).
    def body(stream: bool, usage: bool) -> dict[str, Any]:
        asked: dict[str, Any] = {
            "model": "m",
            "temperature": 0,
            "messages": [{"role": "user", "content": "I need to know how to reset my password?"}],
        }
        if stream:
            asked = {**asked, "stream": True, "stream_options": {"include_usage": usage}}
        return asked

    await ask(sgw, "How do I reset my password?")
    await stored(sgw)
    key = {"Idempotency-Key": "k-1"}
    hit = await sgw.client.post("/v1/chat/completions", json=body(*first), headers=key)
    again = await sgw.client.post("/v1/chat/completions", json=body(*retry), headers=key)
    assert hit.headers["x-carpool"] == "semantic-hit" and fake.count() == 1
    assert hit.headers["x-carpool-usage"] == again.headers["x-carpool-usage"] == "other-prompt"


@pytest.fixture
async def sgw(gateway_with):
    async with gateway_with(**SEMANTIC) as served:
        yield served


@pytest.mark.parametrize(
    "leader_headers", [None, {"Cache-Control": "no-cache"}], ids=["probed", "not-probed"]
)
async def test_a_paraphrase_sent_the_moment_the_first_answer_is_returned_is_a_semantic_hit(
    sgw, fake, leader_headers
):
    # Read-your-writes: the entry is in the index before the first client has its answer (its
    # prompt embedded by the probe, or while the upstream answered when nothing probed).
    for i in range(10):
        first = await ask(sgw, f"How do I reset router number {i}?", headers=leader_headers)
        again = await ask(sgw, f"how can i reset router number {i}")
        assert again.headers["x-carpool"] == "semantic-hit", i
        assert again.json() == first.json()
    assert fake.count() == 10


async def test_a_paraphrase_is_a_semantic_hit_with_its_similarity(sgw, fake):
    first = await ask(sgw, "How do I reset my router?")
    await stored(sgw)
    again = await ask(sgw, "how can i reset my router")
    assert again.headers["x-carpool"] == "semantic-hit"
    assert 0 < float(again.headers["x-carpool-similarity"]) <= 1
    assert "age" in again.headers
    assert again.json() == first.json() and fake.count() == 1
    stats = (await sgw.client.get("/stats")).json()
    assert stats["semantic_hits"] == 1 and stats["layers"]["semantic"]["entries"] == 1


async def test_streaming_semantic_hits_of_an_entry_share_frames_made_once_and_counted_in_its_budget(
    sgw, fake, monkeypatch
):
    # An answer stored without frames (a whole one) is sent to a streaming client as frames
    # made from its body. Each semantic hit was handed a copy of the entry's answer with a memo
    # of its own, so every streaming client had them made anew, for it alone, on the event loop
    # (an 8 MB answer: ~33 ms each, and a copy each client that stops reading holds). Now they
    # are made once per entry and kept in it, counted in the semantic cache's bytes.
    chat = api_of("chat")
    made: list[bool] = []
    synthesize = chat.synthesize

    def counting(body, include_usage):
        made.append(include_usage)
        return synthesize(body, include_usage)

    monkeypatch.setattr(chat, "synthesize", counting)
    await ask(sgw, "How do I reset my router?")  # a whole answer: stored without frames
    await stored(sgw)
    held = sgw.gateway.semantic.bytes
    streams = []
    for include_usage in (False, True, False, True):
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        message = {"role": "user", "content": "how can i reset my router"}
        request = {"model": "m", "temperature": 0, "messages": [message], "stream": True}
        async with sgw.client.stream(
            "POST", "/v1/chat/completions", json={**request, **options}
        ) as streamed:
            raw = (await streamed.aread()).decode()
        assert streamed.headers["x-carpool"] == "semantic-hit"
        assert raw.endswith("data: [DONE]\n\n") and ('"usage"' in raw) == include_usage
        streams.append(raw)
    assert streams[0] == streams[2] and streams[1] == streams[3]
    assert made == [False, True]  # once each way, for the entry: not once a client
    (entry,) = [entry for _, entry in sgw.gateway.semantic._entries.items()]
    assert entry.answer is not None and set(entry.answer.synthesized) == {False, True}
    # Kept in the entry: counted, not held uncounted.
    kept = synthesized_held(entry.answer)
    assert kept > 0 and sgw.gateway.semantic.bytes == held + kept
    stats = (await sgw.client.get("/stats")).json()
    assert stats["layers"]["semantic"]["bytes"] == held + kept and fake.count() == 1


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_the_responses_and_messages_apis_last_user_input_is_compared_by_meaning(
    sgw, fake, path
):
    def body(text, **extra):
        if path == "/v1/responses":  # not stored: a stored response is exact only
            return {"model": "m", "temperature": 0, "store": False, "input": text, **extra}
        return {
            "model": "m",
            "temperature": 0,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": text}],
            **extra,
        }

    first = await sgw.client.post(path, json=body("How do I reset my router?"))
    await stored(sgw)
    again = await sgw.client.post(path, json=body("how can i reset my router"))
    assert again.headers["x-carpool"] == "semantic-hit"
    assert again.json() == first.json()
    async with sgw.client.stream(
        "POST", path, json=body("how can i reset my router", stream=True)
    ) as streamed:
        raw = (await streamed.aread()).decode()
    assert streamed.headers["x-carpool"] == "semantic-hit"
    assert "event: " in raw and "[DONE]" not in raw
    other = "instructions" if path == "/v1/responses" else "system"  # in the scope
    scoped = await sgw.client.post(
        path, json=body("how can i reset my router", **{other: "Answer in French."})
    )
    assert scoped.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_a_stored_response_is_never_served_to_a_paraphrase(sgw, fake):
    # Stored (store absent or true), the answer's id names the response the upstream keeps for
    # its own input: a paraphrase handed it would continue (previous_response_id) or list
    # (input_items) another request's conversation. Not stored, the paraphrase is served.
    def body(text, **extra):
        return {"model": "m", "temperature": 0, "input": text, **extra}

    for store in ({}, {"store": True}):
        first = await sgw.client.post(
            "/v1/responses", json=body("How do I reset my router?", **store)
        )
        again = await sgw.client.post(
            "/v1/responses", json=body("how can i reset my router", **store)
        )
        assert again.headers["x-carpool"] == "miss", store
        assert again.json()["id"] != first.json()["id"]
    assert sgw.gateway.semantic.entries == 0
    await sgw.client.post("/v1/responses", json=body("How do I reset my router?", store=False))
    await stored(sgw)
    again = await sgw.client.post(
        "/v1/responses", json=body("how can i reset my router", store=False)
    )
    assert again.headers["x-carpool"] == "semantic-hit"


async def test_a_paraphrase_of_a_follow_up_of_a_deleted_response_is_not_served(sgw, fake):
    # A follow-up (not stored itself) of a stored response the client then deleted: its
    # semantic entry goes with it, as its exact one does. Before, a paraphrase was still served
    # the follow-up, where the upstream now refuses it (404).
    fake.keeps_responses = True
    made = await sgw.client.post(
        "/v1/responses", json={"model": "m", "temperature": 0, "input": "Keep this."}
    )
    rid = made.json()["id"]

    def body(text):
        return {
            "model": "m",
            "temperature": 0,
            "input": text,
            "store": False,
            "previous_response_id": rid,
        }

    await sgw.client.post("/v1/responses", json=body("How do I reset my router?"))
    await stored(sgw)
    paraphrase = await sgw.client.post("/v1/responses", json=body("how can i reset my router"))
    assert paraphrase.headers["x-carpool"] == "semantic-hit"
    assert (await sgw.client.delete(f"/v1/responses/{rid}")).status_code == 200
    assert sgw.gateway.semantic.entries == 0
    again = await sgw.client.post("/v1/responses", json=body("how can i reset my router"))
    assert again.status_code == 404


async def test_a_continuation_finishing_when_its_response_is_deleted_is_joined_by_no_one_after(
    gateway_with, fake
):
    # A DELETE that came while the continuation's answer was being stored (waiting for its
    # prompt's embedding) dropped its entry but left its flight, still running, to linger: an
    # identical continuation right after was served it (coalesced), not the upstream's 404.
    fake.keeps_responses = True
    settings = {**SEMANTIC, "coalesce": {"window_ms": 5000, "adaptive": False}}
    async with gateway_with(**settings) as gw:
        made = await gw.client.post(
            "/v1/responses", json={"model": "m", "temperature": 0, "input": "Keep this."}
        )
        rid = made.json()["id"]
        semantic, release = gw.gateway.semantic, asyncio.Event()
        vector = semantic.vector

        async def held_vector(view):
            await release.wait()
            return await vector(view)

        semantic.vector = held_vector
        body = {
            "model": "m",
            "temperature": 0,
            "input": "Go on.",
            "store": False,
            "previous_response_id": rid,
        }
        first = asyncio.create_task(gw.client.post("/v1/responses", json=body))
        tag = state_tag(requester({}, gw.gateway.config), rid)
        states = gw.gateway.layers.states
        # (Its key beside the first answer's: the call, indexed while it ran, is being stored.)
        await eventually(
            lambda: len(getattr(states._held.peek(tag), "keys", ())) == 2,
            what="the continuation being stored",
        )
        assert (await gw.client.delete(f"/v1/responses/{rid}")).status_code == 200
        release.set()
        assert (await first).status_code == 200
        again = await gw.client.post("/v1/responses", json=body)
        assert again.status_code == 404 and again.headers.get("x-carpool") != "coalesced"


@pytest.mark.parametrize(
    "extra, kept",
    [
        ({"prompt_token_ids": [101, 7592, 102]}, False),
        ({"prompt_logprobs": [None, {"7592": {"logprob": -1.5}}]}, False),
        ({"prompt_text": "<|user|>How do I reset my router?"}, False),  # (vLLM's)
        ({"prompt_token_ids": None, "prompt_logprobs": None}, True),  # (written null: none)
    ],
)
async def test_an_answer_that_carries_its_prompt_is_never_served_semantically(
    sgw, fake, extra, kept
):
    # Whatever asked for it (vLLM's return_token_ids, or a field or default carpool does not
    # know), an answer holding its prompt's tokens would hand a paraphrase another's prompt.
    fake.chat_extra = extra
    first = await sgw.chat("How do I reset my router?")
    assert first.json()["usage"]
    if kept:
        await stored(sgw)
    again = await sgw.chat("how can i reset my router")
    assert (again.headers["x-carpool"] == "semantic-hit") is kept
    assert sgw.gateway.semantic.entries == (1 if kept else 0)


async def test_echo_completions_are_never_served_semantically(sgw, fake):
    # With echo the answer's text is the prompt and then the completion (OpenAI, vLLM): a
    # paraphrase served the stored answer would read another request's prompt word for word.
    fake.answer_text = lambda n, body: (body["prompt"] if body.get("echo") else "") + f" [{n}]"

    async def complete(prompt):
        body = {"model": "m", "temperature": 0, "echo": True, "max_tokens": 16, "prompt": prompt}
        response = await sgw.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response

    await complete("How do I reset my router?")
    again = await complete("how can i reset my router")
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2
    assert again.json()["choices"][0]["text"].startswith("how can i reset my router")
    assert sgw.gateway.semantic.entries == 0  # no semantic view: never stored there either


async def test_a_prompt_longer_than_max_text_chars_is_matched_exactly_only(sgw, fake):
    # Past ``semantic.max_text_chars`` no semantic view is made: its English gate read the
    # whole text on the event loop (8 MB: ~7 s of every other request's wait) for a text the
    # guard serves only when identical. Its exact repeat is still an exact hit.
    long = "The quarterly report shows that revenue grew while the costs stayed flat. " * 300
    assert len(long) > 16_384
    await ask(sgw, long)
    # (Read-your-writes: a compared prompt's entry is in the index before its answer returns.)
    assert sgw.gateway.semantic.entries == 0
    repeat = await ask(sgw, long)
    assert repeat.headers["x-carpool"] == "hit"
    reworded = await ask(sgw, long.replace("grew", "rose", 1))
    assert reworded.headers["x-carpool"] == "miss" and fake.count() == 2
    await ask(sgw, "How do I reset my router?")  # a short prompt is still compared by meaning
    assert sgw.gateway.semantic.entries == 1


async def test_a_changed_ending_of_a_long_run_on_prompt_is_never_served(sgw, fake):
    # No sentence breaks: ``focus`` leaves the text whole, longer than the verifier reads of a
    # pair. Cut to its first ~127 tokens a side, "accepts" / "declines" at the end was served.
    mail = (
        "dear team, thank you all for your hard work this quarter, we have made great progress "
        "on the new product and our customers are happy with the results, please remember to "
        "submit your timesheets by friday and to update the shared calendar with your plans, "
    ) * 3

    def ending(verb):
        return f"here is an email i got: {mail}and i want you to write a reply that {verb}"

    await ask(sgw, ending("accepts the invitation"))
    await stored(sgw)
    declined = await ask(sgw, ending("declines the invitation"))
    assert declined.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.rejections == {"length": 1}


@pytest.mark.parametrize(
    "first, second",
    [("?", "!"), ("?", "???"), ("", "!"), ("...", "?!"), ("👍", "👎")],
    ids=["question-exclamation", "one-three", "empty-mark", "ellipsis-interrobang", "emoji"],
)
async def test_a_prompt_without_a_word_is_matched_exactly_only(sgw, fake, first, second):
    """Nothing of it can be compared by meaning: "!" was served the answer to "?" (0.74)."""
    await ask(sgw, first)
    response = await ask(sgw, second)
    assert response.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.entries == 0


#: Marks, filler and politeness the packaged verifier misread (scored 0.98-0.99 for unrelated
#: prompts written with them, 0.02-0.37 without), and a prompt pasted twice: it reads the texts
#: without them, and emoticons must match (``rules.tone``); "hi" / "bye" scored 0.99 bare
#: (``rules.polarity``).
MISREAD_MARKS = {
    "exclamation": ("Explain machine learning!", "Explain quantum computing!"),
    "exclamations": ("How do I bake bread!!", "How do I bake cake!!"),
    "interrobang": ("Explain machine learning?!", "Explain quantum computing?!"),
    "smiley": ("Explain machine learning :)", "Explain quantum computing :)"),
    "smiley-on-one-side": ("Explain machine learning :)", "Explain quantum computing"),
    "wink": ("ok ;)", "no ;)"),
    "filler": ("Explain machine learning lol", "Explain quantum computing lol"),
    "politeness": ("continue, thank you", "stop, thank you"),
    "please": ("go ahead please", "wait please"),
    "greeting-farewell": ("Hi!", "Bye!"),
    "yes-no-reply": ("yes, go ahead", "no, go ahead"),
    # (Filler inside a clause is what is asked about: the verifier reads it.)
    "filler-asked-about": (
        "Is it rude to say lol in a work email?",
        "Is it rude to say in a work email?",
    ),
    "pasted-twice": (
        "Explain machine learning? Explain machine learning?",
        "Explain quantum computing? Explain quantum computing?",
    ),
    "sad-for-happy": ("I just got the job :)", "I just got the job :("),
    "trailing-ellipsis": ("How do I bake bread...", "How do I bake cake..."),
    "ellipsis-after-mark": ("How do I bake bread?...", "How do I bake cake?..."),
    "marks-apart": ("How do I bake bread !!!", "How do I bake cake !!!"),
    "marks-and-a-one": ("How do I bake bread!!1", "How do I bake cake!!1"),
    "ones-among-marks": ("How do I bake bread!!!1!", "How do I bake cake!!!1!"),
    "marks-spaced": ("How do I bake bread ! ! !", "How do I bake cake ! ! !"),
    "face-attached": ("How do I bake bread^_^", "How do I bake cake^_^"),
    "face-reversed": ("How do I bake bread (:", "How do I bake cake (:"),
    "operator-asked-about": ("What does !!", "What does ??"),
}


@pytest.mark.parametrize("kind", sorted(MISREAD_MARKS))
async def test_marks_and_filler_the_verifier_misread_never_make_unrelated_prompts_the_same(
    sgw, fake, kind
):
    first, second = MISREAD_MARKS[kind]
    await ask(sgw, first)
    await stored(sgw)
    response = await ask(sgw, second)
    assert response.headers["x-carpool"] == "miss" and fake.count() == 2


@pytest.mark.parametrize(
    "first, second",
    [
        ("How do I reset my router? :)", "how can i reset my router :)"),
        ("How do I reset my router lol", "How can I reset my router?"),
        ("How do I reset my router please", "How do I reset my router"),
        ("How can I reset my password? Thanks in advance.", "How can I reset my password?"),
        # (Marks apart from the last word end the sentence: no operator.)
        ("How do I reset my router ??", "how do i reset my router?"),
        ("How do I reset my router !!!", "How do I reset my router!!!"),
    ],
)
async def test_a_paraphrase_with_the_same_emoticon_or_with_filler_is_still_served(
    sgw, fake, first, second
):
    await served_again(sgw, first, second)


async def test_a_negation_is_never_served(sgw, fake):
    await ask(sgw, "Is ibuprofen safe to take with alcohol?")
    await stored(sgw)
    response = await ask(sgw, "Is ibuprofen unsafe to take with alcohol?")
    assert response.headers["x-carpool"] == "miss" and fake.count() == 2


#: Pairs a review found served as semantic hits, each with the rule that refuses it now: an
#: opposite in its comparative or superlative form (the list held only "big" / "small"), one the
#: list lacked, "still" / "no longer" (its negator left it to the verifier), an exclusion and an
#: audience nothing read, and one thing in place of another inside shared filler (the verifier
#: scored "router" / "modem" low bare, 0.99 with the filler).
#: Long prompts for the traps below: a pasted text, then what to do with it (the cache compares
#: the last sentences; the text before them must match exactly).
SUPPLIER_EMAIL = (
    "Please read the email below from our supplier and draft a short reply for me.\n\nHi Dana,"
    "\n\nThanks for your patience while we sorted out the delays at our warehouse last month. We"
    " have finally received the replacement parts from our manufacturer and the assembly line is"
    " running again at full speed. We can deliver half of the ergonomic chairs by the end of next"
    " week, and the remaining units should follow shortly after that. Our driver will need access"
    " to the loading dock on Thursday morning, so please let me know if that is a problem for your"
    " building manager. I have attached the revised invoice for your records. Please review it"
    " carefully and let me know whether you approve it, or if you would prefer to discuss the"
    " details on a call first.\n\nBest regards,\nMarcus\n\n"
)
DISCOUNT_CODE = (
    "Review this Python function and tell me whether it has any bugs. Be specific.\n\n"
    "def apply_discount(order, customer):\n"
    "    total = 0\n"
    "    for item in order.items:\n"
    "        price = item.unit_price * item.quantity\n"
    "        if item.category == 'clearance':\n"
    "            price = price * 0.5\n"
    "        total += price\n"
    "    if customer.years_active > 3 and total > 100:\n"
    "        total = total - 10\n"
    "    if total < 0:\n"
    "        total = 0\n"
    "    return round(total * 1.08, 2)\n\n"
    "The function is called once per checkout and the result is shown to the customer as the final"
    " amount they will pay. Our tests cover clearance items but not the loyalty branch.\n\n"
)
SERVED_BY_THE_VERIFIER = {
    "comparative": (
        "Which is bigger, the Sun or the Earth?",
        "Which is smaller, the Sun or the Earth?",
        "polarity",
    ),
    "superlative": (
        "Which month has the longest day in Sydney?",
        "Which month has the shortest day in Sydney?",
        "polarity",
    ),
    "sort_order": (
        "Write a Python function that sorts a list in ascending order.",
        "Write a Python function that sorts a list in descending order.",
        "polarity",
    ),
    "no_longer": ("Is Pluto still a planet?", "Is Pluto no longer a planet?", "polarity"),
    "exclusion": (
        "List the countries in Europe that use the euro.",
        "List the countries in Europe except those that use the euro.",
        "polarity",
    ),
    "audience": (
        "Explain quantum computing for beginners.",
        "Explain quantum computing for experts.",
        "polarity",
    ),
    "object_in_filler": (
        "how can i reset my router please",
        "how can i reset my modem please",
        "substitution",
    ),
    "object_in_a_long_filler": (
        "how can i reset my microwave right now please, it has been acting up all week",
        "how can i reset my oven right now please, it has been acting up all week",
        "substitution",
    ),
    # A review's traps, served before: a direction between names of several words, a task's
    # input after a colon with no task verb, "my" / "your", "no longer" on one side of a long
    # prompt, code that differs in one punctuation mark, roles swapped through a pronoun.
    "direction_between_phrases": (
        "Write a function that converts a Unix timestamp to an ISO 8601 string.",
        "Write a function that converts an ISO 8601 string to a Unix timestamp.",
        "order",
    ),
    "direction_from_to": (
        "How do I move my photos from Google Photos to iCloud?",
        "How do I move my photos from iCloud to Google Photos?",
        "order",
    ),
    "migration_reversed": (
        "How do I migrate from MySQL 5.7 to PostgreSQL 15?",
        "How do I migrate from PostgreSQL 15 to MySQL 5.7?",
        "order",
    ),
    "roles_through_a_pronoun": (
        "My manager keeps interrupting me in meetings. How should I handle it?",
        "I keep interrupting my manager in meetings. How should I handle it?",
        "order",
    ),
    "task_input_after_a_colon": (
        "Put this in Spanish please: she is reading a book",
        "Put this in Spanish please: she was reading a book",
        "quoted",
    ),
    "whose_essay": (
        "Can you check my essay for plagiarism?",
        "Can you check your essay for plagiarism?",
        "substitution",
    ),
    "no_longer_in_a_long_prompt": (
        "I'm drafting a memo to the team. Please make the tone formal, keep it under 200 words, "
        "and mention that the Friday meeting is happening as planned.",
        "I'm drafting a memo to the team. Please make the tone formal, keep it under 200 words, "
        "and mention that the Friday meeting is no longer happening as planned.",
        "polarity",
    ),
    "code_missing_colon": (
        "What's wrong with this line: for i in range(10) print(i)",
        "What's wrong with this line: for i in range(10): print(i)",
        "quoted",
    ),
    "code_trailing_comma": (
        "Is this valid JavaScript: const a = [1, 2, 3,]",
        "Is this valid JavaScript: const a = [1, 2, 3]",
        "quoted",
    ),
    # A second review's traps (long prompts, times of day), served before: am / pm after the
    # same number, a "not" added to a long prompt's last sentence (a near repeat, 0.977: its
    # bar 0.90 passed the verifier's 0.96), "keep" / "change" after the same code.
    "medication_am_pm": (
        "I take my medication at 8 am. Can I drink coffee with it?",
        "I take my medication at 8 pm. Can I drink coffee with it?",
        "number",
    ),
    "flight_am_pm": (
        "My flight leaves at 6 am tomorrow. What time should I get to the airport?",
        "My flight leaves at 6 pm tomorrow. What time should I get to the airport?",
        "number",
    ),
    "not_in_a_long_prompts_last_sentence": (
        SUPPLIER_EMAIL + "In my reply, thank him, confirm the dock access, and say that we approve"
        " the revised invoice.",
        SUPPLIER_EMAIL + "In my reply, thank him, confirm the dock access, and say that we do not"
        " approve the revised invoice.",
        "meaning",
    ),
    "keep_or_change_after_the_same_code": (
        DISCOUNT_CODE + "Keep the function signature the same.",
        DISCOUNT_CODE + "Change the function signature as needed.",
        "polarity",
    ),
    # A third review's traps (everyday domains), served before: numbers written together in
    # another order, a unit or a currency on another number, percent / percentage points, a time
    # of day in words, odd / even, keep / discard, over- / under-, "as" taken for "and".
    "fraction_order": ("What is 1/3 of 90?", "What is 3/1 of 90?", "number"),
    "day_and_month_exchanged": (
        "What day of the week is 03/04/2025?",
        "What day of the week is 04/03/2025?",
        "number",
    ),
    "units_on_other_numbers": (
        "How many watts does a 2 amp charger deliver at 5 volts?",
        "How many watts does a 2 volt charger deliver at 5 amps?",
        "number",
    ),
    "currencies_on_other_amounts": (
        "Which is more, $100 or €90?",
        "Which is more, $90 or €100?",
        "number",
    ),
    "percent_or_percentage_points": (
        "Unemployment rose by 2 percentage points. Is that a lot?",
        "Unemployment rose by 2 percent. Is that a lot?",
        "number",
    ),
    "noon_or_midnight": (
        "What time is noon UTC in Tokyo?",
        "What time is midnight UTC in Tokyo?",
        "number",
    ),
    "odd_or_even": (
        "Is the sum of two odd numbers even?",
        "Is the sum of two even numbers even?",
        "polarity",
    ),
    "keep_or_discard": (
        "How do I undo the last git commit but keep the changes?",
        "How do I undo the last git commit and discard the changes?",
        "polarity",
    ),
    "undervalued_or_overvalued": (
        "Is Tesla stock undervalued right now?",
        "Is Tesla stock overvalued right now?",
        "polarity",
    ),
    "roles_after_as": (
        "Should I sign the lease as the landlord or as the tenant's guarantor?",
        "Should I sign the lease as the tenant or as the landlord's guarantor?",
        "order",
    ),
    # A fourth review's traps: a role named again in the question, one-letter names, a name
    # said twice.
    "role_named_again_in_the_question": (
        "If the husband is a US citizen sponsoring the wife, what visa does the wife need?",
        "If the wife is a US citizen sponsoring the husband, what visa does the wife need?",
        "order",
    ),
    "one_letter_names": (
        "Team A beat Team B 3-1. Who advances to the final?",
        "Team B beat Team A 3-1. Who advances to the final?",
        "order",
    ),
    "names_said_twice": (
        "Mary gave John the book John wanted. Who is grateful?",
        "John gave Mary the book Mary wanted. Who is grateful?",
        "order",
    ),
    "exceed_or_fall_short": (
        "Does my income exceed the limit if I earn 40k and the cap is 35k?",
        "Does my income fall short of the limit if I earn 40k and the cap is 35k?",
        "polarity",
    ),
    "prior_or_subsequent": (
        "Was the iPhone released prior to the first Android phone?",
        "Was the iPhone released subsequent to the first Android phone?",
        "polarity",
    ),
    "and_or_or_between_names_of_code": (
        "Explain short circuit evaluation of a and b in Python.",
        "Explain short circuit evaluation of a or b in Python.",
        "operator",
    ),
    "not_before_a_group": (
        "What does not x and y parse as in Python?",
        "What does not (x and y) parse as in Python?",
        "operator",
    ),
    "off_and_onto_reversed": (
        "How do I move my photos off iCloud onto Google Photos?",
        "How do I move my photos off Google Photos onto iCloud?",
        "order",
    ),
    "worth_in_reversed": (
        "What's a euro worth in dollars right now?",
        "What's a dollar worth in euros right now?",
        "order",
    ),
    "how_do_i_say_in_another_tense": (
        "How do I say I studied medicine in Spanish?",
        "How do I say I study medicine in Spanish?",
        "quoted",
    ),
    # A fifth review's traps (tests/semantic/test_traps5.py has them all): a unit in another
    # case (served at 1.0, a retyping), another relative through a possessive, a quantifier, a
    # condition, a modal or a tense in a small edit, over / under.
    "unit_in_another_case": ("Is a 5 MHz signal audible?", "Is a 5 mHz signal audible?", "number"),
    "owner_and_relative_exchanged": (
        "What do I call my wife's brother?",
        "What do I call my brother's wife?",
        "order",
    ),
    "a_relative_of_a_relative": (
        "What should I get my boss's boss for her retirement?",
        "What should I get my boss for her retirement?",
        "relation",
    ),
    "all_or_some": (
        "Do all vaccines contain live virus?",
        "Do some vaccines contain live virus?",
        "qualifier",
    ),
    "if_or_unless": (
        "Will the flight be refunded if the airline cancels it?",
        "Will the flight be refunded unless the airline cancels it?",
        "qualifier",
    ),
    "must_or_can": ("Must a primary key be unique?", "Can a primary key be unique?", "qualifier"),
    "was_or_is": ("Was Pluto a planet?", "Is Pluto a planet?", "qualifier"),
    "under_or_over": (
        "Is inheritance taxed if the estate is under the threshold?",
        "Is inheritance taxed if the estate is over the threshold?",
        "polarity",
    ),
}


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("Do any snakes lay eggs?", "Are there snakes that lay eggs?"),
        ("Who was Queen Victoria's grandmother?", "Who was the grandmother of Queen Victoria?"),
        (
            "Do you need a license to fly a drone in the UK?",
            "Is a license needed to fly a drone in the UK?",
        ),
        (
            "Can I take the bus for free if I'm over 65?",
            "If I'm over 65, can I ride the bus for free?",
        ),
    ],
)
async def test_a_quantifier_a_relative_a_modal_or_a_condition_reworded_is_still_a_semantic_hit(
    sgw, fake, first, second
):
    await served_again(sgw, first, second)
    assert fake.count() == 1


@pytest.mark.parametrize("kind", sorted(SERVED_BY_THE_VERIFIER))
async def test_an_opposite_an_exclusion_or_another_object_in_the_same_words_is_never_served(
    sgw, fake, kind
):
    first, second, reason = SERVED_BY_THE_VERIFIER[kind]
    await ask(sgw, first)
    await stored(sgw)
    response = await ask(sgw, second)
    assert response.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.rejections == {reason: 1}


async def test_a_conversation_whose_earlier_turns_ask_the_opposite_is_never_served(sgw, fake):
    bigger = [
        {"role": "user", "content": "Which is bigger, a cat or a dog?"},
        {"role": "assistant", "content": "A dog is usually bigger."},
    ]
    smaller = [
        {"role": "user", "content": "Which is smaller, a cat or a dog?"},
        {"role": "assistant", "content": "A cat is usually smaller."},
    ]
    await ask(sgw, "By how much?", history=bigger)
    await stored(sgw)
    response = await ask(sgw, "By how much?", history=smaller)
    assert response.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.rejections == {"polarity": 1}
    # Shown to the operator too (counted, never shown before: a review).
    stats = (await sgw.client.get("/stats")).json()
    assert stats["layers"]["semantic"]["refused"] == {"polarity": 1}
    metrics = (await sgw.client.get("/metrics")).text
    assert 'carpool_semantic_refusals_total{reason="polarity"} 1.0' in metrics


#: A long shared first turn, then the assistant saying one thing or its opposite: the earlier
#: turns read as one text, the long turn drowned the "not" (0.985-0.991, served); the turn
#: that differs, read alone, scored 0.02-0.03.
MEDICATIONS = (
    "I'm 62, I take metformin for type 2 diabetes and lisinopril for blood pressure, and my"
    " doctor wants me to start a new medication for my cholesterol next week. Is there anything"
    " I should check first?"
)


async def test_a_conversation_whose_earlier_answer_said_the_opposite_is_never_served(sgw, fake):
    def history(said: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": MEDICATIONS}, {"role": "assistant", "content": said}]

    await ask(sgw, "So what should I do?", history=history("In short, it is safe to combine them."))
    await stored(sgw)
    response = await ask(
        sgw, "So what should I do?", history=history("In short, it is not safe to combine them.")
    )
    assert response.headers["x-carpool"] == "miss" and fake.count() == 2


@pytest.mark.parametrize("collapse", [False, True], ids=["as-sent", "white-space-collapsed"])
async def test_an_earlier_answer_changed_beside_a_long_shared_turn_is_never_served(
    gateway_with, fake, collapse
):
    # Collapsed white space joined the earlier turns into one line: read as one text, the long
    # turn drowned the change ("in the morning" / "at night" 0.992, served).
    def history(said: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": MEDICATIONS}, {"role": "assistant", "content": said}]

    async with gateway_with(**SEMANTIC, fingerprint={"normalize_whitespace": collapse}) as gw:
        await ask(gw, "So what should I do?", history=history("Take it in the morning."))
        await stored(gw)
        response = await ask(gw, "So what should I do?", history=history("Take it at night."))
        assert response.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_a_changed_number_is_never_served(sgw, fake):
    await ask(sgw, "What is the baggage allowance for 2 passengers?")
    await stored(sgw)
    response = await ask(sgw, "What is the baggage allowance for 3 passengers?")
    assert response.headers["x-carpool"] == "miss"


#: Prompts that differ only in what the guard once took for retyping (case, and every character
#: that is no letter or digit): the shortcut served them without asking the verifier.
_CODE = "What does this Python function return for [1, 2, 3]?\n```\ndef f(xs):\n    total = 0\n"
NOT_RETYPED = {
    "emoji": ("Reply with 👍", "Reply with 👎"),
    "emoji_in_a_question": ("What does 🍎 mean?", "What does 🍌 mean?"),
    "flag_case": ("What does ls -a do?", "What does ls -A do?"),
    "math_symbol": ("Is A ⊂ B true when A is empty?", "Is A ⊄ B true when A is empty?"),
    "operator_symbol": ("Explain x++ in Java", "Explain x-- in Java"),
    "language_name": ("Write a hello world program in C", "Write a hello world program in C++"),
    "leading_dot": ("Is .NET free?", "Is NET free?"),
    "acronym": ("What is IT?", "What is it?"),
    "root": ("What is √16?", "What is ∛16?"),
    "arrow": ("Is P ⇒ Q equivalent to not P or Q?", "Is P ⇔ Q equivalent to not P or Q?"),
    "indentation": (
        _CODE + "    for x in xs:\n        total += x\n    return total\n```",
        _CODE + "    for x in xs:\n        total += x\n        return total\n```",
    ),
}


@pytest.mark.parametrize("kind", sorted(NOT_RETYPED))
async def test_a_prompt_differing_only_in_a_symbol_emoji_case_or_indentation_is_never_served(
    sgw, fake, kind
):
    # Case-folded with every non-word character dropped, these were "retyped" (1.0, the verifier
    # never asked): a thumbs down was served the thumbs up's answer, C the answer for C++.
    first, second = NOT_RETYPED[kind]
    headers = {"x-carpool-type": "code"}  # white space kept as sent
    await ask(sgw, first, headers=headers)
    await stored(sgw)
    again = await ask(sgw, second, headers=headers)
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2, kind


async def test_an_invisible_format_character_keeps_a_prompt_exact(sgw, fake):
    # The models do not see a zero-width space: "pay\u200bpal" scored 1.0 against "paypal".
    await ask(sgw, "Is paypal a safe way to pay online?")
    await stored(sgw)
    again = await ask(sgw, "Is pay\u200bpal a safe way to pay online?")
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.entries == 1  # no semantic view: not indexed either
    assert (await ask(sgw, "Is pay\u200bpal a safe way to pay online?")).headers[
        "x-carpool"
    ] == "hit"


@pytest.mark.parametrize(
    "first, second",
    [
        ("How do I reset my router?", "how do i reset my router"),
        ("How long does standard shipping take?", "  How long does standard shipping take ?  "),
        ("What are your opening hours?", "WHAT ARE YOUR OPENING HOURS"),
        ("Cancel it.", "cancel  it"),
        ('Explain "dependency injection" (briefly).', "explain dependency injection briefly"),
    ],
)
async def test_a_near_repeat_up_to_case_edge_punctuation_and_spacing_is_still_served(
    sgw, fake, first, second
):
    await served_again(sgw, first, second)


async def test_the_earlier_turns_are_compared_too_another_context_never_matches(sgw, fake):
    gym = [
        {"role": "user", "content": "I have a gym membership."},
        {"role": "assistant", "content": "Great, how can I help?"},
    ]
    phone = [
        {"role": "user", "content": "I have a phone plan."},
        {"role": "assistant", "content": "Great, how can I help?"},
    ]
    await ask(sgw, "How do I cancel it?", history=gym)
    await stored(sgw)
    assert (await ask(sgw, "How do I cancel it?", history=phone)).headers["x-carpool"] == "miss"
    assert (await ask(sgw, "how do I cancel it", history=gym)).headers[
        "x-carpool"
    ] == "semantic-hit"


async def test_a_different_system_prompt_or_parameter_is_another_scope(sgw, fake):
    await ask(sgw, "How do I reset my router?", system="You are terse.")
    await stored(sgw)
    assert (await ask(sgw, "how can i reset my router", system="You are verbose.")).headers[
        "x-carpool"
    ] == "miss"
    assert (
        await ask(sgw, "how can i reset my router", system="You are terse.", max_tokens=5)
    ).headers["x-carpool"] == "miss"


HEAD = (
    "You are the support assistant of Example Shop. Answer in two short paragraphs, in "
    "plain English, without links. Be polite and accurate, never promise a refund, and ask "
    "for the order number when the customer has not given one. Escalate legal questions."
)


async def complete(gw, prompt):
    response = await gw.client.post(
        "/v1/completions", json={"model": "m", "temperature": 0, "prompt": prompt}
    )
    assert response.status_code == 200, response.text
    return response


async def test_a_long_prompt_head_must_match_exactly_and_only_the_question_is_compared(sgw, fake):
    # Compared whole, two prompts sharing a long head embed alike whatever their question (a
    # 256-token head: similarity 1.0), and the guard leaves long texts to the embedding.
    def ask_(question, head=HEAD):
        return complete(sgw, f"{head}\n\nQuestion: {question}\nAnswer:")

    await ask_("How do I update my password?")
    await stored(sgw)
    assert (await ask_("How do I back up my email address?")).headers["x-carpool"] == "miss"
    await stored(sgw, 2)
    assert (await ask_("how can I update my password?")).headers["x-carpool"] == "semantic-hit"
    other = HEAD.replace("Example Shop", "Other Shop")
    assert (await ask_("how can I update my password?", other)).headers["x-carpool"] == "miss"
    assert fake.count() == 3


def test_focus_moves_a_long_head_into_the_scope():
    from carpool.fingerprint import SemanticView
    from carpool.semantic.cache import focus

    question = "Question: How do I update my password? Answer:"
    view = SemanticView("s", f"{HEAD} {question}")
    focused = focus(view)
    assert focused.text == question and focused.scope != "s"
    assert focus(focused) == focused  # idempotent
    assert (
        focus(SemanticView("s", f"{HEAD} Question: Why? Answer:")).text
        == "Escalate legal questions. Question: Why? Answer:"
    )  # a tail of 4 words at least
    assert focus(SemanticView("t", f"{HEAD} {question}")).scope != focused.scope
    short = SemanticView("s", "How do I update my password? I use the mobile app.")
    assert focus(short) == short  # no long head
    # A paragraph whose last sentence is one of several of its own stays whole...
    paragraph = SemanticView(
        "s",
        " ".join(["The export writes every record to one file."] * 5)
        + " "
        + " ".join(["It keeps the header line"] * 3)
        + ".",
    )
    assert focus(paragraph) == paragraph
    # ...unless it is longer than the model reads.
    long = SemanticView(
        "s",
        " ".join(["The export writes every record to one file."] * 20)
        + " "
        + " ".join(["It keeps the header line"] * 3)
        + ".",
    )
    assert focus(long).text == " ".join(["It keeps the header line"] * 3) + "."


async def test_tenants_never_share_semantic_entries(sgw, fake):
    await ask(sgw, "How do I reset my router?", headers={"Authorization": "Bearer a"})
    await stored(sgw)
    response = await ask(sgw, "how can i reset my router", headers={"Authorization": "Bearer b"})
    assert response.headers["x-carpool"] == "miss"


async def test_no_cache_does_not_read_and_no_store_does_not_write_the_semantic_cache(sgw, fake):
    await ask(sgw, "How do I reset my router?")
    await stored(sgw)
    response = await ask(sgw, "how can i reset my router", headers={"Cache-Control": "no-cache"})
    assert response.headers["x-carpool"] == "miss"
    await stored(sgw, 2)  # no-cache still stores what it fetched
    await ask(sgw, "Where is my parcel right now?", headers={"Cache-Control": "no-store"})
    await ask(sgw, "What time do you open on Sundays?", headers={"x-carpool-type": "factual"})
    assert sgw.gateway.semantic.entries == 2  # (inserted before the reply: none for those two)


async def test_max_age_applies_to_semantic_hits(sgw, fake):
    await ask(sgw, "How do I reset my router?")
    await stored(sgw)
    response = await ask(sgw, "how can i reset my router", headers={"Cache-Control": "max-age=0"})
    assert response.headers["x-carpool"] == "miss"


ADMIN = {"Authorization": "Bearer t"}


async def test_invalidation_by_tag_reaches_the_semantic_cache(fake, gateway_with):
    # Asked again with its tags: without them the paraphrase was another scope, a miss
    # whatever the invalidation did.
    tagged = {"x-carpool-tags": "router"}
    async with gateway_with(admin_token="t", **SEMANTIC) as gw:
        await ask(gw, "How do I reset my router?", headers=tagged)
        await stored(gw)
        assert (await ask(gw, "how can i reset my router", headers=tagged)).headers[
            "x-carpool"
        ] == "semantic-hit"
        dropped = await gw.client.post("/admin/invalidate", json={"tag": "router"}, headers=ADMIN)
        assert dropped.json() == {"invalidated": 2}  # exact + semantic
        again = await ask(gw, "how can i reset my router", headers=tagged)
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2


# Each selector, and the headers that put an answer under it.
SELECTORS = pytest.mark.parametrize(
    "selector, headers",
    [
        ({"tag": "router"}, {"x-carpool-tags": "router"}),
        ({"namespace": "support"}, {"x-carpool-namespace": "support"}),
        ({"all": True}, {}),
        ({"prefix": "How do I"}, {}),  # the entry's own prompt starts with it
    ],
    ids=["tag", "namespace", "all", "own-prefix"],
)


@SELECTORS
async def test_every_invalidation_selector_stops_semantic_hits(
    fake, gateway_with, selector, headers
):
    async with gateway_with(admin_token="t", **SEMANTIC) as gw:
        await ask(gw, "How do I reset my router?", headers=headers)
        await stored(gw)
        hit = await ask(gw, "how can i reset my router", headers=headers)
        assert hit.headers["x-carpool"] == "semantic-hit"  # the same scope: a hit before
        dropped = await gw.client.post("/admin/invalidate", json=selector, headers=ADMIN)
        assert dropped.status_code == 200, dropped.text
        again = await ask(gw, "how can i reset my router?", headers=headers)
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2


@pytest.mark.parametrize(
    "stored_prompt, prefix, asked",
    [
        # The entry's own prompt does not start with the prefix (nothing of it is dropped); the
        # prompt served it does, and its own exact answer would have been dropped.
        (
            "What's the price of the Pro plan?",
            "What is the price",
            "What is the price of the Pro plan?",
        ),
        ("How do I reset my router?", "how can i reset", "how can i reset my router"),
    ],
    ids=["price", "router"],
)
async def test_a_prefix_invalidation_stops_semantic_hits_for_prompts_with_that_prefix(
    fake, gateway_with, stored_prompt, prefix, asked
):
    async with gateway_with(admin_token="t", **SEMANTIC) as gw:
        await ask(gw, stored_prompt)
        await stored(gw)
        assert (await ask(gw, asked)).headers["x-carpool"] == "semantic-hit"
        dropped = await gw.client.post("/admin/invalidate", json={"prefix": prefix}, headers=ADMIN)
        assert dropped.json() == {"invalidated": 0}  # no answer's prompt starts with it
        again = await ask(gw, asked)
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2
        # A prompt without the prefix is still served the entry; the fresh answer, made after
        # the invalidation, is served to paraphrases that have it.
        other = await ask(gw, stored_prompt.rstrip("?").lower())
        assert other.headers["x-carpool"] == "semantic-hit"
        await stored(gw, 2)
        fresh = await ask(gw, asked.rstrip("?") + " ?")
        assert fresh.headers["x-carpool"] == "semantic-hit"
        assert fresh.json() == again.json() and fake.count() == 2


@pytest.mark.parametrize("control", ["\x00", "\x7f", "\x08", "\x1f", "\x0b", "\x85", "\ufffd"])
async def test_a_control_character_keeps_a_prompt_exact(sgw, fake, control):
    # The embedding model's normaliser drops them unread, as it does format characters:
    # "pay\x00pal" scored 1.0 against "paypal" and was served its answer.
    await ask(sgw, "Is paypal a safe site?")
    await stored(sgw)
    again = await ask(sgw, f"Is pay{control}pal a safe site?")
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.entries == 1  # no semantic view: not indexed either
    repeat = await ask(sgw, f"Is pay{control}pal a safe site?")
    assert repeat.headers["x-carpool"] == "hit"


async def test_a_semantic_entry_is_not_served_past_its_ttl(fake, gateway_with):
    # The lookup read the system's time for an entry's age and expiry, while the answers'
    # ``created`` and ``expires`` and the sweep read the gateway's clock.
    from carpool.clock import ManualClock

    clock = ManualClock()
    short = {"x-carpool-type": "realtime"}
    types = {"realtime": {"ttl": 5}}
    async with gateway_with(clock=clock, cache={"types": types}, **SEMANTIC) as gw:
        await ask(gw, "How do I reset my router?", headers=short)
        await stored(gw)
        clock.advance(4)
        hit = await ask(gw, "how can i reset my router", headers=short)
        assert hit.headers["x-carpool"] == "semantic-hit" and hit.headers["age"] == "4"
        too_old = await ask(
            gw, "how can i reset my router", headers={**short, "Cache-Control": "max-age=3"}
        )
        assert too_old.headers["x-carpool"] == "miss" and fake.count() == 2
        clock.advance(6)  # past both entries' TTL (the first's, and the one made at 4 s)
        expired = await ask(gw, "how could i reset my router?", headers=short)
        assert expired.headers["x-carpool"] == "miss" and fake.count() == 3


def exact_reads(gw: Any) -> list[str]:
    """The keys ``gw``'s exact cache is read for from now on (its ``store.get``, counted)."""
    reads: list[str] = []
    get = gw.gateway.store.get

    async def counted(*args: Any, **kwargs: Any) -> Any:
        reads.append(args[0])
        return await get(*args, **kwargs)

    gw.gateway.store.get = counted
    return reads


class HeldLookups:
    """A rule put first in ``gw``'s guard that holds each lookup it reads (on the rules' worker
    thread) until ``release``: ``held(n)`` waits for ``n`` more to be held; ``judged``: the
    texts read, ``released``: whether each was released (False: nobody did, in 10 s)."""

    def __init__(self, gw: Any) -> None:
        from carpool.semantic.verdict import Reason, Rule

        self.release = threading.Event()
        self.judged: list[str] = []
        self.released: list[bool] = []
        self._entered = threading.Semaphore(0)
        guard = gw.gateway.semantic.guard
        guard.rules = (Rule(Reason.ORDER, self._hold), *guard.rules)

    def _hold(self, a: str, b: str) -> bool:
        self.judged.append(a)
        self._entered.release()
        self.released.append(self.release.wait(10))
        return False

    async def held(self, n: int = 1) -> None:
        for _ in range(n):
            assert await asyncio.to_thread(self._entered.acquire, True, 10)


async def test_an_entry_that_aged_past_max_age_while_judged_is_not_served(fake, gateway_with):
    # The entry's age was read as the lookup began: one judged for seconds (behind a burst, or
    # joined by an identical request later: ``lookups_joined``) was served older than the
    # requester's max-age, its Age header saying so.
    from carpool.clock import ManualClock

    clock = ManualClock()
    async with gateway_with(clock=clock, **SEMANTIC) as gw:
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        clock.advance(8)
        lookups = HeldLookups(gw)
        fresh = {"Cache-Control": "max-age=10"}
        first = asyncio.create_task(ask(gw, "how can i reset my router", headers=fresh))
        await lookups.held()
        clock.advance(5)  # (13 s old now)
        joiner = asyncio.create_task(ask(gw, "how can i reset my router", headers=fresh))
        await eventually(lambda: gw.gateway.semantic.lookups_joined == 1, what="the joiner")
        lookups.release.set()
        for reply in await asyncio.gather(first, joiner):
            assert reply.headers["x-carpool"] in ("miss", "coalesced"), reply.headers
        assert fake.count() == 2


async def test_a_semantic_entry_is_served_within_its_ttl_on_the_gateways_clock(fake, gateway_with):
    # A clock behind the system's: the lookup found its fresh entries expired by the system's
    # time (and dropped them).
    from carpool.clock import ManualClock

    clock = ManualClock(now=time.time() - 3600)
    async with gateway_with(clock=clock, **SEMANTIC) as gw:
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        hit = await ask(gw, "how can i reset my router")
        assert hit.headers["x-carpool"] == "semantic-hit" and fake.count() == 1


async def test_mark_mode_never_serves_and_annotates_the_nearest_prior_request(fake, gateway_with):
    async with gateway_with(semantic={"enabled": True, "mode": "mark"}) as gw:
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        response = await ask(gw, "how can i reset my router")
        assert response.headers["x-carpool"] == "miss"
        assert float(response.headers["x-carpool-similarity"]) > 0.8
        assert response.headers["x-carpool-semantic-verdict"] == "serve"
        # The nearest entry by its opaque id, never by its text (another request's).
        assert re.fullmatch(r"[0-9a-f]{24}", response.headers["x-carpool-semantic-nearest"])
        assert "router" not in str(response.headers).lower()
        negated = await ask(gw, "How do I not reset my router?")
        assert negated.headers["x-carpool-semantic-verdict"].startswith("guard:")
        assert fake.count() == 3


async def test_a_slow_guard_never_holds_up_another_tenants_exact_hit(sgw, fake):
    # The guard's rules ran on the event loop: a lookup they were slow on (a few hundred
    # permuted words: ~19 s) held up every other request. Here a rule blocks until the test
    # releases it; another tenant's exact hit must be answered meanwhile.
    victim, attacker = {"authorization": "Bearer victim"}, {"authorization": "Bearer attacker"}
    await ask(sgw, "What is carpool?", headers=victim)
    await ask(sgw, "How do I reset my router?", headers=attacker)
    await stored(sgw, 2)
    lookups = HeldLookups(sgw)
    lookup = asyncio.create_task(ask(sgw, "how can i reset my router", headers=attacker))
    await lookups.held()
    repeat = await ask(sgw, "What is carpool?", headers=victim)  # while the rule is blocked
    assert repeat.headers["x-carpool"] == "hit" and not lookups.release.is_set()
    lookups.release.set()
    assert (await lookup).headers["x-carpool"] == "semantic-hit"
    assert lookups.released == [True]  # (False: nobody released it, the loop was held)


async def test_an_answer_stored_while_a_lookup_was_judged_is_an_exact_hit_not_another_call(
    fake, gateway_with
):
    # A lookup judged while the verifier's queue was long (a burst of 200 identical prompts
    # took ~2 s) came back after its key's flight had ended and its window closed: the
    # request led a call of its own although the exact cache held the answer (3 upstream
    # calls for 200 identical requests). Here a rule holds the lookup while an identical
    # request, asking no-cache (no lookup), is answered and stored.
    async with gateway_with(semantic={"enabled": True}, coalesce={"window_ms": 0}) as gw:
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        await stored_while_held(gw, gw, fake)


async def stored_while_held(looking: Any, storing: Any, fake: Any, **asked: Any) -> None:
    """A lookup on ``looking`` (``asked``: more of its body) held while ``storing`` answers the
    same request (no-cache: no lookup) and stores it: released, the lookup is that answer's
    exact hit, no call made."""
    lookups = HeldLookups(looking)
    prompt, calls = "How do I update the billing details of my router?", fake.count()
    lookup = asyncio.create_task(ask(looking, prompt, **asked))
    await lookups.held()
    fresh = await ask(storing, prompt, headers={"cache-control": "no-cache"})
    assert fresh.headers["x-carpool"] == "miss" and fake.count() == calls + 1
    lookups.release.set()
    judged = await lookup
    assert lookups.released == [True]
    assert judged.headers["x-carpool"] == "hit" and fake.count() == calls + 1
    if not asked:
        assert judged.json() == fresh.json()


async def test_an_answer_stored_while_a_lookups_embedding_failed_is_an_exact_hit(
    fake, gateway_with
):
    # (As above, the embedder in place of the verifier: an upstream embedder's timeout is up
    # to a second.) The lookup embedded nothing, and was taken for one that waited for nothing.
    async with gateway_with(semantic={"enabled": True}, coalesce={"window_ms": 0}) as gw:
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        embedder = gw.gateway.semantic.embedder
        embed, entered, release = embedder.embed, asyncio.Event(), asyncio.Event()

        async def failing(text: str) -> Any:
            entered.set()
            await release.wait()
            raise TimeoutError("the embedder timed out")

        embedder.embed = failing
        prompt = "How do I update the billing details of my router?"
        lookup = asyncio.create_task(ask(gw, prompt))
        await asyncio.wait_for(entered.wait(), 10)
        embedder.embed = embed
        fresh = await ask(gw, prompt, headers={"cache-control": "no-cache"})
        release.set()
        judged = await lookup
        assert judged.headers["x-carpool"] == "hit" and judged.json() == fresh.json()
        assert fake.count() == 2 and gw.gateway.semantic.embed_failures == 1


async def test_a_lookup_that_waited_for_nothing_reads_the_exact_cache_once(sgw, fake):
    # (A second read is for an answer stored while the lookup waited: with Redis, a round
    # trip.) A scope without entries embeds nothing: one read.
    reads = exact_reads(sgw)
    assert (await ask(sgw, "How do I reset my router?")).headers["x-carpool"] == "miss"
    assert len(reads) == 1
    await stored(sgw)
    reads.clear()
    assert (await ask(sgw, "What is the capital of Peru?")).headers["x-carpool"] == "miss"
    assert len(reads) == 2  # (its lookup embedded, judged: read again after)


async def test_identical_lookups_in_progress_share_one(sgw, fake):
    # Each of a burst of identical requests made the lookup of its own: 200 of one prompt in a
    # populated scope were ~44 lookups judged (~3 ms a pair, on the verifier's one thread),
    # seconds of the verifier for one prompt, every other lookup waiting behind them.
    await ask(sgw, "How do I reset my router?")
    await stored(sgw)
    lookups = HeldLookups(sgw)
    prompt = "How do I update the billing details of my router?"
    first = asyncio.create_task(ask(sgw, prompt))
    await lookups.held()
    others = [asyncio.create_task(ask(sgw, prompt)) for _ in range(3)]
    await eventually(lambda: sgw.gateway.semantic.lookups_joined == 3, what="the lookups joined")
    lookups.release.set()
    replies = await asyncio.gather(first, *others)
    assert len(lookups.judged) == 1 and fake.count() == 2
    assert sorted(r.headers["x-carpool"] for r in replies) == ["coalesced"] * 3 + ["miss"]
    stats = (await sgw.client.get("/stats")).json()
    assert stats["layers"]["semantic"]["lookups_joined"] == 3
    assert "carpool_semantic_lookups_joined_total 3.0" in (await sgw.client.get("/metrics")).text


async def test_a_lookup_whose_requesters_all_left_is_cancelled(sgw, fake):
    # (As a flight whose clients all left: nobody would read it.) One requester left while
    # another waits: the lookup goes on for it.
    await ask(sgw, "How do I reset my router?")
    await stored(sgw)
    lookups = HeldLookups(sgw)
    cache = sgw.gateway.semantic
    view = semantic_view_of(sgw, "How do I update the billing details of my router?")
    first = asyncio.create_task(cache.probe(view, key="k"))
    await lookups.held()
    second = asyncio.create_task(cache.probe(view, key="k"))
    await eventually(lambda: cache.lookups_joined == 1, what="the second lookup joined")
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    assert not second.done()
    lookups.release.set()
    assert (await second).match is None
    lookups.release.clear()
    third = asyncio.create_task(cache.probe(view, key="k"))
    await lookups.held()
    third.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await third
    assert cache.pending == 0  # (cancelled: nobody waits)
    lookups.release.set()


async def test_lookups_past_max_pending_are_misses_that_make_no_entry(fake, gateway_with):
    # Lookups queued without bound on the verifier's one thread: at 400 requests/s of
    # paraphrases (carpool bench) a miss's p50 went from 0.2 s without the semantic cache to
    # 3.4 s with it, every request waiting behind the lookups before it. Past the bound a
    # lookup is not made: a miss, no entry made (it would embed), counted.
    async with gateway_with(semantic={"enabled": True, "max_pending": 2}) as gw:
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        lookups = HeldLookups(gw)
        held = [
            asyncio.create_task(ask(gw, text))
            for text in ("how can i reset my router", "how could i reset my router?")
        ]
        await lookups.held(2)
        shed = await ask(gw, "how should i reset my router?")
        assert shed.headers["x-carpool"] == "miss" and not lookups.release.is_set()
        stats = (await gw.client.get("/stats")).json()["layers"]["semantic"]
        assert stats["lookups_shed"] == 1 and stats["entries"] == 1  # (none made for it)
        metrics = (await gw.client.get("/metrics")).text
        assert 'carpool_semantic_shed_total{work="lookup"} 1.0' in metrics
        lookups.release.set()
        assert [r.headers["x-carpool"] for r in await asyncio.gather(*held)] == ["semantic-hit"] * 2
        assert gw.gateway.semantic.pending == 0


async def test_an_entry_to_embed_past_max_pending_is_not_made_and_its_reply_never_waits(
    fake, gateway_with
):
    # A miss in a scope without entries looks nothing up, but embeds its prompt for its entry,
    # and its reply waited for that (no timeout with the local embedder): with a prompt of
    # its own each (a dated system prompt, a tenant each), misses queued on the embedder
    # without bound (60 requests/s of 200 words: replies 4.5 s late after 4 s), the lookups
    # of other scopes behind them. Past the bound no entry is made: the reply goes at once.
    async with gateway_with(semantic={"enabled": True, "max_pending": 1}) as gw:
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        lookups = HeldLookups(gw)
        held = asyncio.create_task(ask(gw, "how can i reset my router"))
        await lookups.held()
        alone = await ask(gw, "What is the capital of Peru?", system="You are a geographer.")
        assert alone.headers["x-carpool"] == "miss" and not lookups.release.is_set()
        stats = (await gw.client.get("/stats")).json()["layers"]["semantic"]
        assert stats["entries_shed"] == 1 and stats["entries"] == 1  # (none made for it)
        metrics = (await gw.client.get("/metrics")).text
        assert 'carpool_semantic_shed_total{work="entry"} 1.0' in metrics
        lookups.release.set()
        assert (await held).headers["x-carpool"] == "semantic-hit"
        made = await ask(gw, "What is the capital of Chile?", system="You are a geographer.")
        assert made.headers["x-carpool"] == "miss"
        await stored(gw, 2)  # (not busy: its entry made)
        assert gw.gateway.semantic.embed_failures == 0  # (a shed entry is no failure)


async def test_a_serve_mode_miss_never_names_the_entry_it_was_near(sgw, fake):
    # The nearest entry, its similarity and the guard's verdict are mark mode's annotations:
    # in serve mode (the default) a miss the guard refused says nothing of the entries it met.
    await ask(sgw, "What is the baggage allowance for 2 passengers?")
    await stored(sgw)
    refused = await ask(sgw, "What is the baggage allowance for 3 passengers?")
    assert refused.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.rejections.get("number") == 1  # it was compared, and refused
    named = {"x-carpool-semantic-nearest", "x-carpool-semantic-verdict", "x-carpool-similarity"}
    assert not named & set(refused.headers)


# ------------------------------------------------------------------------------------------------
# Semantic entries shared across instances through Redis (carpool/redis/semantic.py)

# s: how long a record may take to reach the other instance before a test fails. Not the 1 s
# propagation bound: no timing is asserted in tests (a busy CI machine ran out of 1 s once);
# benchmarks/bench_distributed.py measures the delay against that bound (semantic_propagation).
PROPAGATION = 10.0


@pytest.fixture
def two_semantic(fake, shared_redis):
    pytest.importorskip("redis")
    from conftest import redis_settings, run_gateway

    @contextlib.asynccontextmanager
    async def start(distributed=None, clock_b=None, later=False, **extra):
        """Two instances A and B, started; ``later``: and a third, ``run_later()``, an
        async context manager that starts it when the test says (A's config)."""
        # Redis's timeouts generous: a connection that took over 0.25 s on the busy CI machine
        # put an instance in degraded mode for 0.1 s, and the semantic record it was writing
        # then was its alone (by design), never reaching the other one the test waited on.
        settings = {"retry_interval": 0.05, "connect_timeout": 5.0, "timeout": 5.0}
        shared = {
            **redis_settings(shared_redis, **{**settings, **(distributed or {})}),
            "admin_token": "t",
            **SEMANTIC,
            **extra,
        }
        async with (
            run_gateway([fake.url], **shared) as a,
            run_gateway([fake.url], clock_b or SYSTEM_CLOCK, **shared) as b,
        ):
            for served in (a, b):  # the readers are positioned
                await asyncio.wait_for(served.gateway.semantic.ready.wait(), 5)
            if later:
                yield a, b, lambda: run_gateway([fake.url], **shared)
            else:
                yield a, b

    return start


async def test_an_answer_another_instance_stored_while_a_lookup_waited_is_an_exact_hit(
    two_semantic, fake
):
    # (With shared flights, the read again was once left to the call's claim, which reads
    # the stored answer only for a request that takes any, under its flight's key, with Redis
    # usable: the cases below each made a second call then.)
    async with two_semantic(coalesce={"window_ms": 0}) as (a, b):
        await ask(a, "How do I reset my router?")
        await stored(a)
        await stored_while_held(a, b, fake)


async def test_with_redis_down_an_answer_stored_while_a_lookup_waited_is_an_exact_hit(
    fake, redis_server
):
    from conftest import redis_settings, run_gateway

    settings = {"retry_interval": 60.0, "connect_timeout": 5.0, "timeout": 5.0}
    config = {**redis_settings(redis_server, **settings), "coalesce": {"window_ms": 0}}
    async with run_gateway([fake.url], **config, **SEMANTIC) as gw:
        await asyncio.wait_for(gw.gateway.semantic.ready.wait(), 5)
        await ask(gw, "How do I reset my router?")
        await stored(gw)
        redis_server.kill()
        await ask(gw, "Who wrote Hamlet?")  # (Redis found down)
        assert not gw.gateway.store.usable()
        await stored_while_held(gw, gw, fake)


async def test_a_stream_without_usage_is_an_exact_hit_of_an_answer_stored_while_it_waited(
    two_semantic, fake
):
    # (Its flight's key is apart, the stored answer's not: ``flight_key``.)
    async with two_semantic(coalesce={"window_ms": 0}, upstream={"stream_usage": False}) as (a, b):
        await ask(a, "How do I reset my router?")
        await stored(a)
        await stored_while_held(a, a, fake, stream=True)


async def caught_up(gw, received: int, invalidations: int):
    """Wait for ``gw`` (started later) to read the records stored before it started; its
    semantic cache."""
    semantic = gw.gateway.semantic
    await eventually(
        lambda: (
            semantic.counts["received"] == received
            and semantic.counts["invalidations_received"] == invalidations
        ),
        what="the records stored before it started",
        state=lambda: semantic.counts,
    )
    return semantic


async def propagated(gw, n=1, since=None):
    """Wait for ``n`` entries on ``gw``; the delay in s since ``since`` (a
    ``time.perf_counter()``, default now), printed where a test reports it."""
    started = time.perf_counter() if since is None else since
    await eventually(
        lambda: gw.gateway.semantic.entries >= n,
        timeout=PROPAGATION - (time.perf_counter() - started),
        what="the semantic entry from the other instance",
    )
    return time.perf_counter() - started


async def test_an_answer_stored_via_one_instance_is_a_semantic_hit_on_another(two_semantic, fake):
    async with two_semantic() as (a, b):
        first = await ask(a, "How do I reset my router?")
        answered = time.perf_counter()  # A's client has its answer; A embeds, publishes
        delay = await propagated(b, since=answered)
        print(f"semantic propagation, A's answer -> B's index: {delay * 1000:.1f} ms")
        again = await ask(b, "how can i reset my router")
        assert again.headers["x-carpool"] == "semantic-hit"
        assert again.json() == first.json() and fake.count() == 1
        stats = await b.client.get("/stats", headers={"Authorization": "Bearer t"})
        assert stats.json()["redis"]["semantic"]["received"] == 1
        assert a.gateway.semantic.counts["received"] == 0  # its own record is skipped


async def test_an_instance_started_after_answers_were_stored_serves_them_as_semantic_hits(
    two_semantic, fake
):
    """An instance's reader began at the stream's end: one started (or restarted) after the
    fleet had stored answers missed every paraphrase of them while the others served it. It
    now reads the records already on the stream, in order, an invalidation after an entry
    included: the entry invalidated is not served, the one stored after it is."""
    async with two_semantic(later=True) as (a, b, run_later):
        router = await ask(a, "How do I reset my router?")
        await ask(b, "What is the capital of France?", headers={"x-carpool-tags": "geo"})
        dropped = await a.client.post(
            "/admin/invalidate", headers={"Authorization": "Bearer t"}, json={"tag": "geo"}
        )
        assert dropped.status_code == 200, dropped.text
        soup = await ask(b, "How long should I boil an egg?")
        await eventually(
            lambda: (
                a.gateway.semantic.counts["published"] == 2
                and b.gateway.semantic.counts["published"] == 2
            ),
            what="the three entries and the invalidation on the stream",
        )
        async with run_later() as c:
            semantic = await caught_up(c, received=3, invalidations=1)
            assert semantic.counts["lost"] == semantic.counts["forgotten"] == 0
            calls = fake.count()
            for asked, stored in (
                ("how can i reset my router", router),
                ("how long should i boil an egg", soup),
            ):
                again = await ask(c, asked)
                assert again.headers["x-carpool"] == "semantic-hit", asked
                assert again.json() == stored.json()
            france = await ask(c, "what is the capital of france")
            assert france.headers["x-carpool"] == "miss"  # (invalidated before C started)
            assert fake.count() == calls + 1


async def test_an_instance_cut_off_from_redis_as_it_starts_forgets_its_entries_once_it_reads(
    fake, redis_server
):
    """Its reader's first read failed: the instance served on alone, keeping entries of its
    own (with their answers). Reading the stream from its first record once Redis answered, it
    kept them, though an invalidation of one had left the stream meanwhile (trimmed): that
    invalidated answer was served as a semantic hit. It forgets them first, as a reader that
    was cut off later does."""
    from conftest import redis_settings, run_gateway
    from fakes.latency_proxy import LinkProxy

    proxy = await LinkProxy(redis_server.host, redis_server.port).start()
    quick = {"retry_interval": 0.05, "stream_maxlen": 5}
    settings = {"admin_token": "t", **SEMANTIC}
    geo = {"x-carpool-tags": "geo"}
    try:
        proxy.hold()  # (B's link stalls from the start)
        async with (
            run_gateway([fake.url], **redis_settings(redis_server, **quick), **settings) as a,
            run_gateway(
                [fake.url],
                **{
                    **redis_settings(redis_server, **quick, timeout=0.2, connect_timeout=0.2),
                    "redis": proxy.url,
                },
                **settings,
            ) as b,
        ):
            semantic = b.gateway.semantic
            await eventually(lambda: semantic.counts["errors"] >= 1, what="B's first read failing")
            mine = await ask(b, "What is the capital of France?", headers=geo)
            await eventually(lambda: semantic.entries >= 1, what="B's own entry")
            await ask(a, "What is the capital of France?", headers=geo)
            dropped = await a.client.post(
                "/admin/invalidate", headers={"Authorization": "Bearer t"}, json={"tag": "geo"}
            )
            assert dropped.status_code == 200, dropped.text
            for i in range(8):  # (the invalidation trimmed off the stream by what comes after)
                await ask(a, f"Unrelated question number {i}?")
            proxy.release()
            await eventually(lambda: semantic.ready.is_set(), what="B reading the stream")
            assert semantic.counts["forgotten"] >= 1
            again = await ask(b, "what is the capital of france", headers=geo)
    finally:
        await proxy.aclose()
    assert mine.headers["x-carpool"] == "miss"
    assert again.headers["x-carpool"] == "miss", again.headers


@pytest.mark.parametrize("skew", [-7200, 7200])
async def test_a_record_from_another_instance_is_aged_in_redis_time_whatever_the_clocks(
    two_semantic, fake, skew
):
    """B's wall clock two hours off A's (separate machines): its records were judged on their
    writer's clock, so B ignored A's as expired (ahead: the hour's TTL long past), or kept
    them an age it never had (behind). Counted in Redis time, A's entry reaches B as fresh."""
    from carpool.clock import ManualClock

    clock = ManualClock(now=time.time() + skew)
    async with two_semantic(clock_b=clock) as (a, b):
        await ask(a, "How do I reset my router?")
        await propagated(b)
        assert b.gateway.semantic.counts["ignored"] == 0
        ((_, entry),) = list(b.gateway.semantic._entries.items())
        assert entry.created == pytest.approx(clock.now(), abs=5)
        assert entry.expires == pytest.approx(clock.now() + 3600, abs=5)
        again = await ask(b, "how can i reset my router", headers={"Cache-Control": "max-age=60"})
        assert again.headers["x-carpool"] == "semantic-hit" and fake.count() == 1


async def test_a_report_of_an_entry_from_another_instance_counts_in_its_tenants_budget(
    two_semantic, fake
):
    # A hit counts in its scope's error budget: the tenant's in the namespace. An entry from
    # another instance carries its tenant (the record's ``u``), so a report of it does too.
    from carpool.canonical import requester
    from carpool.semantic.audit import Budget

    tenant = {"authorization": "Bearer key-of-a-tenant"}
    async with two_semantic() as (a, b):
        await ask(a, "How do I reset my router?", headers=tenant)
        await propagated(b)
        hit = await ask(b, "how can i reset my router", headers=tenant)
        assert hit.headers["x-carpool"] == "semantic-hit"
        reported = await b.client.post(
            "/admin/semantic/feedback",
            json={"entry": hit.headers["x-carpool-entry"]},
            headers={"Authorization": "Bearer t"},
        )
        audits = b.gateway.layers.audits
        budget = Budget(requester(tenant, b.gateway.config), "")
        assert reported.json() == {
            "dropped": True,
            "namespace": "",
            "tenant": audits.label(budget.tenant),
        }
        assert (
            audits.snapshot(tenants=True)[""]["tenants"][audits.label(budget.tenant)]["wrong"] == 1
        )


async def test_an_entry_whose_texts_are_over_the_record_bound_is_not_published(
    two_semantic, fake, monkeypatch
):
    # Each record copied the whole conversation (a 96 KB context: 107 KB a record, over a GB at
    # the stream's length, read by every instance). Such an entry is its instance's only.
    from carpool.redis import semantic as shared

    monkeypatch.setattr(shared, "MAX_RECORD_TEXT", 40)
    async with two_semantic() as (a, b):
        await ask(a, "How do I reset my router? It blinks red and orange.")
        await eventually(lambda: a.gateway.semantic.entries == 1, what="A's own entry")
        await ask(a, "Reset?")  # short: published
        await propagated(b)
        counts = a.gateway.semantic.counts
        assert (counts["local_only"], counts["published"]) == (1, 1)
        assert b.gateway.semantic.entries == 1


async def test_the_record_bound_counts_the_bytes_of_the_texts_not_their_characters(
    two_semantic, fake, monkeypatch
):
    # The bound counted characters while the record carries UTF-8: 4-byte characters (emoji;
    # CJK takes 3) made records ~4x the bound (136 KB where 35 KB was meant).
    from carpool.redis import semantic as shared

    monkeypatch.setattr(shared, "MAX_RECORD_TEXT", 60)
    async with two_semantic() as (a, b):
        await ask(a, "How do I reset my router? " + "\N{FIRE}" * 10)  # 36 characters, 66 bytes
        await eventually(lambda: a.gateway.semantic.entries == 1, what="A's own entry")
        await ask(a, "Reset?")  # short: published
        await propagated(b)
        counts = a.gateway.semantic.counts
        assert (counts["local_only"], counts["published"]) == (1, 1)
        assert b.gateway.semantic.entries == 1


async def test_an_instance_started_later_serves_entries_made_after_the_streams_prefix_invalidations(
    two_semantic, fake
):
    """A prefix invalidation read from the stream was dated when read (C's start), not when
    made: every entry made before C started predated it for prompts with that prefix; and two,
    forgotten at once (C had inserted nothing: no TTL known), left a floor above every entry
    C read. C served none of the fleet's entries, to any prompt."""
    async with two_semantic(later=True) as (a, b, run_later):
        for prefix in ("How can I sharpen", "Zzz"):
            done = await a.client.post("/admin/invalidate", json={"prefix": prefix}, headers=ADMIN)
            assert done.status_code == 200, done.text
        knife = await ask(a, "How do I sharpen a pocket knife?")
        egg = await ask(a, "How long should I boil an egg?")
        await eventually(lambda: a.gateway.semantic.counts["published"] == 4, what="A's records")
        async with run_later() as c:
            await caught_up(c, received=2, invalidations=2)
            for asked, stored in (
                ("How can I sharpen a pocket knife?", knife),  # (made after the prefix's)
                ("how long should i boil an egg", egg),
            ):
                again = await ask(c, asked)
                assert again.headers["x-carpool"] == "semantic-hit", asked
                assert again.json() == stored.json()
            assert fake.count() == 2


async def test_a_remote_entry_whose_exact_answer_is_gone_is_dropped(two_semantic, fake):
    async with two_semantic() as (a, b):
        await ask(a, "How do I reset my router?")
        await stored(a)
        await propagated(b)
        # Gone from the shared exact store (as by expiry): B's reference is dead.
        await a.gateway.store.redis.invalidate(Selector(everything=True))
        assert (await ask(b, "how can i reset my router")).headers["x-carpool"] == "miss"
        assert fake.count() == 2


async def test_an_answer_an_invalidation_took_back_gets_no_semantic_entry_either(
    two_semantic, fake
):
    """Another instance invalidated everything while the call ran, and its message had not
    reached this one when the answer was stored: Redis took the answer back (it may predate
    what was dropped), but the semantic layer kept it, served to paraphrases until that
    message came (for ever, had it been lost)."""
    async with two_semantic() as (a, b):
        fake.gate = asyncio.Event()
        first = asyncio.create_task(ask(a, "How do I reset my router?"))
        await fake.wait_until(lambda: fake.count() == 1, what="A's call")
        # Redis's count of invalidations only: a message A has not had (as if lost).
        await b.gateway.store.redis.invalidate(Selector(everything=True))
        fake.gate.set()
        assert (await first).headers["x-carpool"] == "miss"
        # (Read-your-writes: its store, semantic entry included, was done before its answer.)
        assert a.gateway.semantic.entries == 0
        assert (await ask(a, "how can i reset my router")).headers["x-carpool"] == "miss"
        assert fake.count() == 2


async def test_an_invalidation_by_tag_on_one_instance_drops_the_others_semantic_entries(
    two_semantic, fake
):
    async with two_semantic() as (a, b):
        await ask(b, "How do I reset my router?", headers={"x-carpool-tags": "router"})
        await stored(b)  # B holds it with its answer, A as a reference
        await propagated(a)
        dropped = await a.client.post(
            "/admin/invalidate", json={"tag": "router"}, headers={"Authorization": "Bearer t"}
        )
        assert dropped.status_code == 200
        await eventually(
            lambda: b.gateway.semantic.entries == 0,
            timeout=PROPAGATION,
            what="the invalidation to reach the other instance",
        )
        assert a.gateway.semantic.entries == 0
        assert (await ask(b, "how can i reset my router")).headers["x-carpool"] == "miss"


async def test_a_prefix_invalidation_on_one_instance_stops_the_others_older_entries_for_it(
    two_semantic, fake
):
    # The entry's own prompt does not start with the prefix: no instance drops it, and its
    # exact answer stays in Redis. Neither instance serves it to a prompt that starts with it.
    async with two_semantic() as (a, b):
        old = await ask(b, "What's the price of the Pro plan?")
        await stored(b)  # B holds it with its answer, A as a reference
        await propagated(a)
        dropped = await a.client.post(
            "/admin/invalidate", json={"prefix": "What is the price"}, headers=ADMIN
        )
        assert dropped.json() == {"invalidated": 0}
        await eventually(
            lambda: b.gateway.semantic.counts["invalidations_received"] == 1,
            timeout=PROPAGATION,
            what="the invalidation to reach the other instance",
        )
        on_a = await ask(a, "What is the price of the Pro plan?")
        assert on_a.headers["x-carpool"] == "miss" and fake.count() == 2
        # B: a miss, or A's fresh answer (made after the invalidation), never the old one.
        on_b = await ask(b, "What is the price of the pro plan")
        assert on_b.json() != old.json()


@SELECTORS
async def test_an_invalidation_on_an_instance_without_the_semantic_cache_drops_the_others_entries(
    fake, shared_redis, selector, headers
):
    """A fleet mid-change, the semantic cache on for B only: an invalidation sent to A reaches
    the entries B holds with their answers, so B serves the old answer neither to the same
    prompt nor to a paraphrase. (Before, A, without a semantic cache, published no
    ``invalidate`` record: B served them as semantic hits until their TTL.)"""
    pytest.importorskip("redis")
    from conftest import redis_settings, run_gateway

    settings = redis_settings(shared_redis, retry_interval=0.05, connect_timeout=5.0, timeout=5.0)
    async with (
        run_gateway([fake.url], admin_token="t", **settings) as a,
        run_gateway([fake.url], admin_token="t", **settings, **SEMANTIC) as b,
    ):
        await asyncio.wait_for(b.gateway.semantic.ready.wait(), 5)
        first = await ask(b, "How do I reset my router?", headers=headers)
        await stored(b)  # B holds it with its answer
        hit = await ask(b, "how can i reset my router", headers=headers)
        assert hit.headers["x-carpool"] == "semantic-hit"
        done = await a.client.post("/admin/invalidate", json=selector, headers=ADMIN)
        assert done.status_code == 200, done.text
        await eventually(
            lambda: b.gateway.semantic.counts["invalidations_received"] >= 1,
            timeout=PROPAGATION,
            what="the invalidation to reach the instance with the semantic cache",
        )
        same = await ask(b, "How do I reset my router?", headers=headers)
        assert same.headers["x-carpool"] == "miss" and same.json() != first.json()
        # (The paraphrase may be served the fresh answer, made after the invalidation.)
        paraphrase = await ask(b, "how can i reset my router", headers=headers)
        assert paraphrase.json() == same.json() and fake.count() == 2


async def test_a_full_redis_takes_an_invalidation_to_the_others_but_no_new_entry(
    two_semantic, fake, shared_redis
):
    """Redis full (maxmemory, noeviction): A's ``invalidate`` record still reaches B, which
    drops the entry it holds with its answer (before, the record was refused: a 503 for as long
    as Redis stayed full, and B served the answer); a new entry is A's own, not published, and
    the instances stay up (Redis answers)."""
    import redis.asyncio as aredis

    async with two_semantic() as (a, b):
        await ask(b, "How do I reset my router?", headers={"x-carpool-tags": "router"})
        await stored(b)  # B holds it with its answer, A as a reference
        await propagated(a)
        nodes = [aredis.Redis.from_url(node.url) for node in getattr(shared_redis, "nodes", [])]
        nodes = nodes or [aredis.Redis.from_url(shared_redis.url)]
        try:
            for node in nodes:  # full from now on (each master of a cluster)
                await node.config_set("maxmemory", 1)
            admin = {"Authorization": "Bearer t"}
            done = await a.client.post("/admin/invalidate", json={"tag": "router"}, headers=admin)
            assert done.status_code == 200
            await eventually(
                lambda: b.gateway.semantic.entries == 0,
                timeout=PROPAGATION,
                what="the invalidation to reach the other instance",
            )
            published = a.gateway.semantic.counts["published"]
            await ask(a, "What is the capital of France?")
            await eventually(lambda: a.gateway.semantic.entries == 1, what="A's own entry")
            await eventually(lambda: a.gateway.redis_health()["full"] >= 1, what="the refusal")
            assert a.gateway.semantic.counts["published"] == published
            assert a.gateway.redis_health()["state"] == b.gateway.redis_health()["state"] == "up"
        finally:
            for node in nodes:
                await node.config_set("maxmemory", 0)
                await node.aclose()


async def test_an_invalidation_whose_semantic_record_did_not_reach_redis_is_a_503_not_a_success(
    two_semantic, fake
):
    """A's invalidation reaches the exact store but its semantic ``invalidate`` record is not
    published (one connection reset): B keeps its entry, held with its answer, and serves it;
    so the endpoint answers 503 "retry" (done here, nothing else skipped), and the retry
    reaches B. (Before, the lost record answered 200.)"""
    import redis.exceptions

    async with two_semantic() as (a, b):
        first = await ask(b, "How do I reset my router?", headers={"x-carpool-tags": "router"})
        await stored(b)  # B holds it with its answer, A as a reference
        await propagated(a)
        client = a.gateway.semantic._client
        append, published = client.eval, a.gateway.semantic.counts["published"]

        async def reset_once(*args, **kwargs):  # (an invalidate record is one script)
            client.eval = append
            raise redis.exceptions.ConnectionError("connection reset (injected)")

        client.eval = reset_once
        admin = {"Authorization": "Bearer t"}
        refused = await a.client.post("/admin/invalidate", json={"tag": "router"}, headers=admin)
        assert refused.status_code == 503 and "retry" in refused.text
        assert a.gateway.semantic.entries == 0  # done here all the same
        assert a.gateway.semantic.counts["published"] == published
        assert b.gateway.semantic.entries == 1  # the record never came
        retried = await a.client.post("/admin/invalidate", json={"tag": "router"}, headers=admin)
        assert retried.status_code == 200
        await eventually(
            lambda: b.gateway.semantic.entries == 0,
            timeout=PROPAGATION,
            what="the retried invalidation to reach the other instance",
        )
        again = await ask(b, "how can i reset my router")
        assert again.headers["x-carpool"] == "miss" and again.json() != first.json()


async def test_an_instance_whose_reader_was_cut_off_never_serves_an_answer_invalidated_meanwhile(
    two_semantic, fake
):
    # B's reader loses its connection once; the invalidate record A publishes before B's reader
    # has positioned itself again is never read (it resumes from the stream's end). B's entry
    # holds its answer: it must be forgotten, not served.
    import redis.exceptions

    async with two_semantic() as (a, b):
        tags = {"x-carpool-tags": "router"}
        assert (await ask(b, "How do I reset my router?", headers=tags)).headers[
            "x-carpool"
        ] == "miss"
        await stored(b)  # B holds it with its answer, A as a reference
        await propagated(a)
        semantic = b.gateway.semantic
        client, failures, back = semantic._client, [1], asyncio.Event()
        real_xread, real_xrevrange = client.xread, client.xrevrange

        async def xread(*args, **kwargs):  # one failure, as of a connection reset
            if failures:
                failures.pop()
                raise redis.exceptions.ConnectionError("connection reset (injected)")
            return await real_xread(*args, **kwargs)

        async def xrevrange(*args, **kwargs):  # the reader positions itself once we say so
            await back.wait()
            return await real_xrevrange(*args, **kwargs)

        client.xread, client.xrevrange = xread, xrevrange
        try:
            errors = semantic.counts["errors"]
            await eventually(lambda: semantic.counts["errors"] > errors, what="the failure")
            dropped = await a.client.post(
                "/admin/invalidate", json={"tag": "router"}, headers={"Authorization": "Bearer t"}
            )
            assert dropped.status_code == 200
            back.set()  # the record is in the stream, behind where B's reader resumes
            await eventually(semantic.ready.is_set, what="B's reader positioned again")
        finally:
            client.xread, client.xrevrange = real_xread, real_xrevrange
        assert semantic.counts["invalidations_received"] == 0  # (never read: missed)
        assert (await ask(b, "how can i reset my router")).headers["x-carpool"] == "miss"
        assert semantic.counts["forgotten"] == 1 and fake.count() == 2


async def test_an_entry_embedded_after_an_invalidation_read_from_the_stream_is_not_inserted(
    two_semantic, fake
):
    """B's answer was kept in Redis before A invalidated its tag; its prompt's embedding was
    done only after B had applied A's ``invalidate`` record from the stream, and A's pub/sub
    message had not come (lost here: the window was then for ever). B's entry, which holds the
    invalidated answer, went into its index and was served to paraphrases until its TTL."""
    async with two_semantic() as (a, b):
        semantic, store = b.gateway.semantic, b.gateway.store
        real_vector, real_keep = semantic.vector, store.keep
        embedded, kept = asyncio.Event(), asyncio.Event()

        async def vector(view):  # B's embedder, slower than the upstream
            await embedded.wait()
            return await real_vector(view)

        async def keep(*args, **kwargs):
            try:
                return await real_keep(*args, **kwargs)
            finally:
                kept.set()

        semantic.vector, store.keep = vector, keep
        try:
            tags = {"x-carpool-tags": "router"}
            first = asyncio.create_task(ask(b, "How do I reset my router?", headers=tags))
            await asyncio.wait_for(kept.wait(), 5)  # in Redis, its embedding still to come
            # A's invalidation without its PUBLISH (as if lost): Redis's count, the exact
            # store, the semantic stream's record.
            await a.gateway.store.invalidate(Selector(tag="router"))
            await a.gateway.semantic.invalidate(Selector(tag="router"))
            await eventually(
                lambda: semantic.counts["invalidations_received"] == 1,
                what="B applying A's invalidate record",
            )
            embedded.set()
            assert (await first).headers["x-carpool"] == "miss"
        finally:
            semantic.vector, store.keep = real_vector, real_keep
        again = await ask(b, "how can i reset my router", headers=tags)
        assert again.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_a_reader_that_read_every_record_is_never_told_records_were_lost(two_semantic, fake):
    # With a short stream_maxlen, MAXLEN trims the record a caught-up reader read last as soon
    # as the next one comes: taken for records lost unread, it forgot every entry (once a node
    # of records: after 77 here).
    async with two_semantic(distributed={"stream_maxlen": 1}) as (a, b):
        await ask(b, "How do I reset my router?")
        await stored(b)
        semantic, client = b.gateway.semantic, a.gateway.semantic._client
        for n in range(1, 151):  # another instance's records, each read by B before the next
            await client.xadd(
                semantic.stream, {b"op": b"other", b"src": b"c"}, maxlen=1, approximate=True
            )
            await eventually(lambda n=n: semantic.counts["ignored"] >= n, what="B read it")
        assert semantic.counts["lost"] == 0 and semantic.entries == 1
        again = await ask(b, "How can I reset my router?")
        assert again.headers["x-carpool"] == "semantic-hit"


@pytest.mark.parametrize("lost", ["trimmed", "evicted"])
async def test_an_instance_whose_unread_records_left_the_stream_never_serves_what_they_invalidated(
    two_semantic, fake, lost
):
    """B's reader stalled (a GC or VM pause, or slower than the fleet's publishing) while A
    invalidated B's tag, and the stream then moved past that record unread: trimmed by the
    records published after it (``XADD MAXLEN ~``), or the stream itself gone (evicted under an
    ``allkeys-*`` policy). B resumed at its last id, read what came after, and served the
    invalidated answer it holds, even to the identical request, until its TTL."""
    async with two_semantic(distributed={"stream_maxlen": 10}) as (a, b):
        tags = {"x-carpool-tags": "router"}
        first = await ask(b, "How do I reset my router?", headers=tags)
        await stored(b)  # B holds it with its answer, A as a reference
        await propagated(a)
        semantic, client = b.gateway.semantic, a.gateway.semantic._client
        real_xread, stalled, resumed, reads = (
            semantic._client.xread,
            asyncio.Event(),
            asyncio.Event(),
            [0],
        )

        async def xread(streams, *args, **kwargs):  # B's reader stalls once we say so
            if semantic.stream in streams:
                if not resumed.is_set():
                    stalled.set()
                    await resumed.wait()
                reads[0] += 1
            return await real_xread(streams, *args, **kwargs)

        semantic._client.xread = xread
        try:
            await asyncio.wait_for(stalled.wait(), 5)
            admin = {"Authorization": "Bearer t"}
            invalidated = await a.client.post(
                "/admin/invalidate", json={"tag": "router"}, headers=admin
            )
            assert invalidated.status_code == 200
            ((record, _),) = await client.xrevrange(semantic.stream, count=1)
            if lost == "trimmed":  # the others' records, until A's is trimmed away
                while (await client.xrange(semantic.stream, count=1))[0][0] <= record:
                    await client.xadd(
                        semantic.stream,
                        {b"op": b"other", b"src": b"c"},
                        maxlen=10,
                        approximate=True,
                    )
            else:
                await client.delete(semantic.stream)
            resumed.set()
            if lost == "trimmed":  # B reads what came after, to A's next entry
                await ask(a, "What is the capital of France?")
                await eventually(
                    lambda: semantic.counts["received"] == 1, what="B reading A's next entry"
                )
            else:  # B looked at the stream again, and went on reading
                await eventually(lambda: reads[0] >= 2, what="B's reader back at the stream")
        finally:
            semantic._client.xread = real_xread
        assert semantic.counts["invalidations_received"] == 0  # (never read: missed)
        again = await ask(b, "How do I reset my router?", headers=tags)
        assert again.headers["x-carpool"] == "miss" and again.json() != first.json()
        assert semantic.counts["forgotten"] >= 1


async def test_the_semantic_stream_reader_stops_by_itself_once_its_cache_is_closed(
    two_semantic, fake
):
    # As if ``aclose``'s cancellation were swallowed by the client library (``stop_reader``).
    async with two_semantic() as (a, _b):
        semantic = a.gateway.semantic
        reader = semantic._reader
        assert reader is not None and not reader.done()
        semantic._closed = True  # (aclose's first step; no cancellation here)
        await asyncio.wait_for(reader, 10)


async def test_tenants_never_share_semantic_entries_across_instances(two_semantic, fake):
    async with two_semantic() as (a, b):
        await ask(a, "How do I reset my router?", headers={"Authorization": "Bearer a"})
        await stored(a)
        await propagated(b)
        response = await ask(b, "how can i reset my router", headers={"Authorization": "Bearer b"})
        assert response.headers["x-carpool"] == "miss"
        same = await ask(b, "how can i reset my router", headers={"Authorization": "Bearer a"})
        assert same.headers["x-carpool"] == "semantic-hit"


async def test_a_conversations_earlier_turns_travel_with_its_entry_to_other_instances(
    two_semantic, fake
):
    # The earlier turns are out of the scope (compared by meaning): another instance must get
    # them with the entry, or it could not tell a chat about a gym from one about a phone plan.
    gym = [
        {"role": "user", "content": "I have a gym membership."},
        {"role": "assistant", "content": "Great, how can I help?"},
    ]
    phone = [
        {"role": "user", "content": "I have a phone plan."},
        {"role": "assistant", "content": "Great, how can I help?"},
    ]
    async with two_semantic() as (a, b):
        await ask(a, "How do I cancel it?", history=gym)
        await stored(a)
        await propagated(b)
        assert (
            b.gateway.semantic._entries[next(iter(b.gateway.semantic._entries))].context
            == a.gateway.semantic._entries[next(iter(a.gateway.semantic._entries))].context
            != ""
        )
        assert (await ask(b, "How do I cancel it?", history=phone)).headers["x-carpool"] == "miss"
        assert (await ask(b, "how do I cancel it", history=gym)).headers[
            "x-carpool"
        ] == "semantic-hit"


class TestRedisKilled:
    @pytest.fixture
    def shared_redis(self, killable_redis):
        """(A server or a cluster of this test's own: it kills it.)"""
        return killable_redis

    async def test_redis_killed_the_semantic_cache_still_works_locally(
        self, two_semantic, fake, shared_redis
    ):
        async with two_semantic() as (a, b):
            shared_redis.kill()
            first = await ask(a, "How do I reset my router?")
            assert first.status_code == 200
            await stored(a)
            again = await ask(a, "how can i reset my router")
            assert again.headers["x-carpool"] == "semantic-hit"
            assert again.json() == first.json()
            assert (await ask(b, "how can i reset my router")).headers["x-carpool"] == "miss"
            assert (await a.client.get("/healthz")).json()["status"] == "degraded"


@pytest.mark.parametrize(
    "first, second",
    [
        ("如何删除我的账户？", "如何恢复我的账户？"),  # delete vs recover my account
        ("锻炼有哪些好处？", "锻炼有哪些坏处？"),  # benefits vs harms of exercise
        ("Как удалить мой аккаунт?", "Как восстановить мой аккаунт?"),
        ("アカウントを削除する方法", "アカウントを復元する方法"),
    ],
)
async def test_a_script_the_model_cannot_read_gets_no_semantic_hit_at_all(sgw, fake, first, second):
    await ask(sgw, first)
    again = await ask(sgw, second)
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2
    assert sgw.gateway.semantic.entries == 0  # nothing of it is even indexed
    assert (await ask(sgw, first)).headers["x-carpool"] == "hit"  # exact matching still


def test_readable_scripts_are_those_configured():
    from carpool.fingerprint import readable

    assert readable("café, naïve, Ångström, œuvre, straße, Łódź", ["Latin"])
    assert not readable("如何删除我的账户", ["Latin"]) and readable(
        "如何删除我的账户", ["Latin", "Han"]
    )
    assert not readable("Привет", ["Latin"]) and readable("Привет", ["*"])
    assert not readable("cost in αβ units", ["Latin"])


def test_an_index_built_before_the_models_never_crashes_the_process():
    # onnxruntime imported after usearch died with SIGSEGV (here: an index built by one
    # semantic cache, then a gateway's verifier loaded): a process of its own, as it crashes.
    pytest.importorskip("onnxruntime")
    code = (
        "from carpool.semantic.index import VectorIndex\n"
        "VectorIndex(8)\n"
        "import onnxruntime\n"
        "print('alive')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr[-2000:]


def embedding_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("carpool-embed")}


@pytest.mark.parametrize("where", ["local", "shared"])
async def test_a_closed_semantic_gateway_leaves_no_embedding_thread(gateway_with, request, where):
    # Each gateway's embedder has a worker thread of its own; its cache's ``aclose`` never
    # closed it: one thread left per gateway built and closed (the verifier's is shared, kept).
    from conftest import redis_settings

    shared = redis_settings(request.getfixturevalue("redis_server")) if where == "shared" else {}
    before = embedding_threads()
    async with gateway_with(**SEMANTIC, **shared) as gw:
        await ask(gw, "How do I reset my router?")
        assert embedding_threads() - before  # the model ran: its thread is there
    assert embedding_threads() - before == set()


#: A reviewer's traps in Latin script: all letters read, every word known to WordPiece, so the
#: English verifier scored them 0.98+ and the English rules saw no negation or antonym.
NOT_ENGLISH_TRAPS = [
    (
        "Soll ich Antibiotika mit Milch einnehmen?",
        "Soll ich Antibiotika nicht mit Milch einnehmen?",
    ),
    (
        "Escreva um e-mail dizendo que aceito a proposta.",
        "Escreva um e-mail dizendo que não aceito a proposta.",
    ),
    (
        "Comment activer le Bluetooth sur mon téléphone ?",
        "Comment désactiver le Bluetooth sur mon téléphone ?",
    ),
    # Cut into lines too short to be read one by one.
    (
        "Betreff: Kündigung\nKundennummer: 4711\nBitte bestätigen.",
        "Betreff: Verlängerung\nKundennummer: 4711\nBitte bestätigen.",
    ),
]
#: English twins still compared by meaning: a paraphrase of each is served, names and all.
ENGLISH_TWINS = [
    ("How do I turn on Bluetooth on my phone?", "how can i turn on bluetooth on my phone"),
    (
        "What are the best things to do in Los Angeles?",
        "What are the best things to do in Los Angeles",
    ),
]


@pytest.mark.parametrize(
    ("trap", "twin"),
    [(NOT_ENGLISH_TRAPS[i], ENGLISH_TWINS[0]) for i in range(3)]
    + [(NOT_ENGLISH_TRAPS[3], ENGLISH_TWINS[1])],
    ids=["de", "pt", "fr", "de-lines/los-angeles"],
)
async def test_a_prompt_that_does_not_read_as_english_is_matched_exactly_its_english_twin_is_not(
    sgw, fake, trap, twin
):
    first, opposite = trap
    await ask(sgw, first)
    assert (await ask(sgw, first)).headers["x-carpool"] == "hit"  # exact still works
    assert (await ask(sgw, opposite)).headers["x-carpool"] == "miss"
    assert fake.count() == 2 and sgw.gateway.semantic.entries == 0
    # English is still compared by meaning: a true paraphrase is served.
    await ask(sgw, twin[0])
    await stored(sgw)
    again = await ask(sgw, twin[1])
    assert again.headers["x-carpool"] == "semantic-hit" and fake.count() == 3


#: (a completion prompt, what the upstream wrote after it, a prompt that ends otherwise)
CONTINUED = [
    (
        "How do I reset my password? Answer: You",
        " can reset it under Settings > Security.",
        "How do I reset my password? Answer:",
    ),
    (
        "How do I reset my password? The first step is to",
        " open Settings.",
        "How do I reset my password? The first step is",
    ),
    (
        "Q: How do I reset my password?\nA: To",
        " reset it, open Settings.",
        "Q: How do I reset my password?\nA:",
    ),
    (
        "Tell me how to reset my password. Sure, the first step is",
        " to open Settings.",
        "Tell me how to reset my password. Sure, the first step is to",
    ),
]


@pytest.mark.parametrize("prompt,written,other", CONTINUED)
async def test_a_completion_is_never_served_to_a_prompt_that_ends_otherwise(
    sgw, fake, prompt, written, other
):
    # A completion continues its prompt's very words: "...Answer: You" continued with "can
    # reset it...", served to "...Answer:" as "...Answer: can reset it...".
    fake.answer_text = lambda n, body: written
    body = {"model": "m", "temperature": 0, "max_tokens": 32}
    first = await sgw.client.post("/v1/completions", json={**body, "prompt": prompt})
    assert first.json()["choices"][0]["text"] == written
    await stored(sgw)
    again = await sgw.client.post("/v1/completions", json={**body, "prompt": other})
    assert again.headers["x-carpool"] == "miss", other + again.json()["choices"][0]["text"]
    assert fake.count() == 2


async def test_a_completion_whose_prompt_ends_the_same_is_compared_by_its_finished_sentences(
    sgw, fake
):
    body = {"model": "m", "temperature": 0, "max_tokens": 32}
    for prompt in ("How do I reset my password? Answer:", "Why is the sky blue"):
        await sgw.client.post("/v1/completions", json={**body, "prompt": prompt})
    await stored(sgw)
    hit = await sgw.client.post(
        "/v1/completions", json={**body, "prompt": "how can I reset my password? Answer:"}
    )
    assert hit.headers["x-carpool"] == "semantic-hit"
    # No sentence ends: all of it is continued, matched exactly only.
    assert sgw.gateway.semantic.entries == 1
