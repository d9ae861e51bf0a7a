"""Conversations by meaning, over HTTP: earlier turns are compared by the guard, not byte for byte.

A reworded context, an irrelevant earlier exchange or small talk can still be a semantic hit; a
changed product, detail or intent never is. The conversations are written for these tests.
"""

from __future__ import annotations

import pytest

from fakes.waiting import eventually

pytest.importorskip("onnxruntime")
pytest.importorskip("usearch")


def turns(*texts: str) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]


BILL = turns(
    "I need help with my electricity bill.",
    "Happy to help. What's the issue with your electricity bill?",
)
BILL_REWORDED = turns(
    "I need some help with my electricity bill.",
    "Happy to help. What's the issue with your electricity bill?",
)
HELLO = turns("hi there", "Hello! How can I help?")


def ASSISTANT(content: str) -> dict[str, str]:  # noqa: N802 (reads as the turn it is)
    return {"role": "assistant", "content": content}


JACKET = turns(
    "I want to return the blue jacket I bought.",
    "Sure, the blue jacket can be returned within 30 days.",
)
GRINDER = turns(
    "I want to return the coffee grinder I bought.",
    "Sure, the coffee grinder can be returned within 30 days.",
)
TICKET = turns(
    "Can you check the status of ticket 4410?", "Ticket 4410 is waiting on the engineering team."
)
TICKET_OTHER = turns(
    "Can you check the status of ticket 4401?", "Ticket 4401 is waiting on the engineering team."
)
PLAN = turns("My internet plan is the 100 Mbps one.", "Got it, you're on Fibre 100.")

HITS = {
    "reworded_context": (
        BILL + [{"role": "user", "content": "Why is it so high this month?"}],
        BILL_REWORDED + [{"role": "user", "content": "why is it so high this month"}],
    ),
    "irrelevant_history": (
        BILL + [{"role": "user", "content": "Why is it so high this month?"}],
        HELLO + BILL + [{"role": "user", "content": "Why is it so high this month?"}],
    ),
    "extra_chatter": (
        JACKET + [{"role": "user", "content": "How do I return it?"}],
        JACKET + [{"role": "user", "content": "ok thanks! how do I return it?"}],
    ),
}
TRAPS = {
    "context_swap": (
        JACKET + [{"role": "user", "content": "How do I return it?"}],
        GRINDER + [{"role": "user", "content": "How do I return it?"}],
    ),
    "detail_swap": (
        TICKET + [{"role": "user", "content": "escalate it"}],
        TICKET_OTHER + [{"role": "user", "content": "escalate it"}],
    ),
    "intent_flip": (
        PLAN + [{"role": "user", "content": "upgrade it please"}],
        PLAN + [{"role": "user", "content": "downgrade it please"}],
    ),
    # A second review's traps: one detail of an earlier turn changed (a time of day, what a
    # looked-up result or an error message says) passed as a close context, under the
    # near-repeat bar, or was scored the same by the verifier.
    "time_of_day_swap": (
        turns(
            "My flight leaves at 6 am tomorrow.",
            "Okay, noted.",
            "What time should I get to the airport?",
        ),
        turns(
            "My flight leaves at 6 pm tomorrow.",
            "Okay, noted.",
            "What time should I get to the airport?",
        ),
    ),
    "looked_up_result_flip": (
        turns(
            "Is the pharmacy open right now?",
            "Search result: the pharmacy is closed today.",
            "Should I go there now?",
        ),
        turns(
            "Is the pharmacy open right now?",
            "Search result: the pharmacy is open today.",
            "Should I go there now?",
        ),
    ),
    "answer_flip": (
        turns(
            "Is the museum open on Mondays?",
            "The museum is closed on Mondays.",
            "Can we visit it this Monday?",
        ),
        turns(
            "Is the museum open on Mondays?",
            "The museum is open on Mondays.",
            "Can we visit it this Monday?",
        ),
    ),
    "error_message_swap": (
        turns(
            "The server logs say connection refused.",
            "That's a common one.",
            "What should I check first?",
        ),
        turns(
            "The server logs say connection timed out.",
            "That's a common one.",
            "What should I check first?",
        ),
    ),
    "error_text_swap": (
        turns("The error says permission denied.", "Let's look.", "What does it mean?"),
        turns("The error says file not found.", "Let's look.", "What does it mean?"),
    ),
    # A review's: a tense change in an earlier turn (a current or a former citizen, a marriage
    # that is or was) counted as retyping ("am" / "was" function words) and got the 0.90 bar.
    "tense_flip": (
        turns("Do I need a visa? I am a US citizen.", "Noted.", "What should I do?"),
        turns("Do I need a visa? I was a US citizen.", "Noted.", "What should I do?"),
    ),
    "tense_flip_short": (
        turns("I am married. What tax form do I file?", "Let me check.", "Which one?"),
        turns("I was married. What tax form do I file?", "Let me check.", "Which one?"),
    ),
}


async def chat(gw, messages, system=None):
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    response = await gw.client.post(
        "/v1/chat/completions", json={"model": "m", "temperature": 0, "messages": messages}
    )
    assert response.status_code == 200, response.text
    return response


@pytest.fixture
async def sgw(gateway_with):
    async with gateway_with(semantic={"enabled": True}) as served:
        yield served


@pytest.mark.parametrize("kind", ["extra_chatter", "reworded_context", "irrelevant_history"])
async def test_a_conversation_with_the_same_meaning_is_a_semantic_hit(sgw, fake, kind):
    # (irrelevant_history: the verifier scored a context with an extra greeting exchange 0.81;
    # leading small talk is now left out of the context, so it is not asked.)
    first, second = HITS[kind]
    answer = await chat(sgw, first)
    again = await chat(sgw, second)
    assert again.headers["x-carpool"] == "semantic-hit", kind
    assert again.json() == answer.json() and fake.count() == 1


@pytest.mark.parametrize("kind", sorted(TRAPS))
async def test_a_conversation_with_another_context_detail_or_intent_is_never_served(
    sgw, fake, kind
):
    first, second = TRAPS[kind]
    await chat(sgw, first)
    assert (await chat(sgw, second)).headers["x-carpool"] == "miss", kind
    assert fake.count() == 2


async def test_the_system_prompt_still_scopes_a_conversation_exactly(sgw, fake):
    first, second = HITS["reworded_context"]
    await chat(sgw, first, system="You are a billing assistant.")
    assert (await chat(sgw, second, system="You are a sales assistant.")).headers[
        "x-carpool"
    ] == "miss"


INSTRUCTED = turns("From now on, reply only with yes or no.", "Understood.")
BANNED = turns("Do not answer geography questions.", "OK.")


@pytest.mark.parametrize("history", [INSTRUCTED, BANNED], ids=["yes_or_no", "no_geography"])
@pytest.mark.parametrize("instructed_first", [True, False], ids=["instructed_first", "bare_first"])
async def test_an_earlier_instruction_never_meets_the_bare_question(
    sgw, fake, history, instructed_first
):
    # The verifier was asked about the instruction against no context at all, and scored it
    # 0.99: the capital of Australia, answered in a sentence, was served as the yes-or-no reply.
    question = [{"role": "user", "content": "What is the capital of Australia?"}]
    first, second = (
        (history + question, question) if instructed_first else (question, history + question)
    )
    await chat(sgw, first)
    await eventually(lambda: sgw.gateway.semantic.entries >= 1, what="the semantic insert")
    assert (await chat(sgw, second)).headers["x-carpool"] == "miss"
    assert fake.count() == 2 and sgw.gateway.semantic.rejections == {"context": 1}


@pytest.mark.parametrize(
    "greeting",
    [HELLO, turns("Hello there!", "Hi! How can I help you today?"), turns("thanks")],
    ids=["hello", "hello_there", "thanks"],
)
async def test_small_talk_before_a_question_still_meets_the_bare_question(sgw, fake, greeting):
    question = [{"role": "user", "content": "What is the capital of Australia?"}]
    answer = await chat(sgw, question)
    again = await chat(sgw, greeting + question)
    assert again.headers["x-carpool"] == "semantic-hit" and again.json() == answer.json()


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (
            [ASSISTANT("Hello! Is there anything I can help you with today?"), *turns("No.")],
            [ASSISTANT("Hello! Are you doing well today?"), *turns("No.")],
        ),
        (
            turns("Good evening!", "Good evening! How can I help you today?")
            + turns("What should I eat now?"),
            turns("Good morning!", "Good morning! How can I help you today?")
            + turns("What should I eat now?"),
        ),
    ],
    ids=["how_the_user_is", "time_of_day"],
)
async def test_small_talk_that_the_last_turn_answers_or_depends_on_is_context(
    sgw, fake, first, second
):
    # Left out as small talk, both contexts were empty and the last turns the same: "No." (not
    # well) was served "No." (nothing, thanks)'s answer, the morning's meal the evening's.
    await chat(sgw, first)
    await eventually(lambda: sgw.gateway.semantic.entries >= 1, what="the semantic insert")
    assert (await chat(sgw, second)).headers["x-carpool"] == "miss"


def test_a_users_question_is_never_small_talk_an_assistants_offer_to_help_is():
    # Made of small-talk words, "Is it okay?" asked something: left out of the context, its
    # answer ("Yes.") would have met another conversation's.
    from carpool.semantic.view import small_talk

    assert small_talk({"role": "user", "content": "Hello there, thanks a lot!"})
    assert small_talk({"role": "assistant", "content": "Hello! How can I help you today?"})
    for question in ("Is it okay?", "What is it?", "Can I?", "How can I help?"):
        assert not small_talk({"role": "user", "content": question}), question


async def test_a_turn_with_tool_calls_keeps_the_whole_conversation_exact(sgw, fake):
    tool_turns = [
        {"role": "user", "content": "What is the weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    await chat(sgw, tool_turns + [{"role": "user", "content": "Should I take an umbrella?"}])
    reworded = [{"role": "user", "content": "what is the weather"}, *tool_turns[1:]]
    assert (
        await chat(sgw, reworded + [{"role": "user", "content": "Should I take an umbrella?"}])
    ).headers["x-carpool"] == "miss"
    # Its last turn too (it was compared by meaning), even after the very same tool result.
    assert (
        await chat(sgw, tool_turns + [{"role": "user", "content": "should i take an umbrella"}])
    ).headers["x-carpool"] == "miss"
    assert sgw.gateway.semantic.entries == 0 and fake.count() == 3


async def test_a_responses_input_with_a_function_call_keeps_the_whole_request_exact(sgw, fake):
    items = [
        {"role": "user", "content": "What is the weather?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]

    async def ask(text):
        body = {"model": "m", "temperature": 0, "store": False, "input": [*items, text]}
        return await sgw.client.post("/v1/responses", json=body)

    await ask({"role": "user", "content": "Should I take an umbrella?"})
    again = await ask({"role": "user", "content": "should i take an umbrella"})
    assert again.headers["x-carpool"] == "miss" and fake.count() == 2


async def test_a_responses_requests_earlier_input_items_are_matched_exactly(sgw, fake):
    # (As the docs say: chat's and Messages' earlier turns are compared by meaning, Responses'
    # stay in the scope: a greeting before the question is another request there.)
    async def ask(*items):
        body = {"model": "m", "temperature": 0, "store": False, "input": list(items)}
        return await sgw.client.post("/v1/responses", json=body)

    question = {"role": "user", "content": "What is the capital of Australia?"}
    await ask(*HELLO, question)
    await eventually(lambda: sgw.gateway.semantic.entries == 1)
    again = await ask(*HELLO, {"role": "user", "content": "what is the capital of australia"})
    assert again.headers["x-carpool"] == "semantic-hit"
    bare = await ask(question)
    assert bare.headers["x-carpool"] == "miss" and fake.count() == 2


#: ~200 tokens of pasted mail in an earlier turn: more than the verifier reads of a pair.
EMAIL = (
    "Dear team, thank you all for your hard work this quarter. We have made great progress on "
    "the new product and our customers are happy with the results. Please remember to submit "
    "your timesheets by Friday and to update the shared calendar with your vacation plans. "
) * 3


async def test_a_changed_wish_at_the_end_of_a_long_earlier_turn_is_never_served(sgw, fake):
    # The verifier read ~127 tokens a side of the contexts: "decline" after the same long mail
    # was served the reply drafted for "accept". Now a pair it cannot read whole is refused.
    def mail(wish):
        return turns(f"Here is an email I got: {EMAIL}{wish}", "Got it.") + [
            {"role": "user", "content": "Draft the reply."}
        ]

    await chat(sgw, mail("I want to accept the invitation."))
    # ("turn it down": "decline" is an opposite of "accept" that the polarity rule refuses.)
    for wish in ("I want to turn the invitation down.", "Tell them I am quitting my job."):
        assert (await chat(sgw, mail(wish))).headers["x-carpool"] == "miss", wish
    assert set(sgw.gateway.semantic.rejections) == {"length"}  # too long to check: not read
    again = await chat(sgw, mail("I want to accept the invitation."))  # the same: exact
    assert again.headers["x-carpool"] == "hit" and fake.count() == 3


ODD_ROLES = {
    "object_in_the_middle": [
        {"role": "user", "content": "a"},
        {"role": {"x": 1}, "content": "b"},
        {"role": "user", "content": "c"},
    ],
    "list_first": [{"role": ["system"], "content": "a"}, {"role": "user", "content": "c"}],
    "number": [{"role": 7, "content": "a"}, {"role": "user", "content": "c"}],
}


@pytest.mark.parametrize(
    "earlier",
    [
        {"role": "tool", "content": "sunny"},  # (no tool_call_id: it passed as a plain turn)
        {"role": "function", "content": "sunny"},
        {"role": "critic", "content": "sunny"},
    ],
    ids=["tool", "function", "made_up"],
)
def test_only_a_users_or_an_assistants_plain_turn_is_compared_by_meaning(earlier):
    from carpool.semantic.view import conversation

    body = {"messages": [*turns("Weather?", "Let me see."), earlier, *turns("And tomorrow?")]}
    assert conversation(body) is None
    plain = {"messages": [*turns("Weather?", "Let me see.", "And tomorrow?")]}
    assert conversation(plain) is not None


@pytest.mark.parametrize("kind", sorted(ODD_ROLES))
async def test_a_role_that_is_no_string_keeps_the_conversation_exact_never_a_500(
    gateway_with, fake, kind
):
    # The role was looked up in a frozenset: unhashable, a TypeError, a 500 only with the
    # semantic cache on. Now such a conversation has no semantic view: exact, whole.
    from carpool.semantic.view import conversation

    body = {"model": "m", "temperature": 0, "messages": ODD_ROLES[kind]}
    statuses = []
    for enabled in (False, True):
        async with gateway_with(semantic={"enabled": enabled}) as gw:
            response = await gw.client.post("/v1/chat/completions", json=body)
            statuses.append((response.status_code, response.headers.get("x-carpool")))
    assert statuses[1] == statuses[0] and statuses[1][0] < 500, statuses
    assert conversation(body) is None
