"""A list, a set or a mapping in brackets or braces keeps its marks, whatever the words around
it: part of the quoted rule (:mod:`.quoted`), whose code check reads code attached to a word only.

"Is [1, 2, 3,] valid JSON?" / "Is [1, 2, 3] valid JSON?" (a trailing comma), "[1, 2, 3]" /
"[1 2 3]" (a list, an array printed), "[a, b]" / "(a, b)" (a closed interval, an open one),
"[[1, 2], [3, 4]]" / "[[1, 2, 3, 4]]" (two rows, one), "Is {1} a set?" / "Is [1] a set?": the
verifier, which reads the words, scored them 0.98-1.0 (and the retyping check lets a bracket at
a word's edge change). Each group (the innermost, and the outermost around others) is read as
its words and how it writes them (its marks; spaces around a mark and case aside); a pair fires
when a group of the same words is written otherwise on the other side, one of the two forms a
structure (a bracket or a brace, a trailing comma, a list in parentheses inside: "(x (y z))" /
"((x y) z)"). Spacing is no mark: "[0, 1]" / "[0,1]" pass;
prose in parentheses is free, "(e.g., x)" / "(e.g. x)"; and so is a group with an item of more
than two words whose brackets alone change, "[keep it short, about 8 lines]" / "(keep it short,
about 8 lines)". Linear in the text: the innermost groups hold no bracket, the outermost are
found in one pass, and each group's text is read once.
"""

from __future__ import annotations

import re

from .text import lower_words, memo, norm

#: A group in brackets, braces or parentheses, none inside (so each try stops at the next
#: one: linear).
_GROUP = re.compile(r"[\[{(][^\[\]{}()]*[\]})]")


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
    """Each group's words: how it writes them (its marks, in lower case, spaces around marks
    dropped: "[1, 2, 3,]" is (1, 2, 3) written "[1,2,3,]", "[1 2 3]" "[1 2 3]"), and whether it
    is prose (an item of more than two words)."""
    groups: dict[tuple[str, ...], tuple[set[str], bool]] = {}
    for group in _spans(norm(text)):
        forms, prose = groups.setdefault(lower_words(group), (set(), False))
        forms.add(_SPACED.sub(r"\1", " ".join(group.split())).lower())
        wordy = max(len(lower_words(item)) for item in re.split(r"[,:;]", group)) > 2
        groups[lower_words(group)] = (forms, prose or wordy)
    return groups


_ROUND = str.maketrans("[]{}", "()()")
#: A group in parentheses that holds a list: "(1, 2)" inside "((1, 2), 3)".
_INNER_LIST = re.compile(r"\((?=[^()]*[,:; ])[^()]*\)")
#: Spaces around a mark are no mark: "[0, 1]" is "[0,1]"; between two words one is kept ("[1 2]").
_SPACED = re.compile(r"\s*([^\w\s])\s*")


def _structure(written: str) -> bool:
    """A list, a set or a mapping, not prose in parentheses: a bracket or a brace, a trailing
    comma ("(1,)"), or a list inside ("((1, 2), 3)"; not "(e.g. (a) apples, (b) pears)")."""
    return bool(
        set("[]{}") & set(written)
        or written.endswith((",)", ",]", ",}"))
        or _INNER_LIST.search(written, 1, len(written) - 1)
    )


def regrouped(a: str, b: str) -> bool:
    """The same words in a group written with other marks (the module's contract)."""
    ga, gb = _groups(a), _groups(b)
    for words in ga.keys() & gb.keys():
        (fa, prose_a), (fb, prose_b) = ga[words], gb[words]
        written = fa ^ fb
        if not any(_structure(w) for w in written):
            continue  # (no group differs, or prose in parentheses)
        rebracketed = {w.translate(_ROUND) for w in fa} == {w.translate(_ROUND) for w in fb}
        if rebracketed and (prose_a or prose_b):
            continue  # prose whose brackets alone changed
        return True
    return False
