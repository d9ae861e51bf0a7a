"""One thing named in place of another, the rest word for word.

"how can i reset my router please" / "how can i reset my modem please" differ in the thing asked
about and in nothing else. The entity rule reads only capitalised names, and the verifier, which
scored "router" / "modem" 0.13 asked bare, scored the pair 0.99 once a few words of filler were
shared around them: the shared words drown the one that differs. The rule fires when the two
texts are the same words in the same order but for exactly one, and that one

- is a content word on both sides (no :data:`FUNCTION` word: "How do I..." / "How can I...",
  "the best way" / "the best method" are rewordings);
- is not another form or spelling of the same word ("router" / "routers", "engraving" /
  "engraved", "tech" / "technology", "colour" / "color", "recieve" / "receive");
- stands in a noun phrase: within :data:`REACH` words after a determiner or a possessive ("my
  router", "a kitchen sink", "my old router"). A verb or an adjective elsewhere ("How do I
  purchase..." / "How do I buy...", "Why are dogs afraid..." / "...scared...") is left to the
  verifier, which reads those synonyms.

It reads a possessive as well: "my" against "your" (or "our" against "your") before the same
content word ("check my essay" / "check your essay") is another person's thing, and the verifier
served it (0.97); "How can I improve my English?" / "How can you improve your English?" changes
two words, a question asked in general, and passes.

It refuses a synonym in a noun phrase too ("my car" / "my automobile"): no list here tells a
synonym from another thing. Measured on the held-out development pairs, it refused 4 of the
2,260 true rewordings served (0.1 point: "a better author" / "a better writer") and 2 of the 107
wrong hits ("a guy" / "a girl"); refusing every one-word content substitution, in a noun phrase
or not, refused 27 true rewordings over both halves, verbs and adjectives mostly.
"""

from __future__ import annotations

import os.path

from ..verdict import Reason, Rule
from .text import lower_words, memo, one_edit

#: Words that frame a question rather than name what it asks about, and generic nouns and
#: light verbs ("way", "thing", "make") that a rewording swaps freely.
FUNCTION = frozenset(
    """a an the this that these those some any all each every no other another such what which
    who whom whose how why when where whether if than then so as and or but nor of in on at for
    by with from to into onto about over under after before between through during without
    within via per is are was were be been being am do does did doing done have has had having
    can could should would will shall may might must need ought i me my mine we us our ours you
    your yours he him his she her hers it its they them their theirs myself yourself itself
    ourselves themselves one ones there here now just also too very really still even ever only
    much many more most few less least lot lots please thanks thank kindly ok okay get got make
    made best good better way ways thing things someone something anyone anything people
    person""".split()
)
#: What opens a noun phrase: the word changed must follow one, within :data:`REACH` words.
#: Not "that", as often a relative pronoun before a verb ("a reply that accepts the invitation").
DETERMINERS = frozenset(
    "a an the my your his her its our their this these those some any each every".split()
)
REACH = 2
#: Possessives that name another person's thing before the same noun.
PERSONS = frozenset({frozenset({"my", "your"}), frozenset({"our", "your"})})


def _same_word(x: str, y: str) -> bool:
    """Another form or spelling of one word: one the start of the other ("tech"), a shared
    start that leaves at most three letters of the longer and two of the shorter ("engraving"
    / "engraved"), or one letter changed, added, dropped or two swapped in a long word."""
    short, long = sorted((x, y), key=len)
    if long.startswith(short) and len(short) >= 3:
        return True
    common = len(os.path.commonprefix((short, long)))
    if len(short) >= 4 and len(long) - common <= 3 and len(short) - common <= 2:
        return True
    return len(short) >= 5 and one_edit(short, long)


def one_changed(a: tuple[str, ...], b: tuple[str, ...]) -> int | None:
    """Where two texts' words differ, when they are the same words but one; else None."""
    if len(a) != len(b):
        return None
    changed = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return changed[0] if len(changed) == 1 else None


def another_thing(x: str, y: str) -> bool:
    """Whether ``y`` in place of ``x`` names another thing: a content word on both sides, not
    another form or spelling of one word."""
    return (
        x.isalpha()
        and y.isalpha()
        and x not in FUNCTION
        and y not in FUNCTION
        and not _same_word(x, y)
    )


@memo
def _substituted(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    i = one_changed(a, b)
    if i is None:
        return False
    x, y = a[i], b[i]
    if frozenset({x, y}) in PERSONS:  # "my essay" / "your essay": whose, before a content word
        return i + 1 < len(a) and a[i + 1].isalpha() and a[i + 1] not in FUNCTION
    # (The words before it, within REACH, are the same in b.)
    return another_thing(x, y) and any(w in DETERMINERS for w in a[max(0, i - REACH) : i])


def differs(a: str, b: str) -> bool:
    return _substituted(lower_words(a), lower_words(b))


RULE = Rule(Reason.SUBSTITUTION, differs)
