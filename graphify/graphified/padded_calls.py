"""First use's calls of a model whose sequence axis may be padded (`graphify.base.length_padding`):
each call's sequence padded to its bucket, the outputs cut back.

The first padded call is compared with the model run as called, once per graphified function:
where they differ (a model that reads its padded positions after all), padding is turned off
for that function with one warning, and that call returns the model's own answer. Calls the
padding does not cover (positional arguments it cannot name, a length past the model's
longest) go through as they are.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from graphify.base.call_layout import signature_of
from graphify.base.length_padding import SequencePadding, bucket

__all__ = ["PaddedCalls", "agree"]

log = logging.getLogger("graphify")

# (rtol, atol) of the one comparison, by output dtype: padded keys masked out change only the
# order of a reduction (a kernel for another length), so real positions agree to rounding; a
# model that reads padded positions differs by whole values
TOLERANCE = {torch.float32: (1e-3, 1e-4), torch.float64: (1e-6, 1e-7)}
HALF_TOLERANCE = (3e-2, 1e-2)


def agree(got: Any, want: Any) -> bool:
    """Whether two outputs hold the same floating tensors to rounding. Pure."""
    a = [t for t in pytree.tree_leaves(_plain(got)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    b = [t for t in pytree.tree_leaves(_plain(want)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return False
        rtol, atol = TOLERANCE.get(y.dtype, HALF_TOLERANCE)
        if x.numel() and ((x.float() - y.float()).abs().max() > atol + rtol * y.float().abs().max()):
            return False
    return True


def _plain(out: Any) -> Any:
    return out.to_tuple() if hasattr(out, "to_tuple") else out


class PaddedCalls:
    """One graphified function's padding: `call(route, args, kwargs)` pads the call and sends
    it down `route` (graphify's own call path), or sends it as it is."""

    def __init__(self, label: str, fn: Callable, padding: SequencePadding):
        self.label, self.fn, self.padding = label, fn, padding
        self.signature = signature_of(fn)  # a module's forward's
        self.checked = False
        self.off = False
        self.lock = threading.Lock()

    def call(self, route: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        if self.off or self.signature is None:
            return route(args, kwargs)
        try:
            named = self.signature.bind(*args, **kwargs).arguments
        except TypeError:
            return route(args, kwargs)
        length = self.padding.length(named)
        to = None if length is None else bucket(length, self.padding.cap)
        if to is None or to == length:
            return route(args, kwargs)
        out = self.padding.cut(route((), self.padding.pad(dict(named), to)), length, to)
        if not self.checked:
            return self._first(out, args, kwargs, length, to)
        return out

    def _first(self, out: Any, args: tuple, kwargs: dict, length: int, to: int) -> Any:
        """The first padded call, compared with the model run as called."""
        with self.lock:
            if self.checked:
                return out
            want = self.fn(*args, **kwargs)
            self.checked = True
            if agree(out, want):
                return out
            self.off = True
        warnings.warn(
            f"{self.label}: {self.padding.name}'s outputs changed when its sequence of {length} was padded to {to}, "
            "so its calls are not padded: each length gets graphs of its own", stacklevel=4)
        return want
