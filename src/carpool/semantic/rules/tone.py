"""Emoticons must be the same on both sides; the verifier reads the texts without them.

The packaged verifier was trained on questions written plainly. A mark it rarely saw made it
call unrelated prompts the same: "Explain machine learning!" / "Explain quantum computing!"
scored 0.985 (0.097 with a full stop), "Explain machine learning :)" / "Explain quantum
computing :)" 0.993 (0.119 without), "How do I bake bread!" / "How do I bake cake!" 0.988,
"ok :)" / "no :)" 0.994; chat filler did the same ("... lol", "... pls"). Two parts:

- ``RULE``: the emoticons of each side (``:)``, ``:-(``, ``;)``, ``:D``, ``xD``, ``<3``,
  ``^_^``, ``(:``, a cheer...; a nose or a repeated mouth read as one: ``:-)))`` is ``:)``),
  as a multiset, must be equal: "I got the job :)" and "I got the job :(" are answered
  differently, and the verifier, which reads them without (below), cannot tell; and filler on
  both sides must be of the same kinds (thanks, please, a laugh, a pause, an ok): "Japanese
  for thanks?" / "...for please?" scored 0.996.
- :func:`reading`: the text the verifier may be given (``guard.read``: where both sides left
  out the same; else the texts as sent) and what it left out: emoticons (with the space
  before each: no other spacing moves); chat filler ("lol", "haha", "pls", "thx", "hmm",
  "ok") and politeness ("please", "thanks", "thank you (so much) (in advance)") at a clause's
  start or end (inside one, the word is what is asked about: "Is it rude to say lol in a
  work email?"); a sentence said twice in a row, word for word (line breaks and indents
  kept). A run of "!", "?" and "." or "…" (an ellipsis) after a letter is read as one mark
  ("?" if it holds one, else "."), at the text's end spaced from it too ("bread ! ! !"), with
  the "1"s of "!!1" where it holds two "!" or more (not "x!1"). An ellipsis after no word and
  brackets stay ("( If any )" read without its brackets was served for another question).
  What the rules read is the text as sent; only the model's view is plainer, as the texts it
  learned from were. Linear in the text, as every rule (possessive repeats, no pattern tried
  again shorter: a first version took 6.7 s on "!" * 1,024 + "x").
"""

from __future__ import annotations

import re
from collections import Counter
from typing import NamedTuple

from ..retyping import retyped
from ..verdict import Reason, Rule
from .text import memo

#: An emoticon before white space, a sentence mark or the text's end: eyes (``:``, ``;``,
#: ``=``; not after a digit: "3:3)"), an optional nose, a mouth, repeated or not
#: (``:)))``; after a word too: "thanks:)"); or, after no letter or digit, ``xD``, a heart
#: ``<3``, ``^_^``, ``^^``, ``-_-``, ``o_O``. (No apostrophe nose: ``:'(``, crying, is not
#: ``:(``. Possessive repeats: a long run of mouths is read once, never tried again shorter.)
_EMOTICON = re.compile(
    r"(?:(?<![\d:;=])(?P<eyes>[:;=])[\^-]?(?P<mouth>[()\[\]DPpOo3|/\\*@])(?P=mouth)*+"
    r"|(?P<other>(?<!\w)(?:[xX]D++|<3++|-_++-|[oO]_[oO]|\\o/)|(?<!\S)[()]:|\^_*+\^))(?=\s|$|[.,!?])"
)
#: Chat filler and politeness the verifier reads as meaning: shared around two short replies
#: they hid what the replies said ("yes please" / "no thanks" 0.996, "yes" / "no" 0.125;
#: "continue, thank you" / "stop, thank you" 0.982). Left out only at a clause's start or end
#: (:func:`_edges`): inside one, the word is what is asked about ("Is it rude to say lol in a
#: work email?").
_FILLER = re.compile(
    r"(?i:lol+|lmao+|rofl+|(?:ha){2,}h?|(?:he){2,}|pl[sz]|thx|hmm+|um+|uh+|ok|okay|please"
    r"|thanks?(?: you)?(?: (?:so|very) much| a lot)?(?: in advance)?)"
)
#: The longest filler, in words ("thank you so much in advance").
_FILLER_WORDS = 5
_MARK_CHARS = ",.?!;:\n。？！"
_CLAUSE = re.compile(r"[^,.?!;:\n。？！]+|[,.?!;:\n。？！]+")
_WORD = re.compile(r"\S+")
#: What the verifier is not given: an emoticon with the one space or tab before it (no other
#: spacing moves: a line's indentation is code's meaning, ``retyping``).
_FACES = re.compile(r"(?:[ \t])?(?:" + _EMOTICON.pattern + ")")
#: A run of exclamation and question marks, or an ellipsis, after a letter (never ``!=``,
#: "what does !! do", a factorial: "52!", a range: "a..b"; nor a full stop before a mark:
#: "U.S.?"): "How do I bake bread..." / "...cake..." scored 0.993, 0.718 with a full stop.
_MARKS = re.compile(
    # (Apart from the word at the end too, spaced or not: "bread !!!", "bread ! ! !".)
    r"(?<=[^\W\d_])(?:[ \t]++(?=[!?！？](?:[ \t]*+[!?！？1])*+[ \t]*+$))?"
    r"(?:\.{2,}+|[!?！？…])(?:[!?！？.…1]|[ \t]++(?=[!?！？]))*+(?=\s|$|[\"')\]])"
)


def _mark(run: re.Match[str]) -> str:
    """A run of marks as one: "?" where it holds one, else "."; as written where it holds a
    "1" but not two "!" ("!!1", "!1!1" are marks; "x!1" is code)."""
    said = run.group()
    if "1" in said and said.count("!") + said.count("！") < 2:
        return said
    return "?" if "?" in said or "？" in said else "."


#: Where a text's sentences end (the white space after, kept): one said again at once is read
#: once ("Q? Q?" is "Q?": pasted twice, unrelated questions scored 0.76 on average, "Explain
#: machine learning?" twice / "Explain quantum computing?" twice 0.982).
_SENTENCE_END = re.compile(r"((?<=[.?!。？！])\s+)")


@memo
def emoticons(text: str) -> Counter[str]:
    """The emoticons of ``text``, each as its eyes and mouth (``:-)))`` is ``:)``), or as
    written without repeats (``xDDD`` is ``xd``, ``<333`` is ``<3``, ``^__^`` is ``^_^``)."""
    found: Counter[str] = Counter()
    for m in _EMOTICON.finditer(text):
        if m.group("eyes"):
            found[m.group("eyes") + m.group("mouth")] += 1
        else:
            found[re.sub(r"(.)\1+", r"\1", m.group("other").lower())] += 1
    return found


def _differs(a: str, b: str) -> bool:
    if emoticons(a) != emoticons(b):
        return True
    if _ANY_FILLER.search(a) is None or _ANY_FILLER.search(b) is None:
        return False  # (no filler on one side: nothing below; read in a pass of ~1 ms)
    # Filler on both sides, of other kinds: a word swapped for another, which the verifier
    # does not read ("Japanese for thanks?" / "...for please?" 0.996, "Is it rude to reply ok"
    # / "...thanks"), even where it is what is asked about; other words, or the same in other
    # places, when that is all they differ in ("How many letters are in: thanks" / "...: thank
    # you" 0.995; "What does this mean: thanks. Please answer..." / "...: please. Thanks,
    # answer..." 0.989).
    x, y = reading(a), reading(b)
    if not (x.kinds and y.kinds):
        return False
    return x.kinds != y.kinds or (x.words != y.words and retyped(x.text, y.text))


def _edges(text: str) -> tuple[str, list[str]]:
    """``text`` without the filler at the start or end of each clause, and what was left
    out; a clause of filler alone goes with the marks after it, or the comma before it
    ("continue, thank you" is "continue", "...? Thanks!" is "...?", "hmm, what is it?" is
    "what is it?"). Linear: each clause's words are looked at from either end, a few at a
    time."""
    out: list[str] = []
    fillers: list[str] = []  # (what was left out, as said)
    dropped = False  # (the clause before these marks was all filler)
    for part in _CLAUSE.findall(text):
        if part[0] in _MARK_CHARS:
            if not dropped:
                out.append(part)
            dropped = False
            continue
        kept = _unpadded(part, fillers)
        if kept is None:  # (all filler)
            if out and out[-1].strip() == ",":
                out.pop()
            dropped = True
            continue
        out.append(kept)
    return "".join(out), fillers


def _unpadded(clause: str, fillers: list[str]) -> str | None:
    """``clause`` without its leading and trailing filler (its own spacing kept; each one
    left out added to ``fillers``); None when it is nothing else."""
    words = list(_WORD.finditer(clause))

    def filler(i: int, j: int) -> bool:
        said = _FILLER.fullmatch(clause[words[i].start() : words[j - 1].end()])
        if said is not None:
            fillers.append(said.group())
        return said is not None

    def span(first: int, last: int, step: int) -> int:
        """How many words of filler run from ``first`` towards ``last`` (step 1 or -1)."""
        n = 0
        while n < abs(last - first):
            for k in range(min(_FILLER_WORDS, abs(last - first) - n), 0, -1):
                i, j = (first + n, first + n + k) if step > 0 else (first - n - k, first - n)
                if filler(i, j):
                    n += k
                    break
            else:
                return n
        return n

    first = span(0, len(words), 1)
    last = len(words) - span(len(words), first, -1)
    if first == last:
        return None if words else clause
    if (first, last) == (0, len(words)):
        return clause
    head, tail = clause[: words[0].start()], clause[words[-1].end() :]
    return head + clause[words[first].start() : words[last - 1].end()] + tail


#: Whether a text may hold filler at all (a first pass: most hold none).
_ANY_FILLER = re.compile(r"(?i)\b(?:lol|lmao|rofl|haha|hehe|pl[sz]|please|thx|thank|hmm|um|uh|ok)")


class Reading(NamedTuple):
    """A text as the verifier may be given it, and what that left out (:func:`reading`)."""

    text: str
    kinds: tuple[str, ...]  # the filler's kinds, sorted (thanks, please, laugh, pause, ok)
    repeats: int  # sentences said again at once
    words: tuple[str, ...]  # the filler as said, lower case, in order


def _kind(filler: str) -> str:
    """What a filler says: thanks, please, a laugh, a pause, an ok ("thx" and "thank you so
    much" are both thanks)."""
    word = filler.lower()
    if word.startswith(("than", "thx")):
        return "thanks"
    if word.startswith("pl"):
        return "please"
    if word.startswith(("ok", "okay")):
        return "ok"
    return "pause" if word[0] in "hu" and not word.startswith(("ha", "he")) else "laugh"


def _once(text: str) -> tuple[str, int]:
    """``text`` with a sentence said again at once, word for word, read once (with the white
    space before it; every other line break and indent kept: code's meaning), and how many
    were left out."""
    parts = _SENTENCE_END.split(text)  # (sentence, space, sentence, ...)
    out = parts[:1]
    for i in range(2, len(parts), 2):
        if parts[i] != parts[i - 2]:
            out += parts[i - 1 : i + 1]
    return "".join(out), (len(parts) - len(out)) // 2


@memo
def reading(text: str) -> Reading:
    """``text`` as the verifier may be given it (the module's contract), with what that left
    out; as sent, nothing left out, when nothing of it would be left but marks ("lol")."""
    plain, fillers = _edges(_FACES.sub("", text))
    plain = _MARKS.sub(_mark, plain)
    plain, repeats = _once(plain.strip())
    if not any(ch.isalnum() for ch in plain):
        return Reading(text, (), 0, ())
    kinds = tuple(sorted(_kind(word) for word in fillers))
    return Reading(plain, kinds, repeats, tuple(w.lower() for w in fillers))


RULE = Rule(Reason.TONE, _differs)
