"""How many bytes a worker holds for its runs: a deep ``sys.getsizeof`` walk.

Used by the scale test and ``benchmarks/bench_scale_runs.py`` to report memory
per run without tracing every allocation (tracemalloc slows a 10,000-run load
several times over). It follows containers, instance attributes and slots,
counts numpy arrays by their buffers (a view by its base's), and counts every
object once. Classes, modules and functions are shared code, not per-run
state: not counted.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Iterable

_SHARED = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
)


def deep_size(*roots: Any, exclude: Iterable[Any] = ()) -> int:
    """Bytes reachable from ``roots``, each object once; ``exclude`` (and what only they reach) not walked."""
    seen = {id(obj) for obj in exclude}
    stack = list(roots)
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SHARED):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj, 0)  # a numpy array that owns its buffer counts it here
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, (str, bytes, bytearray, int, float, complex, bool)) or obj is None:
            continue
        else:
            if type(obj).__module__ == "numpy" and getattr(obj, "base", None) is not None:
                stack.append(obj.base)  # a view: what it keeps alive is its base
            attrs = getattr(obj, "__dict__", None)
            if attrs is not None:
                stack.append(attrs)
            slots = [
                slot
                for cls in type(obj).__mro__
                for slot in getattr(cls, "__slots__", ())
                if isinstance(slot, str) and hasattr(obj, slot)
            ]
            stack.extend(getattr(obj, slot) for slot in slots)
            if attrs is None and not slots and type(obj).__module__.startswith("sklearn"):
                # A compiled sklearn object (a fitted tree) keeps its arrays out of sight;
                # its pickled state holds copies of the same size.
                state = obj.__getstate__()
                if isinstance(state, dict):
                    for value in state.values():
                        nbytes = getattr(value, "nbytes", None)  # views of the object's own memory
                        if isinstance(nbytes, int):
                            total += nbytes
                        else:
                            stack.append(value)
    return total
