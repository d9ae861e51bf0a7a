"""Comparison and code operators must be the same on both sides.

"Is 8 > 5?" and "Is 8 < 5?" differ in one character that a tokenizer may not even keep; "x == 1"
and "x = 1" are different code. The operators of each side, in order, must be equal:

- symbols: comparison (``<``, ``>``, ``<=``, ``>=``, ``==``, ``===``, ``!=``, ``≠``, ``≤``,
  ``≥``), assignment and arithmetic (``=``, ``+=``, ``-=``, ``*=``, ``/=``, ``+``, ``-``, ``*``,
  ``/``, ``%``, ``**``, ``//``), logic and bits (``&&``, ``||``, ``!``, ``&``, ``|``, ``^``,
  ``~``, ``<<``, ``>>``), arrows (``->``, ``=>``, ``→``, ``←``, ``↑``, ``↓``...) and stars
  (``★``, ``☆``, each: a rating's count), which the verifier reads as near-equal ("CSV → JSON" /
  "CSV ← JSON" 0.986, "shows ↑" / "shows ↓" 0.993); two or more of "!" and "?" standing alone
  before more words ("What does !! do") or ending both texts apart from the last word in other
  runs, two or more marks on a side ("What does !!" / "What does ??", "...is ??" / "...is ?"),
  or after what leaves the question open ("what is", "what's", "the purpose of", "use",
  "about", "the", "operator", "define"), whatever the other ends in ("In C#, what is ??" / "...what is?"; not "What does
  YOLO mean ??", a question complete before its marks);
- the words of comparison, each read as its symbol: "greater/more/larger/bigger/higher than",
  "above", "over", "exceeds" as ``>``; "less/fewer/smaller/lower than", "below", "under" as
  ``<`` ("over", "under", "above", "below" only before an amount: "under $300", not "under
  the table"); "at least" / "no less than" as ``>=``; "at most" / "no more than" as ``<=``; "equal to"
  as ``==``; Chinese 大于, 小于, 不少于, 不超过, 等于.

Code outside backticks: "and", "or", "is", "is not", "in", "not in" between two names of code
(a lower-case letter, an identifier with a digit or an underscore, None / True / False: "a and
b" / "a or b"; not "C or C++", "K or H"), "not" before one ("not x"), "is not" / "is" before
None / True / False ("is not None" / "!= None" read in their order), and parentheses around an
operator ("not (x and y)" / "not x and y").

The same operators must stand between the same names or numbers: "Is a < b" / "Is b < a", "x =
y + 1" / "y = x + 1" differ, but for equality's sides and ``+`` or ``*`` between two numbers
("3 + 5" / "5 + 3"). A stop word or a word about the operator ("use", "operator") beside one is
no operand, nor the word on a prefix's spaced side ("and **kwargs"); and where the two sides name
other words beside their operators, the prose around an operator asked about was reworded: not
compared ("How can I make == compare..." / "How do I get == to compare...").

A hyphen inside a word ("e-mail"), a slash between words ("and/or") and sentence punctuation are
no operators; arithmetic signs count only between digits or names.
"""

from __future__ import annotations

import re

from ..verdict import Reason, Rule
from .text import STOP, memo, norm

_SYMBOL = re.compile(
    r"===|!==|==|!=|<=|>=|<<|>>|->|=>|\*\*|//|\+=|-=|\*=|/=|%=|&&|\|\||[<>=≠≤≥!&|^~]"
    r"|[→←↑↓↔↕⇒⇐⇔★☆]"  # (arrows and stars, each: the verifier reads them as near-equal)
    # (between strings too: "'ab' + 'cd'" / "'cd' + 'ab'" was served, 0.98)
    r"|(?<=[\w)\]'\"]\s)[-+*/%](?=\s[\w(\['\"])|(?<=[\d)\]'\"])[-+*/%](?=[\d(\['\"])"
    # ("??" alone before more words, or beside a comma, a bracket, a hyphen: after a word, a
    # mark; "?." and "?:" of code: "what does ?. mean", "a?.b")
    r"|(?<![^\s(\[{])\?{2,}+(?=[,;:)\]}-]|\s++\S)"
    r"|(?<![^\s(\[{])\?[.:](?=[\s,;)\]}-])|(?<=[\w)\]])\?(?:\.|->|\[)(?=[\w(\[])"
)
_CANONICAL = {"≠": "!=", "≤": "<=", "≥": ">="}
#: "over", "under", "above", "below" compare only before an amount ("under $300", not "under the
#: Text section").
_BEFORE_NUMBER = r"(?=\s+(?:[$€£¥]\s*)?\d)"
_WORDS = [
    (r"\b(?:no|not) (?:less|fewer) than\b|\bat least\b|不少于|不低于|至少", ">="),
    (r"\b(?:no|not) (?:more|greater) than\b|\bat most\b|不超过|不多于|最多|至多", "<="),
    (
        r"\b(?:greater|more|larger|bigger|higher|older|longer|heavier|faster) than\b"
        rf"|\b(?:above|over|exceeds?|exceeding){_BEFORE_NUMBER}|大于|多于|高于|超过",
        ">",
    ),
    (
        r"\b(?:less|fewer|smaller|lower|younger|shorter|lighter|slower) than\b"
        rf"|\b(?:below|under){_BEFORE_NUMBER}|小于|少于|低于",
        "<",
    ),
    (r"\bequals?\b|\bequal to\b|等于", "=="),
]
_WORD_OPERATORS = re.compile("|".join(f"(?P<op{i}>{p})" for i, (p, _) in enumerate(_WORDS)), re.I)
#: Something code names: a one-letter name in lower case (not "i"; not "C" or "K", languages
#: and letters; not "c++"), an identifier with a digit or an underscore, None / True / False.
#: (Not a number: "between 5 and 10" is prose.) After an operator, no "a": an article ("x is a
#: variable").
#: (Atomic: a name is read once, never split again when what follows it fails; "-" then 4,094
#: underscores took 0.6-0.9 s.)
_NAME = r"(?>[A-Za-z_]\w*_\w*|[A-Za-z]+\d\w*|None|True|False)(?![\w'+#])"
_CODE = rf"(?:[a-hj-z](?![\w'+#])|{_NAME})"
_CODE_AFTER = rf"(?:[b-hj-z](?![\w'+#])|{_NAME})"
#: "and", "or", "is", "is not", "in", "not in" between two of them ("a and b", "x is not None"),
#: and a leading "not" before one ("not x", "not (x"; not "not a": an article).
_CODE_WORDS = re.compile(
    rf"(?<![\w']){_CODE}\s+(?P<op>and|or|is not|is|not in|in)\s+(?=(?:not\s+)?{_CODE_AFTER})"
    rf"|(?P<not>(?<![\w'])not)\s+(?=\(|{_CODE_AFTER})"
    r"|(?P<none>(?<![\w'])is not|(?<![\w'])is)\s+(?=None\b|True\b|False\b)"
)
#: A group in parentheses: its operators grouped ("not (x and y)" is no "not x and y").
_GROUP = re.compile(r"\([^()]*\)")
#: Punctuation that looks like an operator in prose: "!" ending a sentence, "-" as a dash.
#: (A run of "!" read from its start, whole: "!" * 4,095 + "x" was tried from each, 0.44 s.
#: After a digit it is a factorial: "How big is 52!" / "How big is 52?" was served, 0.988.
#: Two or more standing alone before more words are what is asked about ("What does !! do"),
#: at the end they end a sentence ("Why is it blue !!": ``differs`` reads them against the
#: other's); one alone is prose: "Bonjour !")
_PROSE = re.compile(
    r"(?<=[^!\d\s])!++(?=\s|$)|(?<!\S)!(?=\s|$)|(?<!\S)!++(?=\s*+$)"
    r"|\s-\s(?=[A-Za-z])|(?<=[A-Za-z])/(?=[A-Za-z])"
)


@memo
def _operators(text: str) -> tuple[str, ...]:
    text = norm(text)
    found: list[tuple[int, str]] = []
    for m in _WORD_OPERATORS.finditer(text):
        index = next(int(k[2:]) for k, v in m.groupdict().items() if v is not None)
        found.append((m.start(), _WORDS[index][1]))
    for m in _SYMBOL.finditer(_PROSE.sub(" ", text)):
        found.append((m.start(), _CANONICAL.get(m.group(), m.group())))
    for m in _CODE_WORDS.finditer(text):
        name = next(k for k in ("op", "not", "none") if m.group(k) is not None)
        found.append((m.start(name), m.group(name)))
    # Parentheses only around an operator: "(optional)" in prose groups nothing.
    for m in _GROUP.finditer(text):
        if any(m.start() < at < m.end() for at, _ in found):
            found += [(m.start(), "("), (m.end() - 1, ")")]
    return tuple(op for _, op in sorted(found))


#: What leaves a question open before a run of marks: the run is then what is asked about
#: ("In C#, what is ??", "what's ??", "the purpose of !!", "how do I use ??", "tell me about
#: ??", "the operator ??", "define ??"); a question complete before it ("What does YOLO mean
#: ??", "What is it ??") ends so. (A preposition may end a complete one, "What is glass made of
#: ??": refused against "...of?", a hit given up.)
_ASKING = frozenset(
    """what's whats operator operators define explain about of for with on by regarding use
    using the a an""".split()
)
_VERBS = frozenset("is are was were does do did means".split())
_WH = frozenset("what how which".split())


def _end_run(text: str) -> tuple[str, bool]:
    """The marks ending ``text`` apart from its last word ("What does !!"; a mark or bracket
    around them aside: "??.", "(??)"), or "", and whether two or more of them follow what
    leaves the question open (``_ASKING``: asked about)."""
    words = [w.strip(".,:;()[]{}").lower() for w in text.split()]
    last = words[-1] if len(words) > 1 else ""
    if not last or last.strip("!?"):
        return "", False
    before = words[-2]
    # (A verb after a wh-word, an adverb between them or not: "what exactly is ??".)
    open_ = before in _ASKING or (before in _VERBS and bool(_WH.intersection(words[-5:-2])))
    return last, len(last) > 1 and open_


#: An operand beside an operator: read forward after it, and backward (reversed) before it,
#: anchored and within :data:`_REACH` characters (searched for from the text's start, each
#: operator's took time quadratic in a long run of letters); a subscript or quotes with it.
_RIGHT = re.compile(r"\s*\(*['\"]?[\w.]+['\"]?(?:\[[^\[\]]{0,32}\])*")
_LEFT_REVERSED = re.compile(r"\s*\)*(?:\][^\[\]]{0,32}\[)*['\"]?[\w.]+['\"]?")
_REACH = 64
#: Words beside an operator that only talk about it ("When should I use === in JavaScript?" /
#: "In JavaScript, when should I use ===?" name no operands), with the stop words.
_TALK = frozenset(
    """operator operators symbol sign use using used vs versus instead mean means meaning
    write type""".split()
)
#: Operators whose operands may change places: equality, and + or * between two numbers
#: ("3 + 5" / "5 + 3"; between names, "a + b" may join strings or lists).
_EQUALITY = frozenset({"==", "!=", "===", "!=="})
_NUMBER = re.compile(r"\(*\d[\d.]*\)*")


def _operand(found: re.Match[str] | None, reversed_: bool = False) -> str:
    """An operand's text, without spaces, or "" when there is none or it is prose (one letter
    is a name: "Is a < i?")."""
    if found is None:
        return ""
    text = "".join((found.group()[::-1] if reversed_ else found.group()).split())
    if len(text) > 1 and (text.lower() in _TALK or text.lower() in STOP):
        return ""
    return text


def _rearranged(a: str, b: str) -> bool:
    """The same names and numbers beside the same operators, placed otherwise ("count < limit" /
    "limit < count", "x = y + 1" / "y = x + 1"). Other words beside them on each side are
    prose reworded around an operator asked about ("How can I make == compare objects" / "how
    do I get == to compare objects"), not another expression."""
    oa, ob = _operands(a), _operands(b)
    if oa == ob:
        return False
    names = [{w for left, _, right in found for w in (left, right) if w} for found in (oa, ob)]
    return names[0] == names[1]


@memo
def _operands(text: str) -> tuple[tuple[str, ...], ...]:
    """Each operator symbol with the names or numbers beside it ("x = y + 1": ``x = y``, ``y +
    1``; a commutative one's in either order): the same operators between other operands are
    another expression."""
    text = _PROSE.sub(" ", norm(text))
    found = []
    for m in _SYMBOL.finditer(text):
        before = text[max(0, m.start() - _REACH) : m.start()][::-1]
        left = _operand(_LEFT_REVERSED.match(before), reversed_=True)
        right = _operand(_RIGHT.match(text, m.end(), m.end() + _REACH))
        # Spaced on one side only, it is a prefix or a suffix ("and **kwargs", "!x"): the word
        # on its spaced side is no operand.
        spaced_before = text[m.start() - 1 : m.start()].isspace()
        if spaced_before != text[m.end() : m.end() + 1].isspace():
            left, right = ("", right) if spaced_before else (left, "")
        if m.group() in _EQUALITY or (
            m.group() in ("+", "*") and _NUMBER.fullmatch(left) and _NUMBER.fullmatch(right)
        ):
            left, right = sorted((left, right))
        found.append((left, m.group(), right))
    return tuple(found)


def differs(a: str, b: str) -> bool:
    # Marks apart at the end end a sentence ("Why is it blue ??"), but two texts that both end
    # so in other marks, two or more on a side, ask about them ("What does !!" / "What does
    # ??" 0.995, "In C#, what is ??" / "...is ?" 0.983), as does a run after what leaves the
    # question open, whatever the other ends in ("In C#, what is ??" / "...is?" 0.995).
    (x, open_x), (y, open_y) = _end_run(a), _end_run(b)
    if (open_x or open_y) and x != y:
        return True
    if _operators(a) != _operators(b) or _rearranged(a, b):
        return True  # (another operator, or the same between other operands: "a < b" / "b < a")
    return bool(x and y) and x != y and max(len(x), len(y)) > 1


RULE = Rule(Reason.OPERATOR, differs)
