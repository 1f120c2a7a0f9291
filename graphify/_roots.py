"""What a function reads beyond its arguments: the roots `graphify._reach` walks.

A graph bakes in what the function read at capture: tensors by address, numbers as kernel
arguments. Besides its arguments a function reads its closure cells, the module globals
its code names, a bound method's object and a partial's bound arguments.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from ._axes import by_value

__all__ = ["function_roots", "GlobalSlot"]

def function_roots(fn: Callable, name: str | None = None) -> dict[str, Any]:
    """The roots a function reads beyond its arguments: its closure cells, the globals its
    code names that are tensors or plain values, a bound method's object (unless it is an
    nn.Module, which `ModuleWatch` covers), and a partial's bound arguments."""
    roots: dict[str, Any] = {}
    seen: set[int] = set()

    def add(f: Any, label: str, level: int) -> None:
        if id(f) in seen or level > 3:
            return
        seen.add(id(f))
        f = getattr(f, "_torchdynamo_orig_callable", f)  # a torch.compile'd function: its Python original
        if isinstance(f, types.MethodType):
            owner = f.__self__
            if not isinstance(owner, (torch.nn.Module, type, types.ModuleType)):
                roots[f"{label}.__self__"] = owner
            add(f.__func__, label, level + 1)
            return
        if hasattr(f, "func") and hasattr(f, "args") and hasattr(f, "keywords"):  # functools.partial
            roots[f"{label}.args"] = f.args
            roots[f"{label}.keywords"] = f.keywords
            add(f.func, label, level + 1)
            return
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None and not isinstance(f, types.FunctionType):
            add(wrapped, label, level + 1)
            return
        if not isinstance(f, types.FunctionType):
            return
        code = f.__code__
        for var, cell in zip(code.co_freevars, f.__closure__ or ()):
            roots[f"{label} closure {var!r}"] = cell
        g = f.__globals__
        for var in code.co_names:
            if var not in g:
                continue
            value = g[var]
            if isinstance(value, torch.Tensor) or (not isinstance(value, (list, dict)) and by_value(value)):
                roots.setdefault(f"{label} global {var!r}", GlobalSlot(g, var))

    add(fn, name or getattr(fn, "__name__", "fn"), 0)
    return roots


class GlobalSlot:
    """A module global as a root: the globals dict, walked for one name only."""

    __slots__ = ("globals", "name")

    def __init__(self, globals_: dict, name: str):
        self.globals, self.name = globals_, name
