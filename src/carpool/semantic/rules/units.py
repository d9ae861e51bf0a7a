"""The units, currencies, relative dates and times of day that :mod:`.numbers` reads.

Each is listed under one name ("kilometres" = "km", "$" = "dollars", "midday" = "noon"), so a
rewording that spells a unit otherwise reads the same. "percentage point(s)" and "basis
point(s)" are units of their own, not "%" (a rate raised by 0.5 % is not raised by 0.5 points):
:func:`points` writes them as one word before the text is read.
"""

from __future__ import annotations

import re

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
    **dict.fromkeys(["percentage_point", "pp"], "percentage point"),
    **dict.fromkeys(["basis_point", "bp", "bps"], "basis point"),
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
    **dict.fromkeys(["amp", "amps", "ampere", "amperes"], "A"),
    **dict.fromkeys(["mph"], "mph"),
    **dict.fromkeys(["kph", "km/h"], "km/h"),
    **dict.fromkeys(["calorie", "calories", "kcal", "卡路里"], "kcal"),
    # A time of day: "6 am" / "6 pm" ask of another time ("6am": :data:`CLOCK`).
    **dict.fromkeys(["am", "a.m"], "am"),
    **dict.fromkeys(["pm", "p.m"], "pm"),
}
#: Units that are also common words ("in", "m", "c", "l", "f", "g", "w", "v"): a unit only
#: right after a number.
AFTER_NUMBER_ONLY = frozenset(
    {"in", "m", "c", "l", "f", "g", "w", "v", "am", "pm", "pp", "bp", "bps", "米", "克", "升", "元"}
)
#: A time of day written on its number ("6am", "6.30pm", "7a.m").
CLOCK = re.compile(r"[\d.,]+(am|pm|a\.m|p\.m)")
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
#: A time of day in words: "noon UTC" / "midnight UTC", "fly at dawn" / "at dusk" ask of
#: another hour. Read only against another one (a side without one may say it otherwise:
#: "at sunset" / "when the sun sets", "noon meals" / "lunch meals"). (Not "morning" /
#: "evening": a greeting says them too; not measured.)
TIMES_OF_DAY = {
    **dict.fromkeys(["noon", "midday"], "noon"),
    **dict.fromkeys(["midnight"], "midnight"),
    **dict.fromkeys(["dawn", "sunrise", "daybreak"], "dawn"),
    **dict.fromkeys(["dusk", "sunset", "nightfall"], "dusk"),
}
CN_DATES = {
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


#: "percentage points" and "basis points" as one word each (read before the words are).
_POINTS = re.compile(r"\b(percentage|basis)[- ]points?\b", re.I)


def points(text: str) -> str:
    """``text`` with "percentage point(s)" and "basis point(s)" written as one word each."""
    return _POINTS.sub(lambda m: m.group(1).lower() + "_point", text)
