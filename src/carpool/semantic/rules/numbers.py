"""Numbers, units, currencies and relative dates must be the same on both sides.

An embedding puts "a 2 bedroom flat" next to "a 3 bedroom flat"; the answers differ. Read here:

- numbers in digits ("1,000", "3.5", "20k", "15%", "v2" is 2, full-width digits), spelled out in English
  ("twenty five", "two hundred") or Chinese ("二十五", "三百", "两"), and ordinals of a thing
  ("3rd", "the third floor"; not the adverb "first"). The two multisets of values must be equal.
  A spelled "one" (or "一") may stand against nothing: "one week" asks what "a week" asks.
- units and currencies, anywhere in the text ("in miles" / "in km", "$5" / "5 euros", "元"):
  the two sets must be equal, each unit under one name ("kilometres" = "km", "$" = "dollars");
  a time of day's am / pm too ("6 am" / "6 pm", "a.m." = "am"), after a number only ("I am");
- relative dates and periods ("today", "tomorrow", "last week" / "last month", "per day",
  "明天", "去年"): the two sets must be equal.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

from ..verdict import Reason, Rule
from .text import lower_words, norm

#: Read on the lower-cased text (no re.I: it would fold the "v" of "v2" into the letters).
_DIGITS = re.compile(
    r"(?<![a-uw-z0-9_.])(\d+(?:,\d{3})+|\d+(?:\.\d+)?|\.\d+)\s*(k|m|bn|st|nd|rd|th|am|pm)?"
    r"(?![a-z0-9_])"
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

UNITS = {
    **dict.fromkeys(
        ["km", "kms", "kilometer", "kilometers", "kilometre", "kilometres", "公里"], "km"
    ),
    **dict.fromkeys(["mi", "mile", "miles", "英里"], "mi"),
    **dict.fromkeys(["m", "meter", "meters", "metre", "metres", "米"], "m"),
    **dict.fromkeys(["cm", "centimeter", "centimeters", "centimetre", "centimetres"], "cm"),
    **dict.fromkeys(["mm", "millimeter", "millimeters"], "mm"),
    **dict.fromkeys(["ft", "foot", "feet"], "ft"),
    **dict.fromkeys(["in", "inch", "inches"], "in"),
    **dict.fromkeys(["kg", "kgs", "kilogram", "kilograms", "kilo", "kilos", "公斤"], "kg"),
    **dict.fromkeys(["g", "gram", "grams", "克"], "g"),
    **dict.fromkeys(["lb", "lbs", "pound", "pounds", "£", "gbp", "磅"], "lb/£"),
    **dict.fromkeys(["oz", "ounce", "ounces"], "oz"),
    **dict.fromkeys(["l", "liter", "liters", "litre", "litres", "升"], "l"),
    **dict.fromkeys(["ml", "milliliter", "milliliters", "millilitre", "millilitres"], "ml"),
    **dict.fromkeys(["gallon", "gallons", "gal"], "gal"),
    **dict.fromkeys(["c", "celsius", "°c", "摄氏"], "°C"),
    **dict.fromkeys(["f", "fahrenheit", "°f", "华氏"], "°F"),
    **dict.fromkeys(["%", "percent", "per cent", "percentage", "百分之"], "%"),
    **dict.fromkeys(["$", "usd", "dollar", "dollars", "美元"], "$"),
    **dict.fromkeys(["€", "eur", "euro", "euros", "欧元"], "€"),
    **dict.fromkeys(["¥", "jpy", "yen", "日元"], "¥"),
    **dict.fromkeys(["cny", "rmb", "yuan", "元", "人民币"], "CNY"),
    **dict.fromkeys(["gb", "gigabyte", "gigabytes"], "GB"),
    **dict.fromkeys(["mb", "megabyte", "megabytes"], "MB"),
    **dict.fromkeys(["tb", "terabyte", "terabytes"], "TB"),
    **dict.fromkeys(["kb", "kilobyte", "kilobytes"], "KB"),
    **dict.fromkeys(["mbps"], "Mbps"),
    **dict.fromkeys(["gbps"], "Gbps"),
    **dict.fromkeys(["ghz"], "GHz"),
    **dict.fromkeys(["mhz"], "MHz"),
    **dict.fromkeys(["kw", "kilowatt", "kilowatts"], "kW"),
    **dict.fromkeys(["kwh"], "kWh"),
    **dict.fromkeys(["w", "watt", "watts"], "W"),
    **dict.fromkeys(["v", "volt", "volts"], "V"),
    **dict.fromkeys(["mph"], "mph"),
    **dict.fromkeys(["kph", "km/h"], "km/h"),
    **dict.fromkeys(["calorie", "calories", "kcal", "卡路里"], "kcal"),
    # A time of day: "6 am" / "6 pm" ask of another time ("6am": :data:`_CLOCK`).
    **dict.fromkeys(["am", "a.m"], "am"),
    **dict.fromkeys(["pm", "p.m"], "pm"),
}
#: Units that are also common words ("in", "m", "c", "l", "f", "g", "w", "v"): a unit only
#: right after a number.
_AFTER_NUMBER_ONLY = frozenset(
    {"in", "m", "c", "l", "f", "g", "w", "v", "am", "pm", "米", "克", "升", "元"}
)
#: A time of day written on its number ("6am", "6.30pm", "7a.m").
_CLOCK = re.compile(r"[\d.,]+(am|pm|a\.m|p\.m)")
DATES = {
    **{
        w: w
        for w in [
            "today",
            "tomorrow",
            "yesterday",
            "tonight",
            "weekend",
            "weekday",
            "weekdays",
            "daily",
            "weekly",
            "monthly",
            "yearly",
            "annually",
            "hourly",
        ]
    },
    **dict.fromkeys(["second", "seconds", "sec", "secs"], "second"),
    **dict.fromkeys(["minute", "minutes", "min", "mins"], "minute"),
    **dict.fromkeys(["hour", "hours", "hr", "hrs"], "hour"),
    **dict.fromkeys(["day", "days"], "day"),
    **dict.fromkeys(["week", "weeks"], "week"),
    **dict.fromkeys(["month", "months"], "month"),
    **dict.fromkeys(["year", "years"], "year"),
    **dict.fromkeys(["decade", "decades"], "decade"),
    **dict.fromkeys(["century", "centuries"], "century"),
}
_CN_DATES = {
    "今天": "today",
    "明天": "tomorrow",
    "昨天": "yesterday",
    "今晚": "tonight",
    "周末": "weekend",
    "上周": "last week",
    "下周": "next week",
    "本周": "this week",
    "这周": "this week",
    "上个月": "last month",
    "下个月": "next month",
    "这个月": "this month",
    "今年": "this year",
    "去年": "last year",
    "明年": "next year",
    "每天": "daily",
    "每周": "weekly",
    "每月": "monthly",
    "每年": "yearly",
    "小时": "hour",
    "分钟": "minute",
}


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


@functools.lru_cache(maxsize=8192)
def _read(text: str) -> tuple[Counter[float], int, frozenset[str], frozenset[str]]:
    """(numbers, spelled "one"s among them, units, dates) of ``text``."""
    flat = norm(text).lower()
    numbers: Counter[float] = Counter()
    for m in _DIGITS.finditer(flat):
        value = float(m.group(1).replace(",", ""))
        numbers[value * _SUFFIX.get((m.group(2) or "").lower(), 1)] += 1
    words = lower_words(text)
    spelled, ones = _english(words)
    chinese, cn_ones = _chinese(flat)
    numbers.update(spelled)
    numbers.update(chinese)
    units = set()
    for i, w in enumerate(words):
        unit = UNITS.get(w)
        if unit is not None and (
            w not in _AFTER_NUMBER_ONLY or (i > 0 and re.fullmatch(r"[\d.,]+k?", words[i - 1]))
        ):
            units.add(unit)
        elif clock := _CLOCK.fullmatch(w):
            units.add(UNITS[clock.group(1)])
    units.update(UNITS[s] for s in ("$", "€", "£", "¥", "%") if s in flat)
    units.update(
        UNITS[w] for w in UNITS if not w.isascii() and w not in _AFTER_NUMBER_ONLY and w in flat
    )
    dates = {DATES[w] for w in words if w in DATES}
    dates.update(v for k, v in _CN_DATES.items() if k in flat)
    return numbers, ones + cn_ones, frozenset(units), frozenset(dates)


def differs(a: str, b: str) -> bool:
    na, ones_a, units_a, dates_a = _read(a)
    nb, ones_b, units_b, dates_b = _read(b)
    if units_a != units_b or dates_a != dates_b:
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
