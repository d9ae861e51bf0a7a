"""The unread rule (carpool.semantic.rules.unread): another language's negation in an English
text. The traps are a review's (served before, 0.98-0.99); every check runs both ways."""

from __future__ import annotations

import pytest

from carpool.semantic.guard import refusal
from carpool.semantic.rules import unread


def passes(a: str, b: str) -> bool:
    assert unread.RULE.differs(a, b) == unread.RULE.differs(b, a), (a, b)
    return not unread.RULE.differs(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # a negator of another language on one side
        (
            "The receptionist answered tu peux, is that a yes?",
            "The receptionist answered tu ne peux pas, is that a yes?",
        ),
        (
            "My landlord texted me puoi, can I get a dog?",
            "My landlord texted me non puoi, can I get a dog?",
        ),
        (
            "The sign says boleh merokok, can I smoke here?",
            "The sign says tidak boleh merokok, can I smoke here?",
        ),
        (
            "The sign says duoc hut thuoc, can I smoke here?",
            "The sign says khong duoc hut thuoc, can I smoke here?",
        ),
        (
            "The sign at the pool says dai, is swimming allowed?",
            "The sign at the pool says mai dai, is swimming allowed?",
        ),
        # "no" before a word no English word is, which both sides say
        ("He said se puede, is that a yes?", "He said no se puede, is that a yes?"),
        ("She answered sí puedes, did she say yes?", "She answered no puedes, did she say yes?"),
        # Swedish, Norwegian, Dutch (a review: served, 0.99)
        (
            "The sign says hundar tillåtna, can I walk my dog?",
            "The sign says hundar inte tillåtna, can I walk my dog?",
        ),
        ("The sign says ikke røyk, can I smoke?", "The sign says røyk, can I smoke?"),
        (
            "He told me honden toegestaan, can I bring mine?",
            "He told me geen honden toegestaan, can I bring mine?",
        ),
        # an ending that says yes or no
        (
            "The sign says sigara içilmez, can I smoke here?",
            "The sign says sigara içilir, can I smoke here?",
        ),
        ("What does park yapılmaz mean on a sign?", "What does park yapılır mean on a sign?"),
        (
            "The sign at the pool says dekimasu, is swimming allowed?",
            "The sign at the pool says dekimasen, is swimming allowed?",
        ),
        ("My filipino friend said hindi pwede", "My filipino friend said pwede"),  # (Tagalog)
        # Turkish's "-m-": one letter, no typo (a review: 9 of 30 such pairs served, 0.98-0.99)
        (
            "The sign says biliyorum, what does it mean?",
            "The sign says bilmiyorum, what does it mean?",
        ),
        (
            "My Turkish friend texted seviyorum, does she love me?",
            "My Turkish friend texted sevmiyorum, does she love me?",
        ),
        # A text's first "no" before a foreign word both sides say (a review: left alone by the
        # version that read a first "no" as a reply, which the comma now tells)
        ("no se puede means what in English?", "se puede means what in English?"),
        # "no" beginning a wider insertion (a code-quality read: the rule read "no" alone)
        ("he said no se puede, is that a yes?", "he said puede, is that a yes?"),
    ],
)
def test_unread_another_languages_negation_in_an_english_text_is_refused(a, b):
    assert not passes(a, b)
    assert refusal(a, b) == refusal(b, a) == "polarity"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("What is identifier?", "What is an identifier?"),  # ("an" before a vowel: English)
        ("What happens to streamlines at a boundary?", "What happens to streamline at a boundary?"),
        ("How do I recieve money on PayPal?", "How do I receive money on PayPal?"),  # (one English)
        ("What does pho taste like?", "What does the pho taste like?"),
        ("i cant login to my account", "i can't login to my account"),
        ("Is it possible to get no fees?", "Is it possible to get fees?"),  # (the verifier's)
        ("What does Nicht mean?", "What does nicht mean?"),  # (a name, then the same word)
        # English around product names the vocabulary lacks, chat filler, a product's other
        # name (a review: a first version refused them, "i" and "an" read as negators).
        ("how to install numpy on ubuntu", "how do i install numpy on ubuntu"),
        ("how do I generate an ssh key", "how to generate ssh key"),
        ("no prob, what is an api", "what is an api"),
        ("how to tune postgres for writes", "how to tune postgresql for writes"),
        ("how to delet a file in linux", "how to delete a file in linux"),
        # (A fourth review's: "no" in a wider edit or before a contraction, typos of names.)
        ("no wifi on ubuntu", "wifi not working on ubuntu"),
        ("no i don't want it", "i don't want it"),
        ("no idk how to fix it", "idk how to fix it"),
        ("how to install kubernets on ubuntu", "how to install kubernetes on ubuntu"),
        ("how to use chatgtp for coding", "how to use chatgpt for coding"),
        # A hyphenated English word is whole ("non" is a negator), a text's first "no" a reply.
        ("What is a non-profit organization?", "What is a nonprofit organization?"),
        ("What does non-zero mean?", "What does nonzero mean?"),
        # English compounds are English (a review: "cost-effective" / "cost-efficient" refused)
        (
            "What is the most cost-effective way to heat a house?",
            "What is the most cost-efficient way to heat a house?",
        ),
        ("Best self-hosted wiki software", "Best self-managed wiki software"),
        # A typo is no foreign word the "no" could stand against (a review)
        ("how to install numpy no conda", "how to install numpy witout conda"),
        ("no, numpy isn't installed", "numpy isn't installed"),
        # A reply's "no", its comma after it (a review: refused mid-text).
        (
            "my friend said no, numpy still fails on windows",
            "my friend said numpy still fails on windows",
        ),
    ],
)
def test_unread_english_and_words_alike_pass(a, b):
    assert passes(a, b)


def test_unread_is_symmetric_whichever_prompt_was_stored():
    # A first version counted negators per difflib opcode, which aligns the two orders
    # otherwise: "how to add a favicon in nextjs" / "how do i add favicon to nextjs" was refused
    # one way and served the other (a review).
    for verb in ("add", "install", "remove"):
        for thing in ("a favicon", "a sidebar", "a webhook"):
            for tool in ("nextjs", "wordpress", "vuejs"):
                a = f"how to {verb} {thing} in {tool}"
                b = f"how do i {verb} {thing.removeprefix('a ')} to {tool}"
                assert unread.RULE.differs(a, b) == unread.RULE.differs(b, a), (a, b)


def test_unread_reads_a_small_edit_in_a_long_text_and_leaves_a_long_edit_to_the_verifier():
    long = "word " * 2000
    assert passes(long + "the sign says dekimasu", long + "the sign says dekimasen") is False
    assert passes("se puede " * 500, "no se puede " * 500)  # (no small edit: the verifier's)
