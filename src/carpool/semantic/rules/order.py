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

"Word for word but for k words" is ``max(len) - LCS`` (the longest common subsequence), and the
rule reads it in linear time: an exchange changes two words, so it mends at most two; a pair
more than ``SLACK + 2`` words apart before any exchange never fires. Then ``y`` must land
within ``SLACK`` places of where it stands on the other side (and ``x`` too), which leaves a few
exchanges to try, each compared in a band of ``SLACK`` places. (Every pair of shared words, each
compared whole, cost seconds for a few hundred permuted words: a review found it.)
"""

from __future__ import annotations

import functools
from collections import Counter

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
_BETWEEN = COORDINATORS | {"a", "an", "the"}


def _mismatches(x: tuple[str, ...], y: tuple[str, ...], cap: int) -> int:
    """``max(len(x), len(y)) - LCS(x, y)``, or ``cap + 1`` when that is more than ``cap``.

    Within ``cap`` mismatches, a common subsequence never strays more than ``cap`` places off
    the diagonal: a band of ``2 * cap + 1`` cells a row is enough (O(len * cap))."""
    n, m = len(x), len(y)
    if abs(n - m) > cap:
        return cap + 1
    width = 2 * cap + 1
    prev = [0] * (width + 2)  # cell k of row i: LCS(x[:i], y[:j]) with j = i + k - 1 - cap
    for i in range(1, n + 1):
        row = [0] * (width + 2)
        for k in range(1, width + 1):
            j = i + k - 1 - cap
            if 1 <= j <= m:
                row[k] = prev[k] + 1 if x[i - 1] == y[j - 1] else max(prev[k + 1], row[k - 1])
        prev = row
    return min(max(n, m) - prev[m - n + cap + 1], cap + 1)


@functools.lru_cache(maxsize=4096)
def _swapped(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    if abs(len(a) - len(b)) > SLACK:  # no exchange brings them within SLACK words
        return False
    count_a, count_b = Counter(a), Counter(b)
    shared = {w for w in a if w not in STOP and count_a[w] == 1 and count_b[w] == 1}
    if len(shared) < 2:
        return False
    before = _mismatches(a, b, SLACK + 2)
    if not 2 <= before <= SLACK + 2:  # an exchange mends two words at most
        return False
    place_a = {w: i for i, w in enumerate(a) if w in shared}
    place_b = {w: j for j, w in enumerate(b) if w in shared}
    at_b = {j: w for w, j in place_b.items()}
    for x, i in place_a.items():
        # y takes x's place: where y stands in b, within SLACK (and x where y stands in b).
        for spot in range(i - SLACK, i + SLACK + 1):
            y = at_b.get(spot)
            if y is None or not place_a[x] < place_a[y] or place_b[x] < place_b[y]:
                continue  # none there, or the pair's order is the same on both sides
            j = place_a[y]
            if abs(place_b[x] - j) > SLACK or set(a[i + 1 : j]) <= _BETWEEN:
                continue  # x lands too far, or "X and Y" / "Y and X": the same pair either way
            exchanged = tuple(y if w == x else x if w == y else w for w in a)
            after = _mismatches(exchanged, b, SLACK)
            if after <= SLACK and after <= before - 2:
                return True
    return False


def differs(a: str, b: str) -> bool:
    wa, wb = lower_words(a), lower_words(b)
    return _swapped(wa, wb) or _swapped(wb, wa)


RULE = Rule(Reason.ORDER, differs)
