"""Dynamic batching with dedup: many concurrent single-item requests become one upstream call.

- :mod:`carpool.batching.core`: :class:`KeyedBatcher`, the generic scheduler (groups, keys,
  delay, size and cost budgets, ``max_in_flight``, ``grow_while_busy``); it knows nothing of
  HTTP or embeddings. ``semantic.embed``'s embedders use it too.
- :mod:`carpool.batching.embeddings`: :class:`EmbeddingBatcher`, the gateway's ``/embeddings``
  on that scheduler (which requests merge, the merged call, each caller's own answer and usage).
- :mod:`carpool.batching.lists`: :class:`ListCheck` and :func:`probe_lists`, whether an upstream
  answers a list of inputs as it answers each alone (so that merging never changes an answer).

Each module's docstring is its contract. Everything public is re-exported here, so
``from carpool.batching import ...`` is the import path to use.
"""

from .core import KeyedBatcher
from .embeddings import DEFAULT_KEY_HEADERS, EmbeddingBatcher, approx_tokens
from .lists import PROBE_INPUTS as PROBE_INPUTS
from .lists import PROBE_TOKENS as PROBE_TOKENS
from .lists import SAME_VECTOR as SAME_VECTOR
from .lists import ListCheck
from .lists import probe_lists as probe_lists

# (as before the split: the probe's names are importable from here, not in ``*``)
__all__ = ["DEFAULT_KEY_HEADERS", "EmbeddingBatcher", "KeyedBatcher", "ListCheck", "approx_tokens"]
