"""rules/tone.py: emoticons match exactly; the verifier reads the texts without marks it misread."""

from __future__ import annotations

import pytest

from carpool.semantic.rules import RULES
from carpool.semantic.rules.tone import RULE, emoticons, reading
from carpool.semantic.verdict import Reason


@pytest.mark.parametrize(
    "text, found",
    [
        ("Explain machine learning :)", {":)": 1}),
        ("ok :-))) and :D", {":)": 1, ":D": 1}),
        ("thanks:)", {":)": 1}),
        ("xDDD so funny", {"xd": 1}),
        ("I <333 it ^__^", {"<3": 1, "^_^": 1}),
        # Not emoticons: a ratio, a time, a colon before a bracket, a URL, a list item.
        ("Is 3:3) a typo? Note:(a) at 8:00 on http://x.org", {}),
        ("Steps: 8) cool", {}),
        ("bread^_^ and yay (: \\o/", {"^_^": 1, "(:": 1, "\\o/": 1}),
    ],
)
def test_emoticons_are_read_as_eyes_and_mouth(text, found):
    assert dict(emoticons(text)) == found


@pytest.mark.parametrize(
    "text, read",
    [
        ("Explain machine learning!", "Explain machine learning."),
        ("What?! No!!!", "What? No."),
        ("Really??", "Really?"),
        ("Is x != y?!", "Is x != y?"),  # (an operator is not a mark)
        ('He said "wow!" then left', 'He said "wow." then left'),
        ("Explain ML :) lol pls", "Explain ML"),
        ("haha so :)", "so"),
        ("def f():\n    return 1  # :)", "def f():\n    return 1  #"),
        ("Why is it followed by ...?", "Why is it followed by ...?"),  # (an ellipsis stays)
        # An ellipsis after a word is a sentence's end.
        ("How do I bake bread...", "How do I bake bread."),
        ("How do I bake bread…", "How do I bake bread."),
        ("Why?... Really!..", "Why? Really."),
        ("I wonder... why", "I wonder. why"),
        ("Use a..b or x.y", "Use a..b or x.y"),  # (no mark: a range, a member)
        ("Is it the U.S.?", "Is it the U.S.?"),  # (an abbreviation's full stop stays)
        # Marks apart from the word at the text's end, "!!1" after "!!".
        ("How do I bake bread !!!", "How do I bake bread."),
        ("How do I bake bread ?!", "How do I bake bread?"),
        ("How do I bake bread!!1", "How do I bake bread."),
        ("What does !! do", "What does !! do"),  # (inside: what is asked about)
        ("How do I bake bread!!!1!", "How do I bake bread."),
        ("How do I bake bread!1!1", "How do I bake bread."),
        ("How do I bake bread!!11!!", "How do I bake bread."),
        ("How do I bake bread ! ! !", "How do I bake bread."),
        ("Is x!1 true", "Is x!1 true"),  # (one "!" before a one: not a mark)
        ("( If any )", "( If any )"),  # (brackets stay)
        ("lol", "lol"),  # (nothing would be left: as sent)
        ("continue, thank you", "continue"),
        ("Please summarize it. Thanks in advance!", "summarize it."),
        ("hmm, what is DNS?", "what is DNS?"),
        ("What does 'please' mean?", "What does 'please' mean?"),  # (quoted: a word asked about)
        ("Explain it? Explain it?", "Explain it?"),
        ("Why? Why? Why?", "Why?"),
        # Filler inside a clause is what is asked about: kept.
        ("Is it rude to say lol in a work email?", "Is it rude to say lol in a work email?"),
        ("Can I write pls to my boss?", "Can I write pls to my boss?"),
        ("Could you please explain it?", "Could you please explain it?"),
        ("How do I reset it lol", "How do I reset it"),
    ],
)
def test_the_verifier_reads_the_text_without_marks_it_misread(text, read):
    assert reading(text).text == read


def test_emoticons_differ_as_a_multiset_and_the_rule_is_last():
    assert RULE.reason is Reason.TONE and RULES[-1] is RULE
    assert RULE.differs("I got the job :)", "I got the job :(")
    assert RULE.differs("Explain it :)", "Explain it")
    assert RULE.differs("Explain it :) :)", "Explain it :)")
    assert not RULE.differs("Explain it :-)", "explain it :)")  # (a nose is no other face)
    assert not RULE.differs("Explain it!", "Explain it lol")  # (marks and filler are not read)
    assert RULE.differs("How do I type :'( on a keyboard?", "How do I type :( on a keyboard?")
    # Filler of other kinds on both sides: a word swapped, which the verifier does not read.
    assert RULE.differs("Japanese for thanks?", "Japanese for please?")
    assert RULE.differs(
        "Should I start my email with lol", "Should I begin my email with thank you"
    )
    assert RULE.differs("Is it rude to text back ok", "Is it rude to text back thanks")
    assert not RULE.differs("Thanks! How do I reset it?", "thank you so much, how can I reset it")
    # Of one kind but other words, when that is all they differ in (the model cannot count).
    assert RULE.differs("How many letters are in: thanks", "How many letters are in: thank you")
    assert RULE.differs("How many letters are in: please", "How many letters are in: pls")
    assert RULE.differs(
        "What does this mean: thanks. Please answer in French.",
        "What does this mean: please. Thanks, answer in French.",
    )
    assert not RULE.differs("How do I reset it please", "How do I reset it")  # (one side)
