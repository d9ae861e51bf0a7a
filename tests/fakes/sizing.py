"""What a structure holds in memory, measured: ``deep_size``."""

from __future__ import annotations

import gc
import sys
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType

from carpool.clock import SYSTEM_CLOCK
from carpool.lru import allocated


def deep_size(root: object) -> int:
    """Bytes reachable from ``root`` (``sys.getsizeof`` of each object once, rounded as the
    allocator hands them out), not crossing into types, modules, functions or the clock."""
    seen = {id(SYSTEM_CLOCK)}
    todo, total = [root], 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (bool, type, ModuleType)):
            continue
        if isinstance(obj, (FunctionType, BuiltinFunctionType, MethodType)):
            continue
        seen.add(id(obj))
        total += allocated(sys.getsizeof(obj))
        todo.extend(gc.get_referents(obj))
    return total
