"""Exact-answer stores behind one interface (see ``base``)."""

from .base import Entry, Store
from .memory import MemoryStore

__all__ = ["Entry", "MemoryStore", "Store"]
