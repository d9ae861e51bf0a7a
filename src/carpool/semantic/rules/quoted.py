"""Quoted strings, code spans and a task's input must be the same text on both sides.

A model reads "Translate 'I eat' into French" and "Translate 'I ate' into French" as the same
request; the answer differs in every word. So:

- every quoted string (``'...'``, ``"..."``, curly quotes, ``「...」``, ``《...》``), code span
  (```...```) and fenced block of one side must occur in the other's text, quoted or not,
  compared case-insensitively with white space collapsed;
- a *task* prompt (it starts with a verb that works on a text: translate, convert, rewrite,
  summarize...; or Chinese 翻译, 转换, 改写, 总结) has an input, the words after its instruction:
  everything but the instruction words (:data:`INSTRUCTION_WORDS`) must be the same words in the
  same order. "Translate I will go into French" / "Translate I went into French" differ.
"""

from __future__ import annotations

import functools
import re

from ..verdict import Reason, Rule
from .text import lower_words, norm

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


@functools.lru_cache(maxsize=8192)
def _quoted(text: str) -> frozenset[str]:
    return frozenset(
        _squash(next(g for g in m.groups() if g is not None)) for m in _QUOTED.finditer(norm(text))
    )


@functools.lru_cache(maxsize=8192)
def _task_input(text: str) -> tuple[str, ...] | None:
    """The words of a task's input, or None when ``text`` is no task."""
    words = lower_words(text)
    start = next((i for i, w in enumerate(words[:6]) if w in TASK_VERBS), None)
    if start is None:
        return None
    return tuple(w for w in words[start:] if w not in INSTRUCTION_WORDS)


@functools.lru_cache(maxsize=8192)
def _flat(text: str) -> str:
    return _squash(re.sub(r"[`'\"「」『』《》“”]", " ", norm(text)))


def differs(a: str, b: str) -> bool:
    # A quoted string must occur on the other side, quoted or not ("'hello'" = "hello").
    if any(q not in _flat(b) for q in _quoted(a)) or any(q not in _flat(a) for q in _quoted(b)):
        return True
    ta, tb = _task_input(a), _task_input(b)
    if ta is None or tb is None:
        return False
    return ta != tb


RULE = Rule(Reason.QUOTED, differs)
