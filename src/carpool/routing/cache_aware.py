"""``cache-aware``: send a prompt where its prefix was sent before, unless that unbalances the load.

vLLM and SGLang reuse the KV cache of a prefix only on the replica that computed it, so a request
whose system prompt / document / few-shot block went to replica A before is cheaper on A. Like
SGLang's router, this policy keeps an *approximate* record of the prompt text sent to each replica
and decides per request:

1. load imbalanced (``max - min > balance_abs_threshold`` AND ``max > balance_rel_threshold *
   min``, in-flight counts over the eligible replicas)  ->  the least-loaded replica
   (``Decision.IMBALANCED`` if that overrules a prefix match);
2. best match rate (matched characters / prompt characters) ``>= cache_threshold``  ->  the
   best-matching replica (``Decision.PREFIX_MATCH``; ties: least loaded);
3. otherwise  ->  the least-loaded replica (``Decision.LEAST_LOADED``; ties: the replica that
   remembers the fewest characters, i.e. has the most cache room, then fewest calls: a new
   prefix goes where it displaces least, which also spreads distinct prefixes over replicas).
   A request with no prompt text (a pass-through call, say: nothing to match or record) breaks
   the tie by fewest calls alone: by cache room, every one went to the replica sent fewest
   prompts.

The record is a **hashed-block chain** rather than a character trie: a prompt is cut into blocks
of ``block_chars`` characters and block *i* is keyed by a hash of (key of block i-1, text of
block i), so a key names a whole prefix (as vLLM's block hashes do). The keys are
``carpool.prefix.block_hashes``, the same chained hash the simulated engine's KV cache uses. A
replica's record is an LRU of such keys; a shared index maps each key to the replicas that hold
it. Matching walks the prompt's keys once, narrowing the set of replicas holding every key so
far; the set that survives deepest is the best match. Keys are hashed as the walk asks for them
and it stops at the first block no eligible replica holds, so a prompt that matches nothing
costs one hash whatever its length; recording a prompt hashes and records only its first
``budget_blocks`` blocks (``tree_budget_chars / block_chars``: deeper ones could not stay in the
replica's record: they would be inserted and evicted at once). Costs: O(min(len(text),
tree_budget_chars) / block_chars) per request, however long the prompt, and ~400 bytes per
remembered block (measured: the key, its LRU entry and its index entry). ``hashed`` counts the
blocks hashed.
Approximations: matches are whole blocks (a partial last block never matches, so prompts
shorter than a block never match); hash collisions (128-bit) are ignored; and the engine's real
cache may hold more or less than the record (``tree_budget_chars`` should approximate its KV
capacity).

Scoped: a prompt's chain starts from its request's ``scope`` (``prefix.root_of``: the tenant,
or the shared namespace; the model; vLLM's ``cache_salt``: ``exchange.routing_scope``), so one
tenant's prompts never steer another tenant's: a prefix one tenant sent does not draw another's
request to the replica that computed it, which would tell that tenant, by the time to its first
token, what the other asked (the prefix-cache timing side channel, made sure by routing). The
cost: tenants share no prefix outside a shared namespace (a common system prompt is computed on
each replica a tenant's requests go to, not once for all tenants). A policy given no scope
(``b""``) uses the unscoped root.

What is recorded: each prompt when it is sent (``on_sent``), and once its replica answered, the
prompt followed by the answer's text (``on_answered``, told by ``exchange.send``: the engine
keeps the generated tokens' blocks too, and a conversation's next turn begins with both; with
the prompt alone, an answer longer than its question left that turn's match under
``cache_threshold``). A replica that could not be reached (``on_lost``: refused, reset; most
likely restarted) is forgotten: it comes back with nothing cached.

Eviction keeps each replica's record prefix-closed: when a prompt is recorded its keys are
touched from the deepest block to the first, so a block is always more recently used than every
block below it and LRU eviction (per replica, beyond ``tree_budget_chars``) removes leaves first:
deep, rarely shared tails go before the shared system prompt they hang off.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from carpool.lru import LRU
from carpool.prefix import ROOT, block_hashes, iter_block_hashes
from carpool.routing import Decision, RoutingPolicy
from carpool.routing.replicas import ReplicaState


class PrefixRecord:
    """The approximate prefix tree: per-replica LRU of block-chain keys plus a shared index."""

    def __init__(self, budget_chars: int = 2_000_000, block_chars: int = 64) -> None:
        if block_chars < 1 or budget_chars < 1:
            raise ValueError("budget_chars and block_chars must be positive")
        self.block_chars = block_chars
        self.budget_blocks = max(1, budget_chars // block_chars)
        self._lru: dict[str, LRU[bytes, bool]] = {}  # replica -> keys, oldest first
        self._index: dict[bytes, set[str]] = {}  # key -> replicas holding it
        self.hashed = 0  # blocks hashed so far (matching and recording)

    def keys(self, text: str, root: bytes = ROOT) -> list[bytes]:
        """The chain keys of ``text``'s whole blocks, first block first (after ``root``)."""
        return block_hashes(text, self.block_chars, root=root)

    def match(
        self, text: str, names: Sequence[str] | None = None, root: bytes = ROOT
    ) -> tuple[int, set[str]]:
        """(matched characters, the replicas among ``names`` matching that many): the best match
        (of ``text``'s chain after ``root``)."""
        alive = set(names) if names is not None else set(self._lru)
        best: set[str] = set()
        depth = 0
        hashed = 0
        index = self._index
        # Hashed block by block: the walk ends at the first block nobody eligible holds, and
        # the rest of a long prompt is never hashed.
        for key in iter_block_hashes(text, self.block_chars, root):
            hashed += 1
            holders = index.get(key)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            best, depth = set(alive), depth + 1
        self.hashed += hashed
        return depth * self.block_chars, best

    def insert(self, text: str, replica: str, root: bytes = ROOT) -> None:
        """Record that ``text`` (its chain after ``root``) was sent to ``replica`` (touching its
        prefix, at most ``budget_blocks`` blocks of it), then evict."""
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = LRU(
                max_entries=self.budget_blocks, on_evict=partial(self._evicted, replica)
            )
        # Only the first budget_blocks blocks: deeper ones are touched first (below), so the
        # blocks before them would evict them before this call ends.
        keys = block_hashes(text, self.block_chars, self.budget_blocks, root)
        self.hashed += len(keys)
        for key in reversed(keys):  # deepest first: prefixes end up most recent
            if key in lru:
                lru.touch(key)
            else:
                self._index.setdefault(key, set()).add(replica)
                lru.put(key, True)  # (beyond the budget: the least recent key goes)

    def forget(self, replica: str) -> None:
        """Drop everything recorded for ``replica`` (e.g. it restarted with an empty cache)."""
        for key in self._lru.pop(replica, ()):
            self._evicted(replica, key)

    def _evicted(self, replica: str, key: bytes, _: bool = True) -> None:
        holders = self._index[key]
        holders.discard(replica)
        if not holders:
            del self._index[key]

    def size_chars(self, replica: str) -> int:
        """Characters remembered for ``replica``."""
        lru = self._lru.get(replica)
        return len(lru) * self.block_chars if lru else 0

    def holds(self, text: str, replica: str, root: bytes = ROOT) -> int:
        """Characters of ``text``'s prefix (after ``root``) recorded for ``replica``."""
        return self.match(text, [replica], root)[0]


class CacheAware(RoutingPolicy):
    name = "cache-aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        tree_budget_chars: int = 2_000_000,
        block_chars: int = 64,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.record = PrefixRecord(tree_budget_chars, block_chars)

    def imbalanced(self, replicas: Sequence[ReplicaState]) -> bool:
        """SGLang's rule: both the absolute and the relative gap in in-flight counts are exceeded."""
        loads = [r.in_flight for r in replicas]
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def select(
        self, text: str, replicas: Sequence[ReplicaState], scope: bytes = b""
    ) -> tuple[ReplicaState, Decision]:
        matched, holders = self.record.match(text, [r.name for r in replicas], scope or ROOT)
        rate = matched / len(text) if text else 0.0
        if text:
            least = min(
                replicas, key=lambda r: (r.in_flight, self.record.size_chars(r.name), r.calls)
            )
        else:
            # No prompt text (a pass-through call, say): nothing will be recorded, so cache room
            # says nothing of where it should go; by it, every such call went to the replica
            # sent the fewest prompts. Fewest calls spreads them, as least-loaded does.
            least = min(replicas, key=lambda r: (r.in_flight, r.calls))
        if text and rate >= self.cache_threshold and holders:
            best = min(
                (r for r in replicas if r.name in holders), key=lambda r: (r.in_flight, r.calls)
            )
            if not self.imbalanced(replicas):
                return best, Decision.PREFIX_MATCH
            if best is least or best.in_flight == least.in_flight:
                return best, Decision.PREFIX_MATCH  # the match is (one of) the least loaded anyway
            return least, Decision.IMBALANCED
        return least, Decision.LEAST_LOADED

    def on_sent(self, text: str, replica: ReplicaState, scope: bytes = b"") -> None:
        # Recorded when sent, before the engine has computed it: the next request sharing the
        # prefix (in its scope) should follow it (SGLang inserts at selection too).
        if text:
            self.record.insert(text, replica.name, scope or ROOT)

    def on_lost(self, replica: ReplicaState) -> None:
        self.record.forget(replica.name)

    learns_answers = True

    def on_answered(self, text: str, replica: ReplicaState, scope: bytes = b"") -> None:
        # The engine keeps the blocks of what it generated too, and a conversation's next turn
        # begins with the prompt and this answer: recorded on, that turn matches it here (with
        # the prompt alone, an answer longer than its question left the next turn's match
        # under ``cache_threshold``, and the least-loaded replica computed it all again).
        self.record.insert(text, replica.name, scope or ROOT)
