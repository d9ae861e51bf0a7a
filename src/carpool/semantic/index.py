"""Approximate nearest neighbours over unit vectors: usearch's HNSW with cosine similarity.

Contract:
- ``add(key, vector)`` inserts (or replaces) one L2-normalised float32 vector under an integer key;
  ``remove(key)`` deletes it; ``search(vector, k)`` returns up to ``k`` ``(key, similarity)``
  pairs, most similar first, similarity = cosine in [-1, 1].
- The graph parameters come from config (``semantic.index_*``): connectivity (memory vs recall),
  expansion on add (build time vs recall) and on search (lookup time vs recall).
- A removed vector's slot keeps its memory (usearch reuses it for the next ``add``, never gives it
  back): an index holds what it held at its largest, ``peak`` vectors; ``slack`` is the slots
  held empty (``peak - len``). ``compact()`` rebuilds the graph from the live vectors alone
  (``len`` additions: the caller bounds them) and gives the rest back.
- usearch is imported lazily, so the core gateway runs without the ``[semantic]`` extra; and
  after onnxruntime when that is installed (``_usearch_index``).
"""

from __future__ import annotations

from typing import Any


def _usearch_index() -> Any:
    """usearch's ``Index``, onnxruntime loaded first: loaded after usearch, onnxruntime's
    import crashes the process (SIGSEGV; onnxruntime 1.32 and usearch 2.26 wheels, Linux
    x86-64), which an index built before the verifier or the local embedder did."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:  # (an upstream embedder needs no onnxruntime)
        pass
    from usearch.index import Index

    return Index


class VectorIndex:
    def __init__(
        self, dim: int, connectivity: int = 16, expansion_add: int = 64, expansion_search: int = 32
    ) -> None:
        Index = _usearch_index()  # noqa: N806  (a class)

        self.dim = dim
        self._settings = {
            "ndim": dim,
            "metric": "cos",
            "dtype": "f32",
            "connectivity": connectivity,
            "expansion_add": expansion_add,
            "expansion_search": expansion_search,
        }
        self._index = Index(**self._settings)
        self.peak = 0  # the most vectors it held at once since it was built: its slots

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def add(self, key: int, vector: Any) -> None:
        if key in self._index:
            self._index.remove(key)
        self._index.add(key, vector)
        self.peak = max(self.peak, len(self._index))

    def add_many(self, keys: Any, vectors: Any) -> None:
        """Bulk insert of new keys (uses every core); for loading and benchmarks."""
        self._index.add(keys, vectors)
        self.peak = max(self.peak, len(self._index))

    def remove(self, key: int) -> None:
        if key in self._index:
            self._index.remove(key)

    def search(self, vector: Any, k: int) -> list[tuple[int, float]]:
        if len(self._index) == 0:
            return []
        matches = self._index.search(vector, min(k, len(self._index)))
        # usearch's cosine "distance" is 1 - cosine similarity.
        return [
            (int(key), 1.0 - float(distance))
            for key, distance in zip(matches.keys, matches.distances, strict=True)
        ]

    @property
    def slack(self) -> int:
        """Slots held empty: vectors removed since the index was at its ``peak``."""
        return self.peak - len(self._index)

    @property
    def capacity(self) -> int:
        """The vectors usearch has room for (a power of two at or above ``peak``)."""
        return int(self._index.capacity)

    def compact(self) -> None:
        """Rebuild the index from its live vectors alone: what the removed ones held is given
        back (``slack`` 0). Costs an ``add`` per live vector (~40 us at 384 dimensions)."""
        import numpy as np

        Index = _usearch_index()  # noqa: N806  (a class)
        fresh = Index(**self._settings)
        if len(self._index):
            keys = np.fromiter(self._index.keys, dtype=np.uint64, count=len(self._index))
            vectors = np.asarray(self._index.get(keys), dtype=np.float32).reshape(len(keys), -1)
            fresh.add(keys, vectors, threads=1)  # (a few: no thread pool for them)
        self._index = fresh
        self.peak = len(fresh)

    @property
    def memory_bytes(self) -> int:
        return int(self._index.memory_usage)
