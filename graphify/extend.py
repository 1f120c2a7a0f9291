"""What code extending graphify builds on: the contract of a split function, and the
pieces of graphify such code needs (`transforms` uses these names and no private ones).

A split function (what `transforms.split` returns) is any object with the attributes of
`SplitFunction`; graphify reads them through `as_split`, never by probing attributes one by
one, so the contract is written down here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager, Protocol, runtime_checkable

from ._axes import layout_for, param_names
from ._job_pickle import register_carried, register_rebuilt
from ._state_types import StateType, register_capture_context, register_forward_adapter, register_state_type
from .backends import Captured
from .backends._base import CompiledCode
from .backends.sim import taping
from .backends.torch_cuda import weak_alias

__all__ = [
    "SplitFunction", "as_split", "Captured", "layout_for", "param_names", "taping", "weak_alias", "StateType",
    "register_state_type", "register_capture_context", "register_forward_adapter", "register_rebuilt",
    "register_carried", "CompiledCode",
]


@runtime_checkable
class SplitFunction(Protocol):
    """A function cut at some ops into graph pieces and eager split ops."""

    is_split: bool  # True: graphify captures PIECEWISE graphs of its pieces
    fn: Callable  # the function as written: eager calls, the op guard's and state recorder's probe
    op_names: frozenset  # every op its trace calls ('aten::mm', 'ns::attention', ...)
    compiled: bool  # its pieces are inductor-compiled (warm-ups at every size; `fn` runs eagerly)
    pieces_write_outside: bool  # a graph piece may write in place to an input or closed-over tensor
    axes: Any  # the argument axes it was traced with (graphify's default for `axes=`)
    out_axes: Any  # per flat output: 'tokens', 'reqs' or None

    def __call__(self, *args: Any) -> Any: ...

    def capture_pieces(self, backend: Any, args: tuple, **options: Any) -> Captured:
        """Capture its graph pieces at the size of `args` on `backend`; the `Captured`'s
        `replay(n, r)` runs the whole schedule for n real tokens and r real requests."""

    def specialised(self, num_tokens: int | None) -> ContextManager:
        """A context in which compiled pieces run the compile for their exact shapes."""


def as_split(fn: Any) -> "SplitFunction | None":
    """`fn` when it is a split function, else None."""
    return fn if getattr(fn, "is_split", False) else None
