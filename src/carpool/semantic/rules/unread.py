"""A small edit of words no English rule reads: another language's negation in an English text.

The semantic view reads English only (:mod:`carpool.semantic.english`), but a few foreign words
in an English sentence leave it English: "The sign says sigara içilmez, can I smoke here?" /
"...sigara içilir..." (no smoking / smoking allowed), "he said se puede" / "he said no se
puede", "the sign says dekimasu" / "...dekimasen", "the receptionist answered tu peux" / "...tu
ne peux pas". The verifier, an English model, scored such pairs 0.98-0.99 and a review had 75
of them served. In an edit of at most :data:`MOST` words a side (the rest word for word), the
rule fires when:

- a negator of another language (:data:`NEGATORS`: "pas", "nicht", "tidak", "không"...) is on
  one side more often than on the other, or "no", "i", "an" is, before one of the next two
  words that is no English word ("no se puede", "i efshar", "an dwaeyo"; "an" only before a
  consonant: "an identifier" is English);
- a word no English word is written on both sides another way, the two beginning alike
  ("içilmez" / "içilir", "dekimasu" / "dekimasen", "biliyorum" / "bilmiyorum"): an ending that
  says yes or no; not a plural ("streamlines" / "streamline").

An English word is one of the verifier's vocabulary, with an English ending or prefix
(:func:`carpool.semantic.english.known`); a capitalised word is a name, not read. Measured on
the labeled pairs: it refused one served held-out rewording ("employable" / "employability")
and no development one.
"""

from __future__ import annotations

import difflib
import re

from ..verdict import Reason, Rule
from .text import memo, norm

#: The most words an edit may change on a side (as :mod:`.qualifiers`' edits).
MOST = 3
#: Negators of other languages that English does not write as words.
NEGATORS = frozenset(
    """pas ne non mai tidak bukan ei mish khong không nicht kein keine nie niet não nao değil
    degil yok nem""".split()
)
#: English words that negate in another language before a word no English word is.
_BEFORE_FOREIGN = frozenset({"no", "i", "an"})
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


def _negators(words: tuple[Word, ...], lo: int, hi: int) -> int:
    count = 0
    for k in range(lo, hi):
        written, lower = words[k]
        if not written.islower():
            continue
        if lower in NEGATORS:
            count += 1
        elif lower in _BEFORE_FOREIGN and k + 1 < len(words):
            following = words[k + 1 : k + 3]
            if lower == "an" and following[0][1][:1] in "aeiou":
                continue  # ("an identifier": English)
            count += any(map(_unread, following))
    return count


def _inflected(x: Word, y: Word) -> bool:
    """Two words no English word is, beginning alike, neither the other's plural."""
    a, b = x[1], y[1]
    if a == b or not (_unread(x) and _unread(y)):
        return False
    if a.rstrip("s") == b.rstrip("s") or a.removesuffix("es") == b.removesuffix("es"):
        return False
    return a[:4] == b[:4] or (a[:3] == b[:3] and min(len(a), len(b)) >= 6)


@memo
def _differs(a: tuple[Word, ...], b: tuple[Word, ...]) -> bool:
    # The edit: what lies between the words both sides start and end with, a few words (difflib
    # is quadratic: it reads that window only).
    start = 0
    while start < min(len(a), len(b)) and a[start][1] == b[start][1]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[-1 - end][1] == b[-1 - end][1]:
        end += 1
    x, y = a[start : len(a) - end], b[start : len(b) - end]
    if not (x or y) or len(x) > 4 * MOST or len(y) > 4 * MOST:
        return False
    matcher = difflib.SequenceMatcher(None, [w for _, w in x], [w for _, w in y], autojunk=False)
    edits = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    if sum(i2 - i1 for _, i1, i2, _, _ in edits) > MOST:
        return False
    if sum(j2 - j1 for _, _, _, j1, j2 in edits) > MOST:
        return False
    for _, i1, i2, j1, j2 in edits:
        if _negators(a, start + i1, start + i2) != _negators(b, start + j1, start + j2):
            return True
        if any(_inflected(u, v) for u in x[i1:i2] for v in y[j1:j2]):
            return True
    return False


def differs(a: str, b: str) -> bool:
    return _differs(_words(a), _words(b))


RULE = Rule(Reason.POLARITY, differs)
