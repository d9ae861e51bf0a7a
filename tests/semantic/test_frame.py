"""frame.py: a pair's core, and the verifier scoring it where shared wording drowned a word."""

from __future__ import annotations

import pytest

from carpool.semantic.frame import core, turns
from carpool.semantic.verifier import render_context


@pytest.mark.parametrize(
    "a, b, cut",
    [
        (
            "Hey there, how do I bake bread?",
            "Hey there, how do I bake cake?",
            ("how do I bake bread?", "how do I bake cake?"),
        ),
        (
            "How do I bake bread? Answer briefly.",
            "How do I bake cake? Answer briefly.",
            ("How do I bake bread?", "How do I bake cake?"),
        ),
        (
            "hey there how do i bake bread",
            "hey there how do i bake cake",
            ("how do i bake bread", "how do i bake cake"),
        ),
        (
            "Question: why do cats purr?",
            "Question: why do cats hiss?",
            ("why do cats purr?", "why do cats hiss?"),
        ),
    ],
)
def test_the_core_is_the_pair_without_its_shared_edges(a, b, cut):
    assert core(a, b) == cut


@pytest.mark.parametrize(
    "a, b",
    [
        ("How do I bake bread?", "How do I bake cake?"),  # (no shared edge: scored as sent)
        ("Hey there, how do I bake bread?", "Hey there, how do I bake bread?"),  # (the same)
        # More than one word apart: read without its context, a rewording lost it.
        ("Hey, my girlfrien just left me. What now?", "Hey, my girlfriend left me. What do I do?"),
        ("Hey there, how do I bake bread?", "Hey there, how do I bake breads?"),  # (a word form)
        ("Hey there, how do I bake the bread?", "Hey there, how do I bake a bread?"),  # (function)
    ],
)
def test_there_is_no_core_but_one_content_word_apart_inside_shared_edges(a, b):
    assert core(a, b) is None


def test_the_verifier_scores_a_pair_as_its_core_where_that_is_lower():
    pytest.importorskip("onnxruntime")
    from carpool.semantic.verifier import CrossEncoder

    verifier = CrossEncoder()
    framed = [
        ("Hey there, how do I bake bread?", "Hey there, how do I bake cake?"),
        ("Hello! Why do cats purr?", "Hello! Why do cats hiss?"),
        ("hey there how do i bake bread", "hey there how do i bake cake"),
        ("Question: how do I train puppies?", "Question: how do I train kittens?"),
    ]
    assert max(verifier.score(framed)) < verifier.threshold
    # A rewording in a shared frame is still the same.
    (kept,) = verifier.score(
        [("Question: why are dogs afraid of thunder?", "Question: why are dogs scared of thunder?")]
    )
    assert kept >= verifier.threshold


@pytest.mark.parametrize(
    "a, b",
    [
        ("Hello how do cats purr?", "Hello (how do cats hiss?)"),
        ("Hey there, how do I bake bread?", "Hey there, how do I bake cake?"),
        ("hey there how do i bake bread", "hey there how do i bake cake"),
    ],
)
def test_the_core_is_the_same_whichever_side_is_asked(a, b):
    """(A question word on one side only, "how" / "(how", was cut at in one order: a verdict
    that was not symmetric, the answer to "...purr?" served for "...hiss?" one way round.)"""
    swapped = core(b, a)
    assert core(a, b) == (None if swapped is None else swapped[::-1])


def _context(*turns: tuple[str, str]) -> str:
    return render_context([{"role": role, "content": content} for role, content in turns])


def test_aligned_turns_are_read_one_differing_turn_at_a_time():
    # Read as one text, a long shared turn drowned a change in another ("safe" / "risky",
    # "in the morning" / "at night": 0.985-0.992 served; alone 0.01-0.06).
    a = _context(("user", "I ordered shoes.\nThey do not fit."), ("assistant", "It is safe."))
    b = _context(("user", "I ordered shoes.\nThey do not fit."), ("assistant", "It is risky."))
    assert turns(a, b) == [("assistant: It is safe.", "assistant: It is risky.")]
    assert turns(b, a) == [("assistant: It is risky.", "assistant: It is safe.")]
    c = _context(("user", "I ordered boots.\nThey do not fit."), ("assistant", "It is not safe."))
    assert turns(a, c) == [
        (
            "user: I ordered shoes.\n  They do not fit.",
            "user: I ordered boots.\n  They do not fit.",
        ),
        ("assistant: It is safe.", "assistant: It is not safe."),
    ]


def test_more_than_two_differing_turns_are_never_read():
    # (A pair a turn: 280 turns a mark apart made 2,240 model runs of one lookup, 3.8 s.)
    many = _context(*[("user", f"Is {i} fine?") for i in range(3)])
    other = _context(*[("user", f"Is {i} fine!") for i in range(3)])
    assert turns(many, other) is None
    two = _context(("user", "Is 0 fine!"), ("user", "Is 1 fine!"), ("user", "Is 2 fine?"))
    assert turns(many, two) == [
        ("user: Is 0 fine?", "user: Is 0 fine!"),
        ("user: Is 1 fine?", "user: Is 1 fine!"),
    ]


def test_turns_that_do_not_align_are_never_read():
    # Read whole, an extra exchange hid a change in another turn ("take it in the morning" /
    # "...at night" and "ok" / "Great." after it: 0.987, served).
    a = _context(("user", "Hi."), ("assistant", "It is safe."))
    more = _context(("user", "Hi."), ("assistant", "It is safe."), ("user", "And?"))
    swapped = _context(("assistant", "Hi."), ("user", "It is safe."))
    assert turns(a, more) is None
    assert turns(a, swapped) is None
