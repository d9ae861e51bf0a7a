"""A negation or an opposite on one side only.

The verifier reads most negations, but not all: measured on held-out pairs it served "Is aspirin
safe with coffee?" / "...unsafe with coffee?" and "List the advantages of remote work." / "...the
disadvantages..." at 0.98. What it misses is the one-word kind, which is exactly what a short list
can read:

- a word on one side and its negative prefix form on the other (un-, in-, im-, il-, ir-, dis-,
  non-, a-: "safe" / "unsafe", "advantages" / "disadvantages", "legal" / "illegal");
- a pair of :data:`OPPOSITES` (each direction), one word on each side.

Only when both sides have as many negators ("not", "no", "never", "n't", "without"...; Chinese
不, 没, 别, 无, 非, 未): "not fast" / "slow" says the same thing twice over, and a negation by a
separate word ("safe" / "not safe") is the verifier's, which reads it (semantoneg's held-out
negations: 0.1 % served). Counting negators here refused four in five true rewordings of the
"not likely" / "unlikely" kind.
"""

from __future__ import annotations

import functools
import re

from ..verdict import Reason, Rule
from .text import lower_words, norm

NEGATORS = frozenset(
    {
        "not",
        "no",
        "never",
        "without",
        "none",
        "nothing",
        "nobody",
        "neither",
        "nor",
        "cannot",
        "nowhere",
    }
)
_CN_NEGATORS = re.compile(r"不|没|别|无|非|未")

_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "a")
OPPOSITES = dict(
    p
    for a, b in (
        ("fast", "slow"),
        ("quickly", "slowly"),
        ("fast", "slowly"),
        ("good", "bad"),
        ("better", "worse"),
        ("best", "worst"),
        ("benefits", "risks"),
        ("benefits", "dangers"),
        ("pros", "cons"),
        ("advantages", "drawbacks"),
        ("increase", "decrease"),
        ("increase", "reduce"),
        ("more", "less"),
        ("more", "fewer"),
        ("most", "least"),
        ("high", "low"),
        ("higher", "lower"),
        ("cheap", "expensive"),
        ("cheapest", "priciest"),
        ("early", "late"),
        ("before", "after"),
        ("first", "last"),
        ("start", "stop"),
        ("start", "end"),
        ("open", "close"),
        ("enable", "disable"),
        ("upgrade", "downgrade"),
        ("import", "export"),
        ("upload", "download"),
        ("add", "remove"),
        ("buy", "sell"),
        ("win", "lose"),
        ("pass", "fail"),
        ("accept", "reject"),
        ("allow", "block"),
        ("include", "exclude"),
        ("inside", "outside"),
        ("up", "down"),
        ("in", "out"),
        ("on", "off"),
        ("hot", "cold"),
        ("warm", "cool"),
        ("big", "small"),
        ("large", "small"),
        ("long", "short"),
        ("heavy", "light"),
        ("easy", "hard"),
        ("easy", "difficult"),
        ("safe", "dangerous"),
        ("true", "false"),
        ("right", "wrong"),
        ("always", "never"),
        ("all", "none"),
        ("love", "hate"),
        ("like", "dislike"),
        ("max", "min"),
        ("maximum", "minimum"),
        ("positive", "negative"),
        ("rise", "fall"),
        ("gain", "lose"),
        ("strong", "weak"),
        ("rich", "poor"),
        ("old", "new"),
        ("young", "old"),
        ("delete", "restore"),
        ("delete", "recover"),
        ("lock", "unlock"),
        ("show", "hide"),
        ("encrypt", "decrypt"),
        ("好处", "坏处"),
        ("优点", "缺点"),
        ("增加", "减少"),
        ("删除", "恢复"),
        ("上", "下"),
        ("开", "关"),
        ("买", "卖"),
        ("快", "慢"),
        ("高", "低"),
        ("大", "小"),
    )
    for p in ((a, b), (b, a))
)


@functools.lru_cache(maxsize=8192)
def _read(text: str) -> tuple[int, frozenset[str]]:
    """(negators, words) of ``text``; CJK text adds its listed one- and two-character words."""
    words = lower_words(text)
    flat = norm(text)
    negators = sum(w in NEGATORS or w.endswith("n't") for w in words)
    negators += len(_CN_NEGATORS.findall(flat))
    cjk = {flat[i : i + 2] for i in range(len(flat) - 1)} | set(flat)
    return negators, frozenset(words) | frozenset(w for w in cjk if w in OPPOSITES)


def _opposed(x: frozenset[str], y: frozenset[str]) -> bool:
    only_x, only_y = x - y, y - x
    for w in only_x:
        if OPPOSITES.get(w) in only_y:  # (a lookup: a scan of only_y per word was quadratic)
            return True
        for prefix in _PREFIXES:
            if prefix + w in only_y or (
                w.startswith(prefix) and w[len(prefix) :] in only_y and len(w) - len(prefix) > 2
            ):
                return True
    return False


def differs(a: str, b: str) -> bool:
    (na, wa), (nb, wb) = _read(a), _read(b)
    return na == nb and _opposed(wa, wb)


RULE = Rule(Reason.POLARITY, differs)
