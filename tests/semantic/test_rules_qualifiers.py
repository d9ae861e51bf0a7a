"""The qualifier rule (carpool.semantic.rules.qualifiers): a small edit of how many, on what
condition, must or may, when, how much, in what form.

The traps are a review's (served before, scored 0.97-0.99); the rewordings are of the kinds the
development pairs hold, which the rule must let through. Every check runs both ways.
"""

from __future__ import annotations

import pytest

from carpool.semantic.guard import refusal
from carpool.semantic.rules import polarity, qualifiers
from carpool.semantic.verdict import Reason


def passes(a: str, b: str) -> bool:
    assert qualifiers.RULE.differs(a, b) == qualifiers.RULE.differs(b, a), (a, b)
    return not qualifiers.RULE.differs(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # how many
        ("Do all vaccines contain live virus?", "Do some vaccines contain live virus?"),
        ("Do all countries in the EU use the euro?", "Do most countries in the EU use the euro?"),
        ("Do few people survive pancreatic cancer?", "Do many people survive pancreatic cancer?"),
        ("Do both parents need to sign?", "Does either parent need to sign?"),
        ("Is it always true that p is odd?", "Is it sometimes true that p is odd?"),
        ("Write a regex for strings of only digits.", "Write a regex for strings of digits."),
        ("Are only mushrooms fungi?", "Are mushrooms only fungi?"),
        # on what condition
        (
            "Will the flight be refunded if it is cancelled?",
            "Will the flight be refunded unless it is cancelled?",
        ),
        ("Is aspirin safe even if they have asthma?", "Is aspirin safe only if they have asthma?"),
        (
            "Can I use a card abroad provided I notify my bank?",
            "Can I use a card abroad if I don't notify my bank?",
        ),
        (
            "Write a loop that sums numbers but skips multiples of 3.",
            "Write a loop that sums numbers but only multiples of 3.",
        ),
        # must, may, should, will
        ("Must a primary key be unique?", "Can a primary key be unique?"),
        ("Are cyclists required to wear helmets?", "Are cyclists allowed to wear helmets?"),
        ("Should I take ibuprofen now?", "Can I take ibuprofen now?"),
        ("Will I have to pay capital gains tax?", "Might I have to pay capital gains tax?"),
        # when
        ("Was Pluto a planet?", "Is Pluto a planet?"),
        # A settled fact asked in another tense is refused too: no word tells it from Pluto's.
        (
            "What were the main causes of the French Revolution?",
            "What are the main causes of the French Revolution?",
        ),
        (
            "Who was the first person to walk on the moon?",
            "Who will be the first to walk on the moon?",
        ),
        ("Is it going to rain tomorrow?", "Was it going to rain tomorrow?"),
        ("How did Rome change during the Republic?", "How did Rome change after the Republic?"),
        ("What did the Fed do last month?", "What will the Fed do next month?"),
        # A review's: "am" was no tense to the rule (0.9925, served); nor a contracted "be".
        (
            "I am a US citizen. Do I need a visa for Canada?",
            "I was a US citizen. Do I need a visa for Canada?",
        ),
        (
            "I'm a US citizen. Do I need a visa for Canada?",
            "I was a US citizen. Do I need a visa for Canada?",
        ),
        ("It's a public holiday in Ireland today?", "It was a public holiday in Ireland today?"),
        ("They're hoping to win the league, right?", "They were hoping to win the league, right?"),
        # "do" asks of a time too, against "did" (a family of its own).
        ("Does my card work abroad?", "Did my card work abroad?"),
        ("How much did a stamp cost?", "How much does a stamp cost?"),
        # A third review's: "did" against "will" (past, future) passed, and negated or "'ve"
        # contractions were no tense.
        ("Did the Fed raise interest rates?", "Will the Fed raise interest rates?"),
        ("Doesn't Apple make phones?", "Didn't Apple make phones?"),
        ("Didn't the Fed raise interest rates?", "Won't the Fed raise interest rates?"),
        (
            "I've been a citizen since 2010. Do I need a visa?",
            "I was a citizen since 2010. Do I need a visa?",
        ),
        # A polite past is a first person's only.
        (
            "The Democrats were hoping to win the Senate. Why?",
            "The Democrats are hoping to win the Senate. Why?",
        ),
        # how much
        ("Is my coffee too hot to drink at 70 C?", "Is my coffee hot enough to drink at 70 C?"),
        ("Is the bread slightly underbaked?", "Is the bread badly underbaked?"),
        # in what form
        ("Compare Python and Java as a table.", "Compare Python and Java as a bulleted list."),
        (
            "Tell me about black holes in three bullet points.",
            "Tell me about black holes in three paragraphs.",
        ),
        # A review's (0.97-0.99, served): "ever", "generally", "typically", "possible",
        # "necessary", "optional" and how long an answer is were in no family.
        ("Is it usually safe to eat raw cookie dough?", "Is it ever safe to eat raw cookie dough?"),
        ("Is it generally safe to drink tap water?", "Is it ever safe to drink tap water?"),
        ("Is it always okay to lie to children?", "Is it ever okay to lie to children?"),
        (
            "Is it required to get a permit to build a shed?",
            "Is it possible to get a permit to build a shed?",
        ),
        ("Is it mandatory to vote in Brazil?", "Is it optional to vote in Brazil?"),
        ("Is a visa necessary for Peru?", "Is a visa optional for Peru?"),
        ("Explain recursion briefly", "Explain recursion in detail"),
        ("Explain how DNS works in a nutshell", "Explain how DNS works step by step"),
    ],
)
def test_qualifiers_a_small_edit_of_a_qualifier_is_refused(a, b):
    assert not passes(a, b)
    assert refusal(a, b) is not None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Are all mammals warm-blooded?", "Is every mammal warm-blooded?"),
        ("Must I file a tax return?", "Do I have to file a tax return?"),
        ("Do you need a license to fly a drone?", "Is a license needed to fly a drone?"),
        ("Should I go to work if I have a fever?", "If I have a fever, should I go to work?"),
        # Phrases that are no qualifier, measured refusing true rewordings.
        ("What are the best jokes ever?", "What are the all time best jokes?"),
        ("How do I stop dreaming at all?", "How do I stop dreaming?"),
        ("What are some interesting facts about NASA?", "What are the most interesting facts?"),
        ("What is the 4th dimension?", "What exactly is the 4th dimension?"),
        ("How should I lose weight from my face?", "How can I lose fat from my face?"),
        ("No, it doesn't exist in v2.10.0.", "It is not available in v2.10.0."),
        ("What art print might complement a poster?", "What art print could complement a poster?"),
        # Another class added on one side only, or a longer rewording: the verifier's.
        ("Can I take the bus for free?", "Can I really take the bus for free?"),
        # A polite past is the present ("I was wondering" asks now), and "do" / "did" carry no
        # tense of their own to the rule (a review: read as tenses, "Did the Beatles ever
        # play in Japan?" / "Have the Beatles ever played..." and "Does coffee dehydrate
        # you?" / "Will coffee..." were refused, true rewordings).
        (
            "I was wondering if you could explain how compound interest works.",
            "I am wondering if you could explain how compound interest works.",
        ),
        ("I was hoping you could recommend a book.", "I am hoping you could recommend a book."),
        # ("just" between them read the polite past as a tense: refused.)
        (
            "I was just wondering how to reset my router?",
            "I'm just wondering how to reset my router?",
        ),
        ("Did the Beatles ever play in Japan?", "Have the Beatles ever played in Japan?"),
        ("Does coffee dehydrate you?", "Will coffee dehydrate you?"),
        ("Is a will required in Texas?", "In Texas, what do I legally need to write a will?"),
        # (One side alone: "ever", "possible" and "briefly" are no question by themselves.)
        ("Have you ever been to Paris?", "Have you been to Paris?"),
        ("Is it possible to learn Python in a month?", "Can I learn Python in a month?"),
        ("Explain recursion briefly", "Explain recursion"),
        ("Is it generally safe to fly?", "Is it usually safe to fly?"),
        # A class said twice is said once (a review: refused, 0.99 to the verifier).
        (
            "Has anyone ever climbed Everest without oxygen?",
            "Has anybody climbed Everest without oxygen?",
        ),
        ("Does anybody ever read the terms of service?", "Does anyone read the terms of service?"),
        ("Do most people generally prefer tea?", "Do people usually prefer tea?"),
    ],
)
def test_qualifiers_the_same_qualifier_reworded_passes(a, b):
    assert passes(a, b)


def test_qualifiers_names_its_own_reason():
    assert refusal("Do all snakes lay eggs?", "Do any snakes lay eggs?") == Reason.QUALIFIER


def test_polarity_over_against_under_is_refused():
    a = "Is inheritance taxed if the estate is under the threshold?"
    b = "Is inheritance taxed if the estate is over the threshold?"
    assert polarity.RULE.differs(a, b) and polarity.RULE.differs(b, a)


@pytest.mark.parametrize("words", [50, 700])
def test_qualifiers_read_only_the_edit_however_long_the_text(monkeypatch, words):
    # difflib is quadratic: only the edit and its margin are compared (700 repeated words took
    # 60 ms whole).
    seen: list[int] = []
    matcher = qualifiers.difflib.SequenceMatcher

    def counting(junk, a, b, autojunk=False):
        seen.append(max(len(a), len(b)))
        return matcher(junk, a, b, autojunk=autojunk)

    monkeypatch.setattr(qualifiers.difflib, "SequenceMatcher", counting)
    text = " ".join(["word"] * words)
    assert qualifiers.RULE.differs(text + " for all of them?", text + " for some of them?")
    assert seen and max(seen) <= qualifiers.SPAN + 2 * qualifiers.MARGIN


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("How much water should I drink every day?", "How much water should I drink each day?"),
        ("How much water should I drink per day?", "How much water should I drink every day?"),
        ("Should I brush my teeth after every meal?", "Should I brush my teeth after each meal?"),
        ("Is every employee entitled to sick leave?", "Is each employee entitled to sick leave?"),
        ("Are all employees entitled to sick leave?", "Is each employee entitled to sick leave?"),
    ],
)
def test_qualifiers_each_and_per_are_every(a, b):
    assert passes(a, b)
    assert refusal(a, b) is None


def test_qualifiers_each_against_another_quantifier_is_refused():
    for a, b in (
        ("Is none of the noble gases reactive?", "Is each of the noble gases reactive?"),
        ("Does each parent need to sign?", "Do both parents need to sign?"),
        ("Does each parent need to sign?", "Does either parent need to sign?"),
    ):
        assert not passes(a, b), (a, b)


def test_qualifiers_just_is_only():
    a = "Do I need a visa if I am only staying for a week?"
    b = "Do I need a visa if I am just staying for a week?"
    assert passes(a, b)
    assert refusal(a, b) is None
    # "just" alone is often "simply" ("Can I just leave?"): unlike "only", the verifier's; and
    # so against another quantifier (a development rewording, refused when "just" was "only").
    assert passes("Can I just leave the car here?", "Can I leave the car here?")
    assert passes(
        "Is this the real life or is this some fantasy?",
        "Is this the real life, or is this just fantasy?",
    )
    assert not passes("Can I only leave the car here?", "Can I leave the car here?")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Will it rain tomorrow in Paris?", "Is it going to rain tomorrow in Paris?"),
        ("Who will win the next football World Cup?", "Who is going to win the next World Cup?"),
        ("Are prices going to rise next year?", "Will prices rise next year?"),
        ("What will happen to the pound?", "What's going to happen to the pound?"),
    ],
)
def test_qualifiers_be_going_to_is_the_future_as_will_is(a, b):
    assert passes(a, b)
    assert refusal(a, b) is None


def test_qualifiers_a_perfect_infinitive_is_the_past():
    # "to have walked" sets the time: "is the first to have walked" asks what "was" asks.
    a = "Who was the first person to walk on the moon?"
    b = "Who is the first person to have walked on the moon?"
    assert passes(a, b)
    assert refusal(a, b) is None
    # "to have" before a noun is no perfect: the tense is read as written.
    assert not passes("Was it required to have a visa?", "Is it required to have a visa?")
