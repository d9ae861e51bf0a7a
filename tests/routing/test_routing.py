"""Routing policies and replica health, with in-process fake upstreams (no HTTP)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
import pytest

from carpool.clock import ManualClock
from carpool.errors import (
    UpstreamAnswerCut,
    UpstreamError,
    UpstreamNoAnswer,
    UpstreamStreamStalled,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from carpool.prefix import root_of
from carpool.routing import Decision, RoutingSettings, build_policy
from carpool.routing.cache_aware import CacheAware, PrefixRecord
from carpool.routing.least_loaded import LeastLoaded
from carpool.routing.replicas import ReplicaSet, ReplicaState
from carpool.routing.round_robin import RoundRobin
from carpool.routing.state import (
    MAX_LEARNED,
    StateHolders,
    answer_names,
    learning,
    path_changed,
    path_state,
    posted_state,
)
from carpool.upstream.base import PassthroughResponse, UpstreamRequest, UpstreamResponse

REQUEST = UpstreamRequest("/chat/completions", {"model": "m"})
STREAM = UpstreamRequest("/chat/completions", {"model": "m", "stream": True}, stream=True)


class Fake:
    """An in-process ``Upstream``: ``mode`` decides what the next call does."""

    def __init__(self, name: str, mode: str = "ok") -> None:
        self.name = name
        self.mode = mode  # ok | unreachable | timeout | 5xx | hang | stall
        self.sent = 0
        self.closed_streams = 0
        self.started = asyncio.Event()
        self.meanwhile: Any = None  # ("noanswer": what happens while the call waits)

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.sent += 1
        self.started.set()
        if self.mode == "unreachable":
            raise UpstreamUnreachable(f"{self.name}: connection refused")
        if self.mode == "timeout":
            raise UpstreamTimeout(f"{self.name}: no answer")
        if self.mode == "5xx":
            return UpstreamResponse(503, {"content-type": "application/json"}, b'{"error": {}}')
        if self.mode == "noanswer":  # (sent whole, no head in time)
            if self.meanwhile is not None:
                self.meanwhile()
            raise UpstreamNoAnswer(f"{self.name}: no answer")
        if self.mode in ("501", "505"):  # (an engine without the endpoint: llama.cpp's embeddings)
            return UpstreamResponse(int(self.mode), {"content-type": "application/json"}, b"{}")
        if self.mode == "hang":
            await asyncio.Event().wait()
        if request.stream:

            async def events() -> AsyncIterator[list[bytes]]:
                if self.mode == "stall":  # (its head, then nothing for upstream_timeout)
                    raise UpstreamStreamStalled(f"{self.name} stalled mid-stream")
                yield [b'{"from": "%s"}' % self.name.encode()]

            async def close() -> None:
                self.closed_streams += 1

            return UpstreamResponse(200, {}, events=events(), close=close)
        return UpstreamResponse(
            200, {"content-type": "application/json"}, b'{"from": "%s"}' % self.name.encode()
        )

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def states(*names: str) -> list[ReplicaState]:
    return [ReplicaState(Fake(n)) for n in names]


def replica_set(
    *modes: str, policy: str = "round-robin", **kw
) -> tuple[ReplicaSet, list[Fake], Clock]:
    fakes = [Fake(f"r{i}", mode) for i, mode in enumerate(modes)]
    clock = Clock()
    return ReplicaSet(fakes, build_policy(policy), clock=clock, **kw), fakes, clock


# ------------------------------------------------------------------------------------------
# Policies


def test_round_robin_cycles():
    policy, replicas = RoundRobin(), states("a", "b", "c")
    picks = [policy.select("", replicas) for _ in range(7)]
    assert [r.name for r, _ in picks] == ["a", "b", "c", "a", "b", "c", "a"]
    assert {d for _, d in picks} == {Decision.ROUND_ROBIN}


def test_least_loaded_picks_fewest_in_flight():
    policy, (a, b, c) = LeastLoaded(), states("a", "b", "c")
    a.in_flight, b.in_flight, c.in_flight = 5, 1, 3
    assert policy.select("x", [a, b, c]) == (b, Decision.LEAST_LOADED)
    b.in_flight = 9
    assert policy.select("x", [a, b, c]) == (c, Decision.LEAST_LOADED)
    c.in_flight, c.calls, a.calls = 5, 2, 7  # a tie on load: fewer calls wins
    assert policy.select("x", [a, b, c]) == (c, Decision.LEAST_LOADED)


def test_build_policy_and_settings():
    assert isinstance(build_policy("round-robin"), RoundRobin)
    assert isinstance(build_policy("least_loaded"), LeastLoaded)
    policy = build_policy(
        "cache-aware",
        policy="cache-aware",
        cache_threshold=0.7,
        tree_budget_chars=1000,
        block_chars=10,
        backoff_s=1,
    )
    assert isinstance(policy, CacheAware)
    assert policy.cache_threshold == 0.7 and policy.record.budget_blocks == 100
    with pytest.raises(ValueError):
        build_policy("random")
    with pytest.raises(ValueError):
        build_policy("cache-aware", cache_treshold=0.7)  # a typo is an error
    fields = RoutingSettings.model_fields
    assert all(f.description for f in fields.values())
    assert {
        "cache_threshold",
        "balance_abs_threshold",
        "balance_rel_threshold",
        "tree_budget_chars",
        "backoff_s",
        "backoff_max_s",
    } <= set(fields)


def _system_prompts(rng: random.Random, count: int, chars: int = 2000) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "router", "prefix", "engine"]
    out = []
    for i in range(count):
        text = f"System prompt {i}. "
        while len(text) < chars:
            text += rng.choice(words) + " "
        out.append(text)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_aware_affinity_with_balance(seed):
    """6 long system prompts x 100 distinct suffixes, shuffled, over 3 replicas under load."""
    rng = random.Random(seed)
    prompts = _system_prompts(rng, 6)
    work = [
        (p, f"\nUser {u}: please answer question number {u * 7919 % 1000} for me.")
        for p in range(6)
        for u in range(100)
    ]
    rng.shuffle(work)
    policy, replicas = CacheAware(), states("a", "b", "c")
    finishing: list[tuple[int, ReplicaState]] = []  # (step it finishes, replica)
    placed: dict[int, Counter[str]] = defaultdict(Counter)
    decisions: Counter[Decision] = Counter()
    for step, (p, suffix) in enumerate(work):
        for item in [f for f in finishing if f[0] <= step]:
            finishing.remove(item)
            item[1].in_flight -= 1
        text = prompts[p] + suffix
        replica, decision = policy.select(text, replicas)
        policy.on_sent(text, replica)
        replica.in_flight += 1
        replica.calls += 1
        finishing.append((step + rng.randint(5, 60), replica))  # ~32 in flight on average
        placed[p][replica.name] += 1
        decisions[decision] += 1
    affinity = sum(max(c.values()) / sum(c.values()) for c in placed.values()) / len(placed)
    calls = [r.calls for r in replicas]
    assert affinity >= 0.8, (affinity, placed)
    assert max(calls) / min(calls) <= 2.5, calls
    assert decisions[Decision.PREFIX_MATCH] >= 500, decisions
    assert decisions[Decision.LEAST_LOADED] >= 6  # each prompt's first request had no match


def test_cache_aware_hot_prefix_is_spread_by_the_load_guard():
    """One prompt takes most of the traffic under high load: the guard overrules its affinity."""
    rng = random.Random(7)
    prompts = _system_prompts(rng, 4)
    work = [0] * 450 + [1, 2, 3] * 50
    rng.shuffle(work)
    policy, replicas = CacheAware(), states("a", "b", "c")
    finishing: list[tuple[int, ReplicaState]] = []
    decisions: Counter[Decision] = Counter()
    for step, p in enumerate(work):
        for item in [f for f in finishing if f[0] <= step]:
            finishing.remove(item)
            item[1].in_flight -= 1
        text = prompts[p] + f" question {step}"
        replica, decision = policy.select(text, replicas)
        policy.on_sent(text, replica)
        replica.in_flight += 1
        replica.calls += 1
        finishing.append((step + rng.randint(60, 180), replica))  # ~120 in flight
        decisions[decision] += 1
        loads = [r.in_flight for r in replicas]
        assert max(loads) - min(loads) <= 32 + 1 or max(loads) <= 1.5 * min(loads) + 1
    calls = [r.calls for r in replicas]
    assert decisions[Decision.IMBALANCED] > 0 and decisions[Decision.PREFIX_MATCH] > 300
    assert max(calls) / min(calls) <= 2.5, (calls, decisions)


def test_cache_aware_prefix_match_and_threshold():
    policy, (a, b) = CacheAware(cache_threshold=0.5, block_chars=16), states("a", "b")
    system = "s" * 320
    policy.on_sent(system + "first question", b)
    assert policy.select(system + "another question", [a, b]) == (b, Decision.PREFIX_MATCH)
    # A shared prefix under the threshold's share of the prompt: least loaded instead.
    short = system[:32] + "q" * 400
    a.in_flight = 0
    b.in_flight = 1
    assert policy.select(short, [a, b]) == (a, Decision.LEAST_LOADED)
    # Prompts shorter than a block never match.
    assert policy.select("hi", [a, b]) == (a, Decision.LEAST_LOADED)


def test_imbalance_overrules_affinity():
    policy = CacheAware(balance_abs_threshold=32, balance_rel_threshold=1.5, block_chars=16)
    a, b, c = states("a", "b", "c")
    text = "shared system prompt " * 50
    policy.on_sent(text, a)
    a.in_flight, b.in_flight, c.in_flight = 40, 5, 20
    assert policy.select(text, [a, b, c]) == (b, Decision.IMBALANCED)
    # Gap over abs but under the relative factor (80 <= 1.5 * 60): balanced enough.
    a.in_flight, b.in_flight, c.in_flight = 80, 60, 70
    assert policy.select(text, [a, b, c]) == (a, Decision.PREFIX_MATCH)
    # Relative over but absolute gap within 32: balanced.
    a.in_flight, b.in_flight, c.in_flight = 30, 0, 10
    assert policy.select(text, [a, b, c]) == (a, Decision.PREFIX_MATCH)
    # Imbalanced, but the matching replica is itself the least loaded: still a prefix match.
    a.in_flight, b.in_flight, c.in_flight = 1, 50, 20
    assert policy.select(text, [a, b, c]) == (a, Decision.PREFIX_MATCH)
    # Imbalanced with no match: plain least loaded.
    a.in_flight, b.in_flight, c.in_flight = 40, 5, 20
    assert policy.select("unrelated " * 40, [a, b, c]) == (b, Decision.LEAST_LOADED)


def test_prefix_record_evicts_within_budget_leaves_first():
    record = PrefixRecord(budget_chars=160, block_chars=16)  # 10 blocks per replica
    shared = "S" * 64  # 4 blocks
    for i in range(6):
        record.insert(shared + f"{i:x}" * 64, "a")  # 4 + 4 blocks each
        assert record.size_chars("a") <= 160
    # The shared prefix (touched last on every insert) survives; old tails are gone.
    assert record.holds(shared + "5" * 64, "a") == 128
    assert record.holds(shared + "0" * 64, "a") == 64
    assert record.match(shared + "0" * 64)[1] == {"a"}
    # Eviction keeps the index consistent: nothing recorded for b, and forget drops a.
    assert record.holds(shared, "b") == 0
    record.forget("a")
    assert record.size_chars("a") == 0 and record.match(shared) == (0, set())
    # A text longer than the whole budget keeps its first blocks.
    record.insert("L" * 16 * 30, "b")
    assert record.size_chars("b") == 160 and record.holds("L" * 16 * 30, "b") == 160


def test_a_prompt_longer_than_the_budget_records_only_its_first_budget_blocks():
    # Each of its 100 blocks was hashed and inserted, 90 of them evicted straight away: an
    # 8 MB prompt cost ~250 ms of the event loop to route.
    record = PrefixRecord(budget_chars=160, block_chars=16)  # 10 blocks per replica
    prompt = "".join(f"{i:016x}" for i in range(100))  # 100 distinct blocks
    record.insert(prompt, "a")
    assert record._lru["a"].evictions == 0
    assert record.hashed == 10
    assert record.holds(prompt, "a") == 160  # its first 10 blocks, as before


def test_matching_stops_hashing_at_the_first_block_nobody_holds():
    record = PrefixRecord(budget_chars=1600, block_chars=16)
    known = "".join(f"{i:016x}" for i in range(20))
    record.insert(known, "a")
    record.hashed = 0
    long_prompt = "".join(f"{i:016x}" for i in range(1000, 2000))  # 1000 blocks, none known
    assert record.match(long_prompt) == (0, set())
    assert record.hashed == 1
    record.hashed = 0
    assert record.match(known[: 16 * 5] + long_prompt) == (80, {"a"})
    assert record.hashed == 6  # the 5 that match, and the first that does not


def test_cache_aware_policy_respects_budget():
    policy = build_policy("cache-aware", tree_budget_chars=1000, block_chars=50)
    a, b = states("a", "b")
    rng = random.Random(3)
    for prompt in _system_prompts(rng, 20, chars=400):
        replica, _ = policy.select(prompt, [a, b])
        policy.on_sent(prompt, replica)
        assert policy.record.size_chars("a") <= 1000 and policy.record.size_chars("b") <= 1000


# ------------------------------------------------------------------------------------------
# Replica health


async def test_unreachable_fails_over_then_backoff_then_probe():
    replicas, (r0, r1, r2), clock = replica_set(
        "unreachable", "ok", "ok", backoff_s=5, backoff_max_s=12
    )
    response, replica, decision = await replicas.send(REQUEST)
    assert response.status == 200 and replica.name != "r0" and decision is Decision.FAILOVER
    snap = replicas.snapshot()
    assert snap["r0"]["state"] == "down" and snap["r0"]["failures"] == 1
    assert snap["r0"]["down_for_s"] == 5
    # During the back-off r0 is skipped.
    names = [(await replicas.send(REQUEST))[1].name for _ in range(6)]
    assert "r0" not in names and r0.sent == 1
    # Back-off over, still dead: the probe fails over; back-off doubles.
    clock.now += 5
    while True:
        _, replica, decision = await replicas.send(REQUEST)
        if r0.sent == 2:
            break
    assert decision is Decision.FAILOVER and replicas.snapshot()["r0"]["down_for_s"] == 10
    clock.now += 10
    r0.mode = "5xx"
    while r0.sent < 3:
        await replicas.send(REQUEST)
    assert replicas.snapshot()["r0"]["down_for_s"] == 12  # capped at backoff_max_s
    # Back-off over and alive again: the next request routed to it is the probe, then healthy.
    clock.now += 12
    r0.mode = "ok"
    assert replicas.snapshot()["r0"]["state"] == "probing"
    decisions = []
    while r0.sent < 4:
        _, replica, decision = await replicas.send(REQUEST)
        decisions.append((replica.name, decision))
    assert decisions[-1] == ("r0", Decision.PROBE)
    snap = replicas.snapshot()["r0"]
    assert snap["state"] == "healthy" and snap["failures"] == 0 and snap["errors"] == 3
    assert [(await replicas.send(REQUEST))[2] for _ in range(3)] == [Decision.ROUND_ROBIN] * 3
    assert replicas.in_flight == 0


async def test_a_replica_down_for_days_keeps_failing_over():
    """Its back-off doubled without bound: at its 1,025th failure (dead ~17 hours, probed once
    every backoff_max_s) ``5 * 2 ** 1024`` overflowed a float. Every request sent to it then
    raised OverflowError (a 500) instead of failing over, and its back-off never moved again."""
    clock = ManualClock()
    dead, alive = Fake("r0", "unreachable"), Fake("r1")
    replicas = ReplicaSet(
        [dead, alive],
        build_policy("least-loaded"),
        clock=clock.monotonic,
        backoff_s=5.0,  # (a float, as the config gives it: ``5 * 2**1024`` is an int)
        backoff_max_s=60.0,
        log_interval=1e9,
    )
    r0 = replicas["r0"]
    replicas["r1"].in_flight = 1  # (busier: r0 is asked whenever it is eligible)
    for probe in range(1, 1101):  # (one probe a minute: over 18 hours)
        clock.advance(max(0.0, r0.down_until - clock.monotonic()))  # its back-off is over
        response, replica, decision = await replicas.send(REQUEST)
        assert (response.status, replica.name, decision) == (200, "r1", Decision.FAILOVER)
        assert dead.sent == r0.failures == probe
    snap = replicas.snapshot()["r0"]
    assert snap["state"] == "down" and snap["down_for_s"] == 60
    assert r0.in_flight == 0 and replicas["r1"].in_flight == 1


async def test_the_replica_that_made_a_stored_response_is_chosen_in_back_off_too():
    replicas, (r0, r1, r2), clock = replica_set("ok", "ok", "ok", policy="least-loaded")
    r2_state = replicas["r2"]
    r2_state.in_flight = 5  # the policy would never pick it
    assert replicas.choose("", holder="r2") == (r2_state, Decision.STATE_HOLDER)
    assert replicas.choose("", holder="gone")[1] is Decision.LEAST_LOADED  # unknown: the policy
    # Down: its back-off is no reason to ask a replica that cannot have the state (its 404).
    r2.mode = "unreachable"
    with pytest.raises(UpstreamUnreachable):
        await replicas.send(REQUEST, holder="r2")
    assert replicas.choose("", holder="r2") == (r2_state, Decision.PROBE)
    assert replicas.choose("", [r2_state], holder="r2")[0] is not r2_state  # (excluded)
    r2.mode = "ok"
    _, replica, decision = await replicas.send(REQUEST, holder="r2")
    assert (replica, decision) == (r2_state, Decision.PROBE) and r2_state.healthy


@pytest.mark.parametrize("mode", ["unreachable", "timeout", "noanswer", "5xx"])
async def test_a_request_sent_to_its_states_holder_is_never_failed_over(mode):
    # Only the holder has the state it continues: failed over, the other replica's answer was
    # a false, final 404 (no SDK retries one), the holder's transient failure hidden.
    replicas, (r0, r1), _ = replica_set(mode, "ok")
    if mode == "5xx":
        response, replica, decision = await replicas.send(REQUEST, holder="r0")
        assert (response.status, replica.name, decision) == (503, "r0", Decision.STATE_HOLDER)
    else:
        with pytest.raises(UpstreamError):
            await replicas.send(REQUEST, holder="r0")
    assert r1.sent == 0 and r0.sent == 1 and replicas.snapshot()["r0"]["state"] == "down"
    assert replicas.in_flight == 0
    # Anything else still fails over from it.
    assert (await replicas.send(REQUEST))[1:] == (replicas["r1"], Decision.ONLY_HEALTHY)
    replicas["r0"].down_until = 0.0  # (its back-off over)
    _, replica, decision = await replicas.send(REQUEST)
    assert (replica.name, decision) == ("r1", Decision.FAILOVER) and r0.sent == 2


def test_a_prefix_is_matched_only_within_its_scope():
    record = PrefixRecord(budget_chars=10_000, block_chars=8)
    text = "a shared system prompt, then a question"
    alice, mallory = root_of(["alice", "", "m", ""]), root_of(["mallory", "", "m", ""])
    record.insert(text, "r1", alice)
    assert record.match(text, root=alice) == (32, {"r1"})
    assert record.match(text, root=mallory) == (0, set())
    assert record.match(text) == (0, set())  # (unscoped: another scope still)
    assert root_of(["alice", "", "m", ""]) == alice and root_of(["alice", "", "m", "s"]) != alice


def test_two_scopes_never_share_a_root_however_their_parts_are_split():
    # The parts were joined with NUL, which a model name or a cache_salt (client JSON) may
    # hold: model "m\0x" without a salt and model "m" salted "x\0" + ... had one root.
    assert root_of(["t", "", "m\x00x", "null"]) != root_of(["t", "", "m", "x\x00null"])
    assert root_of(["a", "b\x00c"]) != root_of(["a\x00b", "c"])
    assert root_of(["a", "b"]) != root_of(["a", "b", ""])


CHAT_ASKED = {"model": "m", "messages": [{"role": "user", "content": "Summarise the handbook."}]}
RESPONSES_ASKED = {"model": "m", "input": "Summarise the handbook.", "store": False}


@pytest.mark.parametrize(
    ("path", "shared", "bound"),
    [
        (
            "/v1/chat/completions",
            CHAT_ASKED,
            {
                **CHAT_ASKED,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Summarise the handbook."},
                            {"type": "file", "file": {"file_id": "file-abc123"}},
                        ],
                    }
                ],
            },
        ),
        ("/v1/chat/completions", CHAT_ASKED, {**CHAT_ASKED, "store": True}),
        ("/v1/responses", RESPONSES_ASKED, {**RESPONSES_ASKED, "previous_response_id": "resp_1"}),
        # (Stored, Responses' default: its answer's id names a response its tenant keeps.)
        (
            "/v1/responses",
            RESPONSES_ASKED,
            {k: v for k, v in RESPONSES_ASKED.items() if k != "store"},
        ),
    ],
    ids=["file", "stored-chat", "previous-response", "stored-response"],
)
def test_in_a_shared_namespace_a_request_naming_its_tenants_state_routes_in_its_tenants_scope(
    path, shared, bound
):
    # Tenants share prefixes in a shared namespace, as they share answers there; not a request
    # that names what the upstream keeps for its own tenant (a file, an earlier response, an
    # answer it stores): its prefix would steer another tenant's request to where it ran.
    from carpool.config import Config
    from carpool.exchange import routing_scope
    from carpool.request import ClientRequest, parse

    config = Config(tenant={"shared_namespaces": ["docs"]})

    def scope(body: dict[str, Any], who: str) -> bytes:
        headers = {"authorization": f"Bearer {who}", "x-carpool-namespace": "docs"}
        request = parse(ClientRequest(path, orjson.dumps(body), headers), 1 << 20)
        return routing_scope(request, config)

    assert scope(shared, "alice") == scope(shared, "mallory")  # (the namespace's)
    assert scope(bound, "alice") != scope(bound, "mallory")


def test_a_stored_response_routes_only_its_own_tenants_requests():
    holders = StateHolders()
    holders.remember("tenant-a", "resp_1", "r1")
    assert holders.holder("tenant-a", "resp_1") == "r1"
    assert holders.holder("tenant-b", "resp_1") is None
    assert holders.holder("tenant-a", "resp_2") is None
    assert holders.holder("tenant-a", None) is None


def test_the_replicas_of_stored_responses_are_remembered_within_a_bound():
    holders = StateHolders(max_entries=2)
    holders.remember("t", "resp_1", "r0")
    holders.remember("t", "resp_2", "r1")
    assert holders.holder("t", "resp_1") == "r0"  # named: the most recent now
    holders.remember("t", "resp_3", "r1")
    assert len(holders) == 2
    assert holders.holder("t", "resp_2") is None  # the least recently made or named
    assert holders.holder("t", "resp_1") == "r0" and holders.holder("t", "resp_3") == "r1"


def test_a_pass_through_path_names_the_stored_response_it_is_about():
    assert path_state("/responses/resp_1") == "resp_1"
    assert path_state("/responses/resp_1/input_items") == "resp_1"
    assert path_state("/responses/resp%5F1/cancel") == "resp_1"
    assert path_state("/responses") is None and path_state("/responses/") is None
    assert path_state("/models/resp_1") is None


def test_a_pass_through_path_names_the_stored_chat_completion_it_is_about():
    # (A chat completion asked with ``store: true``: retrieved, updated, listed, deleted.)
    assert path_state("/chat/completions/chatcmpl-1") == "chatcmpl-1"
    assert path_state("/chat/completions/chatcmpl-1/messages") == "chatcmpl-1"
    assert path_state("/chat/completions") is None and path_state("/chat/completions/") is None
    assert path_state("/completions/cmpl-1") is None


def test_a_pass_through_call_names_the_file_or_batch_it_is_about():
    # (SGLang keeps each upload and batch in the process it reached.)
    assert path_state("/files/file-1") == "file-1"
    assert path_state("/files/file-1/content") == "file-1"
    assert path_state("/batches/batch_1/cancel") == "batch_1"
    assert path_state("/files") is None and path_state("/batches") is None
    made = b'{"input_file_id": "file-1", "endpoint": "/v1/chat/completions"}'
    assert posted_state("POST", "/batches", made) == "file-1"
    assert posted_state("GET", "/batches", made) is None
    assert posted_state("POST", "/files", made) is None
    for body in (b"", b"[]", b"{", b'{"input_file_id": 1}'):
        assert posted_state("POST", "/batches", body) is None
    assert answer_names("POST", "/files") and answer_names("POST", "/batches")
    assert answer_names("GET", "/batches/batch_1") and answer_names("POST", "/batches/b/cancel")
    assert not answer_names("GET", "/files") and not answer_names("GET", "/batches")
    assert not answer_names("GET", "/files/file-1") and not answer_names("POST", "/responses")


async def test_the_ids_a_kept_objects_answer_names_are_remembered_before_its_last_piece_goes():
    answer = b'{"id": "batch_1", "input_file_id": "file-1", "output_file_id": "file-2", '
    answer += b'"error_file_id": null, "status": "completed"}'
    remembered: list[str] = []
    passed: list[tuple[bytes, list[str]]] = []

    async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
        for start in range(0, len(data), size):
            yield data[start : start + size]

    async for piece in learning(pieces(answer, 10), remembered.append):
        passed.append((piece, list(remembered)))
    assert b"".join(piece for piece, _ in passed) == answer
    assert passed[-2][1] == [] and passed[-1][1] == ["batch_1", "file-1", "file-2"]
    for other in (b'[{"id": "x"}]', b'"x"', b"\x1f\x8b gzip", b'{"id": "' + b"x" * MAX_LEARNED):
        remembered.clear()
        assert (
            b"".join([p async for p in learning(pieces(other, 1000), remembered.append)]) == other
        )
        assert remembered == []


async def test_an_answer_learned_from_is_parsed_when_it_can_be_whole_not_once_per_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[int] = []
    loads = orjson.loads

    def counting(data: bytes | bytearray | str) -> object:
        parsed.append(len(data))
        return loads(data)

    monkeypatch.setattr(orjson, "loads", counting)

    async def bytewise(data: bytes) -> AsyncIterator[bytes]:
        for at in range(len(data)):
            yield data[at : at + 1]

    answer = b'{"id": "file-1", "object": "file", "bytes": 140, "purpose": "batch"}\n'
    remembered: list[str] = []
    assert b"".join([p async for p in learning(bytewise(answer), remembered.append)]) == answer
    assert remembered == ["file-1"] and parsed == [len(answer) - 1]
    # Not an object: given up at its first byte, never parsed.
    parsed.clear()
    listed = b'  [{"id": "x"}' + b", {}" * 1000 + b"]"
    assert b"".join([p async for p in learning(bytewise(listed), remembered.append)]) == listed
    assert parsed == [] and remembered == ["file-1"]


def test_only_a_delete_or_update_of_the_stored_object_itself_names_what_it_changes():
    # (A file too: the answers whose request names it are its, OpenAI's and Anthropic's. A
    # stored chat completion's POST sets its metadata, in its request's key.)
    for path, named in [
        ("/responses/resp_1", "resp_1"),
        ("/chat/completions/c%2D1/", "c-1"),
        ("/files/file-1", "file-1"),
    ]:
        assert path_changed("DELETE", path) == named
        assert path_changed("GET", path) is None
        updated = named if path.startswith("/chat/completions/") else None
        assert path_changed("POST", path) == updated
    assert path_changed("POST", "/chat/completions/chatcmpl-1/messages") is None
    assert path_changed("DELETE", "/responses/resp_1/input_items") is None
    assert path_changed("DELETE", "/chat/completions/chatcmpl-1/messages") is None
    assert path_changed("DELETE", "/chat/completions") is None
    assert path_changed("DELETE", "/files/file-1/content") is None
    assert path_changed("DELETE", "/files") is None
    assert path_changed("DELETE", "/batches/batch_1") is None


class _Gated(Fake):
    """A ``Fake`` whose calls all wait for ``gate``, then fail (unreachable)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = asyncio.Event()

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.sent += 1
        await self.gate.wait()
        raise UpstreamUnreachable(f"{self.name}: connection reset")


async def _fail_together(replicas: ReplicaSet, gated: _Gated, requests: int, calls: int) -> None:
    """``requests`` sent at once, ``gated`` failing its ``calls`` of them once all are sent."""
    sent = gated.sent
    tasks = [asyncio.create_task(replicas.send(REQUEST)) for _ in range(requests)]
    async with asyncio.timeout(5):
        while gated.sent < sent + calls:
            await asyncio.sleep(0)
    gated.gate.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    gated.gate.clear()


async def test_calls_failing_together_grow_the_back_off_once():
    """The failures of calls sent before the first one came back are the same news: they
    pushed the back-off to its maximum (5, 10, 20, 40, 60 s) while the log said 5 s."""
    gated, clock = _Gated("r0"), Clock()
    replicas = ReplicaSet(
        [gated, Fake("r1")], build_policy("round-robin"), clock=clock, backoff_s=5
    )
    await _fail_together(replicas, gated, 6, 3)  # (three to each replica, in turn)
    snap = replicas.snapshot()["r0"]
    assert (snap["errors"], snap["failures"], snap["down_for_s"]) == (3, 1, 5)
    # Alone, and down: every call is a probe of it; those sent together fail together, once.
    alone = ReplicaSet([gated], build_policy("round-robin"), clock=clock, backoff_s=5)
    for failures, down_for in [(1, 5), (2, 10)]:
        await _fail_together(alone, gated, 3, 3)
        snap = alone.snapshot()["r0"]
        assert (snap["failures"], snap["down_for_s"]) == (failures, down_for)
    assert snap["errors"] == 6 and alone.in_flight == replicas.in_flight == 0


async def test_5xx_before_any_byte_fails_over():
    replicas, (r0, r1), _ = replica_set("5xx", "ok")
    response, replica, decision = await replicas.send(REQUEST)
    assert (response.status, replica.name, decision) == (200, "r1", Decision.FAILOVER)
    assert replicas.snapshot()["r0"]["state"] == "down"
    # A stream request answered with a 5xx status fails over too.
    r0.mode, r1.mode = "ok", "5xx"
    replicas["r0"].healthy = True
    response, replica, decision = await replicas.send(STREAM)
    assert (response.status, replica.name, decision) == (200, "r0", Decision.FAILOVER)
    assert response.streaming and replicas["r0"].in_flight == 1  # a stream, open
    assert [e async for e in response.events()] == [[b'{"from": "r0"}']]
    await response.aclose()
    await response.aclose()  # safe twice
    assert r0.closed_streams == 1 and replicas.in_flight == 0


async def test_a_stream_stalled_after_its_head_downs_its_replica_only_if_it_answered_nothing_since():
    # A stuck engine behind a live HTTP layer (vLLM's) sends every stream's head, then nothing:
    # its replica stayed healthy. One whose other calls are answered meanwhile is alive.
    replicas, (r0,), clock = replica_set("stall")
    first = (await replicas.send(STREAM))[0]
    clock.now += 1
    second = (await replicas.send(STREAM))[0]  # (its head: news after the first's)
    for stream in (first, second):
        with pytest.raises(UpstreamStreamStalled):
            await anext(stream.events())
        await stream.aclose()
    r0_state = replicas["r0"]
    assert (r0_state.healthy, r0_state.errors, r0_state.failures) == (False, 1, 1)
    # Its probe's head heals it; its stall is news again (not run again: raised as it is).
    clock.now += 5
    probe, _, decision = await replicas.send(STREAM)
    assert decision is Decision.PROBE and r0_state.healthy
    with pytest.raises(UpstreamStreamStalled):
        await anext(probe.events())
    await probe.aclose()
    assert (r0_state.healthy, r0_state.errors, r0_state.failures) == (False, 2, 1)
    assert r0.sent == 3 and replicas.in_flight == 0


async def test_a_call_unanswered_by_a_replica_silent_to_every_call_fails_over_else_is_a_504():
    # A frozen engine's socket takes a small request's bytes: "written whole" told nothing,
    # and every call routed to it was a 504 (it failed over before). A replica that answered
    # other calls while this one waited is alive and may be running it: not run twice.
    replicas, (r0, r1), clock = replica_set("noanswer", "ok")
    response, replica, decision = await replicas.send(REQUEST)
    assert (response.status, replica.name, decision) == (200, "r1", Decision.FAILOVER)
    replicas, (r0, r1), clock = replica_set("noanswer", "ok")
    r0.meanwhile = lambda: setattr(replicas["r0"], "answered_at", clock())
    with pytest.raises(UpstreamNoAnswer):
        await replicas.send(REQUEST)
    assert r1.sent == 0 and replicas.snapshot()["r0"]["state"] != "healthy"


@pytest.mark.parametrize("status", ["501", "505"])
async def test_a_replica_that_does_not_implement_a_call_is_answered_not_down(status):
    # llama.cpp and Ollama answer /v1/embeddings 501 when embeddings are off: each such call
    # downed its replica and failed over to the next (down too), the chat traffic then ran
    # as probes and /readyz said 503. Another replica of the same engine says the same.
    replicas, (r0, r1), _ = replica_set(status, "ok")
    response, replica, decision = await replicas.send(REQUEST)
    assert (response.status, replica.name) == (int(status), "r0") and r1.sent == 0
    assert replicas.snapshot()["r0"]["state"] == "healthy" and decision is not Decision.FAILOVER


async def test_timeout_fails_over_and_every_replica_failing_raises():
    replicas, (r0, r1), _ = replica_set("timeout", "ok", policy="least-loaded")
    assert (await replicas.send(REQUEST))[2] is Decision.FAILOVER
    replicas2, _, _ = replica_set("unreachable", "timeout")
    with pytest.raises(UpstreamTimeout):
        await replicas2.send(REQUEST)  # tried once each, the last error raised
    assert [r.calls for r in replicas2.replicas] == [1, 1] and replicas2.in_flight == 0
    # Both down: the one whose back-off ends first is still tried.
    replicas2.replicas[1].upstream.mode = "ok"
    response, replica, decision = await replicas2.send(REQUEST)
    assert (replica.name, decision) in {("r0", Decision.PROBE), ("r1", Decision.FAILOVER)}


async def test_single_replica_5xx_is_returned_and_error_raised():
    replicas, (r0,), _ = replica_set("5xx")
    response, replica, decision = await replicas.send(REQUEST)
    assert response.status == 503 and decision is Decision.ONLY_HEALTHY
    r0.mode = "unreachable"
    with pytest.raises(UpstreamUnreachable):
        await replicas.send(REQUEST)
    assert replicas.in_flight == 0 and r0.sent == 2


async def test_in_flight_counts_on_every_path():
    replicas, (r0, r1), _ = replica_set("hang", "ok")
    observed: list[tuple[str, int, Decision]] = []
    replicas.observe = lambda r, status, d: observed.append((r.name, status, d))
    # Cancellation while the upstream call is pending.
    task = asyncio.create_task(replicas.send(REQUEST))
    await r0.started.wait()
    assert replicas["r0"].in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert replicas.in_flight == 0 and replicas["r0"].healthy  # no verdict on a cancel
    # Streams stay in flight until closed; plain answers end with send.
    r0.mode = "ok"
    responses = [(await replicas.send(STREAM))[0] for _ in range(4)]
    assert [r.in_flight for r in replicas.replicas] == [2, 2]
    await (await replicas.send(REQUEST))[0].aclose()
    assert replicas.in_flight == 4
    for response in responses:
        await response.aclose()
    assert replicas.in_flight == 0
    # Errors and failover.
    r0.mode = "unreachable"
    await replicas.send(REQUEST)
    assert replicas.in_flight == 0
    assert observed[-2:] == [("r0", 502, Decision.ROUND_ROBIN), ("r1", 200, Decision.FAILOVER)]


async def test_cache_aware_replica_set_end_to_end():
    replicas, fakes, _ = replica_set("ok", "ok", "ok", policy="cache-aware")
    prompts = _system_prompts(random.Random(5), 3)
    homes = {}
    for p in prompts:
        _, replica, decision = await replicas.send(REQUEST, p + " first")
        assert decision is Decision.LEAST_LOADED
        homes[p] = replica.name
    assert len(set(homes.values())) == 3  # new prefixes spread over replicas
    for p in prompts:
        _, replica, decision = await replicas.send(REQUEST, p + " again")
        assert (replica.name, decision) == (homes[p], Decision.PREFIX_MATCH)
    # Its home down: the prompt fails over elsewhere (no unhandled error), then sticks there.
    p = prompts[0]
    replicas[homes[p]].upstream.mode = "unreachable"
    _, replica, decision = await replicas.send(REQUEST, p + " third")
    assert decision is Decision.FAILOVER and replica.name != homes[p]
    _, again, decision = await replicas.send(REQUEST, p + " fourth")
    assert (again.name, decision) == (replica.name, Decision.PREFIX_MATCH)
    assert replicas.in_flight == 0


class _Dying(Fake):
    """A ``Fake`` whose ``GET /models`` fails as its calls do once it is unreachable."""

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        raise UpstreamUnreachable(f"{self.name}: connection refused")


async def test_readiness_trusts_an_answer_for_a_while_then_asks_the_replica_again():
    # A replica that answered once was ready for ever: dead since, with no request to find it
    # out, /readyz kept saying 200 and a balancer kept sending it traffic.
    from carpool.routing.replicas import READY_TRUST_S

    fake, clock = _Dying("r0"), Clock()
    replicas = ReplicaSet([fake], build_policy("round-robin"), clock=clock)
    await replicas.send(REQUEST)
    fake.mode = "unreachable"
    assert await replicas.ready()  # (its answer is recent: not asked)
    clock.now += READY_TRUST_S
    assert not await replicas.ready() and replicas.replicas[0].errors == 1


class _Probed(Fake):
    """A ``Fake`` whose ``GET /models`` fails as ``probe`` says: ``head`` (no answer at all, an
    ``UpstreamError`` no other branch names), ``body`` (its head came, then its body was cut),
    or answers."""

    probe = "ok"

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        self.sent += 1
        if self.probe == "head":
            raise UpstreamError(f"{self.name}: something odd")

        async def content() -> AsyncIterator[bytes]:
            yield b'{"data": ['
            if self.probe == "body":
                raise UpstreamAnswerCut(f"{self.name} failed mid-answer")
            yield b"]}"

        return PassthroughResponse(200, [], content())


async def test_a_readiness_probe_failing_with_any_upstream_error_leaves_that_replica_out_and_asks_the_next():
    # An error no branch of ``ready`` named escaped it: /readyz was a 500, the next replica
    # never asked.
    odd, cut, clock = _Probed("r0"), _Probed("r1"), Clock()
    odd.probe, cut.probe = "head", "body"
    replicas = ReplicaSet([odd, cut], build_policy("round-robin"), clock=clock)
    assert await replicas.ready()  # (r1's head came: reachable, its body cut or not)
    assert (odd.sent, cut.sent) == (1, 1)
    assert replicas.snapshot()["r0"]["state"] == "down" and replicas.replicas[0].errors == 1
    assert replicas.snapshot()["r1"]["state"] == "healthy" and replicas.replicas[1].errors == 0


class _Held(Fake):
    """A ``Fake`` whose ``GET /models`` waits for ``answer`` (``started`` set as it arrives)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.answer = asyncio.Event()

    async def passthrough(
        self, method: str, path: str, query: bytes, headers: Mapping[str, str], body: bytes
    ) -> PassthroughResponse:
        self.sent += 1
        self.started.set()
        await self.answer.wait()

        async def content() -> AsyncIterator[bytes]:
            yield b'{"data": []}'

        return PassthroughResponse(200, [], content())


async def test_a_caller_leaving_does_not_cancel_the_readiness_probe_the_others_wait_for():
    # Concurrent /readyz share one probe; the first caller's leaving (its client gone) must not
    # cancel it for the others, nor leave them a cancellation.
    fake, seen = _Held("r0"), []
    replicas = ReplicaSet(
        [fake], build_policy("round-robin"), clock=Clock(), observe=lambda *a: seen.append(a)
    )
    first = asyncio.ensure_future(replicas.ready())
    await fake.started.wait()
    others = [asyncio.ensure_future(replicas.ready()) for _ in range(3)]
    await asyncio.sleep(0)  # (each in: awaiting the probe under way)
    first.cancel()
    fake.answer.set()
    assert await asyncio.gather(*others) == [True, True, True]
    assert first.cancelled() and fake.sent == 1
    # Counted as an attempt like any (``upstream_calls``), with no routing decision.
    assert replicas.attempts() == 1 and [(r.name, s, d) for r, s, d in seen] == [("r0", 200, None)]
    assert await replicas.ready() and fake.sent == 1  # (its answer is recent: trusted)


def test_a_failure_logged_shows_its_urls_without_query_or_credentials():
    # aiohttp's errors quote the URL they failed on: an upstream's query (api-version,
    # api-key), a pass-through client's query (key=...) and a user and password.
    from carpool.errors import UpstreamUnreachable
    from carpool.routing.replicas import _what

    error = UpstreamUnreachable("upstream replica-0 is unreachable")
    error.__cause__ = RuntimeError(
        "0, message='', url='http://u:PASSWORD@127.0.0.1:5/v1/loop?api-key=UPSECRET&key=CLIENTSECRET'"
        " [Connection timeout to host http://127.0.0.1:5/v1/models?api-key=UPSECRET]"
    )
    logged = _what(error)
    for secret in ("PASSWORD", "UPSECRET", "CLIENTSECRET"):
        assert secret not in logged, logged
    assert "http://***@127.0.0.1:5/v1/loop" in logged and "127.0.0.1:5/v1/models" in logged


async def test_a_replica_that_could_not_be_reached_is_remembered_holding_no_prefix():
    """A replica whose connection was refused has most likely restarted, its KV cache empty.
    What was recorded of it (its prompts, and the prompt of the very call that could not
    reach it) was kept: once back, it drew the prefixes it no longer holds (as deep a match
    as the replica that computed them meanwhile, and fewer calls). It is forgotten."""
    replicas, (r0, r1), _ = replica_set("ok", "ok", policy="cache-aware")
    record = replicas.policy.record
    prompt = "You are the assistant of a long conversation. " * 20
    _, first, _ = await replicas.send(REQUEST, prompt)
    held = r0 if first.name == "r0" else r1
    assert record.size_chars(first.name) > 0
    held.mode = "unreachable"
    _, second, decision = await replicas.send(REQUEST, prompt + " and more")
    assert second.name != first.name and decision is Decision.FAILOVER
    assert record.size_chars(first.name) == 0
    assert replicas.in_flight == 0


async def test_a_replica_a_pass_through_call_could_not_reach_is_remembered_holding_no_prefix():
    """As on the cached endpoints: a pass-through call refused a connection (the replica most
    likely restarted) forgets what the policy recorded of that replica."""

    class Refusing(Fake):
        async def passthrough(self, method, path, query, headers, body):
            raise UpstreamUnreachable(f"{self.name}: connection refused")

    r0 = Refusing("r0")
    replicas = ReplicaSet([r0], build_policy("cache-aware"), clock=Clock())
    record = replicas.policy.record
    record.insert("You are the assistant of a long conversation. " * 20, "r0")
    assert record.size_chars("r0") > 0
    with pytest.raises(UpstreamUnreachable):
        await replicas.passthrough("GET", "models", b"", {}, b"")
    assert record.size_chars("r0") == 0
