"""The relations rule (carpool.semantic.rules.relations): whose relative a question asks about.

The examples are a review's traps (served before: "my wife's brother" / "my brother's wife"
scored 0.99) and rewordings of the same relation that must pass. Every check runs both ways.
"""

from __future__ import annotations

import pytest

from carpool.semantic.guard import READ_CHARS, refusal
from carpool.semantic.rules import order, relations
from carpool.semantic.verdict import Reason


def passes(a: str, b: str) -> bool:
    assert relations.RULE.differs(a, b) == relations.RULE.differs(b, a), (a, b)
    return not relations.RULE.differs(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("What do I call my wife's brother?", "What do I call my brother's wife?"),
        ("What should I get my boss's boss for her retirement?", "What should I get my boss?"),
        ("What is my cousin's daughter to me?", "What is my daughter's cousin to me?"),
        (
            "How do I write a thank-you note to my friend's parents?",
            "How do I write a thank-you note to my parents' friend?",
        ),
        ("Can my employer's client contact me?", "Can my client's employer contact me?"),
        (
            "How do I get my landlord's approval for a pet?",
            "How do I get my landlord's landlord's approval for a pet?",
        ),
        ("Who was Queen Victoria's grandmother?", "Who was Queen Victoria's granddaughter?"),
        ("What's the name of Zeus's father's father?", "What's the name of Zeus's father?"),
        ("Is my husband's ex-wife's son related to me?", "Is my husband's son related to me?"),
        ("Who was the wife of Henry VIII's son?", "Who was the son of Henry VIII's wife?"),
        ("In Git, what is the parent of HEAD's parent?", "In Git, what is the parent of HEAD?"),
        ("Is my stepmother's daughter my sister?", "Is my mother's stepdaughter my sister?"),
        ("Who is my nephew's mother to me?", "Who is my nephew's father to me?"),
    ],
)
def test_relations_another_relative_through_a_possessive_is_refused(a, b):
    assert not passes(a, b)
    assert refusal(a, b) is not None and refusal(b, a) is not None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            "What should I get my manager's manager as a farewell gift?",
            "What would be a good farewell gift for my manager's manager?",
        ),
        ("What do you call your father's brother?", "What is the name for your father's brother?"),
        ("Who was Queen Victoria's grandmother?", "Who was the grandmother of Queen Victoria?"),
        (
            "What is the parent of a node's child in a binary tree?",
            "In a binary tree, what is the parent of the child of a node?",
        ),
        ("What should I buy my girlfriend's mom?", "What should I buy my girlfriend's mother?"),
        ("Who was Rome's first emperor?", "Who was the first emperor of Rome?"),
        # No possessive on either side: relatives named otherwise are the verifier's.
        ("How do I talk to my boss?", "How do I talk to my manager about it?"),
    ],
)
def test_relations_the_same_relation_reworded_passes(a, b):
    assert passes(a, b)


def test_order_an_owner_and_what_it_owns_exchanged_are_refused():
    # "the solvent's solute" / "the solute's solvent": the possessive kept, so the exchange of
    # two neighbours is read (it was dropped, and neighbours exchanged pass).
    for a, b in (
        (
            "What's the boiling point of the solvent's solute?",
            "What's the boiling point of the solute's solvent?",
        ),
        ("Who designed the company's logo?", "Who designed the logo's company?"),
    ):
        assert order.RULE.differs(a, b) and order.RULE.differs(b, a), (a, b)
    assert not order.RULE.differs("Who designed the logo?", "Who designed the company's logo?")


def test_relations_names_its_own_reason():
    a, b = "What do I call my wife's brother?", "What do I call my brother's wife?"
    assert refusal(a, b) in (Reason.ORDER, Reason.RELATION)
    assert relations.RULE.reason == Reason.RELATION


class _CountedWords(list[str]):
    """The words of a text, counting each time one is read by its place."""

    reads = 0

    def __getitem__(self, i):  # type: ignore[override]
        _CountedWords.reads += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("unit", ["Ex Of ", "Mom Of ", "Dad Of My ", "mother of the Queen "])
def test_relations_read_each_word_a_few_times_however_long_the_text(monkeypatch, unit):
    # "R of" before a run of capitalised words walked the whole run for each "R of" in it:
    # quadratic, 100-270 ms on a side of READ_CHARS. Each word is read a bounded number of times.
    pattern = relations._WORD

    class Counting:
        def findall(self, text):
            return _CountedWords(pattern.findall(text))

    monkeypatch.setattr(relations, "_WORD", Counting())
    relations._read.cache_clear()
    text = (unit * READ_CHARS)[: READ_CHARS - 1]
    _CountedWords.reads = 0
    relations.RULE.differs(text, text + "!")
    words = len(pattern.findall(text))
    assert _CountedWords.reads <= 8 * words, (_CountedWords.reads, words)
