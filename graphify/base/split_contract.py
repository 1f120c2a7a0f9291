"""The contract of a split function (what `graphify.transforms.split` returns), written down
once: graphify reads a split function through `as_split`, never by probing attributes one
by one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager, Protocol, runtime_checkable

__all__ = ["SplitFunction", "as_split"]


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
