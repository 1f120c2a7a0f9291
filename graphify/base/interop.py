"""Functions of CuPy (or NumPy) arrays, seen by graphify as functions of torch tensors.

graphify's table, checks, padding and dispatch work on torch tensors. A function of
foreign arrays is wrapped once: arguments cross over through DLPack (zero-copy views of
the same memory, no device work), the user's function runs on arrays of its own library,
and its results cross back. So static buffers, captured outputs and the caller's arrays
share memory, and one runtime serves every array library. CuPy is imported lazily: only
a call that passes CuPy arrays needs it. NumPy arrays run on the CPU simulation backend,
which is how CI checks this layer without a GPU.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["array_library", "foreign_library", "to_torch", "from_torch", "ForeignFunction"]

LIBRARIES = ("cupy", "numpy")


def array_library(x: Any) -> str | None:
    """'cupy' or 'numpy' for an array of those libraries, else None (torch tensors included)."""
    if isinstance(x, torch.Tensor) or not hasattr(x, "__dlpack__"):
        return None
    root = type(x).__module__.split(".", 1)[0]
    return root if root in LIBRARIES else None


def foreign_library(label: str, args: Sequence[Any]) -> str | None:
    """The one foreign array library among `args`, or None; two libraries are an error."""
    found = {lib for lib in map(array_library, args) if lib is not None}
    if len(found) > 1:
        raise TypeError(f"{label}: arguments mix arrays of {sorted(found)}; pass arrays of one library")
    return next(iter(found), None)


def module(name: str):
    """The array library `name`, imported on first use, with an install hint if missing."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        return __import__(name)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        hint = " (pip install 'graphify[cuda12]' or 'graphify[cuda13]', matching your CUDA)" if name == "cupy" else ""
        raise ImportError(f"graphify needs {name} for these arrays{hint}: {exc}") from exc


def to_torch(x: Any) -> Any:
    """A torch view of a foreign array (same memory); anything else unchanged."""
    return torch.from_dlpack(x) if array_library(x) is not None else x


def from_torch(x: Any, xp) -> Any:
    """A `xp` view of a torch tensor (same memory); anything else unchanged."""
    return xp.from_dlpack(x.detach()) if isinstance(x, torch.Tensor) else x


def tree_to_torch(tree: Any) -> Any:
    return pytree.tree_map(to_torch, tree)


def tree_from_torch(tree: Any, xp) -> Any:
    return pytree.tree_map(lambda t: from_torch(t, xp), tree)


class ForeignFunction:
    """`fn` of `library` arrays as a function of torch tensors (views both ways)."""

    def __init__(self, fn: Callable, library: str):
        self.fn, self.library = fn, library
        self.xp = module(library)
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        xp = self.xp
        kwargs = {k: from_torch(v, xp) for k, v in kwargs.items()}
        return tree_to_torch(self.fn(*(from_torch(a, xp) for a in args), **kwargs))
