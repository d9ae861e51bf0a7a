"""The semantic cache: near-duplicate prompts served from cache, never across a change of meaning.

Contract:
- An answer is only a candidate for requests with the same *scope* (tenant, namespace, freshness
  token, model, every parameter, system prompt: ``fingerprint.semantic_view``); the last user
  turn (or the completion prompt) and a conversation's earlier turns (``context``) are compared
  by meaning.
- A text that carries its own long context (a completion prompt made of a system prompt and a
  question, a pasted document followed by a question) is split by :func:`focus`: its *head* (all
  but the last sentences, when it is long: ``HEAD_MIN_WORDS``) joins the scope, so it must match
  exactly, like a chat's system prompt; only the *tail* (the last sentences, at least
  ``TAIL_MIN_WORDS`` words) is embedded, indexed and judged by the guard. Compared whole, such
  texts embed alike whatever their question (the shared head dominates the mean-pooled vector, and
  the model reads only the first 256 tokens: a 300-word system prompt leaves nothing of the
  question, similarity 1.0).
- ``probe(view, max_age, prompt_prefix, key=KEY)``: identical lookups in progress (the same
  request key, ``max_age`` too) share one, counted in ``lookups_joined`` (``/stats``
  ``layers.semantic``): a burst of one prompt is embedded and judged once, not once per
  request (the verifier reads ~3 ms a pair on one thread: 200 identical requests made ~44
  lookups, seconds of it, every other lookup waiting behind them). The lookup runs in a task
  of its own, so that a requester leaving cancels nothing another waits on; the last one
  leaving cancels it. At most ``semantic.max_pending`` lookups and embeddings for entries
  (``vector``: a miss whose lookup embedded nothing, its scope empty, embeds its prompt while
  its call runs, and its reply waits for it) are in progress (``pending``): past it a lookup
  is not made (``lookups_shed``): a miss at once, and no entry made for its prompt (which
  would embed it); ``vector`` answers None (``entries_shed``): no entry is made, the reply
  does not wait. A rate of work over what the verifier (one pair at a time, ~3 ms
  on this project's machine) and the embedder (one thread) do costs hits and entries, not a
  queue every request waits in.
- ``probe(view, max_age, prompt_prefix)`` embeds the text (only when its scope holds entries at
  all), asks the scope's ANN index for the nearest entries, and keeps those at or above the
  threshold, unexpired and younger than ``max_age`` (``Cache-Control``), on the cache's
  ``clock``, and not made before a prefix invalidation that names the requester's prompt
  (below); the guard (``guard.Guard``, passed
  in) judges them: the exact rules, then the verifier, on the texts and on the conversations'
  earlier turns (``SemanticView.context``); the most similar alone first, the others in one
  batch if it fails (one ``guard.Lookup`` for both: a judge's deadline is the lookup's). The
  most similar that passes is the ``match``; the most similar one seen
  (passing or not) is ``nearest``, for ``semantic.mode: mark``.
- The embedder failing (``embedder: upstream`` down, or refusing a text batched with this one;
  a model error; no vector within ``semantic.embed_timeout_ms``) fails no request: the probe finds nothing (a miss, counted in
  ``embed_failures``, ``/stats`` ``layers.semantic``, and logged at most every
  ``FAILURE_LOG_S``: ``embed_failed``), and no entry is made for a prompt it could not embed
  (``Probe.failed``: not asked again for the entry). Vectors of another length than
  ``semantic.embedding_dim`` (``EmbeddingDimMismatch``: a setting to correct, every embedding
  fails until it is) are logged once, as an error naming the key and both lengths (no text),
  and kept in ``embed_problem`` (``/stats`` ``layers.semantic.embed_problem``) until a vector
  is made again; the breaker's refusals that follow are counted, not logged.
- ``insert`` stores a complete answer under its scope with the policies of the exact cache
  (expiry from the type's TTL, tags, namespace, prompt prefix for invalidation). At most
  ``semantic.max_entries`` entries and ``semantic.max_bytes`` bytes: the least recently used go
  first (``carpool.lru``). An entry counts (``SemanticEntry.size``) its answer whole (its own
  copy: the exact cache's budget does not bound it), its texts, its vector in the index (twice
  its raw size: the graph's copy and its links) and ``ENTRY_OBJECTS`` for its Python objects;
  and, from when they are made, the frames its answer synthesized for streaming hits
  (``SemanticEntry.synthesized``), as the in-process exact store counts a hot entry's
  (``store.memory``): every hit of an entry is served the entry's answer itself, so that an
  answer stored without frames is made into frames once per entry, not once per streaming
  client (on the event loop: ~33 ms for 8 MB, and a copy each client that stops reading
  held), and its clients share them. The entry keeps an answer of its own
  (``Answer.served_copy`` of the one inserted: a memo, ``Answer.on_synthesized``, no other
  holder shares), which tells it of the frames it keeps; the least recently used entries (this
  one last) then go until ``bytes`` is within ``max_bytes`` again. Frames made for an answer
  read for a reference (``resolve``, below) are the exact store's to count or not, as for its
  own hits: another instance's answer read from Redis is the request's own copy;
  each scope's index counts ``SCOPE_BYTES`` besides (room is made for it as an entry opens the
  scope: one scope per entry held ~10x what its entries counted before), and each slot its
  removed vectors left (``VectorIndex.slack``: usearch keeps them) what a vector counts. An
  index that fell to a quarter of its ``peak`` is rebuilt from its live vectors when that is
  cheap (``COMPACT_MAX_LIVE`` of them at most, from a peak of ``COMPACT_MIN_PEAK``): a scope
  that once held 30,000 entries and keeps two hot ones held ~53 MB, counted 56 KB. One larger
  than the whole budget is not kept (nor indexed). An entry is its scope, context
  and text: the same three replace the older entry.
- Expired entries (``expires``, on the cache's ``clock``: wall-clock seconds, as the answers'
  ``created``; the gateway's, which a test moves) are never candidates, and they go: dropped
  when a lookup or ``forget`` finds them, and swept (``LRU.sweep``: the next ``SWEEP_STEP`` entries, from where the last step
  stopped) at most every ``REAP_S`` by an ``insert`` or a read of ``entries`` or ``bytes``
  (``/stats``), so that those come to count live entries and their memory is given back. Every entry that goes, for any reason, leaves its scope's index and the maps.
- ``invalidate`` drops entries by tag, namespace, prompt prefix or all, like the exact store,
  and counts itself in ``generation``: whoever inserts an answer whose call began before one
  (read then) must not (``Leader._insert_semantic``), as it may predate what was dropped.
- A prefix names the prompts whose answers go, and an entry is served to other prompts than
  its own: an entry for "What's the price of the Pro plan?" survives the prefix "What is the
  price" and would be served to "What is the price of the Pro plan?", whose own answer was
  dropped. So the cache remembers its prefix invalidations (another instance's too, read from
  the stream, dated when made: ``redis/semantic.py``) and serves no entry made before one (inserted before it,
  or its answer ``created`` before it: a record from another instance may come late) to a
  requester whose prompt prefix (``probe``'s ``prompt_prefix``: what the exact layer keeps,
  ``lead.prompt_prefix``; None: unknown, every one applies) starts with it. At most
  ``MAX_PREFIX_INVALIDATIONS`` are remembered, each until it is older than the longest TTL of
  an entry inserted (no entry made before it lives on); one forgotten for the bound or its age
  leaves a *floor*: no entry made before it is served to anyone (dropped when found).
- ``aclose`` closes the embedder (``LocalEmbedder``: its ``carpool-embed`` worker thread), when
  it has an ``aclose``; the verifier's thread is shared by the process and stays.
- An entry holds its ``Answer``, or (``insert(..., ref=KEY)``, an entry fed by another gateway
  instance: ``redis/semantic.py``) a *reference*: the exact-cache key of its answer, fetched by
  ``await resolve(KEY)`` only when the entry passes every check. ``None`` from ``resolve`` means
  the answer is gone (expired, invalidated): the entry is dropped and the walk goes on with the
  next candidate; ``StoreUnavailable`` from it means unknown for now: the candidate is skipped,
  the entry kept. ``Candidate.answer`` is the answer to serve (None for a reference not resolved:
  ``nearest`` in mark mode).
- No reply carries an entry's text (another request's prompt). An entry is named to clients by
  ``SemanticEntry.public_id`` only (``x-carpool-entry`` on a semantic hit, the nearest entry in
  ``semantic.mode: mark``): a digest of its scope and text keyed with a random secret of this
  process (``_ENTRY_ID_KEY``), so it cannot be reversed, nor confirmed by hashing a guessed
  prompt; it is stable for the life of the process, and differs across instances and restarts.
- ``refuse(entry, view)``: an audit found ``entry``'s answer wrong for ``view``'s prompt
  (``auditor.py``): that pair is refused from then on (:attr:`Reason.AUDIT`, without asking the
  guard; still ``nearest``), the entry still a candidate for every other prompt. Remembered as
  16-byte digests of (entry, scope, context, text), the latest ``MAX_REFUSED`` pairs; an entry
  made again for the same prompt (a new answer) is a new entry, not refused. Only here: another
  instance's copy of a shared entry is refused by its own audits.
- The threshold is ``semantic.threshold``, or ``CALIBRATED_THRESHOLD``: a candidate below it is
  not even shown to the guard (it bounds the verifier's work, not the error rate: the verifier's
  own threshold does that).

How the defaults were chosen: docs/semantic.md and ``scripts/train_verifier.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..answer import Answer
from ..clock import SYSTEM_CLOCK, Clock
from ..config import SemanticConfig
from ..fingerprint import SemanticView
from ..lru import LRU, held
from ..store.base import Selector, StoreUnavailable, synthesized_held
from .embed.base import EmbeddingDimMismatch
from .embed.upstream import EmbedderDown
from .guard import Guard, Lookup, Side, Verdict
from .index import VectorIndex
from .verdict import Reason

log = logging.getLogger("carpool.semantic")

# Seconds between two warnings that the embedder failed (each failure is counted).
FAILURE_LOG_S = 30.0
#: Seconds (on the cache's clock) between two steps of the sweep of the expired entries, and
#: the entries a step looks at (a whole scan took ~5 ms of the loop at 100,000, on a miss's path).
REAP_S = 1.0
SWEEP_STEP = 4096
#: What an entry's Python objects hold besides its texts and answer (the entry, its id, its
#: public id, its places in the three maps): measured at ~0.5 KB (docs/semantic.md).
ENTRY_OBJECTS = 512
# What a scope's index holds besides its entries' vectors (usearch's HNSW with its first vector,
# 384 dimensions: ~52 KB of RSS measured, each), counted in ``bytes`` for every scope.
SCOPE_BYTES = 56 * 1024
#: An index whose live vectors fell to a quarter of its peak (``VectorIndex.slack``) is rebuilt
#: (``VectorIndex.compact``) when it holds at most ``COMPACT_MAX_LIVE`` vectors (~5 ms at 384
#: dimensions, on the event loop: a larger one keeps its slack, counted) and its peak was at
#: least ``COMPACT_MIN_PEAK`` (a smaller slack, ~100 KB at most, is counted, not worth a
#: rebuild). Amortised: a rebuild of n vectors comes after at least 3n removals since the last.
COMPACT_MAX_LIVE = 128
COMPACT_MIN_PEAK = 64
#: Prefix invalidations remembered (``probe``: the module's docstring); the oldest past it
#: becomes the floor (served to nobody: everything made before it).
MAX_PREFIX_INVALIDATIONS = 256
# Calibrated with `carpool eval-semantic --sweep` on the development pairs: see the docstring.
CALIBRATED_THRESHOLD = 0.40
# An entry's answer's ``on_synthesized`` (``_count_synthesized``): a partial of the cache's
# method and the entry's id, counted in the entry's ``size``.
_hook = partial(print, 1 << 40)
_HOOK = held(_hook, _hook.args, _hook.args[0], _hook.keywords)
del _hook
#: Pairs (entry, prompt) audits found wrong, remembered (``refuse``): 16-byte digests, ~2 MB.
MAX_REFUSED = 10_000
#: ``focus`` splits a text into a head (all but its last sentences), matched exactly as part of the
#: scope, and a tail compared by meaning, when the head has at least ``HEAD_MIN_WORDS`` words and
#: either ``HEAD_TAIL_RATIO`` times as many as the tail (context around a question, not a
#: paragraph whose last sentence is one of several of its own) or the text is longer than the
#: model reads (``LONG_TEXT_WORDS``, ~256 tokens). Measured: a shared head of 32 words of system
#: prompt lifts two different questions ("update my password" / "back up my email address", 0.42
#: alone) to 0.67-0.83, inside the threshold band, and one of 256 tokens to 1.0. On the
#: development pairs, 3 of gptcache_mock's 999 paraphrased paragraphs (and no qqp_val pair) are
#: split, and then no longer served (the heads are reworded).
HEAD_MIN_WORDS = 32
HEAD_TAIL_RATIO = 3
LONG_TEXT_WORDS = 160
#: The tail: the last sentences, up to at least this many words ("Question: How do I X? Answer:"
#: keeps the question with its "Answer:" cue).
TAIL_MIN_WORDS = 4
#: Where a sentence ends: after . ! or ? and white space, or at a line break.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\s*\n\s*")


def focus(view: SemanticView) -> SemanticView:
    """``view`` with a long head moved into its scope (module docstring, ``HEAD_MIN_WORDS``), or
    ``view`` itself. Idempotent: the tail is never split again."""
    text = view.text
    if len(text) < 2 * (HEAD_MIN_WORDS + TAIL_MIN_WORDS):  # too short for such a head
        return view
    for brk in reversed(list(_SENTENCE_BREAK.finditer(text))):
        tail = len(text[brk.end() :].split())
        if tail >= TAIL_MIN_WORDS:
            head_text = text[: brk.start()]
            head = len(head_text.split())
            if head < HEAD_MIN_WORDS or (
                head < HEAD_TAIL_RATIO * tail and head + tail < LONG_TEXT_WORDS
            ):
                return view
            scope = hashlib.blake2b(
                f"{view.scope}\x00{head_text}".encode(), digest_size=16
            ).hexdigest()
            return SemanticView(scope, text[brk.end() :], view.context)
    return view


#: The secret that keys entry ids (``SemanticEntry.public_id``): random, per process, never sent.
_ENTRY_ID_KEY = secrets.token_bytes(32)


@dataclass(slots=True, eq=False)
class SemanticEntry:
    id: int
    scope: str
    text: str
    answer: Answer | None  # None: a reference (``ref``) to the exact cache
    expires: float
    tags: tuple[str, ...] = ()
    namespace: str = ""
    prompt_prefix: str = ""
    size: int = 0  # bytes, set by the cache when inserted
    ref: str | None = None  # the exact-cache key of the answer, if remote
    created: float = 0.0  # when the answer was made (for max_age)
    context: str = ""  # a conversation's earlier turns
    tenant: str = "*"  # the scope's (``Fingerprint.tenant``): whose error budget its hits count in
    public_id: str = field(default="", init=False)  # what clients see of it: an opaque id
    # Bytes of the frames its answer synthesized for streaming hits and keeps
    # (``synthesized_held``), counted in the cache's ``bytes`` besides ``size`` (which the LRU
    # map asks again when it goes: it must not change).
    synthesized: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        # Keyed: a plain hash of the prompt could be confirmed by anyone who guesses the prompt.
        self.public_id = hashlib.blake2b(
            f"{self.scope}\x00{self.context}\x00{self.text}".encode(),
            key=_ENTRY_ID_KEY,
            digest_size=12,
        ).hexdigest()

    @property
    def side(self) -> Side:
        return Side(self.text, self.context)


@dataclass(slots=True)
class Candidate:
    entry: SemanticEntry
    similarity: float
    verdict: Verdict
    answer: Answer | None = None  # what to serve (set for the match)


@dataclass(slots=True)
class Probe:
    """The result of one semantic lookup."""

    vector: Any = None  # the text's embedding, reused when inserting
    match: Candidate | None = None  # the entry to serve, if any
    nearest: Candidate | None = None  # the most similar entry seen, served or not
    # The embedder failed, or the lookup was shed (``max_pending``): no entry is made for this
    # text either.
    failed: bool = False
    shed: bool = False  # not made at all (``max_pending``): it waited for nothing

    @property
    def waited(self) -> bool:
        """Whether the lookup waited for the embedder (and the verifier): embedded, or failed
        to (``embed_timeout_ms``: up to a second); not an empty scope's, nor a shed one."""
        return self.vector is not None or (self.failed and not self.shed)


@dataclass
class _Lookup:
    """A lookup in progress (``probe``'s ``key``) and how many requests wait for it."""

    task: asyncio.Future[Probe]
    waiters: int = 0


class SemanticCache:
    def __init__(
        self,
        config: SemanticConfig,
        embedder: Any,
        guard: Guard,
        resolve: Callable[[str], Awaitable[Answer | None]] | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.embedder = embedder
        self.guard = guard
        self.resolve = resolve
        self.threshold = config.threshold if config.threshold is not None else CALIBRATED_THRESHOLD
        self._scopes: dict[str, VectorIndex] = {}
        # Bounded in entries and bytes; an expired entry is dropped when found, or swept
        # (``_reap``); every one that goes leaves the index (``_unindex``).
        self._entries: LRU[int, SemanticEntry] = LRU(
            max_entries=config.max_entries,
            max_bytes=config.max_bytes,
            size=_entry_size,
            expires=_entry_expires,
            clock=clock,
            wall_clock=True,
            on_evict=self._unindex,
        )
        self._clock = clock
        self._by_text: dict[tuple[str, str, str], int] = {}  # (scope, context, text)
        self._by_public: dict[str, int] = {}  # public_id -> id (feedback names entries so)
        self._ids = itertools.count(1)
        self.rejections: dict[str, int] = {}  # guard verdicts by reason, for /stats
        self.embed_failures = 0  # texts the embedder failed (``embed_failed``)
        self._lookups: dict[tuple[str, float | None], _Lookup] = {}  # in progress, by key
        self.lookups_joined = 0  # lookups that joined an identical one in progress
        self.lookups_shed = 0  # lookups not made: ``semantic.max_pending`` in progress
        self.entries_shed = 0  # entries not embedded (so not made), for the same reason
        self._embedding = 0  # ``vector`` calls in progress
        self.generation = 0  # invalidations applied (``invalidate``)
        self._failure_logged_at = float("-inf")
        # The embedder's vectors are not the length semantic.embedding_dim says (a setting to
        # correct: every embedding fails until it is): logged once as an error, in /stats.
        self.embed_problem: str | None = None
        self._refused: LRU[bytes, bool] = LRU(max_entries=MAX_REFUSED)  # (``refuse``)
        self._slack = 0  # slots the scopes' indexes hold empty (``VectorIndex.slack``), in all
        # The prefix invalidations remembered: (prefix, the first id inserted after it, when
        # on the clock); the floor: the same for every prompt (module docstring).
        self._prefixes: deque[tuple[str, int, float]] = deque()
        self._floor: tuple[int, float] = (0, float("-inf"))
        self._longest_ttl = 0.0  # the longest an entry inserted was to live (expires - created)
        self._synthesized = 0  # the live entries' ``synthesized``, in all

    @property
    def entries(self) -> int:
        """Live entries (the expired swept first, at most every ``REAP_S``)."""
        self._reap()
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """What the live entries count (``SemanticEntry.size``, and the frames their answers
        synthesized: ``synthesized``) and their scopes' indexes (``SCOPE_BYTES`` each, and the
        slots they hold empty), against ``max_bytes``."""
        self._reap()
        return self._held()

    def _held(self) -> int:
        return (
            self._entries.bytes
            + self._synthesized
            + SCOPE_BYTES * len(self._scopes)
            + self._slot_bytes() * self._slack
        )

    def _slot_bytes(self) -> int:
        """What a vector's slot in an index counts: as an entry counts its vector (``insert``)."""
        return 8 * int(self.embedder.dim)

    def _reap(self) -> None:
        """A step of the sweep of the expired entries, unless one was taken less than
        ``REAP_S`` ago (``LRU.reap``; each entry dropped heard by ``_unindex``)."""
        self._entries.reap(SWEEP_STEP, REAP_S)

    def has_scope(self, scope: str) -> bool:
        return scope in self._scopes

    def embed_failed(self, error: Exception) -> None:
        """Counted and logged (at most every ``FAILURE_LOG_S``): a lookup's or an entry's."""
        self.embed_failures += 1
        if isinstance(error, EmbeddingDimMismatch):
            # Once, as an error naming the setting and both lengths (the message holds no text):
            # it is no passing failure, and the type name alone ("ValueError") sent the operator
            # nowhere. Its repeats are counted, not logged again.
            if self.embed_problem is None:
                self.embed_problem = str(error)
                log.error("the semantic cache's embedder failed: %s; lookups miss", error)
            return
        if self.embed_problem is not None and isinstance(error, EmbedderDown):
            return  # (the breaker open for that same mismatch: said once already)
        now = time.monotonic()
        if now - self._failure_logged_at >= FAILURE_LOG_S:
            self._failure_logged_at = now
            # Its type (and status) and our words only: an upstream's message may quote a prompt.
            status = getattr(error, "upstream_status", None) or getattr(error, "status", None)
            what = type(error).__name__ + (f" {status}" if isinstance(status, int) else "")
            refused = (
                ": the upstream refused the embedder's credentials (semantic.embedder_api_key, "
                "upstream.api_key, an upstream URL's user and password)"
                if status in (401, 403)
                else ""
            )
            log.warning(
                "the semantic cache's embedder failed (%s; %d failures so far): lookups miss%s",
                what,
                self.embed_failures,
                refused,
            )

    async def vector(self, view: SemanticView) -> Any:
        """The embedding ``insert`` would compute for ``view`` (``focus(view).text``); None
        when ``semantic.max_pending`` are in progress (``entries_shed``: no entry made, and no
        failure of the embedder's)."""
        if self.pending >= self.config.max_pending:
            self.entries_shed += 1
            return None
        self._embedding += 1
        try:
            return await self._embed(focus(view).text)
        finally:
            self._embedding -= 1

    async def _embed(self, text: str) -> Any:
        """The embedder's vector of ``text``: one made says the problem kept is over (an
        operator told to change the setting would break a config that works again)."""
        vector = await self.embedder.embed(text)
        self.embed_problem = None
        return vector

    async def probe(
        self,
        view: SemanticView,
        max_age: float | None = None,
        prompt_prefix: Callable[[], str] | None = None,
        *,
        key: str | None = None,
    ) -> Probe:
        """``prompt_prefix``: the requester's prompt prefix (``lead.prompt_prefix``), asked only
        when a prefix invalidation is remembered; None: unknown (every one applies). ``key``:
        the request's (its fingerprint's), whose lookup in progress this one joins."""
        view = focus(view)
        if view.scope not in self._scopes:
            return Probe()  # nothing to compare with: no embedding needed, nothing to share
        if key is None:
            return await self._probe(view, max_age, prompt_prefix)
        shared = (key, max_age)
        lookup = self._lookups.get(shared)
        if lookup is None:
            if self.pending >= self.config.max_pending:
                # Behind (the verifier reads one pair at a time): a miss at once rather than a
                # wait behind every lookup before it; nor an entry, which would embed.
                self.lookups_shed += 1
                return Probe(failed=True, shed=True)
            task = asyncio.ensure_future(self._probe(view, max_age, prompt_prefix))
            lookup = self._lookups[shared] = _Lookup(task)
            task.add_done_callback(partial(self._looked_up, shared, lookup))
        else:
            self.lookups_joined += 1
        lookup.waiters += 1
        try:
            return await asyncio.shield(lookup.task)
        finally:
            lookup.waiters -= 1
            if not lookup.waiters and not lookup.task.done():
                lookup.task.cancel()  # (nobody waits for it)
                self._looked_up(shared, lookup)

    @property
    def pending(self) -> int:
        """Lookups (those of a ``key``: shared) and entries' embeddings (``vector``) in
        progress, which ``semantic.max_pending`` bounds."""
        return len(self._lookups) + self._embedding

    def _looked_up(self, shared: tuple[str, float | None], lookup: _Lookup, *_: Any) -> None:
        if self._lookups.get(shared) is lookup:
            del self._lookups[shared]

    async def _probe(
        self,
        view: SemanticView,
        max_age: float | None,
        prompt_prefix: Callable[[], str] | None,
    ) -> Probe:
        """``probe``'s lookup of ``view`` (focused already)."""
        index = self._scopes.get(view.scope)
        if index is None:
            return Probe()  # (its scope's last entry gone meanwhile)
        try:
            vector = await self._embed(view.text)
        except Exception as error:  # (the cache's failure, not the request's: a miss)
            self.embed_failed(error)
            return Probe(failed=True)
        probe = Probe(vector)
        now = self._clock.now()
        prefix = None  # the requester's prompt prefix, if a prefix invalidation is remembered
        if self._prefixes:
            self._forget_prefixes(now)
            if self._prefixes and prompt_prefix is not None:
                prefix = prompt_prefix()
        found: list[tuple[SemanticEntry, float]] = []
        for key, similarity in index.search(vector, self.config.candidates):
            entry = self._entries.peek(key)
            if entry is None:
                continue
            if entry.expires <= now or self._below_floor(entry):
                self._drop(entry)  # (made before a forgotten invalidation: served to nobody)
                continue
            if not similarity >= self.threshold:  # (a NaN never passes it)
                break
            if max_age is not None and now - entry.created >= max_age:
                continue
            if self._predates(entry, prefix):
                continue  # (still served to prompts without the prefix)
            found.append((entry, similarity))
        # The most similar candidate is asked about alone (the usual hit: one pair, ~3 ms),
        # the others together only if it fails (8 pairs cost ~7-8 times one: a model run each).
        # Both batches are one lookup: a judge's verdicts share one deadline.
        lookup = Lookup(view.scope)  # (a judge's verdicts: remembered per scope, tenant's)
        for batch in (found[:1], found[1:]):
            if batch and await self._judge(view, batch, probe, max_age, prefix, lookup):
                break
        return probe

    def _below_floor(self, entry: SemanticEntry) -> bool:
        """Whether ``entry`` was made before a prefix invalidation no longer remembered."""
        return _made_before(entry, *self._floor)

    def _predates(self, entry: SemanticEntry, prefix: str | None) -> bool:
        """Whether ``entry`` was made before a remembered prefix invalidation that names
        ``prefix`` (None: unknown, any does), or before the floor."""
        if self._below_floor(entry):
            return True
        return any(
            _made_before(entry, mark, at) and (prefix is None or prefix.startswith(p))
            for p, mark, at in self._prefixes
        )

    def _forget_prefixes(self, now: float) -> None:
        """Forget the prefix invalidations over the bound or older than every entry's TTL; each
        raises the floor (``MAX_PREFIX_INVALIDATIONS``)."""
        prefixes = self._prefixes
        while prefixes and (
            len(prefixes) > MAX_PREFIX_INVALIDATIONS or now - prefixes[0][2] > self._longest_ttl
        ):
            _, mark, at = prefixes.popleft()
            self._floor = (max(self._floor[0], mark), max(self._floor[1], at))

    async def _judge(
        self,
        view: SemanticView,
        found: list[tuple[SemanticEntry, float]],
        probe: Probe,
        max_age: float | None,
        prefix: str | None,
        lookup: Lookup,
    ) -> bool:
        """The guard's verdicts on ``found``; sets ``probe.match`` (True) on the first served.
        ``prefix``: the requester's prompt prefix (``probe``); ``lookup``: what the probe's
        batches share."""
        prompt = _prompt(view) if len(self._refused) else None
        refused = [
            prompt is not None and _pair(entry, prompt) in self._refused for entry, _ in found
        ]
        asked = [pair for pair, no in zip(found, refused, strict=True) if not no]
        judged = iter(
            await self.guard.judge(
                Side(view.text, view.context),
                [entry.side for entry, _ in asked],
                [similarity for _, similarity in asked],
                lookup,
            )
            if asked
            else ()
        )
        verdicts = [Verdict.refused(Reason.AUDIT) if no else next(judged) for no in refused]
        for (entry, similarity), verdict in zip(found, verdicts, strict=True):
            candidate = Candidate(entry, similarity, verdict, entry.answer)
            if probe.nearest is None:
                probe.nearest = candidate
            if not verdict.ok:
                reason = str(verdict.reason)
                self.rejections[reason] = self.rejections.get(reason, 0) + 1
                continue
            if candidate.answer is None:
                candidate.answer = await self._resolved(entry)
                if candidate.answer is None:
                    continue
                # (On the cache's clock, as ``created`` is: the system's aged an answer read
                # from another instance by this machine's wall clock, not the gateway's.)
                if max_age is not None and candidate.answer.age(self._clock.now()) >= max_age:
                    continue
            # (Else the entry's answer itself: frames made for a streaming client are made once
            # and kept for the next, counted: ``_count_synthesized``.)
            now = self._clock.now()
            if (
                self._entries.peek(entry.id) is not entry
                or entry.expires <= now
                or (max_age is not None and now - entry.created >= max_age)
                or self._predates(entry, prefix)
            ):
                # Dropped (invalidated, forgotten, evicted), expired or older than the
                # requester accepts while the guard read it (seconds behind a burst): an
                # invalidation that answered stops what was found before it too.
                continue
            probe.match = candidate
            self._entries.touch(entry.id)
            return True
        return False

    async def _resolved(self, entry: SemanticEntry) -> Answer | None:
        """A reference's answer from the exact cache; None (and the entry dropped) if gone."""
        if self.resolve is None or entry.ref is None:
            self._drop(entry)
            return None
        try:
            answer = await self.resolve(entry.ref)
        except StoreUnavailable:
            return None  # unknown for now: skip it, keep the entry
        if answer is None:
            self._drop(entry)
        return answer

    async def insert(
        self,
        view: SemanticView,
        vector: Any,
        answer: Answer | None,
        expires: float,
        tags: tuple[str, ...] = (),
        namespace: str = "",
        prompt_prefix: str = "",
        *,
        key: str | None = None,
        ref: str | None = None,
        created: float | None = None,
        tenant: str = "*",
    ) -> int | None:
        """Store ``answer`` (or, with ``answer=None``, the reference ``ref``) under the view.

        ``vector``: the embedding of ``focus(view).text`` (``Probe.vector``), or None to compute
        it. ``key``: the answer's exact-cache key (here only passed on to ``_inserted``, which
        ``SharedSemanticCache`` overrides to publish the entry). ``created``: when the answer was
        made (default: ``answer.created``). ``tenant``: the scope's (``Fingerprint.tenant``:
        ``*`` in a shared namespace), whose error budget a report of the entry counts in
        (``forget``). Returns the entry's id (``forget_entry``), or None
        when it was not kept.
        """
        if answer is None and ref is None:
            raise ValueError("an entry needs an answer or a reference")
        self._reap()
        view = focus(view)
        if vector is None:
            vector = await self._embed(view.text)
        old = self._by_text.get((view.scope, view.context, view.text))
        older = None if old is None else self._entries.peek(old)
        if older is not None:
            self._drop(older)
        if created is None:
            created = answer.created if answer is not None else self._clock.now()
        if answer is not None:
            # One of its own (body and frames shared, not copied): the frames it synthesizes
            # for streaming hits are this cache's to count (``_count_synthesized``), and no
            # other holder of the answer inserted (the flight's, an idempotency record) hooks it.
            answer = answer.served_copy()
        entry = SemanticEntry(
            next(self._ids),
            view.scope,
            view.text,
            answer,
            expires,
            tags,
            namespace,
            prompt_prefix,
            ref=ref,
            created=created,
            context=view.context,
            tenant=tenant,
        )
        # The vector is held twice (float32 in the graph, plus its links): ~2x its raw size.
        holds = answer.size + _HOOK if answer is not None else len(ref or "")
        entry.size = (
            holds
            + len(view.text)
            + len(view.context)
            + len(prompt_prefix)
            + 8 * self.embedder.dim
            + ENTRY_OBJECTS
        )
        if entry.size + SCOPE_BYTES > self.config.max_bytes:
            # More than the whole budget with an index of its own (which it has, if the room
            # made for it empties its scope): not kept (the older entry is gone all the same).
            return None
        opens = view.scope not in self._scopes
        # A scope's index costs memory of its own (``SCOPE_BYTES``): room is made for the entry
        # and, if it opens one, for its scope (one scope per entry, as a unique system prompt
        # makes, held ~10x what the entries alone counted).
        while self._entries and self._held() + entry.size + SCOPE_BYTES * opens > (
            self.config.max_bytes
        ):
            self._entries.evict()  # (heard by ``_unindex``: a scope emptied goes)
            opens = view.scope not in self._scopes
        index = self._scopes.get(view.scope)
        if index is None:
            index = self._scopes[view.scope] = VectorIndex(
                self.embedder.dim,
                self.config.index_connectivity,
                self.config.index_expansion_add,
                self.config.index_expansion_search,
            )
        slack = index.slack
        index.add(entry.id, vector)  # (into a slot a removed vector left, if any)
        self._slack += index.slack - slack
        self._longest_ttl = max(self._longest_ttl, expires - created)
        self._by_text[(view.scope, view.context, view.text)] = entry.id
        self._by_public[entry.public_id] = entry.id
        self._entries.put(entry.id, entry)  # the least recently used out (``_unindex``)
        if answer is not None:  # (told of frames it keeps for streaming hits, to count them)
            answer.on_synthesized = partial(self._count_synthesized, entry.id)
        self._inserted(entry, vector, key)
        return entry.id

    def _count_synthesized(self, entry_id: int, answer: Answer) -> None:
        """``answer`` (``entry_id``'s, unless gone since) kept frames it synthesized for a
        streaming hit: counted with its entry, made the most recently used (a client of it now);
        the least recently used entries (this one last) go until the budget holds them."""
        entry = self._entries.peek(entry_id)
        if entry is None or entry.answer is not answer:
            return  # gone since (evicted, expired, dropped): not kept here, not counted
        kept = synthesized_held(answer)
        self._synthesized += kept - entry.synthesized
        entry.synthesized = kept
        self._entries.touch(entry_id)
        while self._entries and self._held() > self.config.max_bytes:
            self._entries.evict()  # (heard by ``_unindex``: its frames uncounted with it)

    def _inserted(self, entry: SemanticEntry, vector: Any, key: str | None) -> None:
        """Called with each entry once it is in this cache (and its index); nothing here."""

    async def invalidate(self, selector: Selector, made: float | None = None) -> int:
        """``made``: when the invalidation was made, on the clock (another instance's, read
        from the stream later); None: now."""
        self.generation += 1
        if selector.prefix is not None and not selector.everything:
            # Remembered: what it names is what a requester's prompt starts with (``probe``).
            now = self._clock.now()
            self._prefixes.append((selector.prefix, next(self._ids), now if made is None else made))
            self._forget_prefixes(now)
        doomed = self._entries.remove_if(lambda _, e: selector.picks(e))
        for key, entry in doomed:
            self._unindex(key, entry)
        return len(doomed)

    def forget(self, public_id: str) -> SemanticEntry | None:
        """Drop the entry clients know as ``public_id`` (``x-carpool-entry``: a reported wrong
        hit); the entry, or None when this cache holds no such entry (any more). Only this
        instance's copy: another instance's copy of a shared entry stays."""
        key = self._by_public.get(public_id)
        entry = None if key is None else self._entries.peek(key)
        if entry is None:
            return None
        self._drop(entry)
        return entry

    def refuse(self, entry: SemanticEntry, view: SemanticView) -> None:
        """Never serve ``entry`` for ``view``'s prompt again (an audit found it wrong)."""
        self._refused.put(_pair(entry, _prompt(focus(view))), True)

    def forget_entry(self, entry_id: int) -> bool:
        """Drop the entry ``insert`` returned ``entry_id`` for, if this cache still holds it
        (a deleted response's: ``state_index``); whether it did."""
        entry = self._entries.peek(entry_id)
        if entry is None:
            return False
        self._drop(entry)
        return True

    async def aclose(self) -> None:
        """Close the embedder (the local one's worker thread), its batches finished first."""
        close = getattr(self.embedder, "aclose", None)
        if close is not None:  # an embedder of the caller's own may hold nothing to close
            await close()

    def _drop(self, entry: SemanticEntry) -> None:
        if self._entries.pop(entry.id) is not None:
            self._unindex(entry.id, entry)

    def _unindex(self, key: int, entry: SemanticEntry) -> None:
        """Forget ``entry`` (gone from ``_entries``) in the text map and its scope's index, and
        the frames its answer kept (``synthesized``)."""
        self._synthesized -= entry.synthesized
        entry.synthesized = 0
        if self._by_text.get((entry.scope, entry.context, entry.text)) == entry.id:
            del self._by_text[(entry.scope, entry.context, entry.text)]
        if self._by_public.get(entry.public_id) == entry.id:
            del self._by_public[entry.public_id]
        index = self._scopes.get(entry.scope)
        if index is not None:
            slack = index.slack
            index.remove(entry.id)
            if len(index) == 0:
                del self._scopes[entry.scope]
                self._slack -= slack
                return
            if (
                4 * len(index) <= index.peak
                and index.peak >= COMPACT_MIN_PEAK
                and len(index) <= COMPACT_MAX_LIVE
            ):
                index.compact()  # (COMPACT_MAX_LIVE: cheap; a larger one's slack is counted)
            self._slack += index.slack - slack


def _prompt(view: SemanticView) -> bytes:
    """A digest of a (focused) view's prompt: its scope, context and text."""
    return hashlib.blake2b(
        f"{view.scope}\x00{view.context}\x00{view.text}".encode("utf-8", "surrogatepass"),
        digest_size=16,
    ).digest()


def _pair(entry: SemanticEntry, prompt: bytes) -> bytes:
    """The key of a refused pair (``refuse``): the entry (its id, never reused) and a prompt."""
    return hashlib.blake2b(entry.id.to_bytes(8, "little") + prompt, digest_size=16).digest()


def _entry_size(key: int, entry: SemanticEntry) -> int:
    return entry.size  # set by ``insert`` before the entry comes in


def _entry_expires(entry: SemanticEntry) -> float:
    return entry.expires


def _made_before(entry: SemanticEntry, mark: int, at: float) -> bool:
    """Whether ``entry`` predates an invalidation that drew entry id ``mark`` at ``at``: it
    came into this cache before (a smaller id), or its answer was made before (``created``)."""
    return entry.id < mark or entry.created < at
