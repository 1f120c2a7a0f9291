"""The backend interface: capture one callable on fixed inputs, replay it later."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch

__all__ = ["Backend", "Captured"]


@attrs.frozen(eq=False)
class Captured:
    """One captured graph: `replay()` reruns it, writing into `outputs` in place.

    `sized` replays take the real (unpadded) tokens and requests: `replay(n, r)` (piecewise
    schedules, whose eager split ops run on the real batch)."""

    replay: Callable[..., None]
    graph: Any
    outputs: Any
    nbytes: int
    sized: bool = False


class Backend(Protocol):
    name: str
    trim_frees_live_graphs: bool  # whether `trim` would free memory live graphs work in (`Pool.trim` then waits)

    def validate(self, label: str, device: torch.device) -> None:
        """Raise a `CaptureError` saying what to do if this backend cannot capture here."""

    def new_pool_handle(self, device: torch.device) -> Any:
        """A fresh memory-pool handle on `device`."""

    def new_stream(self, device: torch.device) -> Any:
        """The side stream every capture of one table shares (None where streams don't apply)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Uninitialised memory for a static buffer, from this backend's allocator."""

    def usage(self, handle: Any) -> "tuple[int, int] | None":
        """(reserved, in use) bytes of a pool, read from the allocator; None if it has none."""

    def trim(self, handle: Any, device: torch.device) -> None:
        """Give a pool's free cached blocks back to the device."""

    def capture(
        self, fn: Callable, args: tuple, *, pool: Any, warmups: int, weak_outputs: bool, stream: Any = None,
        guard: "bool | Callable" = True, keeper: Any = None,
    ) -> Captured:
        """Warm up `fn(*args)` (the first run under the op guard unless `guard` is off; a
        callable `guard` is an eager twin of a compiled `fn` that runs under the guard in
        its place, because torch.compile'd code called under a dispatch mode falls back to
        eager for good), then record it on `stream` into a graph allocated from `pool`.
        `keeper` (a `StateKeeper`) records the first warm-up's writes to outside state and
        undoes every eager run's. A `CompiledCode` `fn` runs torch.compile'd code: the CUDA
        backend does not stage its constants (dynamo would compile again under the mode)."""


class CompiledCode:
    """`fn`, marked as running torch.compile'd code (the caller knows; a wrapped function's
    attributes do not tell): the CUDA backend captures it without its constant-staging mode,
    under which dynamo would compile again, inside the capture. `twin`: its eager original,
    which the simulation records in its place (compiled code run under a dispatch mode makes
    dynamo run that code eagerly from then on, in every later compile of the process)."""

    __slots__ = ("fn", "twin")

    def __init__(self, fn: Callable, twin: Callable | None = None):
        self.fn, self.twin = fn, twin

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.fn, name)
