"""The semantic view of a request: what the semantic cache compares, and how.

Contract: ``semantic_view`` splits a shareable request into its scope, compared exactly, and the
text compared by meaning, if it has one. The last user turn is compared by meaning (each API's
``semantic_split``: chat and Messages' last user message, a completion's prompt, Responses' last
user input), and so are a chat or Messages conversation's earlier turns (``context``:
:func:`conversation`; Responses' earlier ``input`` items stay in the scope, exact), so a
reworded context can still hit while "cancel it" in a chat about a gym never matches "cancel
it" in a chat about a phone plan (the guard reads both); leading small talk is left out of the
context. The model, every parameter and the system prompt (instructions) must be identical: they
are in the scope. Embeddings requests, multimodal last turns, list prompts, requests whose answer
repeats their prompt (``echo``, ``prompt_logprobs``) and conversations with a turn that is not
plain (a tool call or result, a name, non-string content, a late instruction) have no semantic
view; nor has a text (or context) longer than ``semantic.max_text_chars`` (the checks below
read every character on the event loop), one without a letter or a digit (empty, "?", "!!!":
nothing to compare by meaning; "?" was served the answer to "" and "!" that to "?"), one with
a letter of a script the models do not read (``semantic.scripts``, narrowed to the verifier's:
:func:`read_scripts`; Latin only with the packaged one), one that does not read as English
(:func:`.english.reads_english`, while ``semantic.english_only``: the rules and the packaged
verifier read English only) or a character the models drop unread (:func:`invisible`: a
format or control character): it is matched exactly, never guessed at.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..canonical import canonical_body, collapses, digest, normalize_text
from ..config import Config
from ..request import Request
from .english import reads_english, script
from .retyping import UNREAD
from .verifier import PACKAGED, SETTINGS_FILE, render_context

if TYPE_CHECKING:
    from ..fingerprint import Fingerprint

__all__ = [
    "INSTRUCTION_ROLES",
    "SemanticView",
    "conversation",
    "invisible",
    "readable",
    "semantic_view",
    "small_talk",
]


@dataclass(slots=True, frozen=True)
class SemanticView:
    """What the semantic cache compares: ``text`` by meaning, everything else by ``scope``."""

    scope: str  # digest of tenant, namespace, freshness and the body minus text, context
    text: str  # the last user turn (chat) or the prompt (completions), normalised
    context: str = ""  # a conversation's earlier turns (``render_context``), compared by meaning


def semantic_view(request: Request, key: Fingerprint, config: Config) -> SemanticView | None:
    """Split a shareable request into its scope and the text compared by meaning, if it has one
    (see the module's contract)."""
    if key.key is None:
        return None
    split = request.api.semantic_split(request.body)
    if split is None:
        return None
    text, rest = split
    # Bounded before any check reads it: they run on the event loop, ~1 µs a character (an
    # 8 MB prompt stalled every other request ~7 s), and the guard serves a text past its
    # READ_CHARS only when identical. Past the bound the whole request is exact: never a
    # prefix compared, so no tail goes unread.
    bound = config.semantic.max_text_chars
    if len(text) > bound:
        return None
    collapse = collapses(request, config)
    earlier = conversation(rest, collapse)
    if earlier is None:
        return None
    context, rest = earlier
    if len(context) > bound:
        return None
    if not any(ch.isalnum() for ch in text):
        return None  # (no word: nothing a meaning could be read from)
    scripts = read_scripts(config)
    if not (readable(text, scripts) and readable(context, scripts)):
        return None
    # The rules' word lists and the packaged verifier are English, whatever the embedder: a
    # German negation scored 0.98+ against its affirmation (its words are all Latin letters).
    if config.semantic.english_only and not (reads_english(text) and reads_english(context)):
        return None
    if invisible(text) or invisible(context):
        return None
    return SemanticView(
        digest(
            request,
            config,
            f"semantic/{SEMANTIC_FORMAT}",
            key.tenant,
            key.namespace,
            canonical_body(request.kind, rest, collapse),
        ),
        normalize_text(text, collapse),
        context,  # (each turn's text normalised: collapsed whole, turns ran into one line)
    )


#: The semantic scopes' label, with the format of what is compared: moved when that changes,
#: so that a release shares no semantic entry with one that compared otherwise (the exact
#: cache stays). 2: each earlier turn's text normalised apart (a context collapsed whole ran
#: its turns into one line, read as one turn, and met a conversation with a turn more).
SEMANTIC_FORMAT = 2

#: Roles whose messages are instructions, matched exactly (in the scope), never by meaning.
INSTRUCTION_ROLES = frozenset({"system", "developer"})


def conversation(rest: dict[str, Any], collapse: bool = False) -> tuple[str, dict[str, Any]] | None:
    """A chat body's earlier turns as one text (``verifier.render_context``, each turn's text
    ``normalize_text``: ``collapse`` must not join the turns into one line, the guard reads
    them one by one), and the body without them: its instructions and the last turn's other
    fields stay in the scope; ("", ``rest``) for a body with no earlier turns.

    Only plain turns move out of the scope: a role and a string content, nothing else. A turn
    with tool calls or a tool result, a name, a role that is no string or content that is not a
    string, or an instruction after the first turn, leaves the request no semantic view (None):
    exact, whole, its last turn too (when unsure, don't share; the docs promised so, while its
    last turn was still compared by meaning). Leading small talk (:func:`small_talk`: "hi
    there" / "Hello! How can I help?") is no context: it is left out, so a greeting before a
    question still meets the bare question, which an earlier instruction never does (the guard
    refuses earlier turns on one side only).
    """
    messages = rest.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return "", rest
    *earlier, last = messages
    lead = 0  # the instructions before the first turn
    while lead < len(earlier) and _instruction(earlier[lead]):
        lead += 1
    instructions, turns = earlier[:lead], earlier[lead:]
    if not all(
        isinstance(m, dict)
        and set(m) <= {"role", "content"}
        # A user's or an assistant's: not a tool's (even without its tool_call_id), an odd
        # role (an object, a list) or a late instruction: exact, whole.
        and m.get("role") in ("user", "assistant")
        and isinstance(m.get("content"), str)
        for m in turns
    ):
        return None
    chatter = 0
    while chatter < len(turns) and small_talk(turns[chatter]):
        chatter += 1
    if any(invisible(m["content"]) for m in turns[chatter:]):
        return None  # (read before a collapse makes spaces of some: as the last turn is)
    said = [{**m, "content": normalize_text(m["content"], collapse)} for m in turns[chatter:]]
    return render_context(said), {**rest, "messages": [*instructions, last]}


#: The words of a user's small talk: greetings and thanks. A turn made only of these (and
#: sentence marks) asks for nothing and changes no answer. (No question word: "Is it okay?"
#: asks something; no time of day: "Good evening!" changes what to eat now.)
USER_SMALL_TALK_WORDS = frozenset(
    """hi hello hey hiya howdy greetings there good everyone all thanks thank you so much very
    lot a cheers appreciate it ok okay great nice cool""".split()
)
#: An assistant's: those, and its offer to help ("Hello! How can I help you today?"). (Not how
#: the user is: "Are you doing well today?" is answered by the turn after it: "No.")
SMALL_TALK_WORDS = USER_SMALL_TALK_WORDS | frozenset(
    """sure how can could may i help assist with today what do for is anything else i'm am
    glad happy to welcome you're your pleasure meet""".split()
)
#: A small-talk turn is short: "Hello! How can I help you today?" is 7 words.
SMALL_TALK_MAX_WORDS = 12
_SMALL_TALK_TEXT = re.compile(r"[A-Za-z'’ ,.!?]+")


def small_talk(message: dict[str, Any]) -> bool:
    """Whether a plain user or assistant turn is only small talk (:data:`USER_SMALL_TALK_WORDS`,
    :data:`SMALL_TALK_WORDS`)."""
    content, role = message["content"], message["role"]
    if role not in ("user", "assistant") or not _SMALL_TALK_TEXT.fullmatch(content):
        return False
    allowed = USER_SMALL_TALK_WORDS if role == "user" else SMALL_TALK_WORDS
    words = re.findall(r"[a-z'’]+", content.lower().replace("’", "'"))
    return 0 < len(words) <= SMALL_TALK_MAX_WORDS and all(w in allowed for w in words)


def invisible(text: str) -> bool:
    """Whether ``text`` holds a character the models drop unread: a format character (Unicode
    Cf: a zero-width space or joiner, a direction mark, a tag character), a control character
    but tab, line feed and carriage return (NUL, DEL, a backspace, C1), or U+FFFD
    (``retyping.UNREAD``). A zero-width space or a NUL inside "paypal" scored 1.0 against
    "paypal", while the upstream model may read them (text hidden in tag characters,
    "yes\b\b\bno"): such a text is matched exactly, never by meaning."""
    if UNREAD.search(text) is not None:
        return True
    return not text.isascii() and any(unicodedata.category(ch) == "Cf" for ch in set(text))


def _instruction(message: Any) -> bool:
    """Whether ``message`` is an instruction. A role is looked up only when it is a string: a
    list or an object is unhashable (a TypeError, a 500 that only the semantic cache caused)."""
    if not isinstance(message, dict):
        return False
    role = message.get("role")
    return isinstance(role, str) and role in INSTRUCTION_ROLES


def read_scripts(config: Config) -> list[str]:
    """The scripts a text's letters may be of: those of ``semantic.scripts`` the verifier reads
    (``verifier_scripts``: the packaged one Latin only; it splits Cyrillic, Greek or kana into
    pieces of its vocabulary, no unknown token to score 0, and scored their negations the
    same, 0.99)."""
    scripts = config.semantic.scripts
    try:
        reads = verifier_scripts(config.semantic.verifier_dir)
    except ValueError:  # (its verifier.json edited since the config loaded: never a failure)
        reads = ("Latin",)
    if "*" in reads:
        return scripts
    if "*" in scripts:
        return list(reads)
    wanted = {s.upper() for s in scripts}
    return [s for s in reads if s.upper() in wanted]


@functools.lru_cache(maxsize=8)
def verifier_scripts(folder: str | None) -> tuple[str, ...]:
    """The scripts the verifier in ``folder`` (None: the packaged one) reads: its
    ``verifier.json``'s ``scripts``, Latin where it names none (trained on English, as
    ``scripts/train_verifier.py`` trains it), whatever the folder is called. ``ValueError`` for
    one that names them otherwise than as a list of names (checked when the config loads)."""
    path = (Path(folder) if folder else PACKAGED) / SETTINGS_FILE
    try:
        meta = json.loads(path.read_text())
    except OSError:
        return ("Latin",)  # (unreadable: the verifier's own load says why)
    except ValueError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    named = meta.get("scripts") if isinstance(meta, dict) else None
    if named is None:
        return ("Latin",)
    if not (isinstance(named, list) and named and all(isinstance(s, str) for s in named)):
        raise ValueError(f"{path}: 'scripts' must be a list of script names (or [\"*\"])")
    return tuple(named)


def readable(text: str, scripts: list[str]) -> bool:
    """Whether every letter of ``text`` is of one of ``scripts`` (``*``: any)."""
    if text.isascii() or "*" in scripts:
        return True
    allowed = frozenset(name.upper() for name in scripts)
    return all(script(ch) in allowed for ch in set(text) if ch.isalpha())
