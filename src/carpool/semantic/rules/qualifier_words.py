"""The qualifier rule's word lists (:mod:`.qualifiers`): each family's phrases and classes.

A family is a list of ``"phrase phrase ...: class"`` lines (a phrase's words joined by ``_``),
read longest phrase first; ``solo`` are the classes that change a question on one side alone;
``sets``: the classes are compared as sets (a tense said twice is one time frame);
``companions``: classes read only beside another class of the family in the same edit;
``alike``: ``"class=class ..."``, a class compared as another against it, and as itself alone
("each day" / "every day" is one question, "each" alone is not "all"'s restriction);
``loose``: classes of ``alike`` read only against the class they are like ("just" is "only"
against "only", and elsewhere often "simply": "Is this just fantasy?" / "...some fantasy?"). A
phrase of class ``-`` is read so that its words are no other phrase, and counts for nothing
("of all time" is no "all", "the most interesting" no "most", "how can I" asks a way as "how
should I" does: each measured refusing true rewordings of the development pairs).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    phrases: tuple[tuple[tuple[str, ...], str], ...]  # (words, class), longest first
    solo: frozenset[str] = frozenset()
    sets: bool = False
    companions: frozenset[str] = frozenset()
    alike: dict[str, str] = field(default_factory=dict, compare=False)
    loose: frozenset[str] = frozenset()


def _entries(table: str) -> list[str]:
    """The table's entries: a line without a ``:`` goes on on the next."""
    entries, pending = [], ""
    for line in table.strip().splitlines():
        pending += " " + line
        if ":" in line:
            entries.append(pending)
            pending = ""
    return entries


def _family(
    name: str,
    table: str,
    solo: str = "",
    sets: bool = False,
    companions: str = "",
    alike: str = "",
    loose: str = "",
) -> Family:
    phrases = []
    for entry in _entries(table):
        words, label = entry.rsplit(":", 1)
        phrases += [(tuple(p.split("_")), label.strip()) for p in words.split()]
    phrases.sort(key=lambda p: -len(p[0]))  # (stable: a line's order kept among equals)
    return Family(
        name,
        tuple(phrases),
        frozenset(solo.split()),
        sets,
        frozenset(companions.split()),
        dict(pair.split("=") for pair in alike.split()),
        frozenset(loose.split()),
    )


#: How many: "all" / "some" / "most" / "few"... ("always" is "all" of the times).
QUANTIFIERS = _family(
    "quantifier",
    """
    at_all all_time of_all_time the_most the_least: -
    at_most: atmost
    at_least: atleast
    exactly: exactly
    all every everyone everybody everything always: all
    each per: each
    some sometimes someone somebody any anyone anybody ever: some
    most usually mostly generally typically normally: most
    many often: many
    few rarely seldom hardly_ever: few
    none nobody never no_one: none
    only: only
    just: just
    both: both
    either: either
    neither: neither
    """,
    # ("exactly" not alone: "What exactly is the 4th dimension?" asks what the plain one does.)
    solo="only all none atmost atleast",
    # "every day" / "each day" / "per day", "only staying" / "just staying": one question. Alone,
    # "each" does not say "all" of a group ("Is each employee" / "Is an employee"), and "just"
    # is often "simply" ("Can I just leave?"): neither is solo, and "just" is read against "only"
    # alone.
    alike="each=all just=only",
    loose="just",
    # (A class said twice is said: "Has anyone ever climbed..." / "Has anybody climbed...",
    # "most people generally" / "people usually" were refused while they were counted.)
    sets=True,
)
#: Must, may, should or will ("will I have to" / "might I have to"); asked of a way ("how can I" / "how should I") it is one question.
MODALITY = _family(
    "modality",
    """
    how_can how_could how_should how_do what_can what_could what_should what_do: -
    must have_to has_to had_to required require requires mandatory compulsory obliged
    obligated obligatory need_to needs_to need needs needed necessary: obligation
    may might can could allowed permitted legal able_to possible: may
    optional voluntary: optional
    will: will
    should ought_to advisable recommended: advice
    """,
)
#: When: a past or a future marker, before / after / since / until / during, the tense.
TIME_FRAME = _family(
    "time_frame",
    """
    yesterday last previous ago: past
    tomorrow next upcoming: future
    before prior_to: before
    after afterwards: after
    since: since
    until till: until
    during: during
    was were had: past_tense
    is are am has have: present_tense
    will: future_tense
    """,
    sets=True,
)
#: On what condition; a negation is read with a condition changed in the same edit.
CONDITIONS = _family(
    "condition",
    """
    only_if: only_if
    even_if: even_if
    whether_or_not: regardless
    unless: unless
    if whether provided providing as_long_as: if
    except excluding other_than apart_from besides but_not skip skips: except
    only just: only
    including especially also: including
    not don't doesn't didn't isn't aren't wasn't weren't no: negation
    """,
    solo="unless only_if even_if regardless except",
    companions="negation",
)
#: How much: too / enough / very / slightly.
DEGREE = _family(
    "degree",
    """
    too: too
    enough: enough
    very extremely highly badly: very
    slightly somewhat a_bit a_little barely: slightly
    """,
)
#: In what form the answer is written.
FORMAT = _family(
    "format",
    """
    table tables tabular: table
    bulleted bullet bullets bullet_points bullet_point: bullets
    numbered: numbered
    paragraph paragraphs prose: paragraph
    list lists: list
    json csv yaml xml markdown html: data
    essay haiku poem limerick tweet: genre
    brief briefly concise concisely in_a_nutshell: brief
    detailed in_detail thoroughly in_depth step_by_step: detailed
    """,
    solo="table bullets numbered paragraph list data genre",
)

#: The time "do" asks of: "Does my card work abroad?" / "Did...", "Did the Fed raise rates?" /
#: "Will the Fed...". A family of its own: against a "has" (``TIME_FRAME``) "did" is often no
#: other time ("Did the Beatles ever play..." / "Have the Beatles ever played..."), and "will"
#: against "do" none ("Does coffee dehydrate you?" / "Will coffee...": true rewordings
#: refused while "do" was a tense there), so "will" is read as "do" here.
DO_TENSE = _family(
    "do_tense",
    """
    did: did
    do does: do
    will: future
    """,
    alike="future=do",
)

FAMILIES = (QUANTIFIERS, MODALITY, TIME_FRAME, CONDITIONS, DEGREE, FORMAT, DO_TENSE)
