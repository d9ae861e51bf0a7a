"""The semantic cache: near-duplicate prompts served from cache, never across a change of meaning.

Contract:
- An answer is only a candidate for requests with the same *scope* (tenant, namespace, freshness
  token, model, every parameter, system prompt and earlier turns: ``fingerprint.semantic_view``);
  only the last user turn (or the completion prompt) is compared by meaning.
- ``probe(view, max_age)`` embeds the text (only when its scope holds entries at all), asks the
  scope's ANN index for the nearest entries, and walks them most similar first: a candidate must
  be at or above the threshold, unexpired, younger than ``max_age`` (``Cache-Control``), and pass
  the meaning-change guard (``guard.check``). The first that passes is the ``match``; the most
  similar one seen (passing or not) is ``nearest``, for ``semantic.mode: mark``.
- ``insert`` stores a complete answer under its scope with the policies of the exact cache
  (expiry from the type's TTL, tags, namespace, prompt prefix for invalidation). The same text in
  the same scope replaces the older entry. At most ``semantic.max_entries`` entries: the least
  recently used go first.
- ``invalidate`` drops entries by tag, namespace, prompt prefix or all, like the exact store.
- The threshold is ``semantic.threshold``, or ``CALIBRATED_THRESHOLD`` (how it was chosen: README,
  "Semantic cache").
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..answer import Answer
from ..config import SemanticConfig
from ..fingerprint import SemanticView
from .guard import Verdict, check
from .index import VectorIndex

# Calibrated with `carpool eval-semantic --sweep` on the development pairs (README).
CALIBRATED_THRESHOLD = 0.80


@dataclass(slots=True, eq=False)
class SemanticEntry:
    id: int
    scope: str
    text: str
    answer: Answer
    expires: float
    tags: tuple[str, ...] = ()
    namespace: str = ""
    prompt_prefix: str = ""

    @property
    def size(self) -> int:
        return self.answer.size + len(self.text) + len(self.prompt_prefix) + 2 * 384 * 4


@dataclass(slots=True)
class Candidate:
    entry: SemanticEntry
    similarity: float
    verdict: Verdict


@dataclass(slots=True)
class Probe:
    """The result of one semantic lookup."""

    vector: Any = None                      # the text's embedding, reused when inserting
    match: Candidate | None = None          # the entry to serve, if any
    nearest: Candidate | None = None        # the most similar entry seen, served or not


class SemanticCache:
    def __init__(self, config: SemanticConfig, embedder: Any) -> None:
        self.config = config
        self.embedder = embedder
        self.threshold = config.threshold if config.threshold is not None else CALIBRATED_THRESHOLD
        self._scopes: dict[str, VectorIndex] = {}
        self._entries: OrderedDict[int, SemanticEntry] = OrderedDict()
        self._by_text: dict[tuple[str, str], int] = {}
        self._ids = itertools.count(1)
        self._bytes = 0
        self.rejections: dict[str, int] = {}   # guard verdicts by reason, for /stats

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def has_scope(self, scope: str) -> bool:
        return scope in self._scopes

    async def probe(self, view: SemanticView, max_age: float | None = None) -> Probe:
        index = self._scopes.get(view.scope)
        if index is None:
            return Probe()                  # nothing to compare with: no embedding needed
        vector = await self.embedder.embed(view.text)
        probe = Probe(vector)
        now = time.time()
        for key, similarity in index.search(vector, self.config.candidates):
            entry = self._entries.get(key)
            if entry is None:
                continue
            if entry.expires <= now:
                self._drop(entry)
                continue
            if similarity < self.threshold:
                break
            if max_age is not None and entry.answer.age(now) >= max_age:
                continue
            verdict = check(view.text, entry.text)
            candidate = Candidate(entry, similarity, verdict)
            if probe.nearest is None:
                probe.nearest = candidate
            if verdict.ok:
                probe.match = candidate
                self._entries.move_to_end(entry.id)
                break
            reason = verdict.reason or "rejected"
            self.rejections[reason] = self.rejections.get(reason, 0) + 1
        return probe

    async def insert(self, view: SemanticView, vector: Any, answer: Answer, expires: float,
                     tags: tuple[str, ...] = (), namespace: str = "",
                     prompt_prefix: str = "") -> None:
        if vector is None:
            vector = await self.embedder.embed(view.text)
        old = self._by_text.get((view.scope, view.text))
        if old is not None and old in self._entries:
            self._drop(self._entries[old])
        entry = SemanticEntry(next(self._ids), view.scope, view.text, answer, expires, tags,
                              namespace, prompt_prefix)
        index = self._scopes.get(view.scope)
        if index is None:
            index = self._scopes[view.scope] = VectorIndex(
                self.embedder.dim, self.config.index_connectivity,
                self.config.index_expansion_add, self.config.index_expansion_search)
        index.add(entry.id, vector)
        self._entries[entry.id] = entry
        self._by_text[(view.scope, view.text)] = entry.id
        self._bytes += entry.size
        while len(self._entries) > self.config.max_entries:
            self._drop(next(iter(self._entries.values())))

    async def invalidate(self, *, tag: str | None = None, namespace: str | None = None,
                         prefix: str | None = None, everything: bool = False) -> int:
        doomed = [e for e in self._entries.values()
                  if everything
                  or (tag is not None and tag in e.tags)
                  or (namespace is not None and e.namespace == namespace)
                  or (prefix is not None and e.prompt_prefix.startswith(prefix))]
        for entry in doomed:
            self._drop(entry)
        return len(doomed)

    def _drop(self, entry: SemanticEntry) -> None:
        if self._entries.pop(entry.id, None) is None:
            return
        self._bytes -= entry.size
        if self._by_text.get((entry.scope, entry.text)) == entry.id:
            del self._by_text[(entry.scope, entry.text)]
        index = self._scopes.get(entry.scope)
        if index is not None:
            index.remove(entry.id)
            if len(index) == 0:
                del self._scopes[entry.scope]
