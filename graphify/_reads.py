"""What a table's graphs read without copying it in, checked before every replay.

Two records, each cheap to check: the parameters and buffers of the modules the function
belongs to or receives (`graphify._params.ModuleWatch`), and the tensors and plain values
reached through static objects and the closure (`graphify._reach.Reach`). A module whose
tensors were rebound raises `StateChangedError`; a changed object or closure is reported
as stale, so the layer above decides (first use drops the structure and starts over).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ._errors import StaleReachError

__all__ = ["Reads"]


@attrs.frozen(eq=False)
class Reads:
    """`watch`: the modules' tensors (or None); `reach`: the objects' and the closure's."""

    watch: Any = None
    reach: tuple = ()

    def check_modules(self, args) -> None:
        """Raise if a watched module's tensors were rebound; warn once about grad mode
        when `args` (or the modules) require grad."""
        watch = self.watch
        if watch is not None:
            watch.check()
            if torch.is_grad_enabled():
                watch.warn_grad(args)

    def stale(self) -> bool:
        """Whether an object or the closure holds other tensors or values than at capture."""
        return any(r.changed() for r in self.reach)

    def stale_error(self, label: str) -> StaleReachError:
        what = next((d for d in (r.describe() for r in self.reach) if d is not None), "something it reads")
        return StaleReachError(
            f"{label}: {what} since capture. The graphs read what was captured (tensors by address, numbers "
            "baked into kernels), so this call cannot replay them: update tensors in place (copy_) instead of "
            "replacing them, keep numbers the function reads fixed, or capture again"
        )
