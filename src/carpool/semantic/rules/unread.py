"""A small edit of words no English rule reads: another language's negation in an English text.

The semantic view reads English only (:mod:`carpool.semantic.english`), but a few foreign words
in an English sentence leave it English: "The sign says sigara içilmez, can I smoke here?" /
"...sigara içilir..." (no smoking / smoking allowed), "he said se puede" / "he said no se
puede", "the sign says dekimasu" / "...dekimasen", "the receptionist answered tu peux" / "...tu
ne peux pas". The verifier, an English model, scored such pairs 0.98-0.99 and a review had 75
of them served. Between the words both sides start and end with, at most :data:`MOST` words a
side (a longer edit is the verifier's), the rule fires when:

- a negator of another language (:data:`NEGATORS`: "pas", "nicht", "inte", "tidak"...) is
  said more often on one side, or "no" is, before a word no English word is that both sides
  say ("no se puede" / "se puede", "no puedes" / "sí puedes"; not "no prob, what is an API" /
  "what is an API": chat filler, its word on one side only);
- a word no English word is is written on both sides another way, the two beginning alike,
  neither the other's beginning ("içilmez" / "içilir", "dekimasu" / "dekimasen", "biliyorum" /
  "bilmiyorum": an ending that says yes or no; not "postgres" / "postgresql", nor a plural).

An English word is one of the verifier's vocabulary, with an English ending or prefix
(:func:`carpool.semantic.english.known`), which lacks many product names ("numpy", "kubectl"):
so a lower-case "i" or "an" before one is read as English (a first version counted them, and
refused "how to install numpy" / "how do i install numpy"). A capitalised word is a name, not
read. Measured on the labeled pairs: it refused one served held-out rewording ("employable" /
"employability") and no development one.
"""

from __future__ import annotations

import re

from ..verdict import Reason, Rule
from .text import memo, norm

#: The most words an edit may change on a side (as :mod:`.qualifiers`' edits).
MOST = 3
#: Negators of other languages that English does not write as words.
NEGATORS = frozenset(
    """pas ne non mai tidak bukan ei mish khong không nicht kein keine nie niet geen inte ikke
    ingen ej nunca não nao değil degil yok nem""".split()
)
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?")
Word = tuple[str, str]  # (as written, lower-cased)


@memo
def _words(text: str) -> tuple[Word, ...]:
    return tuple(
        (m.group(), m.group().lower().replace("’", "'")) for m in _WORD.finditer(norm(text))
    )


def _unread(word: Word) -> bool:
    """A word in lower case, of 3 letters or more, that is no English word."""
    # (Imported here: ``english`` reads the verifier's vocabulary, whose module imports these
    # rules.)
    from ..english import known

    written, lower = word
    return len(lower) >= 3 and written.islower() and not known(lower)


def _negators(words: tuple[Word, ...], lo: int, hi: int, other: frozenset[str]) -> int:
    """The negators among ``words[lo:hi]``; "no" only before a word no English word is that
    the other side says too (``other``)."""
    count = 0
    for k in range(lo, hi):
        written, lower = words[k]
        if not written.islower():
            continue
        if lower in NEGATORS:
            count += 1
        elif lower == "no":
            count += any(_unread(w) and w[1] in other for w in words[k + 1 : k + 3])
    return count


def _inflected(x: Word, y: Word) -> bool:
    """Two words no English word is, beginning alike, neither the other's beginning (nor its
    plural)."""
    a, b = x[1], y[1]
    if a.startswith(b) or b.startswith(a) or not (_unread(x) and _unread(y)):
        return False
    if a.removesuffix("s") == b.removesuffix("s") or a.removesuffix("es") == b.removesuffix("es"):
        return False
    return a[:4] == b[:4] or (a[:3] == b[:3] and min(len(a), len(b)) >= 6)


@memo
def _differs(a: tuple[Word, ...], b: tuple[Word, ...]) -> bool:
    # The edit: what lies between the words both sides start and end with (read the same from
    # either side: the rule is symmetric).
    start = 0
    while start < min(len(a), len(b)) and a[start][1] == b[start][1]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[-1 - end][1] == b[-1 - end][1]:
        end += 1
    x, y = a[start : len(a) - end], b[start : len(b) - end]
    if not (x or y) or len(x) > MOST or len(y) > MOST:
        return False
    said_a, said_b = frozenset(w for _, w in a), frozenset(w for _, w in b)
    if _negators(a, start, len(a) - end, said_b) != _negators(b, start, len(b) - end, said_a):
        return True
    return any(_inflected(u, v) for u in x for v in y)


def differs(a: str, b: str) -> bool:
    return _differs(_words(a), _words(b))


RULE = Rule(Reason.POLARITY, differs)
