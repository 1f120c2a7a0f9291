"""What code reads beyond its arguments: the names its bytecode looks up, and where they live.

A graph bakes in what the function read at capture: tensors by address, numbers as kernel
arguments, and (through the Python that chose the kernels) every global, attribute and hook
the call looked at. `graphify.reads.reach` walks all of it from the function; these are the
facts about code it needs: which names a function's bytecode (and its nested code) names,
a class's own dict (what monkeypatching a method changes), which code is a library's own
(torch's and graphify's: read by identity, not walked), and the global hook dicts every
module call reads.
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from typing import Any

__all__ = ["code_names", "class_dict", "global_hooks_set", "library_code", "library_module", "own_module", "global_hook_dicts", "NOT_CALLED"]

# Special methods that make, copy or show objects: not what a call over existing ones runs
# (torch.compile patches `Module.__init__` once, mid-capture at times)
NOT_CALLED = frozenset({
    "__init__", "__new__", "__init_subclass__", "__class_getitem__", "__repr__", "__str__", "__format__",
    "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__dir__", "__del__", "__sizeof__",
    "__subclasshook__", "__copy__", "__deepcopy__",
})


_names: "weakref.WeakKeyDictionary[types.CodeType, frozenset]" = weakref.WeakKeyDictionary()


def code_names(code: types.CodeType) -> frozenset:
    """Every name `code` and the code nested in it (comprehensions, inner functions, lambdas)
    look up as a global or an attribute, and the identifier-like strings it holds (names
    read with `getattr`). (Cached weakly: torch.compile hangs compiled graphs on code objects.)"""
    found = _names.get(code)
    if found is None:
        names = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= code_names(const)
            elif isinstance(const, str) and const.isidentifier():  # getattr(config, "sliding_window", None)
                names.add(const)
        found = _names[code] = frozenset(names)
    return found


# torch's, graphify's and Python's own code: read by identity, never walked
_LIBRARIES = frozenset({"torch", "graphify", "triton", "sympy", "mpmath", "numpy", "typing_extensions"}) | frozenset(
    sys.stdlib_module_names)


def library_code(obj: Any) -> bool:
    """Code of torch, graphify or Python's standard library (or a builtin): read by
    identity, its own globals and class attributes not walked, as dynamo treats torch's
    functions as calls in the graph rather than code to trace. Everything else (the model's
    code, transformers', the user's) is walked."""
    return library_module(getattr(obj, "__module__", None))


def library_module(module) -> bool:
    """Whether a module of this name is torch's, graphify's or Python's own (code with no
    module name, `exec`'d without one, is the user's)."""
    if not isinstance(module, str):
        return False
    return module.split(".", 1)[0] in _LIBRARIES or own_module(module)


def own_module(module) -> bool:
    """Whether a module of this name is graphify's (its transforms and models included)."""
    return isinstance(module, str) and module.split(".", 1)[0] == "graphify"


def class_dict(cls: type) -> dict | None:
    """The dict under `cls.__dict__` (a read-only proxy): what class attribute assignment
    changes, and what dict watchers and version tags can follow. None for builtin types.
    (Not cached: a class dict refers back to its class, so a cache would keep classes.)"""
    if cls.__module__ == "builtins":
        return None
    return next((r for r in gc.get_referents(cls.__dict__) if isinstance(r, dict)), None)


def global_hook_dicts() -> dict:
    """The hook dicts every nn.Module call consults (`register_module_forward_hook` and the
    like), by name: a hook added there after capture changes what a call runs."""
    from torch.nn.modules import module as nn_module

    names = [n for n in vars(nn_module) if n.startswith("_global_") and "hooks" in n
             and isinstance(getattr(nn_module, n), dict) and "registration" not in n]
    return {f"torch.nn.modules.module.{n}": getattr(nn_module, n) for n in sorted(names)}


def global_hooks_set() -> bool:
    """Whether any global module hook is registered now."""
    return any(global_hook_dicts().values())
