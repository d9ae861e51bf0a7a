"""The simulated engine: an OpenAI-compatible "model" with a realistic cost model, for demos,
tests and benchmarks. It is labelled as a simulator wherever it appears: ``system_fingerprint:
"carpool-sim"`` in bodies, ``x-carpool-simulated: true`` in headers, ``"simulated": true`` in stats.

Each module states its part of the contract:

    replies.py        identity, endpoints, ``SimReply``, errors in OpenAI's / Anthropic's shapes
    text.py           prompt tokens, the answer's words (seeded), embedding vectors
    plan.py           request validation and ``Plan``: a request's choices decided before serving
    bodies.py         OpenAI-shaped bodies and stream chunks of a plan
    prefix_cache.py   ``PrefixCache``: the KV cache, LRU of chained block hashes (``carpool.prefix``)
    replica.py        ``SimReplica``: the cost model (slots, prefill, decode pacing) and counters
    adapter.py        ``SimUpstream``: a replica behind the ``Upstream`` protocol, no sockets
    ../sim_apis.py    the Responses and Messages APIs, served as their chat equivalent
    ../sim_server.py  each replica as its own HTTP server

Everything the single ``sim`` module offered is importable from this package.
"""

from __future__ import annotations

from carpool.upstream.sim.adapter import SimUpstream, build_upstreams
from carpool.upstream.sim.bodies import completion_body, opening_chunks, step_chunks, usage_chunk
from carpool.upstream.sim.plan import (
    MAX_CHOICES,
    MAX_INPUTS,
    MAX_SEQUENCES,
    Plan,
    Sequence,
    make_plan,
    max_new_tokens,
    parse_inputs,
)
from carpool.upstream.sim.prefix_cache import PrefixCache
from carpool.upstream.sim.replica import (
    MAX_DIMENSIONS,
    MAX_EMBEDDING_VALUES,
    SimReplica,
    Sleep,
    build_replicas,
)
from carpool.upstream.sim.replies import (
    ENDPOINTS,
    JSON_HEADERS,
    MODEL_ID,
    SERVED,
    SIMULATED_HEADER,
    SYSTEM_FINGERPRINT,
    SimReply,
    error_reply,
    not_found_reply,
)
from carpool.upstream.sim.text import (
    ANSWER_PRIMING,
    MAX_ANSWER_WORDS,
    MIN_ANSWER_WORDS,
    TOKENS_PER_MESSAGE,
    VOCABULARY,
    answer_words,
    answers,
    chat_prompt_tokens,
    embedding_vector,
    input_tokens,
    is_greedy,
    words,
)

__all__ = [
    "ANSWER_PRIMING",
    "ENDPOINTS",
    "JSON_HEADERS",
    "MAX_ANSWER_WORDS",
    "MAX_CHOICES",
    "MAX_DIMENSIONS",
    "MAX_EMBEDDING_VALUES",
    "MAX_INPUTS",
    "MAX_SEQUENCES",
    "MIN_ANSWER_WORDS",
    "MODEL_ID",
    "SERVED",
    "SIMULATED_HEADER",
    "SYSTEM_FINGERPRINT",
    "TOKENS_PER_MESSAGE",
    "VOCABULARY",
    "Plan",
    "PrefixCache",
    "Sequence",
    "SimReplica",
    "SimReply",
    "SimUpstream",
    "Sleep",
    "answer_words",
    "answers",
    "build_replicas",
    "build_upstreams",
    "chat_prompt_tokens",
    "completion_body",
    "embedding_vector",
    "error_reply",
    "input_tokens",
    "is_greedy",
    "make_plan",
    "max_new_tokens",
    "not_found_reply",
    "opening_chunks",
    "parse_inputs",
    "step_chunks",
    "usage_chunk",
    "words",
]
