"""A code or identifier on one side must occur on the other.

Models read "S23" and "S24", "python2" and "python3", "/etc/hosts" and "/etc/hostname" as the
same thing. An identifier is a word that is not plain prose:

- letters and digits mixed ("S24", "python3", "v2.1", "5G", "x86_64");
- ``snake_case`` and ``dotted.names`` words, ``CamelCase`` and ``mixedCase`` ("iPhone",
  "JavaScript"; a ``kebab-case`` word is no identifier: "e-mail", "well-known"), ``ALLCAPS`` of two letters or more ("HTTP", "NASA");
- e-mail addresses, URLs, file paths ("/usr/bin", "C:\\\\Windows", "./run.sh"), file names with
  an extension ("config.yaml").

Each side's identifiers must occur, in any case, as words of the other (a dotted name: all
its parts). A capitalised word at the start of
a sentence is not an identifier (:mod:`.entities` reads names).

And two of them exchanged in place, the rest in order, are another command: "cp a.txt b.txt" /
"cp b.txt a.txt" (0.99 to the verifier, served: split into words, "a" is a stop word and "txt"
said twice, so :mod:`.order` saw no exchange), unless only a coordinator stands between them on
both sides ("compare a.py and b.py" / "compare b.py and a.py").
"""

from __future__ import annotations

import re

from ..verdict import Reason, Rule
from .order import COORDINATORS
from .text import exchanged, memo, norm

_TOKEN = re.compile(
    # e-mail: a local part of at most 64 characters (RFC 5321), else every letter of "a+a+..."
    # started a scan to the end of the run: quadratic
    r"[\w.+-]{1,64}@[\w-]+(?:\.[\w-]+)+"
    r"|\b(?:https?|ftp)://\S+"  # URL
    r"|(?<![\w/])(?:[A-Za-z]:\\|\.{0,2}/)[\w.\\/-]+"  # path (not "and/or")
    r"|[\w][\w.'’-]*[\w]|\w"
)
_MIXED_DIGITS = re.compile(r"(?=.*\d)(?=.*[^\W\d_])")
_GLUED = re.compile(r"[\d.,]+([^\W\d_]+)")
_SNAKE = re.compile(r"^_?[A-Za-z0-9]+(?:_[A-Za-z0-9]+)+$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
_CAMEL = re.compile(r"^[a-z]+[A-Z]\w*$|^[A-Z][a-z]+[A-Z]\w*$")
_CAPS = re.compile(r"^[A-Z]{2,}s?$")


def _is_identifier(token: str) -> bool:
    if "@" in token or "://" in token or token.startswith(("/", "./", "../")) or ":\\" in token:
        return True
    if not token.isascii():
        return False
    return bool(
        _MIXED_DIGITS.match(token)
        and not re.fullmatch(r"[vV]?[\d.,:]+\w{0,2}", token)
        or _SNAKE.match(token)
        or _DOTTED.match(token)
        and not token.endswith(".")
        or _CAMEL.match(token)
        or _CAPS.match(token)
        and token not in ("I", "OK", "A")
    )


@memo
def _read(text: str) -> tuple[frozenset[str], frozenset[str]]:
    """(identifiers, every token) of ``text``, lower-cased."""
    tokens = [m.group().rstrip(".,;:!?") for m in _TOKEN.finditer(norm(text))]
    words = {t.lower() for t in tokens}
    words.update(part for t in list(words) if _DOTTED.match(t) for part in t.split("."))
    # (A unit glued to its number says it too: "GB" is in "5GB".)
    words.update(m[1] for t in list(words) if (m := _GLUED.fullmatch(t)))
    return frozenset(t.lower() for t in tokens if _is_identifier(t)), frozenset(words)


_ARTICLES = frozenset({"a", "an", "the"})


@memo
def _placed(text: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """The words of ``text`` (lower-cased, no article), the places of its identifiers among
    them, and the words between each two identifiers (commas, "&" and "/" kept)."""
    text = norm(text)
    words: list[str] = []
    at: list[int] = []
    between: list[str] = []
    last = -1  # (where the identifier before ends)
    for m in _TOKEN.finditer(text):
        token = m.group().rstrip(".,;:!?")
        if token.lower() in _ARTICLES:
            continue
        if _is_identifier(token):
            if last >= 0:
                gap = text[last : m.start()].lower()
                # (A slash joins only alone, unspaced: "python2/python3", not "cp a/ b/".)
                joins = ["/"] if gap == "/" else re.findall(r"[^\W_]+|[&,]", gap)
                between.append(" ".join(w for w in joins if w not in _ARTICLES))
            at.append(len(words))
            last = m.end()
        words.append(token.lower())
    return tuple(words), tuple(at), tuple(between)


#: What joins two identifiers whose order does not matter (:mod:`.order`'s coordinators, "as
#: well as", an unspaced "/", a comma: "a.py and b.py", "HTTP vs HTTPS", "python2, python3");
#: not a space alone ("cp a.txt b.txt": a command's arguments).
_JOINING = frozenset(
    f"{comma}{word}".strip()
    for comma in ("", ", ")
    for word in ("", "/", "as well as", *COORDINATORS)
) - {""}


def _exchanged(a: str, b: str) -> bool:
    """Two identifiers, each once on each side, exchanged in place, every other word the same
    (but an article), and something but a coordinator between them: "cp a.txt b.txt" / "cp
    b.txt a.txt". (A sentence reworded around them is the verifier's to read: "The `from_spec`
    function creates a `ReadInstruction`" / "A `ReadInstruction` is created by `from_spec`".)"""
    (wa, at_a, between_a), (wb, at_b, between_b) = _placed(a), _placed(b)
    if wa == wb or len(wa) != len(wb) or at_a != at_b:
        return False
    moved = [k for k, place in enumerate(at_a) if wa[place] != wb[place]]
    if len(moved) != 2:
        return False
    i, j = moved
    x, y = wa[at_a[i]], wa[at_a[j]]
    if wa.count(x) > 1 or wa.count(y) > 1:
        return False
    if exchanged(wa, x, y) != wb:
        return False
    return not (j == i + 1 and between_a[i] in _JOINING and between_b[i] in _JOINING)


def differs(a: str, b: str) -> bool:
    (ids_a, tokens_a), (ids_b, tokens_b) = _read(a), _read(b)
    return not (_covered(ids_a, tokens_b) and _covered(ids_b, tokens_a)) or _exchanged(a, b)


def _covered(ids: frozenset[str], tokens: frozenset[str]) -> bool:
    """Each identifier is a token of the other side, in any case ("HTTP" = "http"), or, for a
    dotted or hyphenated name, all its parts are ("datasets.Audio" = "Audio ... of datasets",
    "a 3-year-old" = "a 3 year old")."""
    return all(
        i in tokens or ((_DOTTED.match(i) or "-" in i) and set(re.split(r"[.-]", i)) <= tokens)
        for i in ids
    )


RULE = Rule(Reason.IDENTIFIER, differs)
