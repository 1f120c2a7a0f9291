"""A call's arguments against what was captured, in one pass: dtypes, devices, non-batch
shapes, the batch rows of the tokens and requests axes, persistent addresses, static values.
Precomputed tuples, no allocation on the happy path: this runs on every call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphify.base.axes import ArgSpec, Kind, WeakStatic, by_value, mismatch, same_static
from graphify.base.errors import InputMismatchError

__all__ = ["ArgChecks"]


def _device_index(device: torch.device | None) -> int:
    return -1 if device is None or device.type == "cpu" else (device.index if device.index is not None else 0)

def _static_checks(specs) -> tuple:
    """(index, value, compare) per static argument: plain values must be equal (True),
    other objects the very object (False), a weakly held one (first use) the object its
    reference still points to (None: `value` is the reference)."""
    return tuple(
        (s.index, s.value.ref, None) if isinstance(s.value, WeakStatic) else (s.index, s.value, by_value(s.value))
        for s in specs
        if s.axis.kind is Kind.STATIC
    )


class ArgChecks:
    """The checks of one table's argument specs; `rows(args)` runs them."""

    def __init__(self, label: str, specs: Sequence[ArgSpec]):
        self.label, self.specs = label, tuple(specs)
        self.tok_idx = tuple(s.index for s in specs if s.axis.kind is Kind.TOKENS)
        self.req_idx = tuple(s.index for s in specs if s.axis.kind is Kind.REQS)
        # One tuple per padded argument; get_device() is -1 on the CPU, else the GPU index.
        self.padded_checks = tuple(
            (s.index, s.axis.kind is Kind.REQS, s.dtype, _device_index(s.device), len(s.shape), torch.Size(s.trailing))
            for s in specs
            if s.axis.kind.padded
        )
        self.fixed_checks = tuple(
            (s.index, s.dtype, _device_index(s.device), torch.Size(s.shape)) for s in specs if s.axis.kind is Kind.FIXED
        )
        self.persistent_checks = tuple(
            (s.index, s.data_ptr, torch.Size(s.shape), s.stride or None, s.dtype)
            for s in specs if s.axis.kind is Kind.PERSISTENT
        )
        self.static_checks = _static_checks(specs)

    def _fail(self, index: int, arg: Any) -> None:
        # no local names the error: its traceback would hold this frame, a cycle that keeps the
        # call's arguments (a transformers cache) alive until the next garbage collection
        raise mismatch(self.label, self.specs[index], arg) or InputMismatchError(
            f"{self.label}: argument {index} does not match"
        )

    def _disagree(self, idx: tuple[int, ...], i: int, first: int, got: int) -> None:
        what = "reqs" if idx is self.req_idx else "tokens"
        names = [self.specs[j].name for j in idx]
        raise InputMismatchError(
            f"{self.label}: {what}-axis arguments {names} disagree on dim 0 "
            f"({self.specs[idx[0]].name!r} has {first}, {self.specs[i].name!r} has {got})"
        )

    def rows(self, args: Sequence[Any]) -> tuple[int | None, int | None]:
        """Check every argument against its captured spec; return (tokens, requests),
        None where no argument has that axis. One pass, no allocation on the happy path."""
        n = r = None
        for i, is_req, dtype, device, ndim, trailing in self.padded_checks:
            a = args[i]
            try:
                shape = a.shape
                rows = shape[0]
                ok = (
                    a.dtype is dtype
                    and len(shape) == ndim
                    and (ndim == 1 or shape[1:] == trailing)
                    and a.get_device() == device
                )
            except (AttributeError, IndexError, TypeError):
                ok = False
            if not ok:
                self._fail(i, a)
            if is_req:
                if r is None:
                    r = rows
                elif rows != r:
                    self._disagree(self.req_idx, i, r, rows)
            elif n is None:
                n = rows
            elif rows != n:
                self._disagree(self.tok_idx, i, n, rows)
        for i, dtype, device, shape in self.fixed_checks:
            a = args[i]
            if not isinstance(a, torch.Tensor) or a.dtype is not dtype or a.get_device() != device or a.shape != shape:
                self._fail(i, a)
        for i, ptr, shape, stride, dtype in self.persistent_checks:
            a = args[i]
            if not isinstance(a, torch.Tensor) or a.data_ptr() != ptr or a.shape != shape or a.dtype is not dtype \
                    or (stride is not None and a.stride() != stride):
                self._fail(i, a)
        for i, value, equal in self.static_checks:
            a = args[i]
            if equal is None:
                if a is not value():
                    self._fail(i, a)
            elif a is not value and not (equal and same_static(a, value)):
                self._fail(i, a)
        return n, r
