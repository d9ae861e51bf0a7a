"""Emoticons must be the same on both sides; the verifier reads the texts without them.

The packaged verifier was trained on questions written plainly. A mark it rarely saw made it
call unrelated prompts the same: "Explain machine learning!" / "Explain quantum computing!"
scored 0.985 (0.097 with a full stop), "Explain machine learning :)" / "Explain quantum
computing :)" 0.993 (0.119 without), "How do I bake bread!" / "How do I bake cake!" 0.988,
"ok :)" / "no :)" 0.994; chat filler did the same ("... lol", "... pls"). Two parts:

- ``RULE``: the emoticons of each side (``:)``, ``:-(``, ``;)``, ``:D``, ``xD``, ``<3``,
  ``^_^``...; a nose or a repeated mouth read as one: ``:-)))`` is ``:)``), as a multiset, must
  be equal: "I got the job :)" and "I got the job :(" are answered differently, and the
  verifier, which reads them without (below), cannot tell.
- :func:`as_read`: the text the verifier is given: emoticons and chat filler ("lol", "haha",
  "pls", "thx") left out (with the space before each: no other spacing moves), a run of
  exclamation and question marks read as one mark ("?" if it holds one, else "."; an
  ellipsis is left as it is: read as ".", a true rewording was refused; so are brackets: "(
  If any )" read without them was served for another question). What the rules read is the
  text as sent; only the model's view is plainer, as the texts it learned from were.
"""

from __future__ import annotations

import re
from collections import Counter

from ..verdict import Reason, Rule
from .text import memo

#: An emoticon before white space, a sentence mark or the text's end: eyes (``:``, ``;``,
#: ``=``; not after a digit: "3:3)"), an optional nose, a mouth, repeated or not
#: (``:)))``; after a word too: "thanks:)"); or, after no letter or digit, ``xD``, a heart
#: ``<3``, ``^_^``, ``^^``, ``-_-``, ``o_O``.
_EMOTICON = re.compile(
    r"(?:(?<![\d:;=])(?P<eyes>[:;=])['^-]?(?P<mouth>[()\[\]DPpOo3|/\\*@])(?P=mouth)*"
    r"|(?<!\w)(?P<other>[xX]D+|<3+|\^_*\^|-_+-|[oO]_[oO]))(?=\s|$|[.,!?])"
)
#: Chat filler the verifier reads as meaning, left out of what it reads.
_FILLER = r"(?<![\w'])(?i:lol+|lmao+|rofl+|(?:ha){2,}h?|(?:he){2,}|pl[sz]|thx)(?![\w'])"
#: What the verifier is not given: an emoticon or filler with the one space or tab before it
#: (no other spacing moves: a line's indentation is code's meaning, ``retyping``).
_LEFT_OUT = re.compile(r"[ \t]?(?:" + _EMOTICON.pattern + "|" + _FILLER + ")")
#: A run of exclamation and question marks at a word's end (never ``!=``).
_MARKS = re.compile(r"(?:[!?！？]*[!！][!?！？]*|[?？]{2,})(?=\s|$|[\"')\]])")


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
    return emoticons(a) != emoticons(b)


@memo
def as_read(text: str) -> str:
    """``text`` as the verifier is given it (the module's contract); as sent when nothing of
    it would be left but marks ("lol" / "haha" are not the same question)."""
    plain = _MARKS.sub(
        lambda m: "?" if "?" in m.group() or "？" in m.group() else ".", _LEFT_OUT.sub("", text)
    ).strip()
    return plain if any(ch.isalnum() for ch in plain) else text


RULE = Rule(Reason.TONE, _differs)
