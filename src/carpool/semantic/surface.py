"""One token as written, whatever its context, for the analysis of a text
(:mod:`carpool.semantic.analysis`).

:func:`token_facts` says what a token is on its own, memoised per token (the same tokens recur
across prompts): a number, with what it says (a value, ordinal, time of day, version or code of
digits; a currency or unit glued to it; "20k" = 20000, "7pm" = "19:00", "v2.1" = "2.1"); an
identifier (digits, underscores, dots, a trailing + or #: "python3", "snake_case", "C++"); or
words: contractions expanded ("isn't" -> "is not", "child's" -> "child" with a possessive mark,
also "dont"), hyphens split ("hash-map" -> "hash map") or joined after a prefix or around a
number word ("non-zero" -> "nonzero", "one-time" -> "onetime", no number), and the case shape
the analysis reads named entities and acronyms from. What a token means next to its neighbours
(a sentence start, a capitalised run, "twenty five" as one number, "one" as a pronoun) is the
analysis's business.
"""

from __future__ import annotations

import re
from functools import lru_cache

from carpool.semantic import guard_words as W
from carpool.semantic.lexicon import NUMBER_TEXT

_NUM_RE = re.compile(r"^(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([a-z%]*)$")
_TIME_RE = re.compile(r"^(\d{1,2})(?::(\d{2}))?\s?([ap])\.?m\.?$")
_CLOCK_RE = re.compile(r"^(\d{1,2}):(\d{2})$")
_ORD_RE = re.compile(r"^(\d+)(st|nd|rd|th)$")
_VERSION_RE = re.compile(r"^v\d+(?:\.\d+)*$")
_CURRENCY = {"$": "usd", "€": "eur", "£": "gbp", "¥": "jpy", "₹": "inr"}
_JOIN_PREFIXES = frozenset("non un re pre co multi sub anti semi".split())


def number_key(x: float) -> str:
    """The key of a number in :attr:`~carpool.semantic.analysis.Analysis.numbers`: digits and
    spelled-out numbers meet here ("3" = "three" = "3.0")."""
    if x == int(x):
        return str(int(x))
    return repr(round(x, 6))


def _is_abbrev(low: str) -> bool:
    parts = [p for p in low.split(".") if p]
    return all(len(p) == 1 and p.isalpha() for p in parts)


def _expand(low: str) -> tuple[list[str], bool]:
    """Contractions -> words; the flag says a possessive "'s" was removed."""
    full = W.CONTRACTIONS.get(low)
    if full is not None:
        return full.split(), False
    if "'" not in low:
        return [low], False
    if low.endswith("n't"):
        stem = low[:-3]
        stem = {"ca": "can", "wo": "will", "ai": "is", "sha": "shall"}.get(stem, stem)
        return [stem, "not"], False
    for suffix, word in W.SUFFIX_CONTRACTIONS.items():
        if low.endswith(suffix):
            return [low[: -len(suffix)], word], False
    if low.endswith("'s"):
        stem = low[:-2]
        if stem in W.S_IS:
            return [stem, "is"], False
        if stem == "let":
            return ["let", "us"], False
        return [stem], True
    if low.endswith("s'"):
        return [low[:-1]], True
    return [low.replace("'", "")], False


SHAPE_LOWER, SHAPE_CAPITAL, SHAPE_CAPS, SHAPE_MIXED, SHAPE_LOWER_MIXED = range(5)


@lru_cache(maxsize=65536)
def token_facts(tok: str) -> tuple:
    """Static facts about one token, whatever its context.

    ``("n", low, facts)`` a number (facts from :func:`_number_facts`), ``("i", low)`` an
    identifier, or ``("w", pieces, is_poss, shape, head, humps)`` words."""
    low = tok.lower().rstrip(".")
    if not low:
        return ("x",)
    first = tok[0]
    if first.isdigit() or first in _CURRENCY or _VERSION_RE.match(low):
        return ("n", low, _number_facts(low[1:] if low[0] == "v" else low))
    if _IDENT_RE.search(low) and not _is_abbrev(low):
        return ("i", low)
    if "." in low:                       # "e.g.", "U.S."
        low = low.replace(".", "")
        tok = tok.replace(".", "")
    pieces, is_poss = _expand(low)
    if "-" in low and len(pieces) == 1 and low not in W.SPELLING_VARIANTS:
        parts = [x for x in low.split("-") if x]
        if parts and (parts[0] in _JOIN_PREFIXES or (
                any(x in NUMBER_TEXT for x in parts)
                and not all(x in NUMBER_TEXT for x in parts))):
            pieces = ["".join(parts)]
        else:
            pieces = parts or [low]
    letters = tok.replace("'", "").replace("-", "")
    humps = ""
    if first.isupper() and first.isalpha():
        if letters.isupper() and len(letters) >= 2:
            shape = SHAPE_CAPS
        elif letters[1:] and not letters[1:].islower():
            shape = SHAPE_MIXED
            humps = "".join(c for c in letters if c.isupper()).lower()
        else:
            shape = SHAPE_CAPITAL
    elif first.islower() and any(c.isupper() for c in letters[1:]):
        shape = SHAPE_LOWER_MIXED
    else:
        shape = SHAPE_LOWER
    return ("w", tuple(pieces), is_poss, shape, pieces[0], humps)


_IDENT_RE = re.compile(r"[\d_@.]|[+#]$")


def _number_facts(low: str) -> tuple[tuple[str, str], ...]:
    """What a number token says: ("n", number key), ("u", unit), ("i", identifier)."""
    out: list[tuple[str, str]] = []
    cur = _CURRENCY.get(low[0])
    if cur:
        out.append(("u", cur))
        low = low[1:]
        if not low:
            return tuple(out)
    m = _TIME_RE.match(low)
    if m:
        h = int(m.group(1)) % 12 + (12 if m.group(3) == "p" else 0)
        out.append(("n", f"t{h}:{m.group(2) or '00'}"))
        return tuple(out)
    m = _CLOCK_RE.match(low)
    if m:
        out.append(("n", f"t{int(m.group(1))}:{m.group(2)}"))
        return tuple(out)
    m = _ORD_RE.match(low)
    if m:
        out.append(("n", f"o{int(m.group(1))}"))
        return tuple(out)
    m = _NUM_RE.match(low.rstrip(","))
    if m:
        value = float(m.group(1).replace(",", "") + (m.group(2) or ""))
        suffix = m.group(3)
        scale = W.NUMBER_SCALES.get(suffix)
        if scale and suffix != "m":
            value *= scale
            suffix = ""
        out.append(("n", number_key(value)))
        if suffix and suffix not in ("am", "pm"):
            unit = W.UNITS.get(suffix) or W.UNITS.get(suffix.rstrip("s"))
            out.append(("u", unit) if unit else ("i", low))
        return tuple(out)
    # dates like 2024-03-13, 13/03/2024, parcel numbers 7734-991, versions 2.10.0
    out.append(("n", "#" + low.rstrip(".,")))
    return tuple(out)
