"""What a table's graphs read without copying it in, checked before every replay.

Two records: everything the function reaches (its modules wherever they sit, their
parameters, hooks and attributes, the globals and closures of the code that runs: a deep
`Reach` under a `graphify.reads.watch.Watch`, a microsecond or two a call), and the tensors and
plain values reached through static objects such as a transformers cache (shallow `Reach`es,
compared edge by edge, since such objects change their own Python state as they are used).
A change to the first raises `StateChangedError`; a changed static object is reported as
stale. Either way the layer above decides (first use drops the structure and starts over;
a captured callable raises).
"""

from __future__ import annotations

import warnings

import attrs
import torch

from graphify.base.errors import StaleReachError, StateChangedError

__all__ = ["Reads"]


@attrs.frozen(eq=False)
class Reads:
    """`watch`: what the function reaches (or None); `reach`: the static objects'; `state`:
    torch's process-wide settings at capture (`graphify.reads.torch_settings`, or None)."""

    watch: object = None
    reach: tuple = ()
    state: object = None

    def guard(self, args) -> None:
        """Raise if torch's settings or what the function reaches changed; warn once about grad
        mode when `args` (or the parameters) require grad."""
        state = self.state
        if state is not None and not state.same():
            raise StateChangedError(state.error_text())
        watch = self.watch
        if watch is not None:
            watch.guard()
            if torch.is_grad_enabled() and not watch.warned:
                self._warn_grad(args)

    def _warn_grad(self, args) -> None:
        """Once: graphs record no autograd history, so outputs in grad mode have none."""
        if self.watch.requires_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self.watch.warned = True
            warnings.warn(
                f"{self.watch.label}: called with grad mode on and tensors that require grad, but CUDA graphs "
                "replay without autograd: the outputs carry no gradient history. Call under torch.no_grad() or "
                "torch.inference_mode() (graphify is for inference), or use the function itself for training.",
                stacklevel=4,
            )

    def stale(self) -> bool:
        """Whether a static object holds other tensors or values than at capture."""
        return any(r.changed() for r in self.reach)

    def stale_error(self, label: str) -> StaleReachError:
        what = next((d for d in (r.describe() for r in self.reach) if d is not None), "something it reads")
        return StaleReachError(
            f"{label}: {what} since capture. The graphs read what was captured (tensors by address, numbers "
            "baked into kernels), so this call cannot replay them: update tensors in place (copy_) instead of "
            "replacing them, keep numbers the function reads fixed, or capture again"
        )
