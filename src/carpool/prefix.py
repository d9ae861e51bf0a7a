"""Chained prefix-block hashes: the one way carpool names a prompt prefix.

Both prefix caches key their blocks with it: the router's record of what each replica has seen
(``routing.cache_aware.PrefixRecord``, over characters) and the simulated engine's KV cache
(``upstream.sim.prefix_cache.PrefixCache``, over tokens), as vLLM's and SGLang's block hashes do.

Contract:
- ``block_hashes(seq, block_size)`` cuts ``seq`` into whole blocks of ``block_size`` items and
  returns one key per block, first block first. A partial last block has no key (so a sequence
  shorter than a block has none). ``seq`` is a text (its items are characters) or a sequence of
  tokens (strings).
- A block's key hashes the previous block's key (a fixed all-zero key before the first block)
  with the block's own items, so key *i* names the whole prefix up to block *i*: two sequences
  share their first *k* keys exactly when their first *k* blocks are equal (up to 128-bit
  hash collisions, which are ignored).
- Keys are 16-byte BLAKE2b digests, the same in every process and on every run (unlike
  ``hash()``, which is salted per process). They are comparable only between sequences of the
  same kind (text or tokens) cut with the same ``block_size``.
- ``iter_block_hashes`` gives the same keys one at a time, each hashed only when asked for: a
  caller that stops early (a prefix match at its first miss) hashes no further. ``block_hashes``
  with ``limit`` gives only the first ``limit`` keys (and hashes no more).
- ``root``: the key before the first block, ``ROOT`` unless given. ``root_of(parts)`` makes one
  of a scope (strings: the router's tenant, model, ``cache_salt``): the keys of a sequence under
  one root never equal those of any sequence under another (up to collisions), however the
  parts split one string, as vLLM's block hashes under another ``cache_salt``.
- Cost: one hash per block asked for, O(len(seq)) at most; nothing is kept between calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from itertools import islice

KEY_BYTES = 16
ROOT = bytes(KEY_BYTES)  # the key "before" the first block: every hash input is key + block


def _block_bytes(block: str | Sequence[str]) -> bytes:
    """The block as bytes, one-to-one: equal bytes exactly when the blocks are equal."""
    if isinstance(block, str):
        # Blocks of a text all have block_size characters, so UTF-8 alone tells them apart.
        # surrogatepass: a lone surrogate (which JSON can carry) must not fail a request.
        return block.encode("utf-8", "surrogatepass")
    # A token may hold any character, so no separator is safe: the repr of the list of tokens
    # is (it quotes and escapes each one, surrogates included) and is computed in C.
    # list(): the same tokens in a tuple would have another repr.
    return repr(list(block)).encode()


def root_of(parts: Sequence[str]) -> bytes:
    """A chain root for the scope ``parts`` (see the module's contract), never ``ROOT``."""
    # (Each part's length before it: a client's model or ``cache_salt`` may hold any
    # separator, and two splits of one string must be two scopes.)
    material = "".join(f"{len(part)}:{part}" for part in parts).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(material, digest_size=KEY_BYTES, person=b"carpool-scope").digest()


def iter_block_hashes(
    seq: str | Sequence[str], block_size: int, root: bytes = ROOT
) -> Iterator[bytes]:
    """The chained keys of ``seq``'s whole blocks of ``block_size`` items, first block first,
    each hashed when it is asked for; the first hashed after ``root``."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    return _chain(seq, block_size, root)


def _chain(seq: str | Sequence[str], block_size: int, root: bytes) -> Iterator[bytes]:
    key = root
    blake2b = hashlib.blake2b
    for start in range(0, len(seq) - block_size + 1, block_size):
        block = _block_bytes(seq[start : start + block_size])
        key = blake2b(key + block, digest_size=KEY_BYTES).digest()
        yield key


def block_hashes(
    seq: str | Sequence[str], block_size: int, limit: int | None = None, root: bytes = ROOT
) -> list[bytes]:
    """The chained keys of ``seq``'s whole blocks of ``block_size`` items, first block first
    (after ``root``); only the first ``limit`` of them when given."""
    return list(islice(iter_block_hashes(seq, block_size, root), limit))
