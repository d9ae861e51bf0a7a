"""Numbers, units, currencies and relative dates must be the same on both sides.

An embedding puts "a 2 bedroom flat" next to "a 3 bedroom flat"; the answers differ. Read here:

- numbers in digits ("1,000", "3.5", "20k", "15%", "v2" is 2, full-width digits), spelled out in English
  ("twenty five", "two hundred") or Chinese ("二十五", "三百", "两"), and ordinals of a thing
  ("3rd", "the third floor"; not the adverb "first"). The two multisets of values must be equal.
  A spelled "one" (or "一") may stand against nothing: "one week" asks what "a week" asks.
- units and currencies, anywhere in the text ("in miles" / "in km", "$5" / "5 euros", "元"):
  the two sets must be equal, each unit under one name ("kilometres" = "km", "$" = "dollars");
  a time of day's am / pm too ("6 am" / "6 pm", "a.m." = "am"), after a number only ("I am");
  "percentage points" and "basis points" are units of their own, not "%" (:mod:`.units`);
- a unit or currency with the number it is written on (a symbol just before it, "$100"; a unit
  just after it, "2 amp", "500 €"): where the same numbers carry units on both sides, each
  must carry the same one ("2 amp ... 5 volts" / "2 volt ... 5 amps", "$100 or €90" / "$90 or
  €100"; before, a set of units and a multiset of numbers read them alike);
- numbers written together, a fraction, a date, a reading or a ratio ("1/3", "03/04/2025",
  "120/80", "16:9"): the same numbers in another order are refused ("1/3" / "3/1", a day and a
  month exchanged);
- relative dates and periods ("today", "tomorrow", "last week" / "last month", "per day",
  "明天", "去年") and times of day in words ("noon" / "midnight", "dawn" / "dusk"): the two
  sets must be equal.
- a unit after a number is read with its case too, where both sides write it with capitals:
  "5 MHz" / "5 mHz", "1 Gbps" / "1 GBps", "20 mSv" / "20 MSv" are mega against milli, bits
  against bytes (they were served at 1.0: a retyping, the verifier never asked). Only a unit
  of measure whose case says something is read so: the prefix m / M (p / P) and b / B of bits
  and bytes; another word after a number ("15 Pro" / "15 PRO") or a capital that says nothing
  ("3 Ghz" / "3 GHz", "1 Kwh" / "1 kWh", "100 Mhz" / "100 MHz") passes. A unit in lower case
  ("5 mhz") or in a text written in capitals says nothing of its case: how a user types, so
  it passes against any case.
"""

from __future__ import annotations

import re
from collections import Counter

from ..verdict import Reason, Rule
from .text import lower_words, memo, norm
from .units import AFTER_NUMBER_ONLY, CLOCK, CN_DATES, DATES, TIMES_OF_DAY, UNITS, points

#: Read on the lower-cased text (no re.I: it would fold the "v" of "v2" into the letters); a
#: number with letters glued to it too ("5gb", "5g", "3d", "10x": read by no rule, a review),
#: and one in scientific notation ("1e5").
_DIGITS = re.compile(
    r"(?<![a-uw-z0-9_.])(\d+(?:,\d{3})+|\d+(?:\.\d+)?(?:e[+-]?\d+)?|\.\d+)"
    r"(?:\s*(k|m|bn|st|nd|rd|th|am|pm)(?![a-z0-9_])|(?![a-z0-9_])|(?=[a-z°]{1,4}(?![a-z0-9_])))"
)
SMALL = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen".split()
    )
}
TENS = {
    w: 10 * (i + 2)
    for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())
}
SCALES = {
    "hundred": 100,
    "thousand": 1_000,
    "million": 1_000_000,
    "billion": 1_000_000_000,
    "dozen": 12,
}
ORDINALS = {
    w: i + 1
    for i, w in enumerate(
        "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth".split()
    )
}
#: An ordinal word counts only after one of these ("the third floor", not "first, do this").
_ORDINAL_AFTER = frozenset(
    {"the", "my", "your", "his", "her", "its", "our", "their", "this", "that", "a"}
)
_SUFFIX = {"k": 1_000, "m": 1_000_000, "bn": 1_000_000_000}
_CN_DIGITS = {
    "零": 0,
    "〇": 0,
    "一": 1,
    "二": 2,
    "两": 2,
    "三": 3,
    "四": 4,
    "五": 5,
    "六": 6,
    "七": 7,
    "八": 8,
    "九": 9,
}
_CN_SCALES = {"十": 10, "百": 100, "千": 1_000, "万": 10_000, "亿": 100_000_000}
_CN_NUMBER = re.compile(f"[{''.join(_CN_DIGITS)}{''.join(_CN_SCALES)}]+")
#: "一" in these words is no number ("一下" a moment, "一起" together, "一样" the same...).
_CN_NOT_ONE = re.compile(r"一(?=[下起样些般直定切旦致共点会边])|(?<=[统唯万])一|^一(?=个?[问])")


def _english(words: tuple[str, ...]) -> tuple[list[float], int]:
    """Spelled numbers (and the count of lone "one"s among them) in ``words``."""
    values: list[float] = []
    ones = 0
    total = current = None
    for i, w in enumerate((*words, "")):
        if w in SMALL or w in TENS:
            current = (current or 0) + SMALL.get(w, TENS.get(w, 0))
            continue
        if w in SCALES and (current is not None or total is not None):
            total = (total or 0) + (current or 1) * SCALES[w]
            current = None
            continue
        if current is not None or total is not None:
            value = (total or 0) + (current or 0)
            ones += value == 1 and words[i - 1] == "one"
            values.append(value)
            total = current = None
        if w in ORDINALS and i > 0 and words[i - 1] in _ORDINAL_AFTER:
            values.append(ORDINALS[w])
    return values, ones


def _chinese(text: str) -> tuple[list[float], int]:
    values: list[float] = []
    ones = 0
    for m in _CN_NUMBER.finditer(_CN_NOT_ONE.sub(" ", text)):
        total = section = 0
        digit = None
        for ch in m.group():
            if ch in _CN_DIGITS:
                digit = _CN_DIGITS[ch]
            elif ch in ("万", "亿"):
                total = (total + section + (digit or 0)) * _CN_SCALES[ch]
                section, digit = 0, None
            else:
                section += (1 if digit is None else digit) * _CN_SCALES[ch]
                digit = None
        value = total + section + (digit or 0)
        ones += m.group() == "一"
        values.append(value)
    return values, ones


#: A number with the unit written on it, and numbers written together, each counted.
Amounts = Counter[tuple[float, str]]
Groups = Counter[tuple[float, ...]]
#: Numbers written together, in an order that is their meaning: a fraction, a date, a reading
#: or a ratio ("1/3", "03/04/2025", "120/80", "16:9", "2024-03-04", "1:1.5", "1,000:1"), each
#: written as ``_DIGITS`` reads a number (a decimal, thousands).
_PIECE = r"(?:\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
_GROUP = re.compile(rf"(?<![\w.,]){_PIECE}(?:\s*[/:-]\s*{_PIECE})+(?![\w])")
_PIECES = re.compile(_PIECE)
#: A currency symbol just before a number ("$100", "¥ 5,000"), and what follows a number.
_SYMBOL_BEFORE = re.compile(r"([$€£¥])\s?$")
_AFTER = re.compile(r"\s*([%$€£¥]|[a-z°][a-z°/_]*(?:\.[a-z])?)")


def _parts(word: str) -> tuple[str, ...]:
    """A hyphenated number read in its parts: "twenty-one", "a five-year-old" is "a five year
    old", "a two-bedroom flat", "a 30-year mortgage" (a review: "five-year-old" /
    "six-year-old" passed, "five year old" / "five-year-old" was refused); but "zero-" and
    "one-" before a word that is no number, date or unit ("zero-copy", "non-zero", "one-time":
    no count of anything, the other side may say it without a number)."""
    parts = tuple(word.split("-"))
    if len(parts) < 2 or not (parts[0] in SMALL or parts[0] in TENS or parts[0].isdigit()):
        return (word,)
    second = parts[1]
    if second in SMALL or second in TENS or second in DATES or second in UNITS:
        return parts
    return (word,) if parts[0] in ("zero", "one") else parts


def _unit_of(flat: str, m: re.Match[str]) -> str | None:
    """The unit or currency written on the number ``m``: a symbol just before it ("$100"), its
    am / pm, or a unit just after it ("2 amp", "500 €", "15%")."""
    if symbol := _SYMBOL_BEFORE.search(flat, max(0, m.start() - 2), m.start()):
        return UNITS[symbol.group(1)]
    if m.group(2) in ("am", "pm"):
        return UNITS[m.group(2)]
    after = _AFTER.match(flat, m.end())
    return UNITS.get(after.group(1)) if after else None


@memo
def _read(
    text: str,
) -> tuple[Counter[float], int, frozenset[str], frozenset[str], Amounts, Groups, frozenset[str]]:
    """(numbers, spelled "one"s among them, units, dates, amounts, groups, times of day) of
    ``text``."""
    text = points(norm(text))
    flat = text.lower()
    numbers: Counter[float] = Counter()
    units = set()
    amounts: Amounts = Counter()
    for m in _DIGITS.finditer(flat):
        value = float(m.group(1).replace(",", ""))
        value *= _SUFFIX.get((m.group(2) or "").lower(), 1)
        numbers[value] += 1
        if (unit := _unit_of(flat, m)) is not None:
            units.add(unit)
            amounts[value, unit] += 1
    groups = Counter(
        tuple(float(piece.replace(",", "")) for piece in _PIECES.findall(g.group()))
        for g in _GROUP.finditer(flat)
    )
    words = tuple(part for w in lower_words(text) for part in _parts(w))
    spelled, ones = _english(words)
    chinese, cn_ones = _chinese(flat)
    numbers.update(spelled)
    numbers.update(chinese)
    for w in words:
        # A unit that is also a word ("in", "m", "am") only on its number (read above).
        if w in UNITS and w not in AFTER_NUMBER_ONLY:
            units.add(UNITS[w])
        elif clock := CLOCK.fullmatch(w):
            units.add(UNITS[clock.group(1)])
    units.update(UNITS[s] for s in ("$", "€", "£", "¥", "%") if s in flat)
    units.update(
        UNITS[w] for w in UNITS if not w.isascii() and w not in AFTER_NUMBER_ONLY and w in flat
    )
    dates = {DATES[w] for w in words if w in DATES}
    dates.update(v for k, v in CN_DATES.items() if k in flat)
    times = frozenset(TIMES_OF_DAY[w] for w in words if w in TIMES_OF_DAY)
    return numbers, ones + cn_ones, frozenset(units), frozenset(dates), amounts, groups, times


def _reordered(x: Groups, y: Groups) -> bool:
    """The same numbers written together on both sides, in another order ("1/3" / "3/1")."""
    return x != y and Counter(tuple(sorted(g)) for g in x.elements()) == Counter(
        tuple(sorted(g)) for g in y.elements()
    )


def _moved(x: Amounts, y: Amounts) -> bool:
    """The same numbers carry units on both sides, another unit each ("500 €" / "500 £")."""
    return x != y and Counter(v for v, _ in x.elements()) == Counter(v for v, _ in y.elements())


#: A word just after a number, as written: "5 MHz", "10meV".
_CASED_UNIT = re.compile(r"(?<![^\W\d_])\d+(?:[.,]\d+)?\s?([^\W\d_]+)")
#: A unit whose case can carry meaning: a prefix and a unit of measure, read in any case.
_PREFIXED = re.compile(r"([kmgtpuµ]?)(hz|wh|w|v|ah|a|ohms?|sv|gy|ev|pa|j|l|g|bps|b)", re.I)


def _meant(unit: str) -> tuple[str, str] | None:
    """What the case of ``unit`` says: milli or mega (pico or peta) and bits or bytes; None
    for a word that is no such unit ("15 Pro", "11 Home"). A capital on a unit of measure
    ("Hz", "Wh") or on a prefix that has no other case ("Ghz", "Kwh": no milli-giga) says
    nothing."""
    found = _PREFIXED.fullmatch(unit)
    if found is None:
        return None
    prefix, measure = found.groups()
    if prefix not in ("m", "M", "p", "P"):
        prefix = prefix.lower()
    # "b" is bits, "B" bytes (and "Mbps" / "MBps"); any other unit's letters are one unit.
    return prefix, measure if measure in ("b", "B", "bps", "Bps") else measure.lower()


@memo
def _cased_units(text: str) -> dict[str, set[tuple[str, str]]]:
    """The units after a number whose case says something, by their letters in lower case:
    not in lower case, not in a text written in capitals (neither says which case was
    meant)."""
    text = norm(text)
    if not any(ch.islower() for ch in text):
        return {}
    units: dict[str, set[tuple[str, str]]] = {}
    for unit in _CASED_UNIT.findall(text):
        if not unit.islower() and (meant := _meant(unit)) is not None:
            units.setdefault(unit.casefold(), set()).add(meant)
    return units


def _case_differs(a: str, b: str) -> bool:
    """A unit after a number written in another case on each side, both with capitals, that
    says another prefix or bits against bytes."""
    ua, ub = _cased_units(a), _cased_units(b)
    return any(letters in ub and not meant <= ub[letters] for letters, meant in ua.items())


def differs(a: str, b: str) -> bool:
    if _case_differs(a, b) or _case_differs(b, a):
        return True
    na, ones_a, units_a, dates_a, amounts_a, groups_a, times_a = _read(a)
    nb, ones_b, units_b, dates_b, amounts_b, groups_b, times_b = _read(b)
    if units_a != units_b or dates_a != dates_b or (times_a and times_b and times_a != times_b):
        return True
    # (Whatever else differs: "Book one room from 03/04" / "Book a room from 04/03" too.)
    if _reordered(groups_a, groups_b) or _moved(amounts_a, amounts_b):
        return True
    if na == nb:
        return False
    # "one week" / "a week": the only difference is spelled ones on the side that has more.
    extra = (na - nb) + (nb - na)
    if set(extra) != {1}:
        return True
    more_ones = ones_a if na[1] > nb[1] else ones_b
    return extra[1] > more_ones


RULE = Rule(Reason.NUMBER, differs)
