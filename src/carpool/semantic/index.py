"""Approximate nearest neighbours over unit vectors: usearch's HNSW with cosine similarity.

Contract:
- ``add(key, vector)`` inserts (or replaces) one L2-normalised float32 vector under an integer key;
  ``remove(key)`` deletes it; ``search(vector, k)`` returns up to ``k`` ``(key, similarity)``
  pairs, most similar first, similarity = cosine in [-1, 1].
- The graph parameters come from config (``semantic.index_*``): connectivity (memory vs recall),
  expansion on add (build time vs recall) and on search (lookup time vs recall).
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
        self._index = Index(
            ndim=dim,
            metric="cos",
            dtype="f32",
            connectivity=connectivity,
            expansion_add=expansion_add,
            expansion_search=expansion_search,
        )

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def add(self, key: int, vector: Any) -> None:
        if key in self._index:
            self._index.remove(key)
        self._index.add(key, vector)

    def add_many(self, keys: Any, vectors: Any) -> None:
        """Bulk insert of new keys (uses every core); for loading and benchmarks."""
        self._index.add(keys, vectors)

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
    def memory_bytes(self) -> int:
        return int(self._index.memory_usage)
