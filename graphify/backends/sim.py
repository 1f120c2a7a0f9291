"""CPU simulation of CUDA graphs, with the semantics that matter to callers.

Capture runs the function once under the op guard (`graphify._guard`), which rejects ops a
CUDA graph cannot hold (host reads of device values, data-dependent output shapes). Replay reruns the function
on the same static inputs and copies its results into the outputs recorded at capture,
so outputs are overwritten in place on every replay exactly as with a real graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from .._axes import WeakStatic, weaken
from .._errors import CaptureError
from .._guard import UNCAPTURABLE_OPS, CaptureGuard
from .._state import eager_runs
from ._base import Captured

__all__ = ["SimBackend", "CaptureGuard", "UNCAPTURABLE_OPS"]

_copy_all = torch._foreach_copy_  # bound once: replay copies are not input copies

def _clone_out(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class SimBackend:
    """Simulated graphs on any device; see the module docstring."""

    name = "sim"
    _pool_ids = itertools.count(1)

    def validate(self, call: str, device: torch.device) -> None:
        return None

    def new_pool_handle(self, device: torch.device):
        return ("sim", next(self._pool_ids))

    def new_stream(self, device: torch.device):
        return None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def usage(self, handle) -> None:
        """No allocator to ask: the report counts what each capture kept."""
        return None

    def trim(self, handle, device) -> None:
        return None

    def capture(
        self, fn: Callable, args: tuple, *, pool, warmups: int, weak_outputs: bool, stream=None,
        guard: "bool | Callable" = True, keeper=None,
    ) -> Captured:
        # Warm-ups, then the capture run itself (eager here): the first under the guard,
        # each one's writes to outside state undone after it.
        outputs = eager_runs(
            fn, args, keeper=keeper, guard=guard, count=warmups + 1, finish=lambda r: pytree.tree_map(_clone_out, r)
        )
        flat_out, _ = pytree.tree_flatten(outputs)
        static_out = [t for t in flat_out if isinstance(t, torch.Tensor)]
        # A replay reruns fn on the capture's arguments; objects among them are held weakly,
        # as a real graph holds none (a first-use callable must not keep a dropped cache).
        held = tuple(a if isinstance(a, torch.Tensor) else weaken(a) for a in args)
        del args

        def replay() -> None:
            fresh, _ = pytree.tree_flatten(fn(*[a() if isinstance(a, WeakStatic) else a for a in held]))
            fresh = [t for t in fresh if isinstance(t, torch.Tensor)]
            if len(fresh) != len(static_out) or any(a.shape != b.shape for a, b in zip(fresh, static_out)):
                raise CaptureError("sim replay: the function returned different output shapes than at capture")
            if static_out:
                _copy_all(static_out, [t.detach() for t in fresh])

        nbytes = sum(t.untyped_storage().nbytes() for t in static_out)
        return Captured(replay, None, outputs, nbytes)
