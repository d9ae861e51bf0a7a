"""Reading a prompt for the rules: its words (CJK character by character), memoised per text;
and what several rules compare words with (``common_ends``, ``exchanged``, ``one_edit``)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ...unicode_forms import normal_form

#: A word: letters, digits, apostrophes and joiners inside (``don't``, ``snake_case``, ``v2.1``);
#: a run of CJK ideographs counts character by character (Chinese has no spaces).
_WORD = re.compile(r"[\u4e00-\u9fff\u3400-\u4dbf]|[^\W_](?:[\w'’.-]*[^\W_])?|_\w*", re.UNICODE)

#: Words that carry no role (word order): their place may change freely, and they end a phrase.
STOP = frozenset(
    """a an the to of in on at for by with from and or but is are was were be been
do does did can could should would will shall may might must i you he she it we they me him her
us them my your his its our their this that these those what which who whom how why when where
whether if than then so as not no please""".split()
)


#: How many texts (or pairs) each rule's memo keeps (``memo``): what lookups in a row reuse (a
#: query and its ``semantic.candidates``, the popular entries' texts again and again).
MEMO = 1024
#: The longest text a memo keeps (characters; a list of words: 8 characters a word): a longer one
#: is read again each time. What a rule reads of a text takes ~65 bytes a character besides
#: ~5 KB: at 4,096-8,192 texts of up to ``guard.READ_CHARS`` (4,096) characters, the memos held
#: over 1 GB, outside every budget; so bounded, ~40 MB at most. A long prompt is read in ~2-10 ms
#: (past the verifier's 256 tokens it is a miss anyway, the upstream's call far longer).
MEMO_LONGEST = 512

P = ParamSpec("P")
R = TypeVar("R")


def memo(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` memoised (its last ``MEMO`` calls, as ``functools.lru_cache``), but for a
    text longer than ``MEMO_LONGEST``, read again each time."""
    cached = functools.lru_cache(maxsize=MEMO)(function)

    @functools.wraps(function)
    def read(*args: P.args, **kwargs: P.kwargs) -> R:
        if _length(args) > MEMO_LONGEST:
            return function(*args, **kwargs)
        return cached(*args, **kwargs)  # type: ignore[arg-type]

    read.cache_info = cached.cache_info  # type: ignore[attr-defined]
    read.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return read


def _length(args: tuple[object, ...]) -> int:
    """The characters a call reads (``MEMO_LONGEST``)."""
    length = 0
    for arg in args:
        if isinstance(arg, str):
            length += len(arg)
        elif isinstance(arg, tuple):
            length += 8 * len(arg)
    return length


def norm(text: str) -> str:
    """NFKC (full-width digits and letters become ASCII), curly quotes made straight."""
    text = normal_form("NFKC", text) or text  # (read as sent where it would be quadratic)
    return text.replace("’", "'").replace("‘", "'").replace("“", '"').replace("”", '"')


@memo
def words(text: str) -> tuple[str, ...]:
    """The words of ``text`` as written (case kept), in order."""
    return tuple(m.group() for m in _WORD.finditer(norm(text)))


_POSSESSIVE = re.compile(r"'s$")


def plain(word: str) -> str:
    """A word lower-cased, a possessive ``'s`` dropped ("Australia's" is "australia")."""
    return _POSSESSIVE.sub("", word.lower())


@memo
def lower_words(text: str) -> tuple[str, ...]:
    """The words, each :func:`plain` (and without a trailing dot)."""
    return tuple(plain(w.lower().strip(".")) for w in words(text))


def common_ends(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[int, int]:
    """The lengths of the words ``a`` and ``b`` start and end with alike (the end never
    reaching into the start)."""
    n = min(len(a), len(b))
    start = 0
    while start < n and a[start] == b[start]:
        start += 1
    end = 0
    while end < n - start and a[-1 - end] == b[-1 - end]:
        end += 1
    return start, end


def exchanged(words: tuple[str, ...], x: str, y: str) -> tuple[str, ...]:
    """``words`` with ``x`` and ``y`` exchanged wherever they stand."""
    return tuple(y if w == x else x if w == y else w for w in words)


def one_edit(x: str, y: str) -> bool:
    """One letter changed, added or dropped, or two neighbours swapped, makes ``x`` ``y``."""
    short, long = sorted((x, y), key=len)
    i = 0
    while i < len(short) and short[i] == long[i]:
        i += 1
    if len(long) == len(short):
        return short[i + 1 :] == long[i + 1 :] or (
            short[i + 2 :] == long[i + 2 :] and short[i : i + 2] == long[i : i + 2][::-1]
        )
    return len(long) == len(short) + 1 and short[i:] == long[i + 1 :]
