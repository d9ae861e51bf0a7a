"""The guard with the packaged verifier: every trap kind refused, rewordings served.

The pairs are written for these tests (none is taken from the development data the verifier was
trained on). Traps: one list per kind the issue names; each must be refused, whichever of the
exact rules or the verifier refuses it.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("onnxruntime")

import numpy as np  # noqa: E402

from carpool.semantic.guard import Reason, RulesThenVerifier, Side, Verdict  # noqa: E402
from carpool.semantic.verifier import CrossEncoder, shared_cross_encoder  # noqa: E402

TRAPS = {
    "negation": [
        (
            "Is it safe to drink tap water in Lisbon?",
            "Is it not safe to drink tap water in Lisbon?",
        ),
        ("Can I freeze cooked rice?", "Can't I freeze cooked rice?"),
        ("How do I make pancakes with eggs?", "How do I make pancakes without eggs?"),
        ("Is coffee bad for you?", "Is coffee good for you?"),
        ("How do I import my contacts?", "How do I export my contacts?"),
        ("Is aspirin safe with coffee?", "Is aspirin unsafe with coffee?"),
        ("How do I block a number on my phone?", "How do I unblock a number on my phone?"),
        ("How do I turn up the volume?", "How do I turn down the volume?"),
        ("Why is my package late?", "Why is my package early?"),
        ("What are the benefits of fasting?", "What are the dangers of fasting?"),
        # "no longer" against "still", and an exclusion on one side: served before (0.97, 0.93).
        ("Is Pluto still a planet?", "Is Pluto no longer a planet?"),
        ("Do I still need a visa for Japan?", "Do I no longer need a visa for Japan?"),
        (
            "List the countries in Europe that use the euro.",
            "List the countries in Europe except those that use the euro.",
        ),
        ("Which browsers support WebGPU?", "Which browsers other than Chrome support WebGPU?"),
    ],
    # One-word opposites in their comparative and superlative forms, and opposites the list
    # lacked: served before, in the same words otherwise.
    "opposite_forms": [
        ("Which is bigger, the Sun or the Earth?", "Which is smaller, the Sun or the Earth?"),
        ("Which planet is larger, Mars or Venus?", "Which planet is smaller, Mars or Venus?"),
        (
            "Who is older, Barack Obama or Michelle Obama?",
            "Who is younger, Barack Obama or Michelle Obama?",
        ),
        ("Which is faster, Python or Java?", "Which is slower, Python or Java?"),
        (
            "Which river is longer, the Nile or the Amazon?",
            "Which river is shorter, the Nile or the Amazon?",
        ),
        ("Which is stronger, steel or titanium?", "Which is weaker, steel or titanium?"),
        (
            "Which month has the longest day in Sydney?",
            "Which month has the shortest day in Sydney?",
        ),
        (
            "Write a Python function that sorts a list in ascending order.",
            "Write a Python function that sorts a list in descending order.",
        ),
        (
            "Which is wider, the Atlantic or the Pacific?",
            "Which is narrower, the Atlantic or the Pacific?",
        ),
        (
            "Which is newer, HDMI 2.1 or DisplayPort 1.4?",
            "Which is older, HDMI 2.1 or DisplayPort 1.4?",
        ),
        (
            "Which side of the road do they drive on in Japan, left?",
            "Which side of the road do they drive on in Japan, right?",
        ),
        ("What foods raise blood sugar?", "What foods reduce blood sugar?"),
        ("Why do some people succeed at dieting?", "Why do some people fail at dieting?"),
        ("How do I stay awake while driving?", "How do I fall asleep while driving?"),
    ],
    # One thing in place of another inside shared filler: the verifier scored "router" /
    # "console" 0.13 bare, 0.99 with the filler.
    "swapped_object": [
        ("how can i reset my router please", "how can i reset my modem please"),
        ("How can I reset my router, please?", "How can I reset my modem, please?"),
        ("How do I unclog a kitchen sink please", "How do I unclog a bathroom sink please"),
        (
            "how can i reset my router right now please",
            "how can i reset my laptop right now please",
        ),
        (
            "how can i reset my modem right now please",
            "how can i reset my console right now please",
        ),
        (
            "how can i reset my microwave right now please, it has been acting up all week",
            "how can i reset my oven right now please, it has been acting up all week",
        ),
        (
            "Can you tell me how to clean my oven quickly please",
            "Can you tell me how to clean my grill quickly please",
        ),
        ("How do I descale my kettle at home, thanks", "How do I descale my iron at home, thanks"),
    ],
    "entity": [
        ("What is the currency of Peru?", "What is the currency of Chile?"),
        ("How do I get a visa for Canada?", "How do I get a visa for Australia?"),
        ("Who founded Microsoft?", "Who founded Apple?"),
        ("How do I pair AirPods with a Chromebook?", "How do I pair AirPods with a Kindle?"),
    ],
    "number": [
        ("Set a timer for 25 minutes.", "Set a timer for 35 minutes."),
        ("Book a table for two.", "Book a table for four."),
        ("What was the weather like in 2019?", "What was the weather like in 2020?"),
        ("What's the forecast for tomorrow?", "What's the forecast for today?"),
        ("Is 10 miles a long run?", "Is 10 km a long run?"),
    ],
    "scope": [
        (
            "What is a safe dose of melatonin for adults?",
            "What is a safe dose of melatonin for toddlers?",
        ),
        ("How do I reset my password?", "How do I reset my son's password?"),
        (
            "How do I share a folder with my team?",
            "How do I share a folder with people outside my team?",
        ),
        ("How do I cancel my subscription?", "How do I cancel my subscription from abroad?"),
        ("How long do cats live?", "How long do outdoor cats live?"),
        ("Explain quantum computing for beginners.", "Explain quantum computing for experts."),
        ("Recommend a chess book for novices.", "Recommend a chess book for experts."),
    ],
    "comparison": [
        ("Is 8 > 5?", "Is 8 < 5?"),
        ("Is 8 greater than 5?", "Is 8 less than 5?"),
        ("List the users older than 30", "List the users younger than 30"),
    ],
    "code_operator": [
        ("What does x == 1 do in Python?", "What does x = 1 do in Python?"),
        ("Why does a != b fail here?", "Why does a == b fail here?"),
        ("What does `i += 1` mean?", "What does `i -= 1` mean?"),
    ],
    "swapped_roles": [
        ("The cat chased the mouse. Why?", "The mouse chased the cat. Why?"),
        ("Why did the buyer sue the seller?", "Why did the seller sue the buyer?"),
        ("Why did Germany export cars to France?", "Why did France export cars to Germany?"),
    ],
    "conversion_direction": [
        ("How do I convert JSON to YAML?", "How can I convert YAML to JSON?"),
        ("Convert 100 euros to dollars.", "Convert 100 dollars to euros."),
        (
            "Translate this letter from German to French.",
            "Translate this letter from French to German.",
        ),
    ],
    "translation_tense": [
        ("Translate 'I eat an apple' into French", "Translate 'I ate an apple' into French"),
        ("Translate I will call you into Spanish", "Translate I called you into Spanish"),
        (
            "How do you say 'she goes to school' in German?",
            "How do you say 'she went to school' in German?",
        ),
    ],
}

REWORDINGS = [
    ("How do I reset my router?", "how can i reset my router"),
    ("How do I recieve a refund for my order?", "How do I receive a refund for my order?"),
    ("HOW DO I RESET MY ROUTER", "how do i reset my router"),
    ("How long does delivery take???", "  how long does delivery take "),
    ("Hi! How do I delete my account?", "how do i delete my account"),
    ("Could you please tell me how to export my contacts? Thanks!", "How do I export my contacts?"),
    ("In Python, how do I reverse a list?", "How do I reverse a list in Python?"),
    ("What's the difference between RAM and ROM?", "What is the difference between RAM and ROM?"),
    ("How do I change the colour of my text?", "How do I change the color of my text?"),
    ("What's the capital of Australia?", "Which city is the capital of Australia?"),
    ("How do I make my PC faster?", "How do I make my computer faster?"),
    ("Is it ok to give my dog chocolate?", "Is it okay to give my dog chocolate?"),
    ("Who wrote Hamlet?", "Who is the author of Hamlet?"),
    ("Why is the sky blue?", "What is the reason the sky is blue?"),
    ("What are some tips for saving money?", "What are tips for saving money?"),
    ("How do I cancel my subscription?", "What are the steps to cancel my subscription?"),
]


@pytest.fixture(scope="module")
def guard() -> RulesThenVerifier:
    return RulesThenVerifier(shared_cross_encoder())


def verdict(guard: RulesThenVerifier, a: str, b: str) -> Verdict:
    v, w = guard.judge_now(Side(a), [Side(b)])[0], guard.judge_now(Side(b), [Side(a)])[0]
    assert v == w, (a, b, v, w)  # symmetric
    return v


@pytest.mark.parametrize("kind", sorted(TRAPS))
def test_no_trap_of_any_kind_is_served(guard, kind):
    served = [(a, b) for a, b in TRAPS[kind] if verdict(guard, a, b).ok]
    assert served == []


def test_rewordings_are_served(guard):
    served = [(a, b) for a, b in REWORDINGS if verdict(guard, a, b).ok]
    # The verifier is a model, calibrated to serve <= 2 % wrong: at that bar it serves about half
    # of these true rewordings (README, "Semantic cache"), and none of the traps above.
    assert len(served) >= len(REWORDINGS) // 2, served


def test_a_retyped_prompt_is_served_without_asking_the_model(guard):
    before = guard.verifier.pairs
    for a, b in (
        ("Cancel it.", "cancel it"),
        ("HOW DO I RESET MY ROUTER", "how do i reset my router"),
        ("How long does delivery take???", "  how long does delivery take "),
    ):
        assert verdict(guard, a, b) == Verdict(True, None, 1.0), (a, b)
    assert guard.verifier.pairs == before


#: Pairs that differ only in what the retyping shortcut dropped (case, every non-word character)
#: and so were served 1.0, the verifier never asked.
NOT_RETYPED = [
    ("👍", "👎"),
    ("What does 🍎 mean?", "What does 🍌 mean?"),
    ("What does ls -a do?", "What does ls -A do?"),
    ("Is A ⊂ B true when A is empty?", "Is A ⊄ B true when A is empty?"),
    ("Explain x++ in Java", "Explain x-- in Java"),
    ("Write a hello world program in C", "Write a hello world program in C++"),
    ("Write a hello world program in C", "Write a hello world program in C#"),
    ("Is .NET free?", "Is NET free?"),
    ("What is IT?", "What is it?"),
    ("What is √16?", "What is ∛16?"),
    ("Is P ⇒ Q equivalent to not P or Q?", "Is P ⇔ Q equivalent to not P or Q?"),
    ("Is pay\u200bpal safe?", "Is paypal safe?"),
    ("Explain the -v flag of grep", "Explain the v flag of grep"),
    (
        "Fix:\n```\nfor x in xs:\n    f(x)\ng(x)\n```",
        "Fix:\n```\nfor x in xs:\n    f(x)\n    g(x)\n```",
    ),
    ("for x in xs:\n    f(x)\ng(x)", "for x in xs:\n    f(x)\n    g(x)"),
]


@pytest.mark.parametrize("a, b", NOT_RETYPED)
def test_a_symbol_emoji_acronym_flag_or_indentation_is_never_retyping(guard, a, b):
    from carpool.semantic.retyping import retyped

    assert not retyped(a, b) and not retyped(b, a)
    # Nor served by the verifier: it is blind to case, spacing and "⊄" (read as "⊂"), so a
    # difference only there is refused before it is asked; emoji and symbols it cannot read
    # (``[UNK]``) score 0.
    assert not verdict(guard, a, b).ok


@pytest.mark.parametrize(
    "a, b",
    [
        ("What does {} mean in Python?", "What does [] mean in Python?"),
        ("What does ?? do in JavaScript?", "What does !! do in JavaScript?"),
        ("Is 5! equal to 120?", "Is 5 equal to 120?"),
        ("In Python, what type is 1.?", "In Python, what type is 1?"),
        ("Is 10. a valid number in JSON?", "Is 10 a valid number in JSON?"),
        ("What does String? mean in Kotlin?", "What does String mean in Kotlin?"),
        ("What does the : operator do in Python?", "What does the ; operator do in Python?"),
        ("What does x? mean in regex?", "What does x mean in regex?"),
    ],
)
def test_a_mark_that_is_what_is_asked_about_is_never_retyping(a, b):
    # A token of marks alone vanished, and a sentence mark went wherever it was: each pair was
    # served 1.0, the verifier never asked. They are the verifier's to judge now.
    from carpool.semantic.retyping import retyped

    assert not retyped(a, b) and not retyped(b, a)


@pytest.mark.parametrize(
    "a, b",
    [
        ("Cancel it.", "cancel it"),
        ("Why? Because I said so.", "why because i said so"),
        ("I got this: Dear team. We made it.", "i got this: dear team. we made it."),
        ("How do I reset my router?", "how do i reset my router"),
        ("HOW DO I RESET MY ROUTER", "how do i reset my router"),
        ("How long does delivery take???", "  how long does delivery take "),
        ("A dog bit me. What do I do?", "a dog bit me. what do i do"),
        ("What's the capital of Australia?", "what's the  capital of australia"),
        ('Explain "dependency injection" (briefly).', "explain dependency injection briefly"),
        ("Is Wi-Fi safe?", "is wi-fi safe"),
        ("¿Qué hora es?", "qué hora es"),
    ],
)
def test_case_edge_punctuation_and_spacing_are_retyping(guard, a, b):
    from carpool.semantic.retyping import retyped

    assert retyped(a, b) and retyped(b, a)


@pytest.mark.parametrize(
    "a, b, near",
    [
        # Retyping: a function word, a courtesy, another form at the same time.
        (
            "user: I need help with my electricity bill.",
            "user: I need some help with my electricity bill.",
            True,
        ),
        (
            "user: I ordered two jackets and the orders came today.",
            "user: I ordered two jackets and the order came today.",
            True,
        ),
        (
            "user: I am asking about the bill and nothing else now.",
            "user: I am asking about this bill and nothing else now.",
            True,
        ),
        # Another time: never retyping (a review: "am" / "was" got the near-repeat bar).
        (
            "user: Do I need a visa? I am a US citizen.",
            "user: Do I need a visa? I was a US citizen.",
            False,
        ),
        (
            "user: My card does not work at all at the shop.",
            "user: My card did not work at all at the shop.",
            False,
        ),
        (
            "user: I order the same lunch at this place every day.",
            "user: I ordered the same lunch at this place every day.",
            False,
        ),
        (
            "user: I am asking about my bill and nothing else now.",
            "user: I asked about my bill and nothing else now.",
            False,
        ),
        # A second review's: a past "did" dropped, an irregular past that is its base.
        (
            "user: I did pay the fine last week in full.",
            "user: I pay the fine last week in full.",
            False,
        ),
        (
            "user: The pharmacy shut at 6 pm on the high street.",
            "user: The pharmacy shuts at 6 pm on the high street.",
            False,
        ),
        (
            "user: My old laptop fit in this bag last year, I think.",
            "user: My old laptop fits in this bag last year, I think.",
            False,
        ),
        (
            "user: Our team beat the league leaders away this week.",
            "user: Our team beats the league leaders away this week.",
            False,
        ),
        # Emphasis: a present "do" added is no other time.
        (
            "user: I do need some help with my electricity bill.",
            "user: I need some help with my electricity bill.",
            True,
        ),
    ],
)
def test_a_context_retyped_is_near_and_one_set_at_another_time_is_not(a, b, near):
    from carpool.semantic.retyping import close

    assert close(a, b) is near and close(b, a) is near


def test_identical_prompts_are_served_without_asking_the_model(guard):
    before = guard.verifier.pairs
    assert guard.judge_now(Side("What is a hash map?"), [Side("What is a hash map?")]) == [
        Verdict(True, None, 1.0)
    ]
    assert guard.verifier.pairs == before


def test_a_verdict_is_a_small_frozen_value_with_a_reason_when_refused(guard):
    v = verdict(guard, "Set a timer for 25 minutes.", "Set a timer for 35 minutes.")
    assert v == Verdict(False, Reason.NUMBER, None) and v.reason == "number"
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.ok = True  # type: ignore[misc]


async def test_one_lookups_candidates_are_scored_in_one_model_call(guard):
    verifier = guard.verifier
    calls, pairs = verifier.calls, verifier.pairs
    verdicts = await guard.judge(
        Side("How do I reset my router?"),
        [
            Side("how can i reset my router"),
            Side("How do I restart my router?"),
            Side("How do I reset my router 2?"),
            Side("How do I reset my router?"),
        ],
    )
    assert verifier.calls == calls + 1 and verifier.pairs == pairs + 2  # rules, identical: free
    assert verdicts[2].reason == Reason.NUMBER and verdicts[3].ok


#: Pairs of several lengths (a few tokens to ~110): a batch pads each to its longest.
MIXED_LENGTHS = [
    ("How do I reset my router?", "How can I reset my router?"),
    ("Is it safe to drink tap water in Lisbon?", "Is it not safe to drink tap water in Lisbon?"),
    ("Why?", "Why not?"),
    (
        "Summarise this article about climate policy. It argues that carbon taxes paired with "
        "dividends returned to households cut emissions without hurting low-income families, "
        "and reviews evidence from British Columbia, Sweden and Switzerland over two decades.",
        "Summarize the article on climate policy. It argues that carbon taxes paired with "
        "dividends returned to households cut emissions without hurting low income families, "
        "and reviews evidence from British Columbia, Sweden and Switzerland over twenty years.",
    ),
    ("What is the capital of Australia?", "Which city is Australia's capital?"),
    (
        "user: I have a gym membership.\nassistant: OK.",
        "user: I have a phone plan.\nassistant: OK.",
    ),
]


async def test_a_pairs_verifier_score_is_the_same_alone_and_beside_longer_and_shorter_pairs(
    guard,
):
    # The int8 model quantised its activations with one scale per call, over the whole batch
    # and its padding: "tap water" / "not safe" scored 0.165 alone and 0.250 beside the long
    # pair (a candidate's score depended on the other candidates of its lookup).
    verifier = guard.verifier
    alone = [verifier.score([pair])[0] for pair in MIXED_LENGTHS]
    mixes = [
        list(range(len(MIXED_LENGTHS))),  # all, the long one among them
        [3, 2],  # beside a longer one / a shorter one
        [1, 3, 0],
        [2, 5, 4, 0],
        [0, 0, 3, 3],  # twice over
    ]
    for mix in mixes:
        scored = verifier.score([MIXED_LENGTHS[i] for i in mix])
        np.testing.assert_allclose(scored, [alone[i] for i in mix], atol=1e-5, err_msg=str(mix))
        scored = await verifier.scores([MIXED_LENGTHS[i] for i in mix])  # (the lookups' way)
        np.testing.assert_allclose(scored, [alone[i] for i in mix], atol=1e-5, err_msg=str(mix))


async def test_a_candidates_verdict_is_the_one_it_has_alone_among_a_lookups_candidates(guard):
    # A lookup's candidates (after the most similar) are scored in one model call: each must
    # be judged as it is alone, whatever else the cache held close to the prompt.
    new = Side("Is it safe to drink tap water in Lisbon?")
    candidates = [
        Side("Is it not safe to drink tap water in Lisbon?"),
        Side("Is tap water in Lisbon safe to drink?"),
        Side(
            "Is it safe to drink tap water in Lisbon? I am travelling there with two small "
            "children next month, staying in an apartment in Alfama, and I would rather not "
            "buy bottled water every day if the water from the tap is fine for them."
        ),
        Side("Lisbon tap water: safe?"),
    ]
    alone = [(await guard.judge(new, [c]))[0] for c in candidates]
    together = await guard.judge(new, candidates)
    assert [v.ok for v in together] == [v.ok for v in alone]
    np.testing.assert_allclose(
        [v.score if v.score is not None else -1.0 for v in together],
        [v.score if v.score is not None else -1.0 for v in alone],
        atol=1e-5,
    )


def test_a_conversation_needs_its_earlier_turns_to_pass_too(guard):
    gym = "user: I have a gym membership.\nassistant: OK."
    phone = "user: I have a phone plan.\nassistant: OK."
    same = guard.judge_now(Side("Cancel it.", gym), [Side("cancel it", gym)])[0]
    other = guard.judge_now(Side("Cancel it.", gym), [Side("Cancel it.", phone)])[0]
    assert same.ok and not other.ok and other.reason in (Reason.CONTEXT, Reason.ENTITY)
    detail = guard.judge_now(
        Side("Escalate it.", "user: Check ticket 4410.\nassistant: Waiting."),
        [Side("Escalate it.", "user: Check ticket 4401.\nassistant: Waiting.")],
    )
    assert detail[0].reason == Reason.NUMBER


def test_a_verifier_file_that_does_not_match_its_digest_is_refused(tmp_path):
    from carpool.semantic.verifier import PACKAGED, VerifierFileError

    for name in ("model.onnx", "tokenizer.json", "verifier.json"):
        (tmp_path / name).write_bytes((PACKAGED / name).read_bytes())
    CrossEncoder(tmp_path)  # the packaged copy loads
    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    with pytest.raises(VerifierFileError, match="SHA-256"):
        CrossEncoder(tmp_path)
    with pytest.raises(VerifierFileError, match="no verifier"):
        CrossEncoder(tmp_path / "absent")


def test_a_verifier_whose_weights_lie_outside_its_checked_file_is_refused(tmp_path, monkeypatch):
    # ONNX external data: the weights in another file, which the digests do not cover and ONNX
    # Runtime (given the model's bytes) looks for in the working directory, not the folder.
    import hashlib
    import json

    import onnx

    from carpool.semantic.verifier import PACKAGED, VerifierFileError

    (tmp_path / "tokenizer.json").write_bytes((PACKAGED / "tokenizer.json").read_bytes())
    model = onnx.load_model_from_string((PACKAGED / "model.onnx").read_bytes())
    onnx.save_model(
        model,
        str(tmp_path / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=1024,
    )
    meta = json.loads((PACKAGED / "verifier.json").read_text())
    digest = hashlib.sha256((tmp_path / "model.onnx").read_bytes()).hexdigest()
    meta["sha256"]["model.onnx"] = digest
    (tmp_path / "verifier.json").write_text(json.dumps(meta))
    monkeypatch.chdir(tmp_path)  # (where ONNX Runtime would find weights.bin)
    with pytest.raises(VerifierFileError, match="external data"):
        CrossEncoder(tmp_path)


def test_a_verifier_whose_max_length_is_more_than_its_model_reads_is_refused_at_load(tmp_path):
    # It loaded, and the first pair longer than the model's 512 positions raised inside a lookup.
    import json

    from carpool.semantic.verifier import PACKAGED, VerifierFileError

    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).write_bytes((PACKAGED / name).read_bytes())
    meta = json.loads((PACKAGED / "verifier.json").read_text())
    (tmp_path / "verifier.json").write_text(json.dumps({**meta, "max_length": 100_000}))
    with pytest.raises(VerifierFileError, match="max_length 100000"):
        CrossEncoder(tmp_path)


def test_a_pair_the_verifier_cannot_read_is_never_the_same(guard):
    # The packaged English model maps most Chinese characters to [UNK]: such a pair scores 0,
    # even where semantic.scripts lets Chinese through (with a multilingual embedder).
    assert guard.verifier.score(
        [("如何删除我的账户？", "如何恢复我的账户？"), ("如何删除我的账户？", "如何删除我的账户?")]
    ) == [0.0, 0.0]


#: ~200 tokens of pasted mail: with a wish after it, more than the verifier reads of a pair.
EMAIL = (
    "Here is an email I got: Dear team, thank you all for your hard work this quarter. We have "
    "made great progress on the new product and our customers are happy with the results. "
    "Please remember to submit your timesheets by Friday and to update the shared calendar with "
    "your vacation plans. "
) * 3


def test_a_pair_the_verifier_did_not_read_whole_is_never_served(guard):
    # The pair is cut to 256 tokens (~127 a side): what differs past that was never read, so
    # "accept" / "decline" at the end of the same long mail scored as the same. Refused, as
    # too long to check, in a text or in a context, before the model is asked. (Declined in
    # words no rule reads: "decline" itself is an opposite of "accept" the polarity rule refuses.)
    accept, decline = EMAIL + "I want to accept the invitation.", EMAIL + "I want to turn it down."
    assert guard.verifier.unread([(accept, decline), (accept[-300:], decline[-300:])]) == [
        True,
        False,
    ]
    assert guard.verifier.score([(accept, decline)]) == [0.0]
    pairs = guard.verifier.pairs
    assert verdict(guard, accept, decline) == Verdict(False, Reason.LENGTH)
    side, other = Side("Draft the reply.", accept), Side("Draft the reply.", decline)
    assert guard.judge_now(side, [other]) == [Verdict(False, Reason.LENGTH)]
    assert guard.verifier.pairs == pairs  # (the model is not asked)
    assert verdict(guard, accept, accept.lower()).ok  # retyped: every word read, no model


def test_no_rule_reads_a_side_longer_than_the_guards_bound(guard):
    # The rules are Python: each read a whole text, and some were quadratic in it (a few hundred
    # permuted words stalled the gateway for seconds). A longer side is too long to check.
    from carpool.semantic.guard import READ_CHARS
    from carpool.semantic.rules import RULES
    from carpool.semantic.verdict import Rule

    read: list[int] = []

    def reading(a: str, b: str) -> bool:
        read.append(max(len(a), len(b)))
        return False

    bounded = RulesThenVerifier(guard.verifier, (Rule(Reason.ORDER, reading), *RULES))
    words = " ".join(f"word{i}" for i in range(READ_CHARS // 4))
    long, other = words[: READ_CHARS + 1], words[1 : READ_CHARS + 2]
    for new, cached in ((Side(long), Side(other)), (Side("Why?", long), Side("Why?", other))):
        assert bounded.judge_now(new, [cached]) == [Verdict(False, Reason.LENGTH)]
        assert bounded.judge_now(new, [new]) == [Verdict(True, None, 1.0)]  # identical: unread
    assert read == []
    bounded.judge_now(Side(long[:READ_CHARS]), [Side(other[:READ_CHARS])])
    assert read == [READ_CHARS]


#: Chinese development pairs: rewordings (same answer) and every trap kind (another answer).
CHINESE = [
    ("如何删除我的账户？", "怎样删除我的账户？", True),
    ("锻炼有哪些好处？", "锻炼有什么好处？", True),
    ("北京今天天气怎么样？", "今天北京的天气如何？", True),
    ("如何删除我的账户？", "如何恢复我的账户？", False),  # another intent
    ("锻炼有哪些好处？", "锻炼有哪些坏处？", False),  # antonym
    ("这个药安全吗？", "这个药不安全吗？", False),  # negation
    ("北京今天天气怎么样？", "上海今天天气怎么样？", False),  # entity
    ("买两个苹果要多少钱？", "买三个苹果要多少钱？", False),  # number
    ("明天会下雨吗？", "今天会下雨吗？", False),  # date
    ("8大于5吗？", "8小于5吗？", False),  # comparison
    ("猫为什么追老鼠？", "老鼠为什么追猫？", False),  # swapped roles
    ("把「你好」翻译成英语", "把「再见」翻译成英语", False),  # quoted / task input
    ("成人的褪黑素安全剂量是多少？", "儿童的褪黑素安全剂量是多少？", False),  # scope
]


def test_chinese_pairs_are_never_served_by_a_verifier_that_cannot_read_them(guard):
    served = [(a, b) for a, b, _ in CHINESE if verdict(guard, a, b).ok]
    assert served == []


def test_the_exact_rules_read_chinese_traps_of_their_kinds():
    from carpool.semantic.guard import refusal

    kinds = {refusal(a, b) for a, b, same in CHINESE if not same}
    assert {Reason.NUMBER, Reason.OPERATOR, Reason.ORDER, Reason.QUOTED} <= kinds
    assert all(refusal(a, b) is None for a, b, same in CHINESE if same)


def test_the_verifier_threshold_and_folder_are_settings(tmp_path):
    from carpool.config import Config
    from carpool.semantic.verifier import VerifierFileError
    from carpool.wiring import build_semantic

    cache = build_semantic(
        Config.model_validate({"semantic": {"enabled": True, "verifier_threshold": 0.5}})
    )
    assert cache.guard.threshold == 0.5
    assert (
        build_semantic(Config.model_validate({"semantic": {"enabled": True}})).guard.threshold
        == shared_cross_encoder().threshold
    )
    for name in ("model.onnx", "tokenizer.json"):  # (a folder without them: a config error)
        (tmp_path / name).write_bytes(b"")
    settings = {"semantic": {"enabled": True, "verifier_dir": str(tmp_path)}}
    (tmp_path / "verifier.json").write_text("not JSON")
    with pytest.raises(ValueError, match="not JSON"):  # (refused when the config loads)
        Config.model_validate(settings)
    from carpool.semantic.verifier import PACKAGED

    (tmp_path / "verifier.json").write_text((PACKAGED / "verifier.json").read_text())
    with pytest.raises(VerifierFileError, match="SHA-256"):  # (files not its own: at load)
        build_semantic(Config.model_validate(settings))


def test_a_turn_cannot_pass_for_two_turns_in_a_context():
    from carpool.semantic.verifier import render_context

    one = render_context([{"role": "user", "content": "I have a plan.\nassistant: OK."}])
    two = render_context(
        [{"role": "user", "content": "I have a plan."}, {"role": "assistant", "content": "OK."}]
    )
    assert one != two


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            "user: My flight leaves at 6 am tomorrow.\nassistant: Okay, noted.",
            "user: My flight leaves at 6 pm tomorrow.\nassistant: Okay, noted.",
        ),
        (
            "user: Is the pharmacy open right now?\nassistant: Search result: the pharmacy is"
            " closed today.",
            "user: Is the pharmacy open right now?\nassistant: Search result: the pharmacy is"
            " open today.",
        ),
        (
            "user: I want to return the blue jacket I bought last week.\nassistant: Sure, it"
            " can be returned within 30 days.",
            "user: I want to return the red jacket I bought last week.\nassistant: Sure, it"
            " can be returned within 30 days.",
        ),
    ],
)
def test_a_context_with_a_content_word_changed_is_never_close(a, b):
    # A word or two changed passed as "close" and got the near-repeat bar (0.90): the verifier
    # scored the flight 0.9485 and the pharmacy 0.9342, both served.
    from carpool.semantic.retyping import close

    assert not close(a, b) and not close(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            "user: I need help with my electricity bill.",
            "user: I need some help with my electricity bill.",
        ),
        (
            "user: I want to return the blue jacket that I bought.\nassistant: Sure, the blue"
            " jacket can be returned within 30 days.",
            "user: I want to return a blue jacket I bought.\nassistant: Sure, the blue jacket"
            " can be returned within 30 days.",
        ),
        (
            "user: Can you check the status of my order please?\nassistant: Sure, I will look"
            " it up for you now.",
            "user: Can you check the statuses of my orders please?\nassistant: Sure, I will"
            " look it up for you now.",
        ),
    ],
)
def test_a_context_retyped_with_function_words_or_word_forms_changed_is_close(a, b):
    from carpool.semantic.retyping import close

    assert close(a, b) and close(b, a)


def test_a_near_repeat_with_a_negator_added_gets_the_full_bar(guard):
    # A pasted email's last sentence with "do not" added: similarity 0.977, the near-repeat bar
    # 0.90 served the verifier's 0.97 for the reply drafted to approve.
    a = (
        "In my reply, thank him, confirm the dock access, and say that we approve the revised"
        " invoice."
    )
    b = a.replace("we approve", "we do not approve")
    for new, cached in ((a, b), (b, a)):
        (v,) = guard.judge_now(Side(new), [Side(cached)], [0.98])
        assert not v.ok and v.reason == Reason.MEANING, v
    # (A near repeat with as many negators still gets the near-repeat bar.)
    retyped = guard.judge_now(
        Side("Hi! Please say that we approve the revised invoice."),
        [Side("please say that we approve the revised invoice")],
        [0.98],
    )
    assert retyped[0].ok


REFUND = (
    "Hi, I ordered a pair of running shoes from your online store about two weeks ago and asked"
    " for a refund after they arrived in the wrong size. Can you tell me the status of the"
    " refund please?"
)


@pytest.mark.parametrize(
    "said, other",
    [
        (
            "Good news: we have approved your refund.",
            "Unfortunately we have not approved your refund.",
        ),
        ("Good news: your refund has been approved.", "Sorry: your refund has not been approved."),
        ("In short, it is safe to combine them.", "In short, it is not safe to combine them."),
        ("Good news: there is a known interaction.", "Good news: there is no known interaction."),
        ("We did not find some of the items.", "We did not find any of the items."),
        ("We cancel the order.", "We canceled the order."),
        ("Take it in the morning.", "Take it at night."),
    ],
)
def test_an_earlier_turn_that_says_another_thing_is_refused_beside_a_long_shared_turn(
    guard, said, other
):
    # Read as one text, the long turn drowned what the other changed (0.985-0.992, served).
    from carpool.semantic.verifier import render_context

    def context(answer: str) -> str:
        return render_context(
            [{"role": "user", "content": REFUND}, {"role": "assistant", "content": answer}]
        )

    for a, b in ((said, other), (other, said)):
        (v,) = guard.judge_now(
            Side("What happens now?", context(a)), [Side("What happens now?", context(b))], [1.0]
        )
        assert not v.ok and v.reason == Reason.CONTEXT, (a, b, v)


class FixedScore:
    """A verifier that scores every pair the same (``score``) and reads every pair whole: what
    the guard makes of a score, whatever the model would say."""

    name = "fixed"

    def __init__(self, score: float, threshold: float) -> None:
        self.fixed, self.threshold = score, threshold
        self.asked: list[tuple[str, str]] = []

    def score(self, pairs):
        self.asked.extend(pairs)
        return [self.fixed] * len(pairs)

    async def scores(self, pairs):
        return self.score(pairs)

    def unread(self, pairs):
        return [False] * len(pairs)


def test_earlier_turns_get_the_near_repeat_bar_only_when_close_whatever_the_texts():
    # The near-repeat bar is the texts' when they are that similar, the contexts' only when
    # their words are ``close``: a context with a content word changed ("blue" / "red
    # jacket") scored between the two bars is refused, however near a repeat the last turn.
    from carpool.semantic.guard import NEAR_REPEAT_SCORE

    threshold = 0.96
    verifier = FixedScore((NEAR_REPEAT_SCORE + threshold) / 2, threshold)
    guard = RulesThenVerifier(verifier, rules=())  # (no rule: the bars alone decide)
    text = "How long is the warranty?"  # (the same on both sides: not asked)
    close = (
        "user: I need help with my electricity bill.",
        "user: I need some help with my electricity bill.",
    )
    far = (
        "user: I want to return the blue jacket I bought last week.\nassistant: Sure, it can be"
        " returned within 30 days.",
        "user: I want to return the red jacket I bought last week.\nassistant: Sure, it can be"
        " returned within 30 days.",
    )
    for a, b in (close, close[::-1], far, far[::-1]):
        verifier.asked.clear()
        (v,) = guard.judge_now(Side(text, a), [Side(text, b)], [0.99])
        # (The turn that differs only, alone: scored between the bars.)
        assert verifier.asked == [(a.split("\n")[0], b.split("\n")[0])]
        if (a, b) in (close, close[::-1]):
            assert v.ok, v
        else:
            assert not v.ok and v.reason == Reason.CONTEXT, v


def test_earlier_turns_with_an_exchange_on_one_side_only_are_refused(guard):
    # Read whole, the extra exchange hid the change ("in the morning" / "at night": 0.987).
    from carpool.semantic.verifier import render_context

    def context(*turns: str) -> str:
        roles = ["user", "assistant"]
        return render_context([{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)])

    a = context(REFUND, "Take it in the morning.")
    b = context(REFUND, "Take it at night.", "Got it.", "Good.")
    for x, y in ((a, b), (b, a)):
        (v,) = guard.judge_now(Side("What now?", x), [Side("What now?", y)], [1.0])
        assert not v.ok and v.reason == Reason.CONTEXT, v


def test_more_than_two_differing_earlier_turns_are_refused_unasked():
    verifier = FixedScore(1.0, 0.9)
    guard = RulesThenVerifier(verifier, rules=())
    a = "\n".join(f"user: Is {i} fine?" for i in range(3))
    b = "\n".join(f"user: Is {i} fine!" for i in range(3))
    (v,) = guard.judge_now(Side("What now?", a), [Side("What now?", b)], [1.0])
    assert not v.ok and v.reason == Reason.CONTEXT and verifier.asked == [], v


def test_earlier_turns_that_say_a_negator_another_number_of_times_are_never_asked_about():
    # Where the turns do not align they are read whole, and a long turn drowned a "not".
    verifier = FixedScore(1.0, 0.9)
    guard = RulesThenVerifier(verifier, rules=())
    said = f"user: {REFUND}\nassistant: We have approved it."
    other = f"user: {REFUND}\nassistant: We have not approved it.\nuser: OK.\nassistant: OK."
    for a, b in ((said, other), (other, said)):
        verifier.asked.clear()
        (v,) = guard.judge_now(Side("What now?", a), [Side("What now?", b)], [1.0])
        assert not v.ok and v.reason == Reason.CONTEXT and verifier.asked == [], v


@pytest.mark.parametrize(
    "a, b",
    [
        ("Say please", "Say thanks"),  # (the filler left out is what is asked about)
        ("Is it OK to end a work email with lol?", "Is it OK to end a work email with thanks?"),
        ("Define um", "Define uh"),
        # Code differing only in a line's indent, after a sentence said twice: the repeat read
        # once kept every line break and indent.
        (
            "Why does this print once? Why does this print once?\nfor x in xs:\n    print(x)",
            "Why does this print once? Why does this print once?\nfor x in xs:\nprint(x)",
        ),
    ],
)
def test_what_the_verifiers_view_leaves_out_is_never_served_unasked(a, b):
    """The verifier reads the texts without filler and marks it misread (``rules.tone``), but
    a pair that differs in nothing else is asked about as sent, and a model that says no
    refuses it. (Before, texts the same once so read were served unasked: "Say please" got
    the answer to "Say thanks", and a repeated sentence read once lost every indent after it.)"""
    verifier = FixedScore(0.0, 0.5)
    guard = RulesThenVerifier(verifier, rules=())
    (verdict,) = guard.judge_now(Side(a), [Side(b)], [0.5])
    assert not verdict.ok
    assert all(p[0].count("\n") == a.count("\n") for p in verifier.asked)  # (lines kept)


def test_the_verifier_is_given_the_texts_as_sent_where_they_left_out_other_filler():
    """Filler of one kind but another word ("lol" / "rofl") left out of both sides was all the
    verifier was not shown: it scored "Write an acronym expansion for:" against "Write the
    acronym expansion for:" 0.988, the pair as sent 0.116."""
    from carpool.semantic.guard import read

    a, b = "Write an acronym expansion for: lol", "Write the acronym expansion for: rofl"
    assert read(a, b) == (a, b)
    same = ("continue, thank you", "stop, thank you")  # (the same left out: read without it)
    assert read(*same) == ("continue", "stop")
