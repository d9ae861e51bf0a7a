"""A code or identifier on one side must occur on the other.

Models read "S23" and "S24", "python2" and "python3", "/etc/hosts" and "/etc/hostname" as the
same thing. An identifier is a word that is not plain prose:

- letters and digits mixed ("S24", "python3", "v2.1", "5G", "x86_64");
- ``snake_case``, ``dotted.names`` and ``kebab-case-longer`` words, ``CamelCase`` and
  ``mixedCase`` ("iPhone", "JavaScript"), ``ALLCAPS`` of two letters or more ("HTTP", "NASA");
- e-mail addresses, URLs, file paths ("/usr/bin", "C:\\\\Windows", "./run.sh"), file names with
  an extension ("config.yaml").

Each side's identifiers must occur, in any case, as words of the other (a dotted name: all
its parts). A capitalised word at the start of
a sentence is not an identifier (:mod:`.entities` reads names).
"""

from __future__ import annotations

import re

from ..verdict import Reason, Rule
from .text import memo, norm

_TOKEN = re.compile(
    # e-mail: a local part of at most 64 characters (RFC 5321), else every letter of "a+a+..."
    # started a scan to the end of the run: quadratic
    r"[\w.+-]{1,64}@[\w-]+(?:\.[\w-]+)+"
    r"|\b(?:https?|ftp)://\S+"  # URL
    r"|(?<![\w/])(?:[A-Za-z]:\\|\.{0,2}/)[\w.\\/-]+"  # path (not "and/or")
    r"|[\w][\w.'’-]*[\w]|\w"
)
_MIXED_DIGITS = re.compile(r"(?=.*\d)(?=.*[^\W\d_])")
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
    return frozenset(t.lower() for t in tokens if _is_identifier(t)), frozenset(words)


def differs(a: str, b: str) -> bool:
    (ids_a, tokens_a), (ids_b, tokens_b) = _read(a), _read(b)
    return not (_covered(ids_a, tokens_b) and _covered(ids_b, tokens_a))


def _covered(ids: frozenset[str], tokens: frozenset[str]) -> bool:
    """Each identifier is a token of the other side, in any case ("HTTP" = "http"), or, for a
    dotted name, all its parts are ("datasets.Audio" = "Audio ... of datasets")."""
    return all(i in tokens or (_DOTTED.match(i) and set(i.split(".")) <= tokens) for i in ids)


RULE = Rule(Reason.IDENTIFIER, differs)
