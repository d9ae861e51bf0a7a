"""What a retyping may change in a prompt, and what a model cannot see: the guard's
near-repeat tests (:mod:`carpool.semantic.guard`).

Contract
--------
- :func:`retyped`: the same words in the same order up to the case of plain words, sentence
  marks, quotes and brackets at a word's edges, and spacing; never across a symbol, an emoji,
  an acronym's or a single letter's case, a mark inside or before a word, code in a fence or a
  line's indentation. Such a pair is served on the exact rules alone (the model scored
  "Cancel it." / "cancel it" 0.45).
- :func:`unseen_difference`: the pair differs only where an uncased model cannot read (case,
  accents, indentation): the guard refuses it unasked.
- :func:`close`: nearly the same words in the same order, what changed only function words
  (:data:`FUNCTION_WORDS`), case or another form of the same word (a context retyped): it only
  picks the verifier's bar, never serves by itself. A content word changed ("6 am" / "6 pm",
  "closed" / "open") is never close.
All are pure, symmetric and deterministic.
"""

from __future__ import annotations

import difflib
import functools
import re
import unicodedata

from ..unicode_forms import normal_form

__all__ = ["CLOSE_CONTEXT", "FUNCTION_WORDS", "UNREAD", "close", "retyped", "unseen_difference"]


_NOT_WORD = re.compile(r"[^\w]+")


def _plain_words(text: str) -> list[str]:
    """The words of ``text``, case-folded, punctuation and spacing dropped (for :func:`close`,
    which only picks a bar for the verifier, never serves by itself)."""
    return _NOT_WORD.sub(" ", text.casefold()).split()


@functools.lru_cache(maxsize=1024)
def _edge(ch: str) -> int:
    """Where ``ch`` may be added or dropped by retyping a word: 1 before it (an opening bracket or
    quote), 2 after it (a closing one), 3 either, 10 after it, a sentence mark (a comma, a full
    stop, a colon...), 4 after it at a sentence's end only (a question or exclamation mark:
    "String? mean" asks of Kotlin's nullable type), 0 nowhere. Only such marks:
    a "." before a word (".NET"), a "-" (``-a``, ``x--``), a "#" (``C#``), a symbol or an emoji
    are part of the word."""
    category = unicodedata.category(ch)
    if category in ("Ps", "Pi"):
        return 1
    if category in ("Pe", "Pf"):
        return 2
    if category != "Po":
        return 0
    name = unicodedata.name(ch, "")
    if "QUOTATION" in name or "APOSTROPHE" in name or "INVERTED" in name:
        return 3  # 'quoted', ¿...?
    if "QUESTION" in name or "EXCLAMATION" in name:
        return 4
    return 10 if any(mark in name for mark in _SENTENCE_MARKS) else 0


_SENTENCE_MARKS = (
    "FULL STOP",
    "COMMA",
    "COLON",
    "SEMICOLON",
    "EXCLAMATION",
    "QUESTION",
    "ELLIPSIS",
)
#: A word whose case a retyping may change: letters and digits, joined by an apostrophe or a
#: hyphen ("What's", "Wi-Fi"); touching any other mark (``-A``), its case is kept.
_FOLDABLE = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")
_PARTS = re.compile(r"([^\W_]+)")


def _word(token: str, shouted: bool, initial: bool, ends: bool) -> str:
    """A whitespace-separated token as a retyping leaves it: edge marks dropped (sentence marks
    only where a sentence ``ends``, after a word of letters), and the case of its plain words
    folded, but for a single letter or an acronym ("IT", "A") in a text that is not shouted
    whole: the pronoun I and a sentence's first letter ("A dog...") excepted. A token of marks
    alone ("{}", "??", ":") is what is asked about: kept as it is, as is one whose sentence mark
    follows a digit or a single letter ("5!", "1.", "x?")."""
    start, end = 0, len(token)
    while start < end and _edge(token[start]) & 1:
        start += 1
    marked = False  # (a sentence mark dropped)
    while end > start and (edge := _edge(token[end - 1])) & (6 if ends else 2):
        marked = marked or bool(edge & 12)
        end -= 1
    word = token[start:end]
    if not word or (marked and (len(word) == 1 or word[-1].isdigit())):
        return token
    if not _FOLDABLE.fullmatch(word):
        return word
    word = word.replace("’", "'")  # a phone's apostrophe
    if shouted or (initial and len(word) == 1):
        return word.casefold()
    return _PARTS.sub(_folded_part, word)


def _folded_part(match: re.Match[str]) -> str:
    part = match.group(1)
    if part in ("I", "i") or not (len(part) == 1 or part.isupper()):
        return part.casefold()
    return part


def _retyping(text: str) -> list[str]:
    """What a retyping keeps of ``text``: its words (:func:`_word`), each line's indentation
    (code: the ``return`` inside or after a loop) and the inside of a ``` fence verbatim. Line
    breaks, blank lines, runs of spaces inside a line and a one-line text's leading spaces go
    (prose reflowed, a question typed with a stray space)."""
    shouted = not any(ch.islower() for ch in text)
    initial = True  # at a sentence's first word
    tokens: list[str] = []
    for i, piece in enumerate(text.split("```")):
        if i % 2:  # inside a fence: code, every character kept
            tokens.append("```" + piece)
            continue
        lines = [line for line in piece.splitlines() if line.strip()]
        for n, line in enumerate(lines):
            indent = line[: len(line) - len(line.lstrip())]
            if indent and (n or i or len(lines) > 1):
                tokens.append("\n" + indent)
            words = line.split()
            for k, token in enumerate(words):
                # (A sentence ends with the line, or before a capital.)
                ends = k + 1 == len(words) or words[k + 1].lstrip("\"'(“‘[")[:1].isupper()
                tokens.append(_word(token, shouted, initial, ends))
                initial = token[-1] in ".!?"
    return tokens


def retyped(a: str, b: str) -> bool:
    """The same words, in the same order, up to the case of plain words, sentence marks, quotes
    and brackets at a word's edges, and spacing (:func:`_retyping`). Asked after the rules, so
    the model is not asked: it scored "Cancel it." / "cancel it" 0.45. Never across a symbol, an
    emoji, an acronym's or a single letter's case, a mark inside or before a word, code in a
    fence or a line's indentation: "👍" / "👎", "ls -a" / "ls -A", "C" / "C++" and "What is
    IT?" / "What is it?" were served so (everything but letters and digits dropped, case folded),
    the verifier never asked."""
    return a == b or _retyping(a) == _retyping(b)


#: What the models' BERT normaliser drops unread (``clean_text``): the control characters but
#: tab, line feed and carriage return (C0, DEL, C1), and U+FFFD. (Format characters, Unicode Cf,
#: too: looked up by category.) "pay\x00pal" reads "paypal".
UNREAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


def _unseen(text: str) -> str:
    """``text`` as an uncased model reads it (the packaged verifier's BERT normalisation):
    white space only between words, invisible characters dropped, accents stripped, lower
    case."""
    # (Dropped before the split: Python splits at \x1c-\x1f, which the model drops.)
    text = " ".join(UNREAD.sub("", text).split())
    if text.isascii():
        return text.lower()
    kept = "".join(ch for ch in text if unicodedata.category(ch) != "Cf")
    decomposed = normal_form("NFD", kept) or kept  # (as it came where that is quadratic)
    return "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn").lower()


def unseen_difference(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ somewhere a model cannot read: a difference that
    :func:`retyped` keeps (an acronym's or a flag's case, "⊂" / "⊄", "résumé" / "resume", a
    line's indentation) but
    that reads the same to an uncased model. It would vouch for what it never saw ("ls -a" /
    "ls -A" scored 0.98, "A ⊂ B" / "A ⊄ B" 0.99). (Quadratic at worst: asked only of pairs the
    verifier reads whole.)"""
    x, y = _retyping(a), _retyping(b)
    matcher = difflib.SequenceMatcher(None, x, y, autojunk=False)
    return any(
        tag != "equal" and _unseen(" ".join(x[i1:i2])) == _unseen(" ".join(y[j1:j2]))
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
    )


#: Contexts are not embedded (that would cost a second embedding per lookup); a context pair
#: whose words are this close (difflib's ratio over the words) gets the near-repeat bar instead,
#: when what changed is only retyping-like (:func:`close`).
CLOSE_CONTEXT = 0.9

#: Words a retyping adds, drops or swaps without changing what is asked: articles,
#: demonstratives, forms of "be" and "do", fillers and courtesies. Never a negator, a pronoun,
#: a modal or a preposition ("to" / "from", "can" / "should": another question), nor a content
#: word.
FUNCTION_WORDS = frozenset(
    """a an the some any this that these those is are was were be been being am do does did
    just really very quite please so also too well oh ok okay hi hello hey thanks thank and
    then""".split()
)
#: The past forms of "be" and "do": one on one side only is another time ("I am a US citizen" /
#: "I was": a current or a former one), never a retyping.
_PAST = frozenset("was were did".split())
#: Endings of another form of the same word ("order" / "orders", "help" / "helping"); the past
#: ones only ever for another past form ("asked" / "asked"), as "I order" / "I ordered" is
#: another time.
_FORMS = ("s", "es", "ed", "d", "ing")
_PAST_FORMS = ("ed", "d")
#: Verbs whose past is their base: "shut" / "shuts" is "shut" (then) / "shuts" (now).
_SAME_PAST = frozenset(
    """shut put cut hit let set cost hurt quit read spread bet burst cast split shed upset fit
    beat forecast broadcast thrust slit rid wet""".split()
)


def _same_word(a: str, b: str) -> bool:
    """``a`` and ``b`` are forms of one word at one time: one is the other with an ending of
    :data:`_FORMS` but a past one, or both are one stem with two endings, both past or neither
    ("asking" / "asks")."""
    if a == b:
        return True
    short, long = sorted((a, b), key=len)
    if short in _SAME_PAST:
        return False
    if len(short) >= 3 and any(
        long == short + ending for ending in _FORMS if ending not in _PAST_FORMS
    ):
        return True
    stems = [
        {(w[: -len(e)], e in _PAST_FORMS) for e in _FORMS if w.endswith(e) and len(w) - len(e) >= 3}
        for w in (a, b)
    ]
    return bool(stems[0] & stems[1])


def _retyping_like(x: list[str], y: list[str]) -> bool:
    """One changed stretch of words: function words only (a "be" or "do" kept at its tense), or
    each word another form of itself."""
    if all(w in FUNCTION_WORDS for w in (*x, *y)):
        # A past "be" or "do" on one side only: swapped for a present one, or added ("I did
        # pay the fine" / "I pay the fine"). A present one added alone is emphasis ("I do").
        return any(w in _PAST for w in x) == any(w in _PAST for w in y)
    return len(x) == len(y) and all(map(_same_word, x, y))


def close(a: str, b: str) -> bool:
    """Nearly the same words in the same order, and what changed retyping-like (function words,
    case, another form of the same word): a context retyped. A content word changed is not close,
    however long the context: "leaves at 6 am" / "6 pm" and "the pharmacy is closed" / "is open"
    got the near-repeat bar so and were served (0.9485, 0.9342). (Quadratic at worst: asked only
    of pairs the verifier reads whole, 256 tokens at most.)"""
    x, y = _plain_words(a), _plain_words(b)
    matcher = difflib.SequenceMatcher(None, x, y, autojunk=False)
    return matcher.ratio() >= CLOSE_CONTEXT and all(
        _retyping_like(x[i1:i2], y[j1:j2])
        for tag, i1, i2, j1, j2 in matcher.get_opcodes()
        if tag != "equal"
    )
