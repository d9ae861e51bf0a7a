"""carpool.prefix: the chained block hashes both prefix caches (routing, simulator) key by."""

from __future__ import annotations

import subprocess
import sys

import pytest

from carpool.prefix import KEY_BYTES, block_hashes, iter_block_hashes
from carpool.routing.cache_aware import PrefixRecord
from carpool.upstream.sim import PrefixCache


def test_only_whole_blocks_have_keys():
    assert block_hashes("", 4) == []
    assert block_hashes("abc", 4) == []
    assert len(block_hashes("abcd", 4)) == 1
    assert len(block_hashes("abcdefghi", 4)) == 2  # the partial "i" has no key
    assert len(block_hashes("a b c d e".split(), 2)) == 2
    assert all(len(key) == KEY_BYTES for key in block_hashes("abcdefgh", 4))


def test_a_key_names_the_whole_prefix():
    a = block_hashes("abcdefghijkl", 4)
    b = block_hashes("abcdefghXXXX", 4)
    c = block_hashes("XXXXefghijkl", 4)
    assert a[:2] == b[:2] and a[2] != b[2]  # shared prefix: shared keys, then they part
    assert a[1] != c[1] and a[2] != c[2]  # same later blocks after another first: other keys
    assert block_hashes("abcdefgh", 4) == a[:2]  # a prefix's keys are a prefix of the keys
    assert len(set(block_hashes("abab" * 4, 4))) == 4  # a repeated block at another depth


def test_block_size_changes_the_keys():
    assert block_hashes("abcdefgh", 4)[1] != block_hashes("abcdefgh", 8)[0]


def test_tokens_are_blocks_of_items():
    tokens = "the system prompt is long and shared".split()
    assert block_hashes(tokens, 3) == block_hashes(tuple(tokens), 3)  # any sequence of str
    assert len(block_hashes(tokens, 3)) == 2
    # No separator can be confused with a token's own characters.
    assert block_hashes(["a\x00b", "c"], 2) != block_hashes(["a", "b\x00c"], 2)
    assert block_hashes(["a b", "c"], 2) != block_hashes(["a", "b c"], 2)
    assert block_hashes(["ab", "c"], 2) != block_hashes(["a", "bc"], 2)


def test_odd_text_does_not_fail():
    assert len(block_hashes("a\ud800b\udfffcd", 2)) == 3  # lone surrogates, as JSON may carry
    assert len(block_hashes(["\ud800", "x"], 1)) == 2
    assert block_hashes("é" * 4, 2) != block_hashes("e" * 4, 2)


def test_keys_are_stable_across_processes():
    script = "from carpool.prefix import block_hashes; print(block_hashes('abcdefgh', 4)[1].hex())"
    env_seeds = ("1", "2")
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)},
        ).stdout.strip()
        for seed in env_seeds
    }
    assert outputs == {block_hashes("abcdefgh", 4)[1].hex()}


def test_keys_come_one_at_a_time_and_a_limit_gives_the_first():
    text = "abcdefghijklmnop"
    keys = iter_block_hashes(text, 4)
    assert next(keys) == block_hashes(text, 4)[0]
    assert [*keys] == block_hashes(text, 4)[1:]
    assert block_hashes(text, 4, limit=2) == block_hashes(text, 4)[:2]
    assert block_hashes(text, 4, limit=9) == block_hashes(text, 4)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        block_hashes("abc", 0)
    with pytest.raises(ValueError):
        iter_block_hashes("abc", 0)  # at once, not at the first key


def test_both_prefix_caches_key_by_it():
    text = "You are a helpful assistant. " * 10
    assert PrefixRecord(block_chars=16).keys(text) == block_hashes(text, 16)
    tokens = text.split()
    assert PrefixCache(capacity_tokens=64, block_tokens=4).block_ids(tokens) == block_hashes(
        tokens, 4
    )
