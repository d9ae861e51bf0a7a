"""The simulated engine's prefix (KV) cache.

Contract:
- The prompt is cut into full blocks of ``block_tokens``; a block's id chains the previous block's
  id with its tokens (``carpool.prefix.block_hashes``, the hash routing's prefix record uses
  too), so equal ids mean equal prefixes. A request hits the leading blocks already present (never its very
  last token, which an engine always recomputes). After prefill all its blocks are touched in an
  LRU bounded by ``prefix_cache_tokens``.
"""

from __future__ import annotations

from carpool.lru import LRU
from carpool.prefix import block_hashes


class PrefixCache:
    """A simulated KV cache: LRU of prompt blocks identified by chained hashes."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: LRU[bytes, bool] = LRU(max_entries=self.capacity_blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def block_ids(self, tokens: list[str]) -> list[bytes]:
        """Ids of the full blocks of ``tokens``; each id covers the whole prefix up to its block."""
        return block_hashes(tokens, self.block_tokens)

    def cached_tokens(self, ids: list[bytes], prompt_length: int) -> int:
        """Prompt tokens found: the leading blocks present, never the very last token."""
        hits = 0
        for block_id in ids:
            if block_id not in self._blocks:
                break
            hits += 1
        return min(hits * self.block_tokens, max(prompt_length - 1, 0))

    def touch(self, ids: list[bytes]) -> None:
        if self.capacity_blocks == 0:
            return
        # Touch the last block first so the first block is the most recent: eviction then trims
        # prefixes from their tail, and the shared heads (system prompts) stay longest.
        for block_id in reversed(ids):
            self._blocks.put(block_id, True)
