"""The exact-cache store interface every backend implements.

Contract:
- ``get(key, kind)`` returns the stored ``Entry`` or None; an expired entry is never returned,
  nor one a backend others write to cannot read as carpool's (``redis.store``: of another
  ``kind`` than the API of the request whose key it is, its body cut short...).
- ``put(key, entry)`` stores a complete answer until ``entry.expires`` (wall-clock seconds); it
  replaces any entry under the same key. An entry already expired (``expires`` <= now: an
  answer back-dated by an upstream's ``age``) is not stored: it counts nothing and evicts
  nothing, and the key's entry is gone all the same. The caller has already decided the
  answer may be stored (``Answer.storable``: complete, 2xx, and the upstream said neither
  ``no-store`` nor ``private``; ttl > 0, no ``no-store`` request): a store never judges answers.
- ``invalidate(selector)`` drops the entries matching a tag, a namespace, a prompt prefix, or all, and
  returns how many it dropped.
- An entry's tags are its request's (``x-carpool-tags``) and the gateway's own (``state_tag``:
  the stored responses or chat completions its answer is or continues), which no client's tag
  can be.
- ``entries`` and ``bytes`` report the current size, for /stats and /metrics: the live
  entries, or soon so (``reap()``, which the reports call first: a bounded step that drops
  expired entries, for a backend whose expiry is otherwise lazy). ``Entry.size`` is
  the portable measure of an entry (its payload: what the Redis store counts); the in-process
  store counts what the entry takes in this process (packed, ``store.packed``, and its objects,
  ``Entry.held``, while it keeps them), so that its budget bounds the process's memory.
- Keys are fingerprint digests (hex): a backend may use them in its own key space as they are.
- A backend that lives outside the process (Redis) raises ``StoreUnavailable`` when it cannot be
  reached or does not answer in time, promptly and never by hanging, so that the caller can
  degrade to the in-process layers; in-process backends never raise it.
"""

from __future__ import annotations

from dataclasses import dataclass
from sys import getsizeof
from typing import Any, Protocol

from ..answer import Answer
from ..errors import CarpoolError
from ..lru import held
from ..unicode_forms import normal_form_before_run

# Every Answer has its own dict for the frames it synthesizes once (``Answer.sse``): counted as
# the empty dict it is when stored (what fills it later is ``synthesized_held``'s: the memory
# store counts it for an entry it keeps, when it is made; see ``Entry.held``).
_SYNTHESIZED = held({})
# The prompt's start an entry keeps for invalidation by prefix (``prompt_text``).
PROMPT_PREFIX_CHARS = 1024


def prompt_text(text: str) -> str:
    """What an entry keeps of its prompt (``Entry.prompt_prefix``), and what a ``Selector``'s
    prefix is compared as: NFC (the fingerprint's form of a prompt: the answers of an NFD
    and an NFC prompt are one) and at most ``PROMPT_PREFIX_CHARS`` long (a longer prefix is
    cut as the kept prompts are: it then drops every prompt that starts as its first 1,024
    characters do, a few more than it names, never fewer)."""
    # (Cut before it is normalized: NFC of an 8 MB prompt took ~80 ms of the event loop. The
    # first 1,024 characters of the NFC come from the first 4,096 of the text unless one of
    # them carries thousands of combining marks.)
    # (From a long run on as sent, where its normalization would be quadratic: ``unicode_forms``.)
    return normal_form_before_run("NFC", text[: 4 * PROMPT_PREFIX_CHARS])[:PROMPT_PREFIX_CHARS]


def state_tag(tenant: str, state_id: str) -> str:
    """The gateway's own tag of the answers that are, or continue, ``state_id`` (a response or
    a chat completion the upstream stores for ``tenant``, ``Api.state_made`` /
    ``Api.state_continued``), or whose request names it (a file ``tenant`` uploaded,
    ``apis.base.named_files``): a 2xx ``DELETE`` of it by that tenant drops them
    (``Gateway.passthrough``). It starts with a line feed, which no client's tag holds
    (``x-carpool-tags`` are printable), so no client can name it nor collide with it."""
    return f"\nstate {tenant} {state_id}"


def state_tenant(tag: str) -> str:
    """The tenant of a ``state_tag`` (for what is bounded fairly between tenants)."""
    return tag.split(" ", 2)[1] if " " in tag else ""


@dataclass(slots=True, eq=False)
class Entry:
    answer: Answer
    expires: float  # wall-clock seconds
    tags: tuple[str, ...] = ()
    namespace: str = ""
    prompt_prefix: str = ""  # the start of the prompt text, for prefix invalidation

    @property
    def size(self) -> int:
        """The payload: the answer's bytes, the prompt prefix and the tags (``Answer.size``)."""
        return self.answer.size + len(self.prompt_prefix) + sum(len(t) for t in self.tags)

    @property
    def held(self) -> int:
        """Bytes the entry's objects take in this process (``lru.held``): the ``Entry``, its
        ``Answer``, the body, the frames, the strings and numbers they alone refer to. The same
        for the same entry at any time: frames the answer synthesizes later for streaming
        clients (``Answer.sse``) are not counted here (``synthesized_held``)."""
        answer = self.answer
        frames = answer.frames
        if (
            frames is None
            and not self.tags
            and not self.namespace
            and answer.usage_frame is None
            and type(answer.created) is float
            and type(self.expires) is float
        ):
            # The usual entry (every miss stores one): the same sum, its fixed part once.
            return _USUAL + held(answer.body, answer.tokens, self.prompt_prefix)
        return (
            held(
                self,
                answer,
                answer.body,
                answer.created,
                answer.tokens,
                answer.usage_frame,
                self.expires,
                self.tags,
                self.namespace,
                self.prompt_prefix,
                frames,
            )
            + _SYNTHESIZED
            + (_frames_held(frames) if frames else 0)
            + (held(*self.tags) if self.tags else 0)
        )


class Store(Protocol):
    """A store may also offer ``get_now(key)``: ``get`` without a coroutine, for a store that
    answers in-process (``MemoryStore``); the request's first step is taken before a task
    exists with it (``Gateway.repeat_now``). Such a store's ``put`` never waits either: a
    flight's clients reply before it stores their answer, in the same turn (``Leader.lead``)."""

    async def get(self, key: str, kind: str | None = None) -> Entry | None:
        """``key``'s entry. ``kind``: the API of the request whose key it is (None: not known),
        which a backend that others can write to (Redis) checks the answer's against: the key
        scopes its API, so an answer of another is no entry carpool put there."""
        ...

    async def put(self, key: str, entry: Entry) -> None: ...

    async def invalidate(self, selector: Selector) -> int: ...

    async def forget(self, key: str) -> bool:
        """Drop ``key``'s entry; whether there was one (a call whose answer may predate an
        invalidation takes back what it stored: ``redis/flights.py``)."""
        ...

    def reap(self) -> int:
        """Drop some expired entries, if it is time to (a bounded step: the reports call it
        before reading ``entries`` and ``bytes``); how many."""
        ...

    @property
    def entries(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    async def aclose(self) -> None: ...


class StoreUnavailable(CarpoolError):
    """503: a shared store (Redis/Valkey) is down, unreachable, too slow, or refused a command.

    Raised by every operation of an out-of-process backend instead of the client library's
    errors, which are kept as ``__cause__``. The operation may or may not have taken effect.
    """

    status = 503
    type = "server_error"
    code = "store_unavailable"


@dataclass(frozen=True, slots=True)
class Selector:
    """What an invalidation drops (admin ``/admin/invalidate``): ``everything``, or the entries
    carrying ``tag``, in ``namespace`` or whose prompt starts with ``prefix`` (any of those set)."""

    tag: str | None = None
    namespace: str | None = None
    prefix: str | None = None
    everything: bool = False

    def picks(self, entry: Any) -> bool:
        """Whether this selector picks ``entry``: anything with ``tags``, ``namespace`` and
        ``prompt_prefix`` (exact or semantic)."""
        return self.picks_labels((entry.tags, entry.namespace, entry.prompt_prefix))

    def picks_labels(self, labels: tuple[tuple[str, ...], str, str]) -> bool:
        """Whether this selector picks an answer labelled (tags, namespace, prompt prefix): an
        entry's, or a lingering flight's (``broadcast.Labels``)."""
        tags, namespace, prompt_prefix = labels
        return (
            self.everything
            or (self.tag is not None and self.tag in tags)
            or (self.namespace is not None and namespace == self.namespace)
            or (self.prefix is not None and prompt_prefix.startswith(self.prefix))
        )


def synthesized_held(answer: Answer) -> int:
    """Bytes the frames ``answer`` synthesized and keeps take (``Answer.synthesized``): the
    lists, their frames and what their dict grew by (``Entry.held`` counts it empty)."""
    synthesized = answer.synthesized
    if not synthesized:
        return 0
    return (
        held(synthesized)
        - _SYNTHESIZED
        + sum(held(frames) + _frames_held(frames) for frames in synthesized.values())
    )


def _frames_held(frames: list[bytes]) -> int:
    """``held(*frames)`` for a stream's frames (bytes, dozens an answer): the same sum (an empty
    one is shared: 0; any other ``lru.allocated`` of its size), without asking each its type."""
    return sum(
        [(n + 15 if n <= 512 else n + 23) & ~15 for n in map(getsizeof, frames) if n > _EMPTY]
    )


_EMPTY = getsizeof(b"")


# What ``Entry.held`` counts of a usual entry (no frames, tags nor namespace; float times) besides
# its body, tokens and prompt prefix: the Entry, the Answer, two floats and the Answer's dict.
_sample = Answer("chat", b"", True)
_USUAL = held(Entry(_sample, 0.5), _sample, 0.5, 0.25) + _SYNTHESIZED
del _sample
