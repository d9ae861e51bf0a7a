"""A small edit of words no English rule reads: another language's negation in an English text.

The semantic view reads English only (:mod:`carpool.semantic.english`), but a few foreign words
in an English sentence leave it English: "The sign says sigara içilmez, can I smoke here?" /
"...sigara içilir..." (no smoking / smoking allowed), "he said se puede" / "he said no se
puede", "the sign says dekimasu" / "...dekimasen", "the receptionist answered tu peux" / "...tu
ne peux pas". The verifier, an English model, scored such pairs 0.98-0.99 and a review had 75
of them served. Between the words both sides start and end with, at most :data:`MOST` words a
side (a longer edit is the verifier's), the rule fires when:

- a negator of another language (:data:`NEGATORS`: "pas", "nicht", "inte", "tidak"...) is
  said more often on one side, or "no" begins the edit, against nothing or a yes, before a
  word no English word is that both sides say ("no se puede" / "se puede", "no puedes" / "sí
  puedes"; not against other words, "no wifi on ubuntu" / "wifi not working on ubuntu", where
  "ahora se puede" / "no se puede" is the verifier's too, a typo reading as foreign; nor before
  a contraction or a chat spelling, "he said no i don't", "no idk how", nor a reply with its
  comma, "said no, numpy fails");
- a word no English word is is written on both sides another way, the two beginning alike,
  neither the other's beginning nor one typo from it ("içilmez" / "içilir", "dekimasu" /
  "dekimasen": an ending that says yes or no; not "postgres" / "postgresql", "kubernets" /
  "kubernetes", a plural; but an "m" added is Turkish's negation, "seviyorum" / "sevmiyorum").

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
from .text import common_ends, memo, norm, one_edit

#: The most words an edit may change on a side (as :mod:`.qualifiers`' edits).
MOST = 3
#: Negators of other languages that English does not write as words.
NEGATORS = frozenset(
    """pas ne non mai tidak bukan ei mish khong không nicht kein keine nie niet geen inte ikke
    ingen ej nunca não nao değil degil yok nem hindi""".split()
)
#: A word, hyphenated ones whole ("non-profit" is no "non").
_WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")
Word = tuple[str, str]  # (as written, lower-cased)


#: A comma after a word: a "no" before one is a reply ("said no, numpy fails"), read "no,".
_COMMA = re.compile(r"\s*,")


@memo
def _words(text: str) -> tuple[Word, ...]:
    text = norm(text)
    words = []
    for m in _WORD.finditer(text):
        lower = m.group().lower().replace("’", "'")
        if lower == "no" and _COMMA.match(text, m.end()):
            lower = "no,"
        words.append((m.group(), lower))
    return tuple(words)


def _unread(word: Word) -> bool:
    """A word in lower case, of 3 letters or more, that is no English word."""
    # (Imported here: ``english`` reads the verifier's vocabulary, whose module imports these
    # rules.)
    from ..english import known

    written, lower = word
    # (A hyphenated word is English when its parts are: "cost-effective", "non-profit".)
    return len(lower) >= 3 and written.islower() and not all(map(known, lower.split("-")))


def _negators(words: tuple[Word, ...]) -> int:
    return sum(lower in NEGATORS and written.islower() for written, lower in words)


#: A yes of another language that "no" may stand in place of ("sí puedes" / "no puedes").
_YES = frozenset("sí si oui ja da sim evet hai ya".split())
#: Chat spellings the vocabulary lacks, no foreign words ("no u cant", "no idk").
_CHAT = frozenset("dont cant wont isnt doesnt didnt idk im ive ur pls plz thx".split())


def _no_added(
    side: tuple[Word, ...], at: int, edit: tuple[Word, ...], other: frozenset[str]
) -> bool:
    """The edit on ``side`` (at ``at``) begins with a lower-case "no", the other side's being
    nothing or a yes (its words: ``other``), before a word no
    English word is that both sides say: "he said no se puede" / "he said se puede". Not before
    a contraction or a chat spelling ("he said no i don't"), nor against other words ("no wifi
    on ubuntu" / "wifi not working on ubuntu")."""
    if not edit or edit[0] != ("no", "no"):
        return False
    return any(
        _unread(w) and "'" not in w[1] and w[1] not in _CHAT and w[1] in other
        for w in side[at + 1 : at + 3]
    )


def _typo(a: str, b: str) -> bool:
    """``a`` and ``b`` one typo apart (:func:`.text.one_edit`), but an "m" added: Turkish's
    negation ("seviyorum" / "sevmiyorum")."""
    if not one_edit(a, b):
        return False
    longer, shorter = (a, b) if len(a) > len(b) else (b, a)
    return not any(
        longer[k] == "m" and longer[:k] + longer[k + 1 :] == shorter for k in range(len(longer))
    )


def _inflected(x: Word, y: Word) -> bool:
    """Two words no English word is, beginning alike, neither the other's beginning (nor its
    plural), nor a typo of it ("kubernets" / "kubernetes", "chatgtp" / "chatgpt")."""
    a, b = x[1], y[1]
    if a.startswith(b) or b.startswith(a) or _typo(a, b) or not (_unread(x) and _unread(y)):
        return False
    if a.removesuffix("s") == b.removesuffix("s") or a.removesuffix("es") == b.removesuffix("es"):
        return False
    return a[:4] == b[:4] or (a[:3] == b[:3] and min(len(a), len(b)) >= 6)


@memo
def _differs(a: tuple[Word, ...], b: tuple[Word, ...]) -> bool:
    # The edit: what lies between the words both sides start and end with (read the same from
    # either side: the rule is symmetric).
    start, end = common_ends(tuple(w for _, w in a), tuple(w for _, w in b))
    x, y = a[start : len(a) - end], b[start : len(b) - end]
    if not (x or y) or len(x) > MOST or len(y) > MOST:
        return False
    if _negators(x) != _negators(y):
        return True
    yes_a = not x or (len(x) == 1 and x[0][1] in _YES)
    yes_b = not y or (len(y) == 1 and y[0][1] in _YES)
    said_a, said_b = frozenset(w for _, w in a), frozenset(w for _, w in b)
    if (yes_b and _no_added(a, start, x, said_b)) or (yes_a and _no_added(b, start, y, said_a)):
        return True
    return any(_inflected(u, v) for u in x for v in y)


def differs(a: str, b: str) -> bool:
    return _differs(_words(a), _words(b))


RULE = Rule(Reason.POLARITY, differs)
