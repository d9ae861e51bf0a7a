"""Unicode normal forms in linear time: ``normal_form``.

Normalizing a text sorts each run of non-starters (characters of a canonical combining class
other than 0, combining marks) by class, and CPython sorts by insertion: quadratic in the run's
length. One prompt of ``"a"`` and 60,000 alternating marks held the event loop ~12 s (every
tenant's requests with it), 8 MB of them for hours, a stop signal unread meanwhile.

Contract:
- ``normal_form(form, text)``: ``text`` in the normal form ``form`` ("NFC", "NFKC"...), or
  None when it holds a run of more than ``STREAM_SAFE_RUN`` non-starters (Unicode's
  stream-safe bound, UAX #15: no text of any language needs a longer one), counting the
  characters of class 0 that decompose into a non-starter first (``DECOMPOSING_TO_MARKS``:
  Tibetan's U+0F73 is two marks of two classes, sorted as any). The caller reads such a text
  as it came (a key exact, no semantic view) or refuses it; never normalized.
- Linear: an ASCII text costs nothing more; another costs one look at about one character in
  ``STREAM_SAFE_RUN + 1`` where runs are short (each character looked at twice at most),
  then the normalization, itself linear on such a text.
"""

from __future__ import annotations

import unicodedata
from unicodedata import combining

__all__ = ["STREAM_SAFE_RUN", "normal_form", "normal_form_before_run"]

# The longest run of non-starters a text may hold and still be normalized (UAX #15).
STREAM_SAFE_RUN = 30
# The characters of combining class 0 whose decomposition (canonical or compatibility) begins
# with a non-starter: a run of them is a run of marks once decomposed (tested to be all).
DECOMPOSING_TO_MARKS = "\u0f73\u0f75\u0f81\uff9e\uff9f"


def normal_form(form: str, text: str) -> str | None:
    """``text`` in normal form ``form``, or None if normalizing it would be quadratic (module
    contract)."""
    if text.isascii():
        return text
    if _long_run(text) >= 0:
        return None
    return unicodedata.normalize(form, text)  # type: ignore[arg-type]


def normal_form_before_run(form: str, text: str) -> str:
    """``text`` in normal form ``form`` up to its first long run, the run as it came and what
    follows (all of it normalized if it holds none): a prefix of it that ends before the run
    is in the form it has here (an invalidation's selector matches the prompts kept)."""
    if text.isascii():
        return text
    begins = _long_run(text)
    if begins < 0:
        return unicodedata.normalize(form, text)  # type: ignore[arg-type]
    # (The starter the run's marks sit on is normalized with what comes before it, as a
    # selector ending there is: cut before it, Hangul's jamo or an Indic two-part vowel it
    # joins were left apart here and joined there.)
    return unicodedata.normalize(form, text[:begins]) + text[begins:]  # type: ignore[arg-type]


def _long_run(text: str) -> int:
    """Where ``text``'s first run of more than ``STREAM_SAFE_RUN`` non-starters begins, or -1.
    A run that long covers every ``STREAM_SAFE_RUN + 1``-th character: only those are looked
    at, and around the ones that are non-starters, back to where their run begins."""
    # (``combining`` alone, in C, unless one of the few that decompose into marks is there.)
    nonstarter = _nonstarter if any(c in text for c in DECOMPOSING_TO_MARKS) else combining
    span = STREAM_SAFE_RUN + 1
    if not any(map(nonstarter, text[span - 1 :: span])):
        return -1  # (the common case: none of those is a non-starter)
    at = span - 1
    while at < len(text):
        if not nonstarter(text[at]):
            at += span  # (no run of ``span`` holds it: the next may end ``span`` further on)
            continue
        # Back to where its run begins: shorter than ``span`` unless it is the first such run
        # (every character looked at twice at most).
        begins = at
        while begins > 0 and nonstarter(text[begins - 1]):
            begins -= 1
        if at - begins + 1 >= span:
            return begins
        at = begins - 1 + span  # (a run of ``span`` begins after ``begins - 1``)
    return -1


def _nonstarter(character: str) -> bool:
    """Whether ``character`` is, or decomposes into, a non-starter first."""
    return bool(combining(character)) or character in DECOMPOSING_TO_MARKS
