"""The semantic cache's bounded bookkeeping (carpool.semantic.cache on carpool.lru): at most
``semantic.max_entries`` entries and ``semantic.max_bytes`` bytes, least recently used out first,
expired entries swept, and an entry that leaves for any reason leaves the scope's index and the
text map too. A fake embedder, a guard that passes
everything: only the bookkeeping is under test here (test_semantic_cache.py has the rest)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pytest

from carpool.answer import Answer
from carpool.clock import SYSTEM_CLOCK, Clock, ManualClock
from carpool.config import SemanticConfig
from carpool.fingerprint import SemanticView
from carpool.semantic.cache import COMPACT_MAX_LIVE, SCOPE_BYTES, SemanticCache
from carpool.semantic.guard import Lookup, Side
from carpool.semantic.verdict import Verdict
from carpool.store.base import Selector, synthesized_held
from fakes.waiting import eventually

DIM = 8


class Embedder:
    """A distinct unit vector for each text (the same for the same text)."""

    dim = DIM

    async def embed(self, text: str) -> np.ndarray:
        rng = np.random.default_rng(abs(hash(text)) % (1 << 32))
        vector = rng.standard_normal(DIM).astype(np.float32)
        return vector / np.linalg.norm(vector)


class PassEverything:
    async def judge(
        self,
        new: Side,
        candidates: Sequence[Side],
        similarities: Sequence[float] | None = None,
        lookup: Lookup | None = None,
    ) -> list[Verdict]:
        return [Verdict(True) for _ in candidates]


def cache(max_entries: int = 100, clock: Clock = SYSTEM_CLOCK, **config: Any) -> SemanticCache:
    settings = SemanticConfig(max_entries=max_entries, threshold=0.99, **config)
    return SemanticCache(settings, Embedder(), PassEverything(), clock=clock)


async def insert(
    semantic: SemanticCache, text: str, scope: str = "s", *, body: bytes = b"", ttl=60.0, **kw
) -> None:
    answer = Answer("chat", body or text.encode(), True)
    now = answer.created = semantic._clock.now()  # (made on the cache's clock, as a gateway's)
    await semantic.insert(SemanticView(scope, text), None, answer, now + ttl, **kw)


async def served(semantic: SemanticCache, text: str, scope: str = "s") -> bool:
    probe = await semantic.probe(SemanticView(scope, text))
    return probe.match is not None and probe.match.entry.text == text


def counted(semantic: SemanticCache) -> int:
    """What ``bytes`` must say: the entries' sizes with the frames their answers made for
    streaming hits, and their scopes' indexes, with the slots those hold empty (a vector's
    count each: twice its raw size)."""
    return sum(e.size + e.synthesized for _, e in semantic._entries.items()) + sum(
        SCOPE_BYTES + 8 * DIM * (index.peak - len(index)) for index in semantic._scopes.values()
    )


async def test_at_most_max_entries_the_least_recently_used_out_first():
    semantic = cache(max_entries=3)
    for text in ("one", "two", "three"):
        await insert(semantic, text)
    assert await served(semantic, "one")  # a hit makes it the most recently used
    await insert(semantic, "four")
    assert semantic.entries == 3
    assert not await served(semantic, "two")
    assert all([await served(semantic, t) for t in ("one", "three", "four")])


async def test_an_evicted_entry_leaves_its_index_and_text_map_and_bytes_stay_exact():
    semantic = cache(max_entries=2)
    await insert(semantic, "alpha", scope="a")
    await insert(semantic, "beta", scope="b")
    await insert(semantic, "gamma", scope="b")  # alpha out: its scope has nothing left
    assert not semantic.has_scope("a") and semantic.has_scope("b")
    assert len(semantic._by_text) == 2
    assert semantic.bytes == counted(semantic)
    await insert(semantic, "alpha", scope="a")  # beta out
    assert semantic.entries == 2 and len(semantic._by_text) == 2
    assert semantic.bytes == counted(semantic)


async def test_the_same_text_replaces_its_entry_and_invalidate_empties_everything():
    semantic = cache(max_entries=10)
    await insert(semantic, "same", tags=("t",))
    await insert(semantic, "same", tags=("t",))
    await insert(semantic, "other", tags=("u",))
    assert semantic.entries == 2
    assert await semantic.invalidate(Selector(tag="t")) == 1
    assert semantic.entries == 1 and not await served(semantic, "same")
    assert await semantic.invalidate(Selector(everything=True)) == 1
    assert semantic.entries == 0 and semantic.bytes == 0
    assert not semantic.has_scope("s") and semantic._by_text == {}


class HeldGuard(PassEverything):
    """Passes everything, once ``release`` is set (a verifier or judge still reading)."""

    def __init__(self) -> None:
        self.reading, self.release = asyncio.Event(), asyncio.Event()

    async def judge(self, new, candidates, similarities=None, lookup=None):
        self.reading.set()
        await self.release.wait()
        return await super().judge(new, candidates, similarities, lookup)


async def test_an_entry_invalidated_while_the_guard_reads_it_is_not_served():
    # The lookup picked its candidate, then awaited the guard (the verifier's thread, the
    # judge's call): an invalidation that answered meanwhile did not stop it serving the entry.
    guard = HeldGuard()
    semantic = SemanticCache(SemanticConfig(threshold=0.99), Embedder(), guard, clock=SYSTEM_CLOCK)
    await insert(semantic, "same", tags=("t",))
    lookup = asyncio.create_task(served(semantic, "same"))
    await guard.reading.wait()
    assert await semantic.invalidate(Selector(tag="t")) == 1
    guard.release.set()
    assert not await lookup


async def test_entries_are_bounded_in_bytes_each_counting_its_own_answer():
    # semantic.max_bytes: cache.max_bytes does not bound the answers semantic entries hold
    # (200 answers of 50 KB held 10 MB under a 1 MB exact cache). The least recently used go
    # first, and leave the index and the maps with their bytes.
    semantic = cache(max_bytes=SCOPE_BYTES + 200_000)
    for i in range(20):
        await insert(semantic, f"prompt {i}", body=b"x" * 50_000)
        assert semantic.bytes <= SCOPE_BYTES + 200_000
    assert semantic.entries == 3  # each ~54 KB: its answer, its text, its vector, its objects
    assert all(entry.size > 50_000 for _, entry in semantic._entries.items())
    assert semantic.bytes == counted(semantic)
    assert len(semantic._by_text) == len(semantic._by_public) == len(semantic._scopes["s"]) == 3
    assert await served(semantic, "prompt 19") and not await served(semantic, "prompt 16")


async def test_an_entry_larger_than_the_whole_budget_is_not_kept_nor_indexed():
    semantic = cache(max_bytes=SCOPE_BYTES + 10_000)
    await insert(semantic, "small")
    await insert(semantic, "huge", body=b"x" * (SCOPE_BYTES + 20_000))
    assert semantic.entries == 1 and not await served(semantic, "huge")
    assert len(semantic._scopes["s"]) == 1 and set(semantic._by_text) == {("s", "", "small")}


async def test_each_scopes_index_counts_against_the_byte_budget():
    # One index per scope (~52 KB of RSS each), uncounted before: one entry per scope (a unique
    # system prompt per request) held ~10x what the budget said. An entry that opens a scope
    # makes room for its index too; one joining a scope does not pay for it again.
    budget = 5 * (SCOPE_BYTES + 2_000)
    semantic = cache(max_bytes=budget)
    for i in range(30):
        await insert(semantic, f"prompt {i}", scope=f"system prompt {i}")
        assert semantic.bytes <= budget and semantic.bytes == counted(semantic)
    assert len(semantic._scopes) == semantic.entries == 5  # (each < 1 KB + its index)
    assert await served(semantic, "prompt 29", scope="system prompt 29")
    assert not semantic.has_scope("system prompt 24")  # (25 to 29 stay)
    for i in range(20):
        await insert(semantic, f"more {i}", scope="system prompt 29")
    assert semantic.bytes == counted(semantic) and len(semantic._scopes) < 5


async def test_an_entry_is_kept_only_if_it_fits_with_an_index_of_its_own():
    # It joined a scope, so its index was not counted; evicting that scope's last entry to make
    # room took the index away: the entry, with a new index, was kept over the budget.
    budget = SCOPE_BYTES + 5_000
    semantic = cache(max_bytes=budget)
    await insert(semantic, "small")
    await insert(semantic, "large", body=b"x" * 30_000)
    assert semantic.bytes <= budget and semantic.bytes == counted(semantic)
    assert semantic.entries == 1 and await served(semantic, "small")  # (nothing evicted for it)


def chat_body(text: str, words: int = 300) -> bytes:
    """A whole chat answer (no frames: a streaming client of it is sent frames made from it)."""
    content = " ".join([text] * words)
    return orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": words, "total_tokens": words + 1},
        }
    )


async def hit(semantic: SemanticCache, text: str) -> Answer:
    """The answer a probe for ``text`` serves (it must be a hit)."""
    probe = await semantic.probe(SemanticView("s", text))
    assert probe.match is not None and probe.match.answer is not None, text
    return probe.match.answer


async def test_frames_made_for_streaming_hits_are_made_once_counted_and_bounded_by_the_budget():
    # Each hit was handed a copy of the entry's answer with a memo of its own: every streaming
    # client of an entry stored without frames had its frames made anew, for it alone. Now the
    # entry keeps them for its next streaming hits, counted in ``bytes`` from when they are
    # made, and the least recently used entries (this one last) go to keep within the budget.
    measure = cache(max_bytes=1 << 30)
    for text in ("one", "two"):
        await insert(measure, text, body=chat_body(text))
    sizes = [entry.size for _, entry in measure._entries.items()]
    made = Answer("chat", chat_body("one"), True)
    made.sse(True), made.sse(False)
    frames = synthesized_held(made)
    assert frames > sizes[0]  # (its text twice, and more)
    # Room for both entries, and for one's frames, not two's.
    budget = SCOPE_BYTES + sum(sizes) + frames + frames // 2
    semantic = cache(max_bytes=budget)
    for text in ("one", "two"):
        await insert(semantic, text, body=chat_body(text))
    before = semantic.bytes
    first = await hit(semantic, "one")
    with_usage, without = first.sse(True), first.sse(False)
    again = await hit(semantic, "one")
    assert again.sse(True) is with_usage and again.sse(False) is without  # made once
    assert semantic.bytes == before + synthesized_held(first) == counted(semantic)
    assert before + frames <= semantic.bytes <= budget and semantic.entries == 2
    # The other's too: no room for both; the least recently used entry goes, not this one.
    second = await hit(semantic, "two")
    second.sse(True), second.sse(False)
    assert semantic.bytes <= budget and semantic.bytes == counted(semantic)
    assert semantic.entries == 1 and semantic._entries.evictions == 1
    assert not await served(semantic, "one")
    assert (await hit(semantic, "two")).sse(True) is second.sse(True)
    # Frames made later on an entry that is gone are not the cache's: not counted.
    counted_now = semantic.bytes
    first.sse(True), first.sse(False)
    assert semantic.bytes == counted_now
    await semantic.invalidate(Selector(everything=True))
    assert semantic.entries == 0 and semantic.bytes == 0


async def test_a_scope_that_shrank_gives_back_its_index_memory():
    # usearch keeps a removed vector's slot: a scope that once held 30,000 entries and kept two
    # hot ones held ~53 MB, counted 56 KB. Its slots are counted while it shrinks, and once it
    # is down to a quarter of its peak (and cheap to rebuild) its index is rebuilt.
    semantic = cache(max_entries=600)
    for i in range(598):
        await insert(semantic, f"cold {i}", scope="big")
    for hot in ("hot a", "hot b"):  # the most recently used: evicted last
        await insert(semantic, hot, scope="big")
    big = semantic._scopes["big"]
    assert big.peak == 600 and big.capacity >= 600
    for i in range(598):  # another scope's entries push the cold ones out
        await insert(semantic, f"other {i}", scope="other")
        assert semantic.bytes == counted(semantic)
        if len(big) == COMPACT_MAX_LIVE + 1:  # a quarter of its peak, too large to rebuild
            assert big.peak == 600 and semantic.bytes > counted_without_slack(semantic)
    assert len(big) == 2 and semantic._scopes["big"] is big
    assert big.capacity <= 32 and big.peak <= 32  # rebuilt: its slots given back
    assert semantic.bytes == counted(semantic)  # (what it still holds empty counted)
    assert await served(semantic, "hot a", scope="big") and await served(
        semantic, "hot b", scope="big"
    )
    assert not await served(semantic, "cold 597", scope="big")


def counted_without_slack(semantic: SemanticCache) -> int:
    return sum(e.size for _, e in semantic._entries.items()) + SCOPE_BYTES * len(semantic._scopes)


async def test_a_prefix_invalidation_stops_an_older_entry_for_prompts_with_that_prefix():
    # The entry's own prompt does not start with it; a requester's that does is not served
    # an entry made before it, whether the entry was inserted before it or, from another
    # instance, its answer created before it and its record read after.
    clock = ManualClock()
    semantic = cache(clock=clock)
    await insert(semantic, "price", prompt_prefix="What's the price")
    clock.advance(1)
    await semantic.invalidate(Selector(prefix="What is the price"))
    view = SemanticView("s", "price")
    asked = await semantic.probe(view, prompt_prefix=lambda: "What is the price of Pro?")
    assert asked.match is None
    other = await semantic.probe(view, prompt_prefix=lambda: "What's the price of Pro?")
    assert other.match is not None  # still served to the prompts the prefix does not name
    assert (await semantic.probe(view)).match is None  # (no prefix known: every one applies)

    # A record from another instance, read after the invalidation, of an answer made before.
    await semantic.invalidate(Selector(everything=True))
    answer = Answer("chat", b"old", True)
    late = semantic._clock.now() - 0.5
    await semantic.insert(view, None, answer, late + 60, created=late)
    asked = await semantic.probe(view, prompt_prefix=lambda: "What is the price of Pro?")
    assert asked.match is None
    # One made after it is served.
    clock.advance(1)
    await insert(semantic, "price")
    asked = await semantic.probe(view, prompt_prefix=lambda: "What is the price of Pro?")
    assert asked.match is not None


async def test_prefix_invalidations_are_remembered_within_a_bound_then_as_a_floor(monkeypatch):
    from carpool.semantic import cache as module

    monkeypatch.setattr(module, "MAX_PREFIX_INVALIDATIONS", 2)
    clock = ManualClock()
    semantic = cache(clock=clock)
    await insert(semantic, "first", ttl=60)
    clock.advance(1)
    for prefix in ("a", "b", "c"):
        await semantic.invalidate(Selector(prefix=prefix))
    assert [p for p, _, _ in semantic._prefixes] == ["b", "c"]  # "a": the floor
    # Made before the floor: served to no prompt, and dropped when found.
    assert (
        await semantic.probe(SemanticView("s", "first"), prompt_prefix=lambda: "z")
    ).match is None
    assert semantic.entries == 0
    await insert(semantic, "second", ttl=60)
    assert (await semantic.probe(SemanticView("s", "second"), prompt_prefix=lambda: "z")).match
    # Forgotten once older than the longest TTL of an entry: nothing made before lives on.
    clock.advance(61)
    await insert(semantic, "third", ttl=60)
    assert (await semantic.probe(SemanticView("s", "third"), prompt_prefix=lambda: "b")).match
    assert not semantic._prefixes


async def test_a_sweep_step_looks_at_a_bounded_number_of_entries(monkeypatch):
    # A step scanned every entry (~5 ms of the event loop at 100,000, on a miss's path).
    from carpool.semantic import cache as module

    monkeypatch.setattr(module, "SWEEP_STEP", 2)
    clock = ManualClock()
    semantic = cache(clock=clock)
    for i in range(5):
        await insert(semantic, f"prompt {i}", ttl=1)
    clock.advance(1)
    assert semantic.entries == 3  # one step: two of the five looked at
    clock.advance(1)
    assert semantic.entries == 1
    clock.advance(1)
    assert semantic.entries == 0


async def test_expired_entries_are_swept_from_the_counts_the_index_and_the_maps():
    # Found by no lookup, they held their memory and counted in /stats until evicted.
    clock = ManualClock()
    semantic = cache(clock=clock)
    await insert(semantic, "short-lived", scope="a", ttl=1)
    await insert(semantic, "long-lived", scope="b", ttl=60)
    assert semantic.entries == 2
    clock.advance(1)  # expired; a sweep is due (REAP_S)
    assert semantic.entries == 1 and not semantic.has_scope("a") and semantic.has_scope("b")
    assert semantic.bytes == counted(semantic)
    assert set(semantic._by_text) == {("b", "", "long-lived")} and len(semantic._by_public) == 1
    clock.advance(60)
    await insert(semantic, "newcomer", scope="c")  # an insert sweeps too
    assert set(semantic._by_text) == {("c", "", "newcomer")} and set(semantic._scopes) == {"c"}


async def test_stats_count_only_live_semantic_entries(fake, gateway_with):
    # Over HTTP, on the gateway's clock: an answer's entry expires with its type's ttl, and
    # /stats stops counting it (and its bytes) without any lookup finding it.
    clock = ManualClock()
    types = {"realtime": {"ttl": 1}}
    async with gateway_with(clock=clock, cache={"types": types}, semantic={"enabled": True}) as gw:
        await gw.chat("How do I reset my router?", headers={"x-carpool-type": "realtime"})
        await eventually(lambda: gw.gateway.semantic.entries == 1, what="the entry")
        clock.advance(1)
        semantic = (await gw.client.get("/stats")).json()["layers"]["semantic"]
        assert (semantic["entries"], semantic["bytes"]) == (0, 0)


async def test_an_embedder_that_fails_makes_a_miss_never_an_error(fake, gateway_with, caplog):
    # With ``embedder: upstream`` the probe asks the upstream's /v1/embeddings, shared by the
    # lookups of every tenant: its failure (down, or refusing another tenant's text batched with
    # this one) is the semantic cache's, not the request's. It was a 500.
    config = {"enabled": True, "embedder": "upstream", "embedding_dim": 8}
    async with gateway_with(semantic=config) as gw:
        assert (await gw.chat("How do I reset my router?")).status_code == 200
        await eventually(lambda: gw.gateway.semantic.entries == 1, what="the entry")
        fake.fail_status, fake.fail_times = 500, 1  # the probe's embeddings call
        embedded = fake.count("/v1/embeddings")
        response = await gw.chat("How can I reset my router?")
        assert response.status_code == 200 and response.headers["x-carpool"] == "miss"
        assert gw.gateway.semantic.embed_failures == 1
        # Not asked again to embed it for an entry (each miss asked twice, and each second
        # failure was an ERROR with its traceback): one failure, one warning.
        assert fake.count("/v1/embeddings") == embedded + 1
        assert not [r for r in caplog.records if r.levelname == "ERROR"]


class NotANumber(Embedder):
    """An embedder gone wrong: every text a NaN vector."""

    async def embed(self, text: str) -> np.ndarray:
        return np.full(DIM, np.nan, dtype=np.float32)


async def test_a_nan_similarity_is_below_every_bar_never_a_hit():
    """A NaN compares false with the threshold: the cut ``similarity < threshold`` let it
    through, and an entry of an embedder gone wrong was served for any text in its scope, with
    ``x-carpool-similarity: nan``."""
    semantic = SemanticCache(
        SemanticConfig(max_entries=10, threshold=0.5), NotANumber(), PassEverything()
    )
    await insert(semantic, "How do I reset my router?")
    probe = await semantic.probe(SemanticView("s", "Write a poem about the sea"))
    assert probe.match is None


async def test_the_model_giving_a_non_finite_or_zero_vector_fails_its_batch():
    """A zero vector is as near to another zero vector as a text to itself (usearch: 1.0), a
    NaN passes no bar but fills the index: either is the model failing, as a wrong shape is
    (the lookup a counted miss, no entry made)."""
    from carpool.semantic.embed.microbatch import _BatchingEmbedder

    class Model(_BatchingEmbedder):
        dim, name = DIM, "m"

        def __init__(self, vector: np.ndarray) -> None:
            self.vector = vector

            async def compute(texts: list[str]) -> np.ndarray:
                return np.stack([self.vector] * len(texts))

            self._init_batching(compute, max_batch=4, max_delay_s=0.0, max_in_flight=1)

    unit = np.eye(DIM, dtype=np.float32)[0]
    assert (await Model(unit).embed("fine")).shape == (DIM,)
    for broken in (np.zeros(DIM, np.float32), np.full(DIM, np.nan, np.float32), unit / 0):
        with pytest.raises(ValueError, match="non-finite or zero"):
            await Model(broken).embed("broken")
