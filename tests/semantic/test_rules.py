"""The exact rules (carpool.semantic.rules): what a cached answer must match word for word.

Each rule module has tests that it refuses its trap kind and that it lets through the ordinary
variations of one question (case, punctuation, spelling of a number, politeness). The examples are
written for these tests. Every check runs both ways: a rule is symmetric.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.semantic.guard import refusal
from carpool.semantic.rules import (
    RULES,
    entities,
    identifiers,
    numbers,
    operators,
    order,
    polarity,
    quoted,
    substitution,
    text,
)
from carpool.semantic.verdict import Reason


def refused(a: str, b: str) -> Reason | None:
    r, s = refusal(a, b), refusal(b, a)
    assert r == s, (a, b, r, s)
    return r


def passes(rule, a: str, b: str) -> bool:
    assert rule.differs(a, b) == rule.differs(b, a), (a, b)
    return not rule.differs(a, b)


# ------------------------------------------------------------------------------ numbers


def test_numbers_a_different_number_is_refused():
    assert refused("Set a timer for 25 minutes.", "Set a timer for 35 minutes.") == "number"
    assert refused("What is 12% of 300?", "What is 21% of 300?") == "number"
    assert refused("Book a table for two.", "Book a table for four.") == "number"
    assert refused("Wake me up at 6:30.", "Wake me up at 16:30.") == "number"
    assert (
        refused("Which floor is the third room on?", "Which floor is the 4th room on?") == "number"
    )


def test_numbers_a_hyphenated_word_is_read_in_its_parts():
    # "five-year-old" was one word, no number: "a five-year-old" / "a six-year-old" passed the
    # rule, and "a five year old" / "a five-year-old" was refused (a review).
    assert refused("Explain it to a five-year-old", "Explain it to a six-year-old") == "number"
    assert refused("Is a 3-year-old too young?", "Is a 4-year-old too young?") == "number"
    # Any count before a hyphen, but "zero-" and "one-" before a word ("zero-copy", "one-time")
    # (a code-quality read: "two-bedroom" / "two bedroom" was refused).
    assert (
        refused("Find a two-bedroom flat in Leeds", "Find a three-bedroom flat in Leeds")
        == "number"
    )
    for a, b in (
        ("Find a two-bedroom flat in Leeds", "Find a two bedroom flat in Leeds"),
        ("It makes a zero-copy slice", "It makes a slice without copying"),
        ("Explain photosynthesis to a five year old", "Explain photosynthesis to a five-year-old"),
        ("Is a 3 year old too young for school?", "Is a 3-year-old too young for school?"),
        ("Is a 30-year mortgage better?", "Is a 30 year mortgage better?"),
        ("What is twenty-one plus one?", "What is twenty one plus one?"),
    ):
        assert refused(a, b) is None, (a, b)


def test_numbers_a_number_with_letters_glued_to_it_is_read():
    # "5G" / "4G", "3D" / "2D", "10x" / "100x", "5GB" / "10GB" were read by no rule (the
    # identifiers rule left them to numbers, which read no number glued to letters: a review,
    # served at 0.99); and scientific notation.
    for a, b in (
        ("Is a 5G phone better?", "Is a 4G phone better?"),
        ("Is a 3D printer worth it?", "Is a 2D printer worth it?"),
        ("Is Rust 10x faster than Python?", "Is Rust 100x faster than Python?"),
        ("Is 5GB enough?", "Is 10GB enough?"),
        ("What is 1e5?", "What is 1e6?"),
    ):
        assert refused(a, b) == "number", (a, b)
    for a, b in (
        ("Is 5GB enough?", "Is 5 GB enough?"),
        ("Is 5kg heavy?", "Is 5 kg heavy?"),
        ("Is a 4K monitor good?", "Is a 4k monitor good?"),
        ("Meet at 10am", "Meet at 10 am"),
    ):
        assert refused(a, b) is None, (a, b)


def test_numbers_chinese_numbers_are_read():
    assert refused("买两个苹果要多少钱？", "买三个苹果要多少钱？") == "number"
    assert refused("二十五加三等于几？", "二十五加四等于几？") == "number"
    assert passes(numbers.RULE, "我们一起去公园吧", "我们一起去公园吧！")
    assert passes(numbers.RULE, "二十五是质数吗？", "25是质数吗？")


def test_numbers_units_currencies_and_dates_are_read():
    assert refused("How far is 10 miles in steps?", "How far is 10 km in steps?") == "number"
    assert refused("Is $50 a good price?", "Is 50 euros a good price?") == "number"
    assert (
        refused("What's the forecast for tomorrow?", "What's the forecast for today?") == "number"
    )
    assert refused("Show my orders from last year.", "Show my orders from last week.") == "number"
    assert refused("明天天气怎么样？", "今天天气怎么样？") == "number"


def test_numbers_the_same_number_written_another_way_passes():
    for a, b in (
        ("Is twenty five a prime number?", "Is 25 a prime number?"),
        ("Which laptops cost under $1,000?", "Which laptops cost under 1000 dollars?"),
        ("What is 15% of 80?", "What is 15 percent of 80?"),
        (
            "What should I pack for a week in Iceland?",
            "What should I pack for one week in Iceland?",
        ),
        (
            "Summarise this article in three bullet points.",
            "Summarize this article in 3 bullet points.",
        ),
        ("Is a 20k salary enough?", "Is a 20000 salary enough?"),
        ("First, how do I start?", "How do I start?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


def test_numbers_am_and_pm_after_a_number_are_read():
    # "6" was read on both sides and no am / pm: another time of day was served (0.98-0.99).
    for a, b in (
        (
            "I take my medication at 8 am. Can I drink coffee with it?",
            "I take my medication at 8 pm. Can I drink coffee with it?",
        ),
        (
            "My flight leaves at 6 am tomorrow. What time should I get to the airport?",
            "My flight leaves at 6 pm tomorrow. What time should I get to the airport?",
        ),
        ("Set an alarm for 7 a.m.", "Set an alarm for 7 p.m."),
        ("Is the shop open at 9am?", "Is the shop open at 9pm?"),
        ("Remind me at 6am.", "Remind me at 7am."),
    ):
        assert refused(a, b) == "number", (a, b)


def test_numbers_numbers_written_together_are_read_in_their_order():
    # The numbers were a multiset: "1/3" and "3/1", a day and a month exchanged, were the same.
    for a, b in (
        ("What is 1/3 of 90?", "What is 3/1 of 90?"),
        ("What day of the week is 03/04/2025?", "What day of the week is 04/03/2025?"),
        (
            "What is the zodiac sign for someone born on 05/06?",
            "What is the zodiac sign for someone born on 06/05?",
        ),
        (
            "How many days are between 1/2/2024 and 3/4/2024?",
            "How many days are between 2/1/2024 and 4/3/2024?",
        ),
        (
            "My blood pressure is 120/80. Is that normal?",
            "My blood pressure is 80/120. Is that normal?",
        ),
        ("Is 16:9 wider than 4:3?", "Is 9:16 wider than 4:3?"),
    ):
        assert refused(a, b) == "number", (a, b)


def test_numbers_the_same_fraction_or_date_reworded_passes():
    for a, b in (
        ("What day of the week is 03/04/2025?", "What day of the week was 03/04/2025?"),
        ("What is 1/3 of 90?", "What's 1 / 3 of 90?"),
        ("My blood pressure is 120/80. Is that normal?", "Is a blood pressure of 120/80 normal?"),
        (
            "How many days are between 1/2/2024 and 3/4/2024?",
            "Count the days from 1/2/2024 to 3/4/2024.",
        ),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


def test_numbers_a_unit_or_currency_is_read_with_its_number():
    # Units and currencies were a set of their own: "2 amp ... 5 volts" / "2 volt ... 5 amps"
    # and "$100 or €90" / "$90 or €100" held the same numbers and the same units.
    for a, b in (
        (
            "How many watts does a 2 amp charger deliver at 5 volts?",
            "How many watts does a 2 volt charger deliver at 5 amps?",
        ),
        ("What's 500 € in pounds?", "What's 500 £ in euros?"),
        ("Which is more, $100 or €90?", "Which is more, $90 or €100?"),
        ("Is ¥5,000 in $ enough for lunch in Tokyo?", "Is $5,000 in ¥ enough for lunch in Tokyo?"),
    ):
        assert refused(a, b) == "number", (a, b)


def test_numbers_the_same_amounts_in_their_units_reworded_pass():
    for a, b in (
        (
            "How many watts does a 2 amp charger deliver at 5 volts?",
            "At 5 volts, how many watts does a 2 amp charger deliver?",
        ),
        ("What's 500 € in pounds?", "Convert 500 euros to pounds."),
        ("Which is more, $100 or €90?", "Is €90 more than $100?"),
        ("Is ¥5,000 enough for lunch in Tokyo?", "Is 5,000 yen enough for lunch in Tokyo?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


def test_numbers_percentage_points_and_basis_points_are_units_of_their_own():
    # "percentage" was "%" and "points" no unit: a rate's rise by 0.5 % read as by 0.5 points.
    for a, b in (
        (
            "If the Fed raises rates by 0.5 percent, how does my mortgage payment change?",
            "If the Fed raises rates by 0.5 percentage points, how does my mortgage payment change?",
        ),
        (
            "Unemployment rose by 2 percentage points. Is that a lot?",
            "Unemployment rose by 2 percent. Is that a lot?",
        ),
        ("The bank cut rates by 25 basis points.", "The bank cut rates by 25%."),
    ):
        assert refused(a, b) == "number", (a, b)
    for a, b in (
        ("Unemployment rose by 2 percentage points.", "Unemployment went up 2 percentage points."),
        ("The bank cut rates by 25 basis points.", "The bank cut rates by 25 bps."),
        ("What percentage of adults vote?", "What percent of adults vote?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


def test_numbers_a_time_of_day_in_words_is_read():
    for a, b in (
        ("What time is noon UTC in Tokyo?", "What time is midnight UTC in Tokyo?"),
        ("Is it safe to fly at dawn in fog?", "Is it safe to fly at dusk in fog?"),
        ("Do shops open at midday on Sunday?", "Do shops open at midnight on Sunday?"),
    ):
        assert refused(a, b) == "number", (a, b)
    for a, b in (
        ("What time is noon UTC in Tokyo?", "What time is midday UTC in Tokyo?"),
        ("Is it safe to fly at dawn in fog?", "Is flying at dawn in fog safe?"),
        ("Why is the sky red at dusk?", "Why is the sky red at sunset?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


def test_numbers_order_and_units_are_read_whatever_else_differs_and_ratios_of_any_number():
    # A spelled "one" against "a" skipped the order and unit checks; a ratio with a decimal or
    # thousands was no group ("1.5:1" none, "1,000:1" read as 0:1): all four were served.
    for a, b in (
        ("Book one room from 03/04/2025", "Book a room from 04/03/2025"),
        ("One ticket costs $100 or €90?", "A ticket costs $90 or €100?"),
        ("Mix rice and water in a 1:1.5 ratio?", "Mix rice and water in a 1.5:1 ratio?"),
        ("Are odds of 1:1,000 good?", "Are odds of 1,000:1 good?"),
    ):
        assert refused(a, b) == "number", (a, b)
    for a, b in (
        ("Book one room from 03/04/2025", "Book a room from 03/04/2025"),
        ("Mix rice and water in a 1:1.5 ratio?", "Rice to water at 1:1.5, right?"),
        ("Are odds of 1:1,000 good?", "are 1:1000 odds good"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


def test_a_time_of_day_or_keep_said_otherwise_on_the_other_side_passes():
    # Read against no time of day, "sunset" refused "when the sun sets"; "keep" against
    # "remove" refused "keep only unique rows" / "remove duplicate rows".
    for a, b in (
        ("What time is sunset in Paris today?", "When does the sun set in Paris today?"),
        ("Why is the sky orange at sunset?", "Why is the sky orange when the sun sets?"),
        ("What are good noon meals?", "What are good lunch meals?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)
    for a, b in (
        ("How do I keep only unique rows in Excel?", "How do I remove duplicate rows in Excel?"),
        (
            "How to keep only digits in a Python string",
            "How to remove everything but digits from a Python string",
        ),
    ):
        assert passes(polarity.RULE, a, b), (a, b)


def test_numbers_a_unit_written_in_another_case_after_a_number_is_refused():
    # Served at 1.0, retyped, the verifier never asked: milli is not mega, bits are not bytes.
    for a, b in (
        ("Is a 5 MHz signal audible?", "Is a 5 mHz signal audible?"),
        ("What particles have an energy of 10 MeV?", "What particles have an energy of 10 meV?"),
        ("How long to copy 50 GB at 1 Gbps?", "How long to copy 50 GB at 1 GBps?"),
        ("Is a dose of 20 mSv dangerous?", "Is a dose of 20 MSv dangerous?"),
        ("Is a 2 MOhm resistor safe for an LED?", "Is a 2 mOhm resistor safe for an LED?"),
        ("Is 3 Mbps fast enough for video calls?", "Is 3 MBps fast enough for video calls?"),
        ("Is 1 Mbps enough for streaming HD video?", "Is 1 MBps enough for streaming HD video?"),
    ):
        assert not passes(numbers.RULE, a, b), (a, b)


def test_numbers_a_unit_typed_in_lower_case_or_shouted_passes():
    # Lower case or a text in capitals says nothing of the unit's case: how a user types.
    for a, b in (
        ("Is a 5 mhz signal audible?", "Is a 5 MHz signal audible?"),
        ("is 3 mbps fast enough?", "Is 3 Mbps fast enough?"),
        ("IS 3 MBPS FAST ENOUGH?", "Is 3 Mbps fast enough?"),
        ("Convert 5 km to miles", "convert 5 Km to miles"),
        ("Is 3 Mbps fast enough?", "Is 3 Mbps fast enough for calls?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


def test_numbers_only_a_prefix_or_bits_against_bytes_is_a_unit_case():
    # Only m / M (milli / mega), p / P and b / B (bits / bytes) say something by their case: a
    # word after a number ("15 Pro", "11 Home") or a capitalised G or K (no giga or kilo in
    # another case) is how it was typed.
    for a, b in (
        ("Is the iPhone 15 Pro worth it?", "Is the iPhone 15 PRO worth it?"),
        ("Is Windows 11 Home good for gaming?", "Is Windows 11 HOME good for gaming?"),
        ("Is a 3 Ghz processor fast enough for gaming?", "Is a 3 GHz processor fast enough?"),
        ("How much does 1 Kwh of electricity cost?", "How much does 1 kWh of electricity cost?"),
        ("Is a 100 Mhz oscilloscope enough?", "Is a 100 MHz oscilloscope enough?"),
        ("Is a 2 KB file small?", "Is a 2 kB file small?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)
        assert refusal(a, b) is None, (a, b)
    for a, b in (
        ("Is a 5 MW turbine big?", "Is a 5 mW turbine big?"),
        ("How long to download 2 Gb?", "How long to download 2 GB?"),
        ("Is a 3 MeV photon harmful?", "Is a 3 meV photon harmful?"),
    ):
        assert not passes(numbers.RULE, a, b), (a, b)


def test_numbers_am_and_pm_written_another_way_or_am_as_a_verb_pass():
    for a, b in (
        ("Set an alarm for 7 am.", "Set an alarm for 7 a.m."),
        ("Set an alarm for 7am.", "set an alarm for 7 AM"),
        (
            "I am 30 years old. Is it too late to learn piano?",
            "I'm 30 years old. Is it too late to learn piano?",
        ),
        ("What am I doing wrong with my 2 plants?", "What am I doing wrong with my two plants?"),
    ):
        assert passes(numbers.RULE, a, b), (a, b)


# ------------------------------------------------------------------------------ operators


def test_operators_a_different_comparison_is_refused():
    assert refused("Is 8 > 5?", "Is 8 < 5?") == "operator"
    assert refused("Is 8 >= 5?", "Is 8 <= 5?") == "operator"
    assert refused("Is 8 greater than 5?", "Is 8 less than 5?") == "operator"
    assert refused("Find users older than 30", "Find users younger than 30") == "operator"
    assert refused("Show flights under $300", "Show flights over $300") == "operator"
    assert refused("8大于5吗？", "8小于5吗？") == "operator"


def test_operators_a_different_code_operator_is_refused():
    assert refused("What does x == 1 do in C?", "What does x = 1 do in C?") == "operator"
    assert refused("Why use a != b here?", "Why use a == b here?") == "operator"
    assert refused("What is 3 - 2?", "What is 3 + 2?") == "operator"
    assert refused("Explain a && b in JavaScript", "Explain a || b in JavaScript") == "operator"
    # Arrows and stars the verifier reads as near-equal (0.986-0.995 served).
    assert refused("Convert CSV → JSON", "Convert CSV ← JSON") == "operator"
    assert (
        refused("The RSI indicator shows ↑ today", "The RSI indicator shows ↓ today") == "operator"
    )
    assert (
        refused("What does a rating of ★★★★★ mean?", "What does a rating of ★ mean?") == "operator"
    )


def test_operators_the_same_operators_between_other_operands_are_refused():
    # Only the operators were compared, in order: names exchanged around them were served
    # ("Is a < b..." / "Is b < a...", 0.987).
    for a, b in (
        ("Is a < b when a = 1 and b = 2?", "Is b < a when a = 1 and b = 2?"),
        ("Does x = y + 1 imply y > x?", "Does y = x + 1 imply y > x?"),
        ("What is x = y + 1 doing here?", "What is y = x + 1 doing here?"),
    ):
        assert refused(a, b) == "operator", (a, b)
    for a, b in (
        ("What does x = y + 1 do?", "x = y + 1, what does it do?"),
        ("What is 5 + 3?", "What's 5+3?"),
        ("How do I write a -> b in Rust?", "In Rust, how do I write a -> b?"),
        # (A prefix has no operand on its spaced side: a true rewording was refused so.)
        ("Its arguments are url, and **kwargs.", "Its arguments are url, and more in **kwargs."),
        # Prose beside an operator asked about is no operand, and a commutative operator's
        # operands may change places (a review: refused by the first version, 0.94-0.99).
        ("When should I use === in JavaScript?", "In JavaScript, when should I use ===?"),
        ("What does the ?? operator do in C#?", "What does ?? do in C#?"),
        ("What is 3 + 5?", "What is 5 + 3?"),
        ("Is 7 == 7.0 in Python?", "Is 7.0 == 7 in Python?"),
        ("Why use !== instead of != in JS?", "In JS, why use !== instead of !=?"),
        ("How do I use the -> operator in C++?", "In C++, how do I use ->?"),
    ):
        assert passes(operators.RULE, a, b), (a, b)
    # Names of code are operands whatever they spell, and "^" (a power in prose) is not
    # commutative (a review of the first version: served, 0.96-0.99).
    for a, b in (
        ("Is count < limit in this loop?", "Is limit < count in this loop?"),
        (
            "Why does speed = distance / time give inf?",
            "Why does speed = time / distance give inf?",
        ),
        ("Why is balance -= amount wrong here?", "Why is amount -= balance wrong here?"),
        ("What is 2^3?", "What is 3^2?"),
        ("Is a < i?", "Is i < a?"),  # (one letter is a name, stop word or not)
        # (+ between names may join strings or lists: not commutative there.)
        ("What does a + b give for two strings?", "What does b + a give for two strings?"),
        # Between strings too (served, 0.98: a sign after a quote was no operator).
        ("What is 'ab' + 'cd' in Python?", "What is 'cd' + 'ab' in Python?"),
        ('What is "ab"+"cd" in JS?', 'What is "cd"+"ab" in JS?'),
    ):
        assert refused(a, b) == "operator", (a, b)
    # Other words beside an operator asked about are prose reworded, not operands moved (a
    # third review: refused, served before, 0.96-0.99).
    for a, b in (
        ("How is === different from == in PHP?", "In PHP, what makes === different from ==?"),
        (
            "How can I make == compare objects by value in Python?",
            "In Python, how do I get == to compare objects by value?",
        ),
        (
            "What is the difference between == and === in JavaScript?",
            "In JavaScript, how do == and === differ?",
        ),
        ("Why does foo !bar fail?", "Why does !bar fail?"),  # (a prefix's spaced side)
    ):
        assert passes(operators.RULE, a, b), (a, b)
    # Subscripted and quoted operands are read whole.
    for a, b in (
        (
            "Why is arr[j] > arr[j+1] true in my bubble sort?",
            "Why is arr[j+1] > arr[j] true in my bubble sort?",
        ),
        ('Is "apple" < "banana" in Python?', 'Is "banana" < "apple" in Python?'),
    ):
        assert refused(a, b) == "operator", (a, b)


def test_operators_word_operators_between_names_of_code_and_their_grouping_are_refused():
    # Outside backticks "and" / "or" / "is not" / "not" were prose, and parentheses nothing:
    # "a and b" was served "a or b"'s answer, "not (x and y)" that of "not x and y".
    for a, b in (
        (
            "Explain short circuit evaluation of a and b in Python.",
            "Explain short circuit evaluation of a or b in Python.",
        ),
        (
            "Why use is not None instead of != None in Python?",
            "Why use != None instead of is not None in Python?",
        ),
        (
            "What does not x and y parse as in Python?",
            "What does not (x and y) parse as in Python?",
        ),
        ("Is k in seen_keys?", "Is k not in seen_keys?"),
    ):
        assert refused(a, b) == "operator", (a, b)


def test_operators_word_operators_in_prose_or_said_alike_pass():
    for a, b in (
        (
            "Explain short circuit evaluation of a and b in Python.",
            "In Python, how is a and b evaluated?",
        ),
        ("Is it not a problem to use a and b?", "Is using a and b not a problem?"),
        ("Is cheese good or bad for you (honestly)?", "Is cheese good for you or bad (honestly)?"),
        ("What does x is not None return?", "What is returned by x is not None?"),
        ("Should I study and work or only study?", "Should I only study, or study and work?"),
        (
            "Which compiler is best for C++ beginners?",
            "Which is the best compiler to learn c and c++?",
        ),
        ("Should I learn C or C++ first?", "Which first, C or C++?"),
        (
            "DEFAULT_NAME is a variable holding the name.",
            "The variable DEFAULT_NAME holds the name.",
        ),
    ):
        assert passes(operators.RULE, a, b), (a, b)


def test_operators_prose_punctuation_and_synonyms_pass():
    for a, b in (
        ("Is 8 greater than 5?", "Is 8 more than 5?"),
        ("How are you today!", "How are you today?"),
        ("What is an e-mail?", "What is an email?"),
        ("Pros and cons - quickly", "Pros and cons quickly"),
        ("Is at least 5 enough?", "Is no less than 5 enough?"),
    ):
        assert passes(operators.RULE, a, b), (a, b)


# ------------------------------------------------------------------------------ quoted text


def test_quoted_a_different_quoted_string_or_code_span_is_refused():
    assert (
        refused("Translate 'see you soon' into Spanish.", "Translate 'see you later' into Spanish.")
        == "quoted"
    )
    assert (
        refused("What does `git reset --hard` do?", "What does `git reset --soft` do?") == "quoted"
    )
    assert refused("「你好」用英语怎么说？", "「再见」用英语怎么说？") == "quoted"


def test_quoted_a_task_input_must_be_the_same_words_in_order():
    # tense in a translation task
    assert (
        refused("Translate I eat an apple into French", "Translate I ate an apple into French")
        == "quoted"
    )
    assert refused("Rewrite this: the cat sat", "Rewrite this: the sat cat") == "quoted"
    assert (
        refused("Please rewrite: the meeting is on", "Please rewrite: the meeting is off")
        == "quoted"
    )


def test_quoted_the_same_quoted_text_and_task_pass():
    for a, b in (
        ("Translate 'hello' to French", "translate hello into French"),
        ("Translate 'see you soon' into Spanish.", "Please translate 'See you  soon' to Spanish"),
        (
            "Summarize the following text: cats sleep a lot",
            "summarize this text: Cats sleep a lot.",
        ),
        ("How do I fix my bike?", "How can I repair my bike?"),
    ):
        assert passes(quoted.RULE, a, b), (a, b)


def test_quoted_the_input_after_a_colon_of_an_instruction_naming_a_language_is_compared():
    # No task verb ("put"), so the input was never read: both pairs were served.
    for a, b in (
        (
            "Put this in Spanish please: she is reading a book",
            "Put this in Spanish please: she was reading a book",
        ),
        (
            "Put this in Spanish please: she is reading a book",
            "Put this in Spanish please: he is reading a book",
        ),
        ("Say this in French: I will call you", "Say this in French: you will call me"),
        ("translate into french: good morning", "translate into german: good morning"),
    ):
        assert refused(a, b) == "quoted", (a, b)


def test_quoted_the_input_of_how_do_i_say_or_a_language_translation_of_is_compared():
    # Without a colon or a task verb first, "how do I say X in Spanish" had no input: another
    # tense was served the first one's translation.
    for a, b in (
        (
            "How do I say I studied medicine in Spanish?",
            "How do I say I study medicine in Spanish?",
        ),
        (
            "French translation of you have won, please.",
            "French translation of you will win, please.",
        ),
        ("What's the German for we were late?", "What's the German for we are late?"),
    ):
        assert refused(a, b) == "quoted", (a, b)


def test_quoted_the_same_input_named_by_its_language_reworded_passes():
    for a, b in (
        (
            "How do I say I studied medicine in Spanish?",
            "How would you say I studied medicine in Spanish?",
        ),
        ("French translation of you have won, please.", "What's the French for you have won?"),
        ("How do I say thank you in Japanese?", "Translate to Japanese: thank you"),
    ):
        assert passes(quoted.RULE, a, b), (a, b)


def test_quoted_the_same_input_after_a_colon_in_another_instruction_passes():
    for a, b in (
        (
            "Put this in Spanish please: she is reading a book",
            "Can you say this in Spanish: She is reading a book.",
        ),
        ("In French: good morning", "How do you say this in French: good morning?"),
        ("Note: how do I learn Spanish?", "Note: what is the best way to learn Spanish?"),
    ):
        assert passes(quoted.RULE, a, b), (a, b)


def test_quoted_code_that_differs_in_one_punctuation_mark_is_refused():
    # Code outside backticks was read as prose: a missing colon or a trailing comma was served.
    for a, b in (
        (
            "What's wrong with this line: for i in range(10) print(i)",
            "What's wrong with this line: for i in range(10): print(i)",
        ),
        (
            "Is this valid JavaScript: const a = [1, 2, 3,]",
            "Is this valid JavaScript: const a = [1, 2, 3]",
        ),
        ("Why does print(len(x) fail?", "Why does print(len(x)) fail?"),
    ):
        assert refused(a, b) == "quoted", (a, b)


def test_quoted_a_list_or_mapping_in_brackets_keeps_its_marks():
    # Only a bracket attached to a word or a spaced "=" made code: a literal standing alone was
    # prose, and a trailing comma (invalid JSON) was served at 0.98; so were the same literal
    # with a word added around it, a comma's spacing, a list printed by NumPy, an open interval.
    for a, b in (
        ("Is [1, 2, 3,] valid JSON?", "Is [1, 2, 3] valid JSON?"),
        ('Is {"a": 1,} valid JSON?', 'Is {"a": 1} valid JSON?'),
        ("Is the list [1, 2, 3,] valid?", "Is the list [1, 2, 3] valid?"),
        ("Is [1, 2, 3,] a valid list in Python?", "Is [1, 2, 3] a valid list in Python?"),
        ("Is [1, 2, 3, ] valid JSON?", "Is [1, 2, 3 ] valid JSON?"),
        ('Is {"a": 1, } valid JSON?', 'Is {"a": 1 } valid JSON?'),
        ("Is [1, 2, 3,] valid JSON?", "Is [1, 2, 3] a valid JSON?"),
        ("Is this valid JSON? [1, 2, 3,]", "Is this JSON valid? [1, 2, 3]"),
        (
            "Is [1, 2, 3] a Python list or a NumPy array?",
            "Is [1 2 3] a Python list or a NumPy array?",
        ),
        ("Is [1; 2; 3] valid in MATLAB?", "Is [1, 2, 3] valid in MATLAB?"),
        ("Is the interval [0, 1] compact?", "Is the interval (0, 1) compact?"),
        # (Groups with none inside alone, a review found: nested lists were served; so were
        # an interval half-open and a tuple's trailing comma in parentheses.)
        (
            "What is the shape of the array [[1, 2], [3, 4]]?",
            "What is the shape of the array [[1, 2, 3, 4]]?",
        ),
        ("Reshape [(1, 2), (3, 4)] in numpy", "Reshape [(1, 2, 3, 4)] in numpy"),
        ("Is f continuous on (a, b]?", "Is f continuous on (a, b)?"),
        ("Is (1,) a tuple in Python?", "Is (1) a tuple in Python?"),
        ("What is the first element of ((1, 2), 3)?", "What is the first element of (1, (2, 3))?"),
        # (A group of one item whose brackets changed was no list: served at 1.0.)
        ("Is [1] a list in Python?", "Is (1) a list in Python?"),
        ("Is {1} a set in Python?", "Is [1] a set in Python?"),
        ("What does [x] mean in regex?", "What does (x) mean in regex?"),
        # (Nesting without a separator: a review found them served.)
        ("What is the shape of [[1 2] [3 4]]?", "What is the shape of [[1 2 3 4]]?"),
        ("Reduce (x (y z)) in lambda calculus", "Reduce ((x y) z) in lambda calculus"),
        ("In Racket, what is (- (- 10 4) 3)?", "In Racket, what is (- 10 (- 4 3))?"),
    ):
        assert quoted.RULE.differs(a, b), (a, b)
        assert refused(a, b) == "quoted", (a, b)
    for a, b in (
        ("What does [1, 2] + [3] give?", "What does [1, 2] + [3] give"),
        ("Explain the notation [a, b] in math.", "Explain the notation [a, b] in math"),
        ("What is a list [in Python]?", "What is a list in Python?"),
        ("Explain [a, b] intervals", "Explain [a,b] intervals"),
        ("Is [1, 2, 3] a list?", "Is [1,2,3] a list?"),
        ("What are {name: value} pairs?", "What are {name:value} pairs?"),
        ("Mean of uniform on [0, 1]?", "Mean of uniform on [0,1]?"),
        ("In the range [0, 1], what is the mean?", "In the range [0, 1] what is the mean?"),
        ("Explain [a, b] intervals: open or closed?", "Explain [a, b] intervals - open or closed?"),
        (
            "Note: for the interval [0, 1], is it compact?",
            "Note - for the interval [0, 1], is it compact?",
        ),
        ("Are fruits (e.g., apples, pears) healthy?", "Are fruits (e.g. apples, pears) healthy?"),
        (
            "Are fruits (e.g., (a) apples, (b) pears) healthy?",
            "Are fruits (e.g. (a) apples, (b) pears) healthy?",
        ),
        ("What does [citation needed] mean?", "What does [citation needed] mean"),
        (
            "Write a poem about autumn [keep it short, about 8 lines]",
            "Write a poem about autumn (keep it short, about 8 lines)",
        ),
        (
            "Explain recursion [in simple terms, please]",
            "Explain recursion (in simple terms, please)",
        ),
        ("Is [1, 2] a list?", "Is [1, 2] a list, really?"),
    ):
        assert passes(quoted.RULE, a, b), (a, b)


def test_quoted_code_with_the_same_punctuation_and_prose_punctuation_pass():
    for a, b in (
        ("How do I use print() in Python?", "How do I use print() in Python"),
        ("What does x = [1, 2] do?", "What does x = [1, 2] do."),
        ("In Python, what does len(x) return?", "In Python what does len(x) return?"),
        # The same code where the prose moved around it, spaced otherwise (a review: refused
        # by the first version of the rule below, 0.87-0.99).
        ("What is len(), in Python?", "In Python, what is len()?"),
        ("How do I use print(x) in Python", "In Python how do I use print(x)"),
        ("In Python, how do I call max(a, b)?", "How do I call max(a,b) in Python?"),
        (
            "What does np.zeros((3, 3)) create in NumPy?",
            "In NumPy, what does np.zeros((3,3)) create?",
        ),
        ("In pandas, what does df.iloc[0:5] return?", "What does df.iloc[0 : 5] return in pandas?"),
        ("What is round(2.5) in Python: 2 or 3?", "In Python, what is round(2.5): 2 or 3?"),
    ):
        assert passes(quoted.RULE, a, b), (a, b)


def test_quoted_the_same_words_moved_inside_code_are_refused():
    # Only the same words in the same order were compared by their code's punctuation:
    # calls nested the other way round were served (the verifier scored them 0.94 to 0.98).
    for a, b in (
        ("What is pow(pow(2,3),2)?", "What is pow(2,pow(3,2))?"),
        ("Compute max(min(4, 7), 5)", "Compute min(max(4, 7), 5)"),
        ("Evaluate f(g(x)) when x = 2", "Evaluate g(f(x)) when x = 2"),
        ("What does sorted(reversed(xs)) return?", "What does reversed(sorted(xs)) return?"),
    ):
        assert refused(a, b) == "quoted", (a, b)


def test_quoted_the_text_an_error_or_a_log_says_must_be_the_same():
    # Another error message was served: the verifier scored "connection refused" / "connection
    # timed out" after "The server logs say" 0.99.
    for a, b in (
        ("The server logs say connection refused.", "The server logs say connection timed out."),
        ("The error says permission denied.", "The error says file not found."),
        (
            "I get this error: ModuleNotFoundError. What now?",
            "I get this error: KeyError. What now?",
        ),
        ("The error message said disk full. Help?", "The error message said out of memory. Help?"),
    ):
        assert refused(a, b) == "quoted", (a, b)


def test_quoted_the_same_error_text_or_one_side_quoting_none_passes():
    for a, b in (
        ("The error says permission denied.", "the error says: Permission denied"),
        ("The server logs say connection refused. Why?", "The logs say connection refused, why?"),
        ("What does the error say about this?", "What does this error say?"),
        ("The error says permission denied.", "I get permission denied. What does it mean?"),
    ):
        assert passes(quoted.RULE, a, b), (a, b)


# ------------------------------------------------------------------------------ identifiers


def test_identifiers_a_different_code_or_name_is_refused():
    for a, b in (
        ("What does error E1042 mean?", "What does error E1024 mean?"),
        ("How do I use pandas.merge?", "How do I use pandas.concat?"),
        ("Is python2 still supported?", "Is python3 still supported?"),
        ("What is in /etc/hosts?", "What is in /etc/hostname?"),
        ("How do I call get_user_id?", "How do I call get_user_name?"),
        ("What does HTTP mean?", "What does FTP mean?"),
    ):
        assert refused(a, b) == "identifier", (a, b)


def test_identifiers_case_and_plain_words_pass():
    for a, b in (
        ("What does HTTP mean?", "what does http mean"),
        ("How do I update my iPhone?", "how do i update my iphone"),
        ("Is it OK to nap?", "Is it okay to nap?"),
        # words joined by a slash are words, not a path ("/modification" was one)
        (
            "It allows inspection/modification of a script.",
            "It allows inspection/alteration of a script.",
        ),
        (
            "What is it like to date a female/male celebrity?",
            "What is it like to date a celebrity?",
        ),
    ):
        assert passes(identifiers.RULE, a, b), (a, b)
    assert refused("Open src/main.py", "Open src/test.py") == "identifier"
    assert refused("What is in ./run.sh?", "What is in ./build.sh?") == "identifier"


def test_identifiers_two_exchanged_in_place_are_refused_unless_only_joined():
    # A command's arguments exchanged ("cp a.txt b.txt" / "cp b.txt a.txt", 0.99 to the
    # verifier, served: "a" is a stop word and "txt" said twice, so no exchange of words read it).
    for a, b in (
        ("cp a.txt b.txt", "cp b.txt a.txt"),
        ("mv old.py new.py", "mv new.py old.py"),
        ("How do I run diff main.c util.c?", "How do I run diff util.c main.c?"),
        ("Does config.yaml override settings.yaml?", "Does settings.yaml override config.yaml?"),
    ):
        assert identifiers.RULE.differs(a, b) and identifiers.RULE.differs(b, a), (a, b)
        assert refused(a, b) is not None, (a, b)
    for a, b in (
        ("Compare a.py and b.py", "Compare b.py and a.py"),
        ("python2, python3: which is faster?", "python3, python2: which is faster?"),
        ("HTTP vs. HTTPS", "HTTPS vs. HTTP"),
        ("Should I learn python2 or python3?", "Should I learn python3 or python2?"),
        ("What do NASA and ESA do?", "What do ESA and NASA do?"),
        (
            "Read c.txt after cp a.txt b.txt",
            "cp a.txt b.txt, then read c.txt",
        ),  # (not one exchange)
        ("Are a.py as well as b.py tracked?", "Are b.py as well as a.py tracked?"),
        (
            "Does package.json plus yarn.lock conflict?",
            "Does yarn.lock plus package.json conflict?",
        ),
        ("HTTP/HTTPS: which is used here?", "HTTPS/HTTP: which is used here?"),
    ):
        assert passes(identifiers.RULE, a, b), (a, b)
    # A hyphenated identifier is covered by its parts on the other side.
    assert passes(identifiers.RULE, "Is a 3-year-old too young?", "Is a 3 year old too young?")
    assert not passes(identifiers.RULE, "Is a 3-year-old too young?", "Is a 4 year old too young?")
    # A directory's slash is no coordinator (a review: "cp -r my_app/ my_app_backup/" swapped
    # was served, 0.99).
    assert identifiers.RULE.differs("mv build_out/ release_dir/", "mv release_dir/ build_out/")


# ------------------------------------------------------------------------------ names


def test_entities_a_different_name_is_refused():
    assert refused("What is the currency of Peru?", "What is the currency of Chile?") == "entity"
    assert (
        refused("How do I get a visa for Canada?", "How do I get a visa for Australia?") == "entity"
    )
    assert refused("Is the museum open on Monday?", "Is the museum open on Tuesday?") == "entity"


def test_entities_case_sentence_starts_and_titles_pass():
    for a, b in (
        ("Is paris expensive in summer?", "Is Paris expensive in summer?"),
        ("Hi! How do I delete my account?", "how do i delete my account"),
        (
            "Explain Recursion Like I Am Five Years Old",
            "explain recursion like i am five years old",
        ),
        ("Where do Indians celebrate Diwali?", "Where do indians celebrate diwali?"),
    ):
        assert passes(entities.RULE, a, b), (a, b)


# ------------------------------------------------------------------------------ word order


def test_order_swapped_roles_and_directions_are_refused():
    for a, b in (
        ("The cat chased the mouse. Why?", "The mouse chased the cat. Why?"),
        ("How do I convert JSON to YAML?", "How can I convert YAML to JSON?"),
        ("Convert 100 euros to dollars.", "Convert 100 dollars to euros."),
        ("Why did the buyer sue the seller?", "Why did the seller sue the buyer?"),
        ("猫为什么追老鼠？", "老鼠为什么追猫？"),
    ):
        assert refused(a, b) in ("order", "quoted"), (a, b)
        assert order.RULE.differs(a, b), (a, b)


def test_order_a_reworded_question_that_moves_words_passes():
    for a, b in (
        ("In Python, how do I reverse a list?", "How do I reverse a list in Python?"),
        ("What is the best way to learn Python?", "How to learn Python the best way?"),
        (
            "How do I get from the station to the museum?",
            "How do I get to the museum from the station?",
        ),
    ):
        assert passes(order.RULE, a, b), (a, b)


def test_order_as_is_no_coordinator_between_two_exchanged_roles():
    # "as" was a coordinator: "the landlord or as the tenant" read as "X or Y", free to change.
    for a, b in (
        (
            "Should I sign the lease as the landlord or as the tenant's guarantor?",
            "Should I sign the lease as the tenant or as the landlord's guarantor?",
        ),
        (
            "Can I work as a nurse or as a doctor's assistant?",
            "Can I work as a doctor or as a nurse's assistant?",
        ),
    ):
        assert refused(a, b) == "order", (a, b)
    for a, b in (
        ("Should I learn Python as well as Java?", "Should I learn Java as well as Python?"),
        ("Which is better, cats or dogs?", "Which is better, dogs or cats?"),
        ("Should I rent or buy a house?", "Should I buy or rent a house?"),
    ):
        assert passes(order.RULE, a, b), (a, b)


def test_order_refuses_a_direction_between_phrases_reversed():
    # Only single words were exchanged: a direction between names of several words was served.
    for a, b in (
        (
            "Write a function that converts a Unix timestamp to an ISO 8601 string.",
            "Write a function that converts an ISO 8601 string to a Unix timestamp.",
        ),
        (
            "How do I migrate from MySQL 5.7 to PostgreSQL 15?",
            "How do I migrate from PostgreSQL 15 to MySQL 5.7?",
        ),
        (
            "How do I move my photos from Google Photos to iCloud?",
            "How do I move my photos from iCloud to Google Photos?",
        ),
    ):
        assert order.RULE.differs(a, b), (a, b)
        assert refused(a, b) == "order", (a, b)


def test_order_refuses_a_direction_said_with_onto_off_worth_in_or_a_phrase_with_of_reversed():
    # Only "to" / "into" after "from" or a verb were read: "off X onto Y", "X worth in Y" and a
    # phrase with "of" inside ("a list of dicts") were served the other way round.
    for a, b in (
        ("What's a euro worth in dollars right now?", "What's a dollar worth in euros right now?"),
        (
            "How do I go from a pandas DataFrame to a list of dicts?",
            "How do I go from a list of dicts to a pandas DataFrame?",
        ),
        (
            "How do I move my photos off iCloud onto Google Photos?",
            "How do I move my photos off Google Photos onto iCloud?",
        ),
        (
            "How do I get data out of Excel into Python?",
            "How do I get data out of Python into Excel?",
        ),
    ):
        assert order.RULE.differs(a, b), (a, b)
        assert refused(a, b) == "order", (a, b)


def test_order_the_same_direction_with_onto_off_or_worth_in_reworded_passes():
    for a, b in (
        ("What's a euro worth in dollars right now?", "How much is a euro worth in dollars today?"),
        (
            "How do I go from a pandas DataFrame to a list of dicts?",
            "Convert a pandas DataFrame to a list of dicts",
        ),
        (
            "How do I move my photos off iCloud onto Google Photos?",
            "How can I move photos from iCloud to Google Photos?",
        ),
    ):
        assert passes(order.RULE, a, b), (a, b)


def test_order_the_same_direction_between_phrases_reworded_passes():
    for a, b in (
        (
            "How do I move my photos from Google Photos to iCloud?",
            "What is the best way to move photos from Google Photos to iCloud?",
        ),
        (
            "Write a function that converts a Unix timestamp to an ISO 8601 string.",
            "Write a function converting a Unix timestamp into an ISO 8601 string",
        ),
        (
            "How do I migrate from MySQL 5.7 to PostgreSQL 15?",
            "Migrating to PostgreSQL 15 from MySQL 5.7: how?",
        ),
        ("How do I convert JSON to YAML in Python?", "Python: convert JSON into YAML"),
    ):
        assert passes(order.RULE, a, b), (a, b)


def test_order_refuses_roles_swapped_through_a_pronoun():
    # Pronouns were words without a role (STOP): who does what to whom was served.
    for a, b in (
        (
            "My manager keeps interrupting me in meetings. How should I handle it?",
            "I keep interrupting my manager in meetings. How should I handle it?",
        ),
        (
            "My brother owes me $200 and won't pay. What should I do?",
            "I owe my brother $200 and won't pay. What should I do?",
        ),
        (
            "My landlord is suing me. What are my options?",
            "I am suing my landlord. What are my options?",
        ),
        (
            "She asked him to marry her. How should he respond?",
            "He asked her to marry him. How should he respond?",
        ),
    ):
        assert order.RULE.differs(a, b), (a, b)
        assert refused(a, b) == "order", (a, b)


def test_order_refuses_roles_swapped_through_a_pronoun_in_a_clause_before_a_question():
    # Sentences were split at "." "?" "!" ";" only: a question after a comma or a dash repeats
    # the pronoun ("what should I do"), the exchange swapped it too, and the pair was served.
    for a, b in (
        ("My landlord is suing me, what should I do?", "I am suing my landlord, what should I do?"),
        (
            "My brother owes me money, what should I do?",
            "I owe my brother money, what should I do?",
        ),
        ("My boss fired me, can I sue?", "I fired my boss, can I sue?"),
        ("My wife is divorcing me, what should I do?", "I am divorcing my wife, what should I do?"),
        (
            "She asked him to marry her, what should he say?",
            "He asked her to marry him, what should he say?",
        ),
        (
            "I am sponsoring the wife, what visa does the wife need?",
            "The wife is sponsoring me, what visa does the wife need?",
        ),
        (
            "My landlord is suing me - what should I do?",
            "I am suing my landlord - what should I do?",
        ),
        (
            "My landlord is suing me...what should I do?",
            "I am suing my landlord...what should I do?",
        ),
        ("My boss fired me\u2026can I sue?", "I fired my boss\u2026can I sue?"),
        # (A possessive against "the" kept the roles apart: served.)
        ("Where did the teacher send her son?", "Where did her son send the teacher?"),
        ("Why did the doctor call her mother?", "Why did her mother call the doctor?"),
        (
            "My landlord is suing me and I need advice, what should I do?",
            "I am suing my landlord and I need advice, what should I do?",
        ),
    ):
        assert order.RULE.differs(a, b), (a, b)
        assert refused(a, b) == "order", (a, b)


def test_order_refuses_a_role_said_twice_exchanged_everywhere_and_hers_read_as_a_possessive():
    # Exchanged at its first place only (a review of the clause reading), a role said twice
    # was served ("...after the landlord evicted me"); "her" before a noun was read as "she".
    for a, b in (
        (
            "The landlord sued me after the landlord evicted me.",
            "I sued the landlord after I evicted the landlord.",
        ),
        (
            "Can the landlord evict me if the landlord owes me money?",
            "Can I evict the landlord if I owe the landlord money?",
        ),
        (
            "The landlord sued me after the landlord evicted me, what now?",
            "I sued the landlord after I evicted the landlord, what now?",
        ),
        ("She fired her boss, what should she do?", "Her boss fired her, what should she do?"),
        # ("her" then read as a possessive always, a review found: a person before an object,
        # a particle or an adverb was dropped, and these passed the rule.)
        ("He owes her money", "She owes him money"),
        ("He gave her flowers", "She gave him flowers"),
        ("Should I lend her money?", "Should she lend me money?"),
        ("My brother owes her money", "She owes my brother money"),
        ("Should he ask her out?", "Should she ask him out?"),
        ("I hired her yesterday", "She hired me yesterday"),
    ):
        assert order.RULE.differs(a, b) or order.RULE.differs(b, a), (a, b)
        assert refused(a, b) == "order", (a, b)


def test_order_the_same_roles_with_pronouns_reworded_pass():
    for a, b in (
        ("My boss yells at me. What should I do?", "What should I do when my boss yells at me?"),
        ("Why does my dog bite me?", "Why does my dog keep biting me?"),
        (
            "My landlord is suing me. What are my options?",
            "My landlord is suing me, what can I do?",
        ),
        ("How can I improve my English?", "How can I improve my English skills?"),
        ("How do I tell him I like him?", "How do I tell her I like her?"),
    ):
        assert passes(order.RULE, a, b), (a, b)


def test_order_refuses_a_role_named_by_a_phrase_exchanged_with_a_pronoun():
    # One word was exchanged with the pronoun: a role of several words ("my friend's dog",
    # "the police", "my old boss") passed the rule, and the verifier served some (0.99).
    for a, b in (
        ("My friend's dog bit me", "I bit my friend's dog"),
        ("My boss's wife hit me, what should I do?", "I hit my boss's wife, what should I do?"),
        ("Why did my sister's husband leave me?", "Why did I leave my sister's husband?"),
        ("The company's lawyer sued me", "I sued the company's lawyer"),
        ("The police are chasing me", "I am chasing the police"),
        ("My old boss hired me", "I hired my old boss"),
        ("A stranger followed me home", "I followed a stranger home"),
        (
            "Should she forgive her ex-husband's new wife?",
            "Should her ex-husband's new wife forgive her?",
        ),
        # The verb agreeing with the other person ("has" / "have", "was" / "were", "does" /
        # "do") or contracted with the pronoun ("I'm", "I've") (a review: served, 0.98-0.99).
        ("My friend's dog has bitten me twice", "I have bitten my friend's dog twice"),
        ("My friend's kids were bullying me", "I was bullying my friend's kids"),
        (
            "Does my landlord's agent owe me the deposit?",
            "Do I owe my landlord's agent the deposit?",
        ),
        ("My ex's family has blocked me on Facebook", "I've blocked my ex's family on Facebook"),
        ("I'm suing my ex-husband's new wife", "My ex-husband's new wife is suing me"),
        # "you" takes a role too, "your" a possessive (served, 0.99).
        ("You bit my friend's dog", "My friend's dog bit you"),
        ("Why does your old boss hate you?", "Why do you hate your old boss?"),
    ):
        assert refused(a, b) == "order", (a, b)
    # Saying which is which, or a relation that holds both ways round, reads the same either
    # way (a review: "I'm married to my cousin" / "My cousin is married to me" refused, 0.989).
    for a, b in (
        (
            "I am the executor of my dad's will. What do I need to do?",
            "The executor of my dad's will is me. What do I need to do?",
        ),
        ("I'm tired of my job", "I am tired of my job"),
        ("I'm married to my cousin, is that legal?", "My cousin is married to me, is that legal?"),
        (
            "I'm friends with my boss. Is that a problem?",
            "My boss is friends with me. Is that a problem?",
        ),
        ("I'm dating my coworker, is that allowed?", "My coworker is dating me, is that allowed?"),
        (
            "I'm the same age as my stepmom, is that weird?",
            "My stepmom is the same age as me, is that weird?",
        ),
    ):
        assert passes(order.RULE, a, b), (a, b)
    # "'ll" and "'d" are "will" and "would" (a review: served, 0.95-0.99); a symmetric word
    # elsewhere in the clause, or a noun, links no two (a third review: served, 0.98-0.99).
    for a, b in (
        (
            "My roommate owes me $500, how do I get it back?",
            "I owe my roommate $500, how do I get it back?",
        ),
        (
            "My fiance cheated on me while we were engaged",
            "I cheated on my fiance while we were engaged",
        ),
        (
            "My ex is stalking me now that I'm dating someone",
            "I am stalking my ex now that I'm dating someone",
        ),
        (
            "My sister is jealous of me because we're the same age",
            "I am jealous of my sister because we're the same age",
        ),
        (
            "My landlord sued me the same day I moved out",
            "I sued my landlord the same day I moved out",
        ),
        ("My dad hit me when we were arguing", "I hit my dad when we were arguing"),
        ("My friend's dog had bitten me", "I'd bitten my friend's dog"),  # ("'d": "had" too)
        ("I'll pay my brother back next month", "My brother will pay me back next month"),
        ("I'd marry my cousin if it were legal", "My cousin would marry me if it were legal"),
        ("She'll divorce him if he cheats", "He'll divorce her if she cheats"),
    ):
        assert refused(a, b) == "order", (a, b)
    # A clause joined by "and" / "but" / "so" before a pronoun says the other pronoun once the
    # roles before it are exchanged: the sentence read whole passed (0.98, served).
    for a, b in (
        ("I lent my friend money and he spent it", "My friend lent me money and I spent it"),
        ("My boss yelled at me but I stayed calm", "I yelled at my boss but he stayed calm"),
        ("My sister hit me so I told my dad", "I hit my sister so she told my dad"),
    ):
        assert refused(a, b) == "order", (a, b)
    assert passes(
        order.RULE, "I called my mom and she answered", "I called my mom and she picked up"
    )
    # A middle that only joins the two exchanges no role.
    for a, b in (
        ("I and my brother went to Paris", "My brother and I went to Paris"),
        ("Me and my wife want to adopt", "My wife and I want to adopt"),
    ):
        assert passes(order.RULE, a, b), (a, b)


def test_order_roles_exchanged_in_one_clause_of_several_are_refused():
    # Only words said once on each side were exchanged (a question naming a role again passed),
    # "an uncle" / "a nephew" counted as a mismatch, one-letter names were articles, and a name
    # said twice ("the book John wanted") was never exchanged: all served.
    for a, b in (
        (
            "If Alice owes Bob $50 and pays him, what is Bob's balance?",
            "If Bob owes Alice $50 and pays her, what is Bob's balance?",
        ),
        (
            "Write an email from a manager to an employee announcing a promotion.",
            "Write an email from an employee to a manager announcing a promotion.",
        ),
        (
            "Team A beat Team B 3-1. Who advances to the final?",
            "Team B beat Team A 3-1. Who advances to the final?",
        ),
        (
            "Node A sends a SYN to node B. Which node replies with SYN-ACK?",
            "Node B sends a SYN to node A. Which node replies with SYN-ACK?",
        ),
        (
            "Player X challenged player Y to a duel and player Y accepted. Who chose the weapons?",
            "Player Y challenged player X to a duel and player X accepted. Who chose the weapons?",
        ),
        (
            "Mary gave John the book John wanted. Who is grateful?",
            "John gave Mary the book Mary wanted. Who is grateful?",
        ),
        (
            "If the husband is a US citizen sponsoring the wife, what visa does the wife need?",
            "If the wife is a US citizen sponsoring the husband, what visa does the wife need?",
        ),
        (
            "An uncle adopted a nephew; what rights does the nephew gain?",
            "A nephew adopted an uncle; what rights does the nephew gain?",
        ),
        (
            "The landlord evicted the tenant, and the tenant appealed. Who will the landlord face?",
            "The tenant evicted the landlord, and the landlord appealed. Who will the landlord face?",
        ),
        (
            "Company X sued company Y for breach of contract; what can company X recover?",
            "Company Y sued company X for breach of contract; what can company X recover?",
        ),
        # (Joined on one side only: it was refused one way round, served the other, 0.994.)
        (
            "I know Python and Python is easier than Java, right?",
            "I know Python and Java is easier than Python, right?",
        ),
    ):
        assert order.RULE.differs(a, b) and order.RULE.differs(b, a), (a, b)
        assert refused(a, b) == "order", (a, b)


def test_order_a_question_asked_of_the_other_role_is_refused():
    # "Who did X kill?" asks X's victim, "Who killed X?" X's killer: no exchange of two words
    # makes one the other, and the verifier served most (a review: 9 of 16, 0.93-0.99).
    for a, b in (
        ("Who did Cain kill?", "Who killed Cain?"),
        ("Who did Brutus betray?", "Who betrayed Brutus?"),
        ("Who did Lee Harvey Oswald shoot?", "Who shot Lee Harvey Oswald?"),
        (
            "Which team did Argentina beat in the 2022 World Cup final?",
            "Which team beat Argentina in the 2022 World Cup final?",
        ),
        ("Who does Romeo love?", "Who loves Romeo?"),
        # A second review's: "whom", "what", words before the question, no "did", a past not
        # spelled as its verb, the passive (served, 0.98-0.99).
        (
            "Whom did Nadal beat in the 2008 Wimbledon final?",
            "Who beat Nadal in the 2008 Wimbledon final?",
        ),
        ("What did the Titanic hit?", "What hit the Titanic?"),
        ("What animals do foxes hunt?", "What animals hunt foxes?"),
        ("In the Bible, who did Cain kill?", "In the Bible, who killed Cain?"),
        ("Do you know who Cain killed?", "Do you know who killed Cain?"),
        ("Who did Brutus see at Philippi?", "Who saw Brutus at Philippi?"),
        ("Who was killed by Cain?", "Who killed Cain?"),
        ("Who was Abraham Lincoln shot by?", "Who was shot by Abraham Lincoln?"),
        ("Who was Oswald shot by?", "Who did Oswald shoot?"),
        # "play" and "draw" hold both ways round in a match only (a third review: the first
        # version passed them, and served "Who did Heath Ledger play?" / "Who played...").
        (
            "Who did Heath Ledger play in The Dark Knight?",
            "Who played Heath Ledger in The Dark Knight?",
        ),
        ("Who did Picasso draw?", "Who drew Picasso?"),
        # A particle after the verb, "got" for "was" (a fourth review: served, 0.98-0.99).
        ("Who did Taylor Swift write about?", "Who wrote about Taylor Swift?"),
        ("Who did Einstein work for?", "Who worked for Einstein?"),
        ("Who got fired by Trump?", "Who fired Trump?"),
        # (A review: under, from, before, and irregular pasts came/ran, served 0.98-0.99.)
        ("Who did Plato study under?", "Who studied under Plato?"),
        ("What did birds evolve from?", "What evolved from birds?"),
        ("Who did Obama come after?", "Who came after Obama?"),
    ):
        assert refused(a, b) == "order", (a, b)
    for a, b in (
        ("Who did Cain kill?", "Whom did Cain kill?"),
        ("Who killed Cain?", "Who murdered Cain?"),
        ("Who did Cain kill?", "Who was killed by Cain?"),
        ("Who was Oswald shot by?", "Who shot Oswald?"),
        # A verb that holds both ways round asks the same (a review: refused, 0.98-0.99).
        ("Who did Barack Obama marry?", "Who married Barack Obama?"),
        ("Who did Einstein work with?", "Who worked with Einstein?"),
        # ("against" holds both ways round: a review, 28 of 30 such rewordings refused)
        ("Who did Lincoln run against in 1860?", "Who ran against Lincoln in 1860?"),
        ("Who did Federer compete against?", "Who competed against Federer?"),
        ("Which team did Spain face in the final?", "Which team faced Spain in the final?"),
        ("Who did Nixon debate in 1960?", "Who debated Nixon in 1960?"),
        # No act of one on the other: "means", "is" are no verb to exchange around.
        ("Tell me what ROI means", "Tell me what means ROI"),
        ("What is Python?", "What Python is?"),
    ):
        assert passes(order.RULE, a, b), (a, b)


def test_order_a_plural_is_its_singular_in_a_conversion_reversed():
    # "How many liters are in a gallon?" / "How many gallons are in a liter?" exchanges
    # "liters" and "gallon", each said once in another form: no exchange read it (a review:
    # served, 0.98-0.99).
    for a, b in (
        ("How many liters are in a gallon?", "How many gallons are in a liter?"),
        ("How many cups are in a quart?", "How many quarts are in a cup?"),
        ("How many meters are in a foot?", "How many feet are in a meter?"),
        ("How many inches are in a centimeter?", "How many centimeters are in an inch?"),
        ("How many sheep does a wolf kill a year?", "How many wolves does a sheep kill a year?"),
        ("How many geese does a fox eat?", "How many foxes does a goose eat?"),
    ):
        assert refused(a, b) == "order", (a, b)
    assert passes(order.RULE, "How many liters are in a gallon?", "How many liters in one gallon?")
    # Two words each before the same noun are joined as by a coordinator once the noun is read
    # in one form ("intensive and extensive properties": refused while plurals were folded
    # alone, a development rewording).
    for a, b in (
        (
            "What are the major differences between Chinese and Western cultures?",
            "What the difference between western culture and Chinese culture?",
        ),
        (
            "What are some examples of abstract and concrete nouns?",
            "What are some examples of concrete nouns and abstract nouns?",
        ),
    ):
        assert passes(order.RULE, a, b), (a, b)
    assert (
        refused(
            "Is western culture older than chinese culture?",
            "Is chinese culture older than western culture?",
        )
        == "order"
    )


def test_order_the_same_roles_in_clauses_or_a_letter_reworded_pass():
    for a, b in (
        (
            "Team A beat Team B 3-1. Who advances to the final?",
            "Team A beat Team B 3-1; who goes through to the final?",
        ),
        ("Is A a vowel?", "Is a a vowel?"),
        (
            "Should I learn Python or Java? Python or Java?",
            "Should I learn Java or Python? Java or Python?",
        ),
        (
            "The landlord evicted the tenant, and the tenant appealed. What now?",
            "The tenant appealed after the landlord evicted the tenant. What now?",
        ),
        ("Write A Cover Letter For A Nurse", "write a cover letter for a nurse"),
        ("How can I earn money fast online?", "How can I earn money online fast?"),
        (
            "Mary gave John the book John wanted. Who is grateful?",
            "Mary gave John the book that John wanted. Who is grateful?",
        ),
    ):
        assert passes(order.RULE, a, b), (a, b)


@pytest.mark.parametrize("words", [50, 400])
def test_order_tries_a_bounded_number_of_exchanges_however_long_the_text(monkeypatch, words):
    # Every pair of shared words in opposite order was tried, each compared whole: ~450 permuted
    # words froze the gateway for ~19 s. Now one comparison a direction, and a few exchanges
    # (an exchange mends two words at most; the words must land where the other side has them).
    limit = 100
    compared = []
    real = order._mismatches

    def counting(*args):
        compared.append(len(args[0]))
        assert len(compared) <= limit, "more comparisons than the bound"
        return real(*args)

    monkeypatch.setattr(order, "_mismatches", counting)
    text = [f"w{i}" for i in range(words)]
    adjacent = [text[i ^ 1] for i in range(words)]  # every neighbouring pair exchanged
    once = list(text)
    once[3], once[words - 3] = once[words - 3], once[3]
    for other, swapped in ((text[::-1], False), (adjacent, False), (once, True)):
        order._swapped.cache_clear()
        compared.clear()
        assert order.differs(" ".join(text), " ".join(other)) is swapped
        assert len(compared) <= limit


@given(st.text(alphabet=list("aB c.!?:;\n\"“(\x1c\x85\u2028\u00a0\t3_-'’É"), max_size=30))
def test_entities_read_sentence_starts_in_one_pass_as_the_pattern_did(text):
    # The pattern searched the whole text before each word (quadratic); one pass over the gaps
    # between words must find the same words inside sentences.
    start = re.compile(r"(?:^|[.!?:;\n\"“(]\s*)$")
    pattern = [
        m.span() for m in entities._WORD.finditer(text) if not start.search(text[: m.start()])
    ]
    assert [m.span() for m in entities._inside(text)] == pattern


# ------------------------------------------------------------------------------ polarity


def test_polarity_a_one_word_opposite_is_refused():
    for a, b in (
        ("Is aspirin safe with coffee?", "Is aspirin unsafe with coffee?"),
        ("List the advantages of remote work.", "List the disadvantages of remote work."),
        ("Why is my phone charging fast?", "Why is my phone charging slowly?"),
        ("How do I import my contacts?", "How do I export my contacts?"),
        ("锻炼有哪些好处？", "锻炼有哪些坏处？"),
    ):
        assert refused(a, b) == "polarity", (a, b)


def test_polarity_a_comparative_or_superlative_of_an_opposite_is_refused():
    # A review found these served: the list held "big" / "small", never "bigger" / "smaller".
    for a, b in (
        ("Which is bigger, the Sun or the Earth?", "Which is smaller, the Sun or the Earth?"),
        ("Which planet is larger, Mars or Venus?", "Which planet is smaller, Mars or Venus?"),
        ("Who is older, Barack or Michelle?", "Who is younger, Barack or Michelle?"),
        ("Which is faster, Python or Java?", "Which is slower, Python or Java?"),
        (
            "Which river is longer, the Nile or the Amazon?",
            "Which is shorter, the Nile or the Amazon?",
        ),
        ("Which is stronger, steel or titanium?", "Which is weaker, steel or titanium?"),
        ("Which month has the longest day?", "Which month has the shortest day?"),
        ("Which is newer, HDMI or DisplayPort?", "Which is older, HDMI or DisplayPort?"),
        ("Is Spanish easier to learn?", "Is Spanish harder to learn?"),
        ("What is the hottest planet?", "What is the coldest planet?"),
        ("Which is the earliest flight?", "Which is the latest flight?"),
        ("Which is safer, flying or driving?", "Which is riskier, flying or driving?"),
        ("Which is heavier, water or oil?", "Which is lighter, water or oil?"),
    ):
        assert refused(a, b) == "polarity", (a, b)


def test_polarity_opposites_the_list_lacked_are_refused():
    for a, b in (
        ("Sort a list in ascending order.", "Sort a list in descending order."),
        ("Do they drive on the left in Japan?", "Do they drive on the right in Japan?"),
        ("What foods raise blood sugar?", "What foods reduce blood sugar?"),
        ("What foods raise blood pressure?", "What foods lower blood pressure?"),
        ("Why do some people succeed at dieting?", "Why do some people fail at dieting?"),
        ("Which way is north from here?", "Which way is south from here?"),
        ("Is the Atlantic wider than it was?", "Is the Atlantic narrower than it was?"),
        ("How deep is the lake?", "How shallow is the lake?"),
        ("Explain quantum computing for beginners.", "Explain quantum computing for experts."),
        # (The verifier scored "Hi." / "Bye." 0.995, "hello" / "goodbye" 0.98.)
        ("Hi!", "Bye!"),
        ("hello there", "goodbye there"),
        ("yes, go ahead", "no, go ahead"),  # (a reply's yes or no)
        ("Sure, delete them.", "Nope, delete them."),
        ("Hmm, no, go ahead", "Hmm, yes, go ahead"),  # (its first word but filler)
        ("thanks! no, go ahead", "thanks! yes, go ahead"),
        ("Ok so no, go ahead", "Ok so yes, go ahead"),
        ("No - go ahead", "Yes - go ahead"),  # (no mark after it: still a reply)
        ("No\ngo ahead and delete it", "Yes\ngo ahead and delete it"),
        ("No go ahead and delete it", "Yes go ahead and delete it"),
        ("Ok, no, go ahead", "Ok, yes, go ahead"),  # (the last of a run of filler)
        ("Good question. No, go ahead", "Good question. Yes, go ahead"),  # (a clause's)
        ("Hi! No, go ahead", "Hi! Yes, go ahead"),
        ("Right, no, go ahead", "Right, yes, go ahead"),
        ("Yes and go ahead", "No and go ahead"),
        # A later clause's, when both open with the same reply word.
        (
            "Sure, one more question. Yes, go ahead and delete the branch.",
            "Sure, one more question. No, go ahead and delete the branch.",
        ),
        ("Hi. Hmm well so um oh ah no, go ahead.", "Hi. Hmm well so um oh ah yes, go ahead."),
        # Clause by clause: each question answered otherwise, as many yeses and noes.
        (
            "Do I use Windows? Yes. Do I have admin rights? No. How do I install Python?",
            "Do I use Windows? No. Do I have admin rights? Yes. How do I install Python?",
        ),
    ):
        assert refused(a, b) == "polarity", (a, b)


def test_operators_a_factorial_is_no_exclamation():
    assert refused("How big is 52!", "How big is 52?") == "operator"
    assert refused("Is 3!! the same as 3!", "Is 3! the same as 3") == "operator"


def test_operators_marks_standing_alone_are_what_is_asked_about():
    # After a word "!!" and "??" end a sentence; alone they are operators ("!!" casts to a
    # boolean, "??" coalesces): "What does !!" / "What does ??" scored 0.995.
    assert refused("What does !!", "What does ??") == "operator"
    assert refused("Meaning of !!!", "Meaning of ???") == "operator"
    assert refused("Why write a ?? b", "Why write a || b") == "operator"
    assert refused("In C#, what is ??", "In C#, what is ?") == "operator"
    assert refused("In Kotlin what does !!", "In Kotlin what does ?") == "operator"
    assert refused("In JavaScript what does !!", "In JavaScript what does !") == "operator"
    # After a word that leaves the question open, a run ends it as what is asked about, against
    # a mark after that word too ("In C#, what is?" 0.995 served).
    assert refused("In C#, what is ??", "In C#, what is?") == "operator"
    assert refused("In JavaScript what does !!", "In JavaScript what does!") == "operator"
    assert refused("In Kotlin what does !!", "In Kotlin what does?") == "operator"
    assert refused("What is the meaning of ??", "What is the meaning of?") == "operator"
    assert refused("In C#, what's ??", "In C#, what's?") == "operator"
    assert refused("In C#, what is ??.", "In C#, what is?") == "operator"
    assert refused("In C#, what is (??)", "In C#, what is?") == "operator"
    assert refused("What is the Kotlin operator !!", "What is the Kotlin operator?") == "operator"
    assert refused("In JavaScript, define ??", "In JavaScript, define?") == "operator"
    for asked in (
        "In C#, tell me about",
        "In C#, how do I use",
        "In C#, what is the purpose of",
        "In Kotlin, why use",
        "In C#, what is the",
        "In C#, explain the",
    ):
        assert refused(f"{asked} ??", f"{asked}?") == "operator", asked
    assert refused("In C#, what is {??}", "In C#, what is?") == "operator"
    assert refused("In C#, what is meant by ??", "In C#, what is meant by?") == "operator"
    assert refused("In C#, what exactly is ??", "In C#, what exactly is?") == "operator"
    assert refused("In C#, what were ??", "In C#, what were?") == "operator"
    # A run beside a comma, a bracket or a hyphen, and single-mark code operators.
    assert refused("In C#, what is ??, exactly?", "In C#, what is ?., exactly?") == "operator"
    assert refused("What is (??) in C#?", "What is (?.) in C#?") == "operator"
    assert refused("In C#, what is the ??-operator", "In C#, what is the ?.-operator") == "operator"
    assert refused("In Kotlin, what does ?. mean", "In Kotlin, what does ?: mean") == "operator"
    assert refused("What does a?.b do in C#?", "What does a.b do in C#?") == "operator"
    # (A question ending in a preposition, then marks apart from it, reads as one asking about
    # them: refused against its retyping, a hit given up: "What is it used for ??" / "...for?".)
    assert refused("What is it used for ??", "What is it used for?") == "operator"
    # A question complete before the run is no operator's: its retyping is served.
    for asked in ("What does YOLO mean", "What is the tallest mountain called", "What is it"):
        assert passes(operators.RULE, f"{asked} ??", f"{asked}?"), asked
    assert passes(operators.RULE, "What is it??", "What is it?")
    assert passes(operators.RULE, "Really!!", "Really?")
    # At the end, apart from the last word, a run ends the sentence: read only against another.
    assert passes(operators.RULE, "Why is the sky blue ??", "Why is the sky blue?")
    assert passes(operators.RULE, "Explain machine learning !!", "Explain machine learning")
    assert passes(operators.RULE, "How do I bake bread !!!", "How do I bake bread!!!")


def test_polarity_a_yes_or_no_that_is_no_reply_is_read_as_any_word():
    # "No problem" / "Sure" are the same reply; "Yes or no:" asks for one.
    for a, b in (
        ("No problem, how do I reset my router?", "Sure, how do I reset my router?"),
        ("No worries, explain photosynthesis.", "OK, explain photosynthesis."),
        ("Yes or no: is Paris in France?", "No or yes: is Paris in France?"),
        # (A later clause opening with "No" and a noun is no reply.)
        ("Explain recursion simply. No jargon.", "Explain recursion simply, ok? Without jargon."),
    ):
        assert refused(a, b) != "polarity", (a, b)


def test_polarity_opposites_of_everyday_domains_are_refused():
    # A review found these served: odd / even, keep / discard and under- / over- were no pair.
    for a, b in (
        ("Is the sum of two odd numbers even?", "Is the sum of two even numbers even?"),
        (
            "How do I undo the last git commit but keep the changes?",
            "How do I undo the last git commit and discard the changes?",
        ),
        ("Should I keep old tax records?", "Should I delete old tax records?"),
        ("Is Tesla stock undervalued right now?", "Is Tesla stock overvalued right now?"),
        ("Why do people underestimate risks?", "Why do people overestimate risks?"),
    ):
        assert refused(a, b) == "polarity", (a, b)
    for a, b in (
        ("Is the sum of two odd numbers even?", "Is adding two odd numbers always even?"),
        (
            "How do I undo the last git commit but keep the changes?",
            "How can I undo my last git commit and keep the changes?",
        ),
        ("Is Tesla stock overvalued right now?", "Is Tesla stock currently overvalued?"),
    ):
        assert passes(polarity.RULE, a, b), (a, b)


def test_polarity_inverse_actions_of_code_and_tools_are_refused():
    # A review: read / write served (0.99), load / save, copy / paste, promote / demote and
    # others left to the verifier's score alone (0.94-0.98).
    for a, b in (
        ("How to read a CSV file with pandas", "How to write a CSV file with pandas"),
        ("How do I load a pickle file?", "How do I save a pickle file?"),
        ("What is the shortcut to copy on a Mac?", "What is the shortcut to paste on a Mac?"),
        ("How do I promote a user in Discord?", "How do I demote a user in Discord?"),
        ("How do I grant access to a bucket?", "How do I revoke access to a bucket?"),
        ("How do I pause a Docker container?", "How do I resume a Docker container?"),
    ):
        assert refused(a, b) == "polarity", (a, b)
    assert (
        refused(
            "What is the fastest way of saving a DataFrame?",
            "What is the fastest way of loading a DataFrame?",
        )
        == "polarity"
    )
    assert passes(polarity.RULE, "How do I read and write files?", "How do I write and read files?")


def test_polarity_a_reply_reported_yes_against_no_is_refused():
    # A reply after "said", "answered"... was read only at a clause's start (a review: "she
    # answered sure" / "she answered no way" served, 0.984).
    for a, b in (
        (
            "She answered sure when I asked, did she say yes?",
            "She answered no way when I asked, did she say yes?",
        ),
        ("He said yes when I asked, can I go?", "He said no when I asked, can I go?"),
        ("My boss replied ok to my request", "My boss replied nope to my request"),
    ):
        assert refused(a, b) == "polarity", (a, b)
    assert passes(polarity.RULE, "He said no problem when I asked", "He said sure when I asked")
    assert passes(polarity.RULE, "She texted yes", "She replied yes")


def test_polarity_a_word_with_two_opposites_is_refused_both_ways():
    # A word with two opposites kept only the last listed: "old" read "young", never "new", so
    # "Is this car old?" / "Is this car new?" was refused one way and left to the verifier the
    # other (which side was cached decided).
    for a, b in (
        ("Is this car old?", "Is this car new?"),
        ("Is the train fast?", "Is the train slow?"),
        ("Is the box big?", "Is the box small?"),
        ("Should I increase the dose?", "Should I decrease the dose?"),
    ):
        assert refused(a, b) == "polarity", (a, b)


def test_polarity_every_listed_opposite_is_refused_both_ways():
    for word, others in polarity.OPPOSITES.items():
        for other in others:
            a, b = f"Is it {word} now?", f"Is it {other} now?"
            negated = word in polarity.NEGATORS or other in polarity.NEGATORS
            assert polarity.RULE.differs(a, b) is polarity.RULE.differs(b, a) is not negated, (a, b)


def test_polarity_exceeding_against_falling_short_and_before_against_after_are_refused():
    # "exceeds" was read (as ">") only before an amount, "prior to" / "subsequent to" and
    # "predate" / "postdate" were no opposites: each was served the other's answer.
    for a, b in (
        (
            "Does my income exceed the limit if I earn 40k and the cap is 35k?",
            "Does my income fall short of the limit if I earn 40k and the cap is 35k?",
        ),
        (
            "Was the iPhone released prior to the first Android phone?",
            "Was the iPhone released subsequent to the first Android phone?",
        ),
        ("Does the manuscript predate the war?", "Does the manuscript postdate the war?"),
        ("Did Rome fall earlier than Carthage?", "Did Rome fall later than Carthage?"),
    ):
        assert refused(a, b) in ("polarity", "operator"), (a, b)


def test_polarity_exceeding_or_falling_short_said_on_both_sides_passes():
    for a, b in (
        (
            "Does my income exceed the limit?",
            "Is my income exceeding the limit?",
        ),
        (
            "Why did sales fall short of the forecast?",
            "Why did sales fall short of what was forecast?",
        ),
        ("What happened prior to the war?", "What happened in the years prior to the war?"),
    ):
        assert passes(polarity.RULE, a, b), (a, b)


def test_polarity_still_against_no_longer_and_an_exclusion_on_one_side_are_refused():
    # "no longer" has a negator that "still" lacks: the counts differed, so it was the
    # verifier's, which served it (0.97); nothing read "except".
    for a, b in (
        ("Is Pluto still a planet?", "Is Pluto no longer a planet?"),
        ("Is Pluto still a planet?", "Is Pluto not a planet anymore?"),
        ("Do I still need a visa?", "Don't I need a visa any longer?"),
        (
            "List the countries in Europe that use the euro.",
            "List the countries in Europe except those that use the euro.",
        ),
        ("Which fruits are high in fiber?", "Which fruits other than apples are high in fiber?"),
        ("Show all my files.", "Show all my files excluding photos."),
    ):
        assert refused(a, b) == "polarity", (a, b)


def test_polarity_an_exclusion_or_no_longer_said_on_both_sides_passes():
    for a, b in (
        ("What can I eat other than bread?", "What can I eat except bread?"),
        ("Is Pluto no longer a planet?", "Is Pluto not a planet anymore?"),
        ("Is Pluto a planet?", "Is Pluto still a planet?"),
        # "apart from" is as often "in addition to": no exclusion read.
        ("Apart from metrics, what tools are there?", "In addition to metrics, what tools exist?"),
    ):
        assert passes(polarity.RULE, a, b), (a, b)


def test_polarity_no_longer_on_one_side_only_is_refused():
    # "no longer" was subtracted from the negators and read only against "still": said on one
    # side of a long prompt, the verifier served it (0.96).
    memo = (
        "I'm drafting a memo to the team. Please make the tone formal, keep it under 200 words, "
        "and mention that the Friday meeting is {}happening as planned."
    )
    for a, b in (
        (memo.format(""), memo.format("no longer ")),
        ("Is the store open on Sundays?", "Is the store no longer open on Sundays?"),
    ):
        assert refused(a, b) == "polarity", (a, b)


def test_polarity_no_longer_on_both_sides_or_against_a_negation_passes():
    for a, b in (
        ("Why is the app no longer working?", "Why does the app no longer work?"),
        ("Is Pluto no longer a planet?", "Why is Pluto not a planet any longer?"),
        ("Is the meeting no longer happening?", "Is the meeting not happening?"),
    ):
        assert passes(polarity.RULE, a, b), (a, b)


def test_polarity_an_opposite_with_a_negation_is_left_to_the_verifier():
    # "not fast" / "slow" says the same twice over; the verifier reads negations.
    assert polarity.RULE.differs("The train is not fast.", "The train is slow.") is False
    assert polarity.RULE.differs("Is it safe?", "Is it not safe?") is False


def test_polarity_closed_against_open_is_refused_when_open_is_said_on_both_sides():
    # "closed" was not listed, and "open" said on both sides (the question) dropped out of a
    # set difference: an assistant's looked-up "closed" / "open" was served.
    for a, b in (
        (
            "user: Is the pharmacy open right now?\nassistant: Search result: the pharmacy is "
            "closed today.\nuser: Should I go there now?",
            "user: Is the pharmacy open right now?\nassistant: Search result: the pharmacy is "
            "open today.\nuser: Should I go there now?",
        ),
        (
            "Is the museum open on Mondays? The museum is closed on Mondays.",
            "Is the museum open on Mondays? The museum is open on Mondays.",
        ),
        ("Keep the function signature the same.", "Change the function signature as needed."),
    ):
        assert refused(a, b) == "polarity", (a, b)


def test_polarity_an_opposite_said_as_often_on_both_sides_passes():
    for a, b in (
        ("Is the museum open on Mondays?", "Is the museum open on a Monday?"),
        (
            "Open the file, then close it when done.",
            "Close the file when done after you open it.",
        ),
        ("Should I keep my old laptop?", "Is it worth keeping my old laptop?"),
        ("Is the store open or closed today?", "Is the store closed or open today?"),
    ):
        assert passes(polarity.RULE, a, b), (a, b)


# ------------------------------------------------------------------------------ substitution


def test_substitution_one_thing_named_in_place_of_another_is_refused():
    # The verifier scored "router" / "modem" 0.13 bare and 0.99 inside shared filler.
    for a, b in (
        ("how can i reset my router please", "how can i reset my modem please"),
        ("How can I reset my router, please?", "How can I reset my modem, please?"),
        ("How do I unclog a kitchen sink please", "How do I unclog a bathroom sink please"),
        ("how can i reset my old router right now", "how can i reset my old console right now"),
        (
            "how can i reset my microwave right now please, it has been acting up all week",
            "how can i reset my oven right now please, it has been acting up all week",
        ),
    ):
        assert refused(a, b) == "substitution", (a, b)


def test_substitution_a_reworded_frame_another_form_or_a_verb_passes():
    for a, b in (
        ("How do I reset my router?", "How can I reset my router?"),
        ("How do I reset my router?", "How do I reset my routers?"),
        ("How do I change the colour of my text?", "How do I change the color of my text?"),
        ("How do I recieve a refund for my order?", "How do I receive a refund for my order?"),
        ("What are the best tech jobs?", "What are the best technology jobs?"),
        ("What is the best way to learn Python?", "What is the best method to learn Python?"),
        ("What do you want to purchase right now?", "What do you want to buy right now?"),
        ("Why are dogs afraid of fireworks?", "Why are dogs scared of fireworks?"),
        ("How do I reset my router?", "How do I reset my modem and my router?"),
        ("Write a function that sorts a list.", "Write a function that orders a list."),
    ):
        assert passes(substitution.RULE, a, b), (a, b)


def test_substitution_my_against_your_before_the_same_noun_is_refused():
    # Only the content word after a determiner was read: "my essay" / "your essay" was served.
    for a, b in (
        ("Can you check my essay for plagiarism?", "Can you check your essay for plagiarism?"),
        (
            "Can you review my cover letter for a nursing job?",
            "Can you review your cover letter for a nursing job?",
        ),
        ("What do you think of our plan?", "What do you think of your plan?"),
    ):
        assert refused(a, b) == "substitution", (a, b)


def test_substitution_a_question_asked_of_oneself_or_in_general_passes():
    for a, b in (
        ("How can I improve my English?", "How can you improve your English?"),
        ("How do I check my essay for plagiarism?", "How can I check my essay for plagiarism?"),
        ("What is your favourite book?", "What is your favorite book?"),
    ):
        assert passes(substitution.RULE, a, b), (a, b)


# ------------------------------------------------------------------------------ all rules


def test_every_rule_names_its_own_reason():
    assert [r.reason for r in RULES] == [
        Reason.QUOTED,
        Reason.NUMBER,
        Reason.OPERATOR,
        Reason.IDENTIFIER,
        Reason.ENTITY,
        Reason.ORDER,
        Reason.POLARITY,
        Reason.POLARITY,  # (unread: another language's negation)
        Reason.SUBSTITUTION,
        Reason.RELATION,
        Reason.QUALIFIER,
        Reason.TONE,
    ]


def test_the_same_text_passes_every_rule():
    assert refused("What is a hash map?", "What is a hash map?") is None


@given(st.text(max_size=60), st.text(max_size=60))
def test_every_rule_is_symmetric_and_never_fails_on_any_text(a, b):
    refused(a, b)


def test_rules_let_through_what_rewordings_of_the_development_kind_change():
    # Found refusing true rewordings: a possessive, a version with "v", a dotted name against
    # its parts, a coordinated pair in another order, "under"/"over" that compare nothing.
    for a, b in (
        ("What is the capital of Australia?", "Which city is Australia's capital?"),
        ("No, it doesn't exist in v2.10.0.", "It is not available in version 2.10.0."),
        (
            "What are the parameters of datasets.AudioClassification?",
            "What are the parameters of the AudioClassification class of datasets?",
        ),
        ("Are beauty and intelligence related?", "Are intelligence and beauty correlated?"),
        ("Which is better, MBA or CA?", "Which is better, CA or an MBA?"),
        ("Find it under the Text section.", "The Text section has it."),
        ("Apply a transform over the dataset.", "Transform the whole dataset."),
        ("My reset link expired, what now?", "My reset link expired. What should I do?"),
    ):
        assert refused(a, b) is None, (a, b, refused(a, b))


def test_every_stop_word_is_one_word_as_the_rules_read_a_text():
    # A slip in the list's quoting once left `please".split()` there instead of "please": the
    # order and direction rules never saw "please" as a word without a role.
    for word in text.STOP:
        assert text.lower_words(word) == (word,), word
    assert "please" in text.STOP


# A memo keyed by one word or character (a bounded vocabulary), not by a text.
_WORD_KEYED = {"polarity._forms"}


def test_every_memo_of_what_a_rule_read_of_a_text_is_bounded_by_memo():
    """Each rule memoises what it read of a text (its words, numbers, names...), up to
    ``guard.READ_CHARS`` characters: with 8,192 texts a memo, prompts of 4,000 characters held
    over 1 GB (1,000 of them: +600 MB), counted in no budget, shown nowhere. Now ``MEMO`` texts
    of ``MEMO_LONGEST`` characters at most; a longer one is read again each time."""
    import importlib
    import pkgutil

    import carpool.semantic.rules as package

    functions = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if hasattr(value, "cache_info") and value.__module__ == module.__name__:
                functions[f"{info.name}.{name}"] = value
    memos = {name: function.cache_info().maxsize for name, function in functions.items()}
    assert "text.words" in memos and "order._swapped" in memos
    too_large = {
        name: size
        for name, size in memos.items()
        if name not in _WORD_KEYED and (size is None or size > text.MEMO)
    }
    assert not too_large
    long = "How tall is the tower " + "and the bridge " * (text.MEMO_LONGEST // 15) + "?"
    assert len(long) > text.MEMO_LONGEST
    text.words.cache_clear()
    refusal(long, "How tall is the tower?")
    for read in (long, long):
        text.words(read)
    assert text.words.cache_info().hits == 0  # (read again each time)

    # A popular entry's text is read once, then taken from the memos (the guard's speed).
    def hits() -> int:
        return sum(function.cache_info().hits for function in functions.values())

    before = hits()
    for _ in range(3):
        refusal("How tall is tower number 7?", "How tall is the tower?")
    assert hits() > before
