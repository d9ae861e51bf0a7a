"""Whether a text reads as English: the one language the semantic cache's checks read.

Contract: :func:`reads_english` says whether ``text`` reads as English; a text that does not
gets no semantic view (:mod:`carpool.semantic.view`, ``semantic.english_only``): it is matched
exactly, never guessed at. The rules' word lists (negation, antonyms, quantities, intents) are
English, and the packaged verifier, an English model, reads any Latin-script text without an
unknown token: it scored "Soll ich Antibiotika mit Milch einnehmen?" against "...nicht mit
Milch..." 0.98+, and a reviewer's 149 traps in 10 languages were served 29.5 % of the time
(English: ~1.5 %). Whatever embedder is configured, the checks after it stay English.

A text reads as English when:

- no word (a run of 2 or more letters) holds a letter outside the Latin script (Chinese,
  Cyrillic, Greek words: one letter alone, "2π", is a symbol and skipped), and no "¿" or "¡";
- at least :data:`KNOWN_SHARE` of its plain words are whole words of the packaged verifier's
  vocabulary (its ``tokenizer.json``, read once), allowing an English ending ("-ing", "-ed",
  "-ies"...): German, Turkish, Polish, Vietnamese words mostly are not. The share is read over
  the whole text and over each clause (";", ":", a line, a sentence) of 2 plain words or more,
  so a text cut into short lines ("Betreff: ...\nBitte bestätigen.") is still read; 1 or 2
  plain words holding a marker ("It's improbable.") are English;
- each sentence of :data:`MARKED_WORDS` or more plain words holds a word of :data:`MARKERS`,
  function words that are English only: Spanish, French, Dutch or Portuguese words that the
  vocabulary holds too ("de", "la", "die", "in", "no", "a") are not in it; or, an
  instruction's terse sentence ("Answer in two short paragraphs, in plain English, without
  links.", "Escalate legal questions."), at least :data:`UNMARKED_SHARE` of its plain words
  are words of the vocabulary (all 7 of 12 such instructions were refused by markers alone);
- no sentence holds a word of :data:`FOREIGN` (other languages' function words, romanised Hindi's
  too), unless it is written as a name or an acronym: capitalised past a sentence's first word,
  first before another capitalised word ("Las Vegas", "Che Guevara"), or 4 capitals or fewer
  ("IST", "APA").

Plain words are lower-case words of 2 or more letters (the first word of a sentence may be
capitalised, unless a capitalised word follows it: "Ashwin Sanghi"): a name ("Berlin",
"PostgreSQL"), an acronym, a one-letter word and a number say nothing of the language, and an
identifier in code ("snake_case") is split into its words. A sentence of 3 or more words all
in capitals or Title Case ("¿PUEDO TOMAR...", "Antibiotika Ohne Milch Einnehmen") says nothing
of names by its capitals: all its words are plain, its FOREIGN words count. A text without
plain words (a name, "ok", "2+2?") reads as English: the rules still read its numbers, names
and identifiers exactly. The check errs towards "not English": a foreign text served a wrong
answer, an English one refused only costs an upstream call ("wat is the best laptop" is
refused: "wat" is Dutch). It reads the whole text, ~0.9-1.4 µs a character, on the event loop
when a request is looked up: :func:`.view.semantic_view` gives it no text longer than
``semantic.max_text_chars``.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata

from ..unicode_forms import normal_form
from .verifier import PACKAGED

__all__ = [
    "FOREIGN",
    "KNOWN_SHARE",
    "MARKED_WORDS",
    "MARKERS",
    "UNMARKED_SHARE",
    "known",
    "reads_english",
    "script",
]

#: The share of a sentence's plain words that must be words of the vocabulary (measured on
#: the development pairs: English sentences are ~0.9+, German/Turkish/Polish/Vietnamese ~0.2-0.5;
#: French/Spanish/Italian share many words with it, the markers tell those).
KNOWN_SHARE = 0.6
#: A sentence of this many plain words or more must hold a marker: shorter ones ("Reset
#: password", "Thanks!") say too little either way, and their words are still looked up.
MARKED_WORDS = 3
#: ...unless this share of its plain words, or more, are words of the vocabulary (0.65 lets
#: no more of a reviewer's non-English traps through than 0.75, with FOREIGN's question words).
UNMARKED_SHARE = 0.65

#: English function words (and a few frequent words) that are not words of the other common
#: Latin-script languages: not "a", "i", "in", "no", "me", "die", "de", "la", "un", "se", "so",
#: "an", "also" (German), "want", "help", "had", "over" (Dutch), "he" (Spanish), "on" (French).
#: ("will" and "was" are German words too, but German texts fail the vocabulary share.)
MARKERS = frozenset(
    """the to of and is are were be been being am do does did done can could should would
    shall might must you she it we they my your his its our their them him her us this that
    these those what which who whom whose how why when where if than not for with from at by
    or but has have there here about any some every each get got make made after before into
    out up just very too then because while until something anything nothing everything
    someone anyone everyone nobody wrong right please thanks thank yes yeah like know think
    tell give show write explain will was he's he'd he'll i'm i've i'd i'll you're you've
    we're they're it's that's
    what's there's here's who's how's let's don't doesn't didn't can't couldn't won't
    wouldn't isn't aren't wasn't weren't shouldn't haven't hasn't""".split()
)

#: Function words of the other common Latin-script languages that are no English words: a
#: sentence holding one of them does not read as English, whatever markers it has ("Was ist
#: die...", "¿Qué significa...?"). Not those English also writes: "pour", "per", "non", "den",
#: "jest", "um", "ya", "del", "para", "von" and "der" ("van der Waals").
FOREIGN = frozenset(
    """und das ist wat sind nicht ein eine auf für wie ich wir het een welke niet zijn voor que
    qué por una los las cómo está qui sont avec dans sur une ces cette il di che della sono
    não uma como você ini itu apa berapa bagaimana nasıl mı się nie czy của và có không là
    những nahi nahin hai hain hoon karo karna karta karti karte karni kar ko mujhe kya chahiye
    kaise kyun kyon bahut abhi yeh raha rahi gaya hota hoga sakta sakte quelle quel quels quelles
    qual quais quanto quanta quid ou hao le les du des au aux aus zu nein""".split()
)
#: Endings an English word may carry past a vocabulary word ("booking", "cancelled", "stories").
ENDINGS = ("s", "es", "ed", "d", "ing", "ly", "er", "est", "ers", "ies", "ness", "ment", "ful")
#: The endings before which an English word doubles its last consonant.
DOUBLING = ("ing", "ed", "er", "est")
#: Prefixes it may carry before one ("nonfictional", "outcompete", "unipolar").
PREFIXES = ("un", "non", "out", "re", "dis", "mis", "over", "under", "pre", "anti", "sub")

#: Sentences: the share is read per sentence and clause (";", ":"), the markers per sentence.
#: A stop ends one only after a word of two letters or more, before no digit ("B. Tech",
#: "Rs. 500" go on).
_CLAUSES = re.compile(r"(?<=[^\W\d_]{2}[.;:])\s+(?!\d)|(?<=[!?])\s+|\n\s*")
_SENTENCES = re.compile(r"(?<=[^\W\d_]{2}\.)\s+(?!\d)|(?<=[!?])\s+|\n\s*")
#: Code, read by the rules and not a language: fenced blocks and inline spans.
_CODE = re.compile(r"```.*?(?:```|$)|`[^`\n]*`", re.DOTALL)
#: A word: letters, with an English contraction's tail ("don't", "something's"), between
#: white space and sentence marks. A token with other marks in it ("torch.utils", "x_max",
#: "a/b", "e-mail") is an identifier or a compound and says nothing of the language.
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)?")
_TOKEN = re.compile(r"[\"'“”‘’¿¡(\[{]*([^\W\d_]+(?:['’][^\W\d_]+)?)[\"'“”‘’)\]},.;:!?]*")
_CONTRACTION = re.compile(r"n't$|'(?:s|re|ve|ll|d|m)$")


@functools.cache
def vocabulary() -> frozenset[str]:
    """The whole words (no "##" pieces) of the packaged verifier's WordPiece vocabulary."""
    with (PACKAGED / "tokenizer.json").open(encoding="utf-8") as file:
        vocab = json.load(file)["model"]["vocab"]
    return frozenset(word for word in vocab if word.isalpha())


def reads_english(text: str) -> bool:
    """Whether ``text`` reads as English (see the module's contract)."""
    # Composed first: "café" decomposed would split into "cafe" and a lone mark. (A text no
    # language writes, whose normalization would be quadratic, is none: ``unicode_forms``.)
    composed = normal_form("NFC", text)
    if composed is None:
        return False
    text = composed
    if not text.isascii() and (
        "¿" in text or "¡" in text or any(_foreign(word) for word in _WORD.findall(text))
    ):
        return False
    text = _CODE.sub(" ", text)
    if not all(_marked(sentence) for sentence in _SENTENCES.split(text)):
        return False
    # Each clause of 2 plain words or more, then all of them together: a text cut into short
    # lines or sentences ("Antibiotika. Ohne Milch. Einnehmen?") is still read as a whole.
    plain: list[str] = []
    for clause in _CLAUSES.split(text):
        words = _plain(clause)
        if len(words) >= 2 and not _known_share(words):
            return False
        plain += words
    return not plain or _known_share(plain)


def _words(text: str) -> list[str]:
    """The words of ``text``: its tokens that are letters only (see :data:`_TOKEN`)."""
    tokens = (_TOKEN.fullmatch(token) for token in text.split())
    return [match.group(1) for match in tokens if match is not None]


def _shouted(words: list[str]) -> bool:
    """Whether a sentence is in CAPS or Title Case: its capitals then say nothing of names."""
    return len(words) >= MARKED_WORDS and all(word[0].isupper() for word in words if len(word) > 1)


def _titled(words: list[str], i: int) -> bool:
    return i < len(words) and words[i][0].isupper() and words[i][1:].islower()


def _plain(text: str) -> list[str]:
    """The plain words of ``text``, lower-cased (see the module's contract)."""
    words = _words(text)
    shouted = _shouted(words)
    return [
        word.lower().replace("’", "'")
        for i, word in enumerate(words)
        if len(word) > 1
        # A capitalised first word before another ("Ashwin Sanghi") is a name.
        and (shouted or word.islower() or (i == 0 and word[1:].islower() and not _titled(words, 1)))
    ]


def _known_share(plain: list[str]) -> bool:
    # A marker says English where 1 or 2 words say too little ("It's improbable.").
    if len(plain) < MARKED_WORDS and any(map(_is_marker, plain)):
        return True
    return _share(plain) >= KNOWN_SHARE


def _share(plain: list[str]) -> float:
    """The share of ``plain``'s words that are vocabulary words (1 if none), contractions'
    tails apart ("don't": "don" and "t"): the vocabulary splits them so too."""
    words = [part for word in plain for part in word.split("'") if len(part) > 1]
    return sum(map(known, words)) / len(words) if words else 1.0


def _is_marker(word: str) -> bool:
    word = word.replace("’", "'")
    return word in MARKERS or _CONTRACTION.sub("", word) in MARKERS


def _named(words: list[str], i: int) -> bool:
    """Whether ``words[i]`` is written as a name or an acronym ("Los Angeles", "IST", "Che")."""
    word = words[i]
    if not word[0].isupper():
        return False
    if word.isupper():
        return len(word) <= 4
    return not word[1:].islower() or i > 0 or _titled(words, 1)


def _marked(sentence: str) -> bool:
    # Any word may be the marker ("Japanese: Do westerners smell bad?") or foreign ("Berapa"),
    # but a name's or an acronym's spelling says nothing ("Las Vegas", "APA"), unless the
    # sentence is all capitals ("¿PUEDO TOMAR...").
    words = _words(sentence)
    shouted = _shouted(words)
    for i, word in enumerate(words):
        if word.lower().replace("’", "'") in FOREIGN and (shouted or not _named(words, i)):
            return False
    plain = _plain(sentence)
    if len(plain) < MARKED_WORDS or any(_is_marker(word.lower()) for word in words):
        return True
    # No marker: an instruction's terse sentences ("Avoid speculation.", "Answer in two short
    # paragraphs, in plain English.") read as English when nearly every word is English.
    return _share(plain) >= UNMARKED_SHARE


def known(word: str) -> bool:
    """Whether ``word`` is a vocabulary word, or one with an English prefix or ending."""
    if _stem_known(word):
        return True
    return any(
        word.startswith(prefix)
        and len(word) - len(prefix) >= 4
        and _stem_known(word[len(prefix) :])
        for prefix in PREFIXES
    )


def _stem_known(word: str) -> bool:
    vocab = vocabulary()
    if word in vocab:
        return True
    for ending in ENDINGS:
        if word.endswith(ending) and len(word) - len(ending) >= 3:
            stem = word[: -len(ending)]
            if stem in vocab or stem + "e" in vocab or (ending == "ies" and stem + "y" in vocab):
                return True
            # A doubled consonant before "-ing", "-ed", "-er" ("formatting", "planned").
            if ending in DOUBLING and stem[-1] == stem[-2] and stem[:-1] in vocab:
                return True
    return False


def _foreign(word: str) -> bool:
    """Whether a word of 2 or more letters holds a letter outside the Latin script."""
    if len(word) < 2 or word.isascii():
        return False
    return any(ch.isalpha() and script(ch) != "LATIN" for ch in word)


@functools.lru_cache(maxsize=4096)
def script(ch: str) -> str:
    """A letter's script, from its Unicode name: "LATIN SMALL LETTER E WITH ACUTE" -> LATIN
    (``semantic.scripts`` names them so: :func:`carpool.semantic.view.readable`)."""
    name = unicodedata.name(ch, "")
    if name.startswith(("CJK ", "KANGXI")):
        return "HAN"
    if name.startswith(("FULLWIDTH LATIN", "MODIFIER LETTER SMALL")):
        return "LATIN"
    return name.split(" ", 1)[0]
