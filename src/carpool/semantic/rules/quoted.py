"""Quoted strings, code spans and a task's input must be the same text on both sides.

A model reads "Translate 'I eat' into French" and "Translate 'I ate' into French" as the same
request; the answer differs in every word. So:

- every quoted string (``'...'``, ``"..."``, curly quotes, ``「...」``, ``《...》``), code span
  (```...```) and fenced block of one side must occur in the other's text, quoted or not,
  compared case-insensitively with white space collapsed;
- a *task* prompt (it starts with a verb that works on a text: translate, convert, rewrite,
  summarize...; or Chinese 翻译, 转换, 改写, 总结) has an input, the words after its instruction:
  everything but the instruction words (:data:`INSTRUCTION_WORDS`) must be the same words in the
  same order. "Translate I will go into French" / "Translate I went into French" differ;
- the text after a colon is a task's input when the instruction before it has a task verb or
  names a language (:data:`LANGUAGES`): "Put this in Spanish please: she is reading a book" /
  "...: she was reading a book" differ (no task verb starts it). When both sides are such a
  task, the words after the colon must be the same, all of them, in order; so must the input
  of "how do I say X in Spanish", "French translation of X" and "what's the German for X"
  ("How do I say I studied medicine in Spanish?" / "...I study medicine...");
- what an error, a log or a message says, unquoted ("The error says permission denied", "the
  server logs say connection refused", "error: KeyError"; to the sentence's end): when both
  sides say such a text, the texts must be the same words in order. "...logs say connection
  refused" / "...connection timed out" differ (the verifier scored them 0.99);
- code outside backticks (a word with a bracket attached, ``f(x)``, ``a[0]``, or a `` = ``)
  keeps its punctuation: when both sides have code and the same words, every chunk between
  spaces that has a bracket, a brace, ``=``, ``;`` or ``:`` must be on both sides (sentence
  marks at a chunk's end dropped). "for i in range(10) print(i)" / "for i in range(10):
  print(i)" differ; "print() in Python?" / "print() in Python" do not; nor may the same words
  move in the code: "f(g(x))" / "g(f(x))", "pow(pow(2,3),2)" / "pow(2,pow(3,2))" differ;
- a list or a mapping in brackets or braces keeps its marks, whatever the words around it
  (:mod:`.brackets`): "[1, 2, 3,]" / "[1, 2, 3]" differ, "[0, 1]" / "[0,1]" do not.
"""

from __future__ import annotations

import re
from collections import Counter

from ..verdict import Reason, Rule
from .brackets import regrouped
from .text import lower_words, memo, norm

_QUOTED = re.compile(
    r"```(.+?)```|`([^`]+)`|\"([^\"]+)\"|(?<![\w])'([^']+)'(?![\w])|「([^」]+)」|『([^』]+)』"
    r"|《([^》]+)》|“([^”]+)”",
    re.S,
)

#: Verbs that work on a text given with them (not "reverse a list", "fix my bike": those ask how).
TASK_VERBS = frozenset(
    {
        "translate",
        "convert",
        "rewrite",
        "paraphrase",
        "summarize",
        "summarise",
        "rephrase",
        "proofread",
        "reformat",
        "transliterate",
        "conjugate",
        "翻",
        "转",
        "改",
        "总",
    }
)
#: Languages an instruction names before a colon ("Put this in Spanish: ...").
LANGUAGES = frozenset(
    """english spanish french german italian portuguese dutch russian chinese mandarin
    cantonese japanese korean arabic hindi bengali urdu turkish polish swedish norwegian danish
    finnish greek hebrew latin vietnamese thai indonesian malay persian ukrainian czech
    romanian hungarian swahili tagalog 英语 英文 中文 日语 法语 德语""".split()
)
#: Words of the instruction around a task's input, dropped before the inputs are compared.
INSTRUCTION_WORDS = frozenset(
    {
        "please",
        "can",
        "could",
        "would",
        "you",
        "kindly",
        "help",
        "me",
        "to",
        "into",
        "in",
        "from",
        "the",
        "following",
        "this",
        "sentence",
        "text",
        "phrase",
        "word",
        "language",
        "for",
        "us",
        "it",
        "and",
        "a",
        "an",
        "of",
        "译",
        "换",
        "写",
        "结",
        "成",
        "为",
        "把",
        "将",
        "下",
        "面",
        "句",
        "话",
        "文",
        "请",
        "帮",
        "我",
        "一",
    }
    | TASK_VERBS
)


def _squash(text: str) -> str:
    return " ".join(text.lower().split())


@memo
def _quoted(text: str) -> frozenset[str]:
    return frozenset(
        _squash(next(g for g in m.groups() if g is not None)) for m in _QUOTED.finditer(norm(text))
    )


@memo
def _task_input(text: str) -> tuple[str, ...] | None:
    """The words of a task's input, or None when ``text`` is no task."""
    words = lower_words(text)
    start = next((i for i, w in enumerate(words[:6]) if w in TASK_VERBS), None)
    if start is None:
        return None
    return tuple(w for w in words[start:] if w not in INSTRUCTION_WORDS)


@memo
def _after_colon(text: str) -> tuple[str, ...] | None:
    """The words after the first colon when the instruction before it is a task's."""
    head, colon, tail = norm(text).partition(":")
    if not colon:
        head, colon, tail = norm(text).partition("：")
    instruction = set(lower_words(head))
    if not colon or not (instruction & TASK_VERBS or instruction & LANGUAGES):
        return None
    return lower_words(tail)


_LANGUAGE = "|".join(sorted(w for w in LANGUAGES if w.isascii()))
#: A task's input named by its language, no colon: "how do I say X in Spanish", "French
#: translation of X", "what's the German for X" (X to the end, but for a closing "please").
_NAMED_INPUT = re.compile(
    rf"\bhow (?:(?:do|would|can|could|should) (?:i|you|we|one) |to )say (?P<a>.+?) in (?:{_LANGUAGE})\b"
    rf"|\b(?:{_LANGUAGE}) translation (?:of|for) (?P<b>.+)"
    rf"|\bwhat(?:'s| is) the (?:{_LANGUAGE}) (?:word |phrase )?for (?P<c>.+)",
    re.I,
)


@memo
def _named_input(text: str) -> tuple[str, ...] | None:
    """The words of a task's input that names its language without a colon, or None."""
    m = _NAMED_INPUT.search(norm(text))
    if m is None:
        return None
    said = lower_words(next(g for g in m.groups() if g is not None))
    while said and said[-1] == "please":
        said = said[:-1]
    return said


def _input(text: str) -> tuple[str, ...] | None:
    """A task's input after a colon, or named by its language ("how do I say X in Spanish")."""
    after = _after_colon(text)
    return after if after is not None else _named_input(text)


#: What an error, a log or a message says, unquoted: "The error says permission denied",
#: "the server logs say connection refused", "error: KeyError". The text runs to the sentence's
#: end or a comma (a mark before a space or the end: "file.txt" is inside it; "refused, why?").
_SAYS = re.compile(
    r"\b(?:(?:error|exception|message|logs?|output)(?: message)?"
    r" (?:says|say|said|shows|show|showed|reads|read)\b:?|(?:error|exception|warning):)"
    r"(.*?)(?:[.!?;,](?=\s|$)|\n|$)",
    re.I,
)


@memo
def _says(text: str) -> tuple[tuple[str, ...], ...]:
    """The words of each text an error or a log says (none said: an empty tuple)."""
    said = (lower_words(m.group(1)) for m in _SAYS.finditer(norm(text)))
    return tuple(w for w in said if w)


#: Code outside backticks: a bracket or parenthesis attached to a word, or a spaced "=".
_CODE = re.compile(r"\w[(\[]|\s=\s")
_CODE_MARK = re.compile(r"[()\[\]{}=;:]")


@memo
def _code_chunks(text: str) -> Counter[str] | None:
    """The chunks of code that hold its punctuation, or None when ``text`` has no code."""
    text = norm(text)
    if not _CODE.search(text):
        return None
    chunks = (c.rstrip("?!.") for c in text.split())
    return Counter(c for c in chunks if _CODE_MARK.search(c))


#: Where a call or a subscript begins: a name (dots in it) and its bracket.
_CALL = re.compile(r"(?<![\w.])[\w.]+[(\[]")  # (from a name's start: once a run of letters)


@memo
def _calls(text: str) -> Counter[str]:
    """Each call or subscript of the code, outermost, whole and without spaces ("max(a, b)" is
    "max(a,b)", "np.zeros((3, 3))" "np.zeros((3,3))"): what it says, wherever the prose puts it
    and however it spaces it. (Read once, left to right: a nested call is inside its outer one.)"""
    text = norm(text)
    found: Counter[str] = Counter()
    at = 0
    while (m := _CALL.search(text, at)) is not None:
        depth, end = 0, m.end() - 1
        while end < len(text):
            mark = text[end]
            depth += 1 if mark in "([" else -1 if mark in ")]" else 0
            end += 1
            if depth == 0:
                break
        found["".join(text[m.start() : end].split())] += 1
        at = end
    return found


@memo
def _flat(text: str) -> str:
    return _squash(re.sub(r"[`'\"「」『』《》“”]", " ", norm(text)))


def differs(a: str, b: str) -> bool:
    # A quoted string must occur on the other side, quoted or not ("'hello'" = "hello").
    if any(q not in _flat(b) for q in _quoted(a)) or any(q not in _flat(a) for q in _quoted(b)):
        return True
    ca, cb = _code_chunks(a), _code_chunks(b)
    if ca is not None and cb is not None and ca != cb:
        wa, wb = lower_words(a), lower_words(b)
        if wa == wb:
            return True  # the same words, the code's punctuation changed
        if Counter(wa) == Counter(wb) and _calls(a) != _calls(b):
            return True  # the same words moved in the code: "f(g(x))" / "g(f(x))"
    if regrouped(a, b):
        return True
    sa, sb = _says(a), _says(b)
    if sa and sb and sa != sb:
        return True  # another error message: the verifier scored "refused" / "timed out" 0.99
    ia, ib = _input(a), _input(b)
    if ia is not None and ib is not None and ia != ib:
        return True  # then the task's input read the older way too ("into French" / "German")
    ta, tb = _task_input(a), _task_input(b)
    if ta is None or tb is None:
        return False
    return ta != tb


RULE = Rule(Reason.QUOTED, differs)
