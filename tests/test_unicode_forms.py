"""Unicode normal forms in linear time (``carpool.unicode_forms``)."""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carpool.canonical import canonical_body
from carpool.errors import PathRefused
from carpool.paths import confine
from carpool.unicode_forms import DECOMPOSING_TO_MARKS, STREAM_SAFE_RUN, _long_run, normal_form

# Two combining marks of two classes, alternating: out of canonical order, each pair swapped by
# a normalization, whose sort of a run is quadratic in its length.
PAIR = "\u0301\u0316"


def test_a_text_whose_normalization_would_be_quadratic_is_never_normalized():
    """One prompt of "a" and 60,000 such marks held the event loop ~12 s, 8 MB of them for
    hours: a run of non-starters longer than Unicode's stream-safe bound (30) is read as it
    came, never normalized; a run as long as the bound is normalized."""
    at_the_bound = "a" + PAIR * (STREAM_SAFE_RUN // 2)
    assert normal_form("NFC", at_the_bound) == unicodedata.normalize("NFC", at_the_bound)
    for over in ("a" + PAIR * 16, PAIR * 16, "你好" + PAIR * 500_000 + "x"):
        assert normal_form("NFC", over) is None and normal_form("NFKC", over) is None
    assert normal_form("NFC", "cafe\u0301") == "café"
    assert normal_form("NFKC", "ｆｕｌｌ") == "full"


MARKS = "\u0301\u0316\u064e\u0f73\uff9e"


@given(st.text(alphabet="a你" + MARKS, max_size=200))
def test_a_long_run_is_found_wherever_it_is(text):
    longest = run = 0
    for character in text:
        marks = unicodedata.combining(character) or character in DECOMPOSING_TO_MARKS
        run = run + 1 if marks else 0
        longest = max(longest, run)
    begins = _long_run(text)
    assert (begins >= 0) == (longest > STREAM_SAFE_RUN)
    if begins >= 0:  # (where the first such run begins)
        run = len(text[begins:]) - len(text[begins:].lstrip(MARKS))
        assert run > STREAM_SAFE_RUN and (begins == 0 or text[begins - 1] not in MARKS)
        assert all(len(r) <= STREAM_SAFE_RUN for r in re.split(f"[^{MARKS}]", text[:begins]))


def test_a_prompt_whose_normalization_would_be_quadratic_is_keyed_as_sent():
    """Keyed in NFC, such a prompt was sorted on the event loop, every tenant's requests held
    meanwhile; it is keyed exactly as it came now (its canonical twin is another key)."""
    adversarial = "a" + PAIR * 1000
    body = {"model": "m", "messages": [{"role": "user", "content": adversarial}]}
    assert canonical_body("chat", body, False)["messages"][0]["content"] == adversarial
    composed = {"model": "m", "messages": [{"role": "user", "content": "cafe\u0301"}]}
    assert canonical_body("chat", composed, False)["messages"][0]["content"] == "café"


def test_a_path_whose_compatibility_form_would_be_quadratic_is_refused():
    # (Its NFKC is what the confinement checks read: not read, the path is refused.)
    marks = "".join(f"%{b:02X}" for b in ("a" + PAIR * 16).encode())
    with pytest.raises(PathRefused, match="combining marks"):
        confine(f"/v1/files/{marks}".encode())
    assert confine(b"/v1/files/caf%C3%A9")  # (an accent, normalized, is no refusal)


def test_characters_that_decompose_into_marks_count_in_a_run():
    """U+0F73 is of class 0 but decomposes into two marks of two classes: a run of it was no
    run (each of its characters a starter) and sorted in quadratic time all the same (30,000
    of them 2.7 s, twice a request). Every such character is listed, and counts."""
    listed = set(DECOMPOSING_TO_MARKS)
    found = set()
    for code in range(sys.maxunicode + 1):
        character = chr(code)
        if unicodedata.combining(character):
            continue
        for form in ("NFD", "NFKD"):
            decomposed = unicodedata.normalize(form, character)
            if decomposed != character and unicodedata.combining(decomposed[0]):
                found.add(character)
    assert found == listed
    assert normal_form("NFC", "a" + "\u0f73" * (STREAM_SAFE_RUN + 1)) is None
    halfwidth = "ﾊﾟﾋﾟﾌﾟ ﾃﾞｽ"  # (a voiced mark after each letter: short runs, normalized)
    assert normal_form("NFKC", halfwidth) == unicodedata.normalize("NFKC", halfwidth)


def test_a_kept_prompt_prefix_is_never_normalized_in_quadratic_time():
    # (Every miss keeps its prompt's first characters, NFC: 4,095 U+0F73 are 8,190 marks
    # sorted, ~50 ms of the event loop a request.)
    from carpool.store.base import PROMPT_PREFIX_CHARS, prompt_text

    prompt = "a" + "\u0f73" * 4095
    assert prompt_text(prompt) == prompt[:PROMPT_PREFIX_CHARS]
    assert prompt_text("cafe\u0301") == "café"


def test_an_invalidation_by_prefix_drops_a_prompt_holding_a_long_run_after_it():
    """A kept prompt prefix holding a long run was kept all as sent, its start not composed,
    while a selector, short, was composed: "Cafe\u0301 menu" never matched "Café menu". The
    prefix is normalized up to the run now."""
    from carpool.store.base import prompt_text

    prompt = "Cafe\u0301 menu: a" + "\u0301" * 40
    assert prompt_text(prompt).startswith(prompt_text("Cafe\u0301 menu: "))
    # (Characters the normalization joins to the run's starter go with it: Hangul's jamo, an
    # Indic two-part vowel.)
    for before in ("\u1100\u1161", "x\u0b47\u0b3e"):
        assert prompt_text(before + "\u0301" * 40).startswith(prompt_text(before))
