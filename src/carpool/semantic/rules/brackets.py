"""A list or a mapping in brackets or braces keeps its marks, whatever the words around it: part
of the quoted rule (:mod:`.quoted`), whose code check reads code attached to a word only.

"Is [1, 2, 3,] valid JSON?" / "Is [1, 2, 3] valid JSON?" (a trailing comma), "[1, 2, 3]" /
"[1 2 3]" (a list, an array printed), "[a, b]" / "(a, b)" (a closed interval, an open one),
"[[1, 2], [3, 4]]" / "[[1, 2, 3, 4]]" (two rows, one): the verifier, which reads the words,
scored them 0.98-0.99. Each group (the innermost, and the outermost around others) is read as
its words and how it writes them without spaces, and a pair fires when a group of the same
words is written with other marks on the other side, a comma, a colon or a semicolon among
them, and a bracket or a brace (or a trailing comma). Spacing is no mark: "[0, 1]" / "[0,1]"
pass; groups in parentheses are prose, "(e.g., x)" / "(e.g. x)"; and so is a group with an item
of more than two words whose brackets alone change, "[keep it short, about 8 lines]" / "(keep
it short, about 8 lines)". Linear in the text: no group holds a bracket, and the outermost are
found in one pass.
"""

from __future__ import annotations

import re

from .text import lower_words, memo, norm

#: A group in brackets, braces or parentheses, none inside (so each try stops at the next
#: one: linear).
_GROUP = re.compile(r"[\[{(][^\[\]{}()]*[\]})]")
_SEPARATORS = frozenset(",:;")


def _spans(text: str) -> list[str]:
    """The groups with none inside, and the outermost ones ("[[1, 2], [3, 4]]")."""
    spans = [m.group() for m in _GROUP.finditer(text)]
    depth = start = 0
    for i, c in enumerate(text):
        if c in "([{":
            start, depth = (i if depth == 0 else start), depth + 1
        elif c in ")]}" and depth:
            depth -= 1
            if depth == 0:
                spans.append(text[start : i + 1])
    return spans


@memo
def _groups(text: str) -> dict[tuple[str, ...], tuple[set[str], bool]]:
    """Each group's words: how it writes them (its marks, without spaces: "[1, 2, 3,]" is (1,
    2, 3) written "[1,2,3,]"), and whether it is prose (an item of more than two words)."""
    groups: dict[tuple[str, ...], tuple[set[str], bool]] = {}
    for group in _spans(norm(text)):
        forms, prose = groups.setdefault(lower_words(group), (set(), False))
        forms.add("".join(group.split()))
        wordy = max(len(lower_words(item)) for item in re.split(r"[,:;]", group)) > 2
        groups[lower_words(group)] = (forms, prose or wordy)
    return groups


_ROUND = str.maketrans("[]{}", "()()")


def regrouped(a: str, b: str) -> bool:
    """The same words in a group written with other marks, one of them a list or a mapping
    (a comma, a colon or a semicolon inside) in brackets or braces: "[1, 2, 3,]" / "[1, 2, 3]"
    (a trailing comma), "[1, 2, 3]" / "[1 2 3]", "[a, b]" / "(a, b)" (a closed interval, an
    open one), "[[1, 2], [3, 4]]" / "[[1, 2, 3, 4]]". Spacing is no mark ("[0, 1]" / "[0,1]");
    groups in parentheses are prose ("(e.g., x)" / "(e.g. x)") but for a trailing comma ("(1,)"
    / "(1)") or groups inside ("((1, 2), 3)" / "(1, (2, 3))"), and so is a group with an item of more than two words whose brackets alone
    change ("[keep it short, about 8 lines]" / "(keep it short, ...)")."""
    ga, gb = _groups(a), _groups(b)
    for words in ga.keys() & gb.keys():
        (fa, prose_a), (fb, prose_b) = ga[words], gb[words]
        written = fa ^ fb
        if not any(_SEPARATORS & set(w) for w in written):
            continue
        if not any(
            set("[]{}") & set(w) or w.endswith((",)", ",]", ",}")) or w.count("(") > 1
            for w in written
        ):
            continue  # parentheses, none inside
        if (prose_a or prose_b) and {w.translate(_ROUND) for w in fa} == {
            w.translate(_ROUND) for w in fb
        }:
            continue
        return True
    return False
