"""Exact-answer stores behind one interface (see ``base``)."""

from .base import Entry, Selector, Store
from .memory import MemoryStore

__all__ = ["Entry", "MemoryStore", "Selector", "Store"]
