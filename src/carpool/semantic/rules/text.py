"""Reading a prompt for the rules: its words (CJK character by character), memoised per text."""

from __future__ import annotations

import functools
import re
import unicodedata

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


#: How many texts (or pairs) each rule's memo keeps: what lookups in a row reuse (a query and
#: its ``semantic.candidates``, the popular entries' texts again and again). Each holds what the
#: rule read of a text, up to ``guard.READ_CHARS`` long: at 8,192 the memos held over 1 GB of
#: 4,000-character prompts, outside every budget; at this size ~30 MB at most of those.
MEMO = 128


def norm(text: str) -> str:
    """NFKC (full-width digits and letters become ASCII), curly quotes made straight."""
    text = unicodedata.normalize("NFKC", text)
    return text.replace("’", "'").replace("‘", "'").replace("“", '"').replace("”", '"')


@functools.lru_cache(maxsize=MEMO)
def words(text: str) -> tuple[str, ...]:
    """The words of ``text`` as written (case kept), in order."""
    return tuple(m.group() for m in _WORD.finditer(norm(text)))


_POSSESSIVE = re.compile(r"'s$")


def plain(word: str) -> str:
    """A word lower-cased, a possessive ``'s`` dropped ("Australia's" is "australia")."""
    return _POSSESSIVE.sub("", word.lower())


@functools.lru_cache(maxsize=MEMO)
def lower_words(text: str) -> tuple[str, ...]:
    """The words, each :func:`plain` (and without a trailing dot)."""
    return tuple(plain(w.lower().strip(".")) for w in words(text))
