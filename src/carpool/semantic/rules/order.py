"""The same words in another order: who does what to whom, and which way a conversion goes.

"The cat chased the mouse" / "the mouse chased the cat" and "convert JSON to YAML" / "convert
YAML to JSON" have the same words, so the same mean-pooled embedding, and opposite answers. The
rule fires when exchanging two words of one side makes it *the other side*, or nearly: for two
content words ``x`` and ``y`` found once on each side, in opposite orders, the side with ``x``
and ``y`` exchanged matches the other word for word but for at most :data:`SLACK` words
("How do I convert JSON to YAML?" / "How can I convert YAML to JSON?"), and by two words better
than before the exchange. Words joined only by a coordinator ("beauty and intelligence",
"MBA or CA") may change places. A reworded paraphrase that also moves words ("the best way to learn Python" /
"learn Python the best way") is far from the other side after any one exchange, so it passes.
Chinese is read character by character, so "猫追老鼠" / "老鼠追猫" is caught too (a name of two
characters is exchanged as a unit only through its characters, which is enough).
"""

from __future__ import annotations

import difflib
import functools
from collections import Counter
from itertools import combinations

from ..verdict import Reason, Rule
from .text import lower_words

#: Words that carry no role: their place may change freely.
STOP = frozenset(
    """a an the to of in on at for by with from and or but is are was were be been
do does did can could should would will shall may might must i you he she it we they me him her
us them my your his its our their this that these those what which who whom how why when where
whether if than then so as not no please".split()""".split()
)
SLACK = 2
#: Words between two words whose order does not matter ("beauty and intelligence").
COORDINATORS = frozenset({"and", "or", "nor", "&", "vs", "versus", "plus", "as", "well"})


def _mismatches(x: list[str], y: tuple[str, ...]) -> int:
    matcher = difflib.SequenceMatcher(None, x, y, autojunk=False)
    same = sum(block.size for block in matcher.get_matching_blocks())
    return max(len(x), len(y)) - same


@functools.lru_cache(maxsize=4096)
def _swapped(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    count_a, count_b = Counter(a), Counter(b)
    shared = [w for w in a if w not in STOP and count_a[w] == 1 and count_b[w] == 1]
    if len(shared) < 2:
        return False
    place_b = {w: b.index(w) for w in shared}
    before = _mismatches(list(a), b)
    for x, y in combinations(shared, 2):
        if place_b[x] < place_b[y]:  # same order on both sides: nothing swapped
            continue
        i, j = sorted((a.index(x), a.index(y)))
        if set(a[i + 1 : j]) <= COORDINATORS | {"a", "an", "the"}:
            continue  # "X and Y" / "Y and X": the same pair either way
        exchanged = [y if w == x else x if w == y else w for w in a]
        after = _mismatches(exchanged, b)
        if after <= SLACK and after <= before - 2:
            return True
    return False


def differs(a: str, b: str) -> bool:
    wa, wb = lower_words(a), lower_words(b)
    return _swapped(wa, wb) or _swapped(wb, wa)


RULE = Rule(Reason.ORDER, differs)
