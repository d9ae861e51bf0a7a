"""A question asked of the other role, for :mod:`.order`: "Who did Cain kill?" / "Who killed
Cain?" ask Cain's victim and Cain's killer.

No exchange of two words makes one the other (a "did" more, the verb in another form), and the
verifier served most (a review: 9 of 16, 0.93-0.99). :func:`other_role` reads the words of each
side (lower-cased), the same before a question word ("who", "whom", "which", "what", and up to
two words after it: "which team"; "whom" read as "who") and the same after what it asks:

- "who did X kill ..." / "who killed X ...";
- "who X killed ..." / "who killed X ..." ("Tell me who Cain killed" / "...who killed Cain");
- "who did X work for ..." / "who worked for X ..." (a particle after the verb, not "with");
- "who was killed by X ..." / "who killed X ..." ("got" read as "was");
- "who was X shot by ..." / "who was shot by X ...", and / "who did X shoot ...".

``X`` is one to :data:`LONGEST` words, the verb the same in any form ("kill" / "killed", "shoot"
/ "shot", "see" / "saw": :data:`_PAST`). Not a verb that holds both ways round (:data:`_MUTUAL`:
"Who did Obama marry?" / "Who married Obama?" ask the same), nor a
form of "be", "have", "do" or "mean" ("Tell me what ROI means" / "...what means ROI"). Only
around the first place the two sides differ: linear in the words.
"""

from __future__ import annotations

from .phrases import LONGEST

_WH = frozenset({"who", "whom", "which", "what"})
_DO = frozenset({"did", "does", "do"})
_BE = frozenset({"was", "were", "is", "are", "got", "gets", "get"})  # ("who got fired by")
#: A verb's particle or preposition left after it: "Who did Einstein work for?" (not "with" nor
#: "against": "Who did Lincoln run against?" asks who ran against him, both ways round).
_PARTICLES = frozenset(
    (w,) for w in "about for to at on out up off after before over under from".split()
)
#: Forms that name no act of one on the other.
_NO_ACT = frozenset(
    """be is are was were am been being have has had do does did mean means meant can could
    will would shall should may might must""".split()
)
#: Verbs that hold both ways round, their beginnings: who married whom is who whom married.
#: Not "play" or "draw", which do in a match but not on a stage or a canvas ("Who did Heath
#: Ledger play?" / "Who played Heath Ledger?": a review had them served).
_MUTUAL = tuple("face marr wed date meet met fight fought battl debat divorc resembl".split())
#: Past forms that do not start as their verb does ("saw" / "see").
_PAST = dict(
    pair.split("/")
    for pair in """saw/see seen/see slew/slay slain/slay won/win ate/eat eaten/eat taught/teach
    caught/catch told/tell bought/buy sold/sell found/find made/make gave/give given/give
    took/take taken/take left/leave chose/choose chosen/choose bit/bite bitten/bite
    struck/strike stole/steal stolen/steal threw/throw thrown/throw led/lead fed/feed held/hold
    brought/bring sought/seek hid/hide drew/draw drawn/draw wrote/write written/write sang/sing
    spoke/speak broke/break forgave/forgive froze/freeze rode/ride drove/drive came/come ran/run
    spun/spin began/begin became/become grew/grow knew/know flew/fly swam/swim sat/sit
    stood/stand wore/wear woke/wake""".split()
)


def _base(word: str) -> str:
    return _PAST.get(word, word)


def _same_verb(verb: str, done: str) -> bool:
    """``done`` is a form of ``verb`` ("kill" / "killed", "shoot" / "shot", "see" / "saw"), or a
    verb beginning as it does (three letters: "contact" / "contradicted" too; another verb asks
    another question anyway)."""
    verb, done = _base(verb), _base(done)
    if verb in _NO_ACT or done in _NO_ACT or verb.startswith(_MUTUAL) or done.startswith(_MUTUAL):
        return False
    return done == verb or (len(verb) >= 3 and done[:3] == verb[:3])


def _named(words: tuple[str, ...]) -> bool:
    return _NO_ACT.isdisjoint(words) and "by" not in words


def _forms(x: tuple[str, ...], y: tuple[str, ...]) -> bool:
    """``x`` and ``y``, from just after the question (and its noun), ask the other role."""
    for size in range(1, LONGEST + 1):
        # who did X kill R / who killed X R; who did X write about R / who wrote about X R
        if x[:1] and x[0] in _DO and len(x) > size + 1 and y[1 : 1 + size] == x[1 : 1 + size]:
            if y[1 + size :] == x[2 + size :] and _same_verb(x[1 + size], y[0]):
                return True
        if x[:1] and x[0] in _DO and x[2 + size : 3 + size] == y[1:2] and y[1:2] in _PARTICLES:
            if y[2 : 2 + size] == x[1 : 1 + size] and y[2 + size :] == x[3 + size :]:
                if len(x) > size + 1 and _same_verb(x[1 + size], y[0]):
                    return True
        # who X killed R / who killed X R ("what ROI means" / "what means ROI": no verb to
        # read "means" as X, "ROI" as a verb, the other way round)
        named = x[:size]
        if len(x) > size and y[1 : 1 + size] == named and y[0] == x[size] and _named(named):
            if y[1 + size :] == x[1 + size :] and _same_verb(x[size], y[0]):
                return True
        # who was killed by X R / who killed X R
        if x[:1] and x[0] in _BE and x[2:3] == ("by",) and x[3 : 3 + size] == y[1 : 1 + size]:
            if x[3 + size :] == y[1 + size :] and _same_verb(y[0], x[1]):
                return True
        # who was X shot by R / who was shot by X R, or / who did X shoot R
        if x[:1] and x[0] in _BE and x[2 + size : 3 + size] == ("by",) and len(x) > size + 2:
            named, done, rest = x[1 : 1 + size], x[1 + size], x[3 + size :]
            if y[:1] == x[:1] and y[2:3] == ("by",) and y[3 : 3 + size] == named:
                if y[3 + size :] == rest and _same_verb(done, y[1]):
                    return True
            if y[:1] and y[0] in _DO and y[1 : 1 + size] == named and len(y) > size + 1:
                if y[2 + size :] == rest and _same_verb(y[1 + size], done):
                    return True
    return False


def other_role(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """``a`` and ``b`` ask the same question of the other role (see the module's contract)."""
    a = tuple("who" if w == "whom" else w for w in a)
    b = tuple("who" if w == "whom" else w for w in b)
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    for at in range(max(0, same - 5), min(same, len(a) - 1) + 1):
        if a[at] not in _WH or a[:at] != b[:at]:
            continue
        for nouns in (0, 1, 2):  # "who", "which team", "which football team"
            start = at + 1 + nouns
            if a[at:start] != b[at:start]:
                break
            if _forms(a[start:], b[start:]) or _forms(b[start:], a[start:]):
                return True
    return False
