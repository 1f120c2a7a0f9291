"""CPU simulation of CUDA graphs, with the semantics that matter to callers.

Capture runs the function once under a guard that rejects ops a CUDA graph cannot hold
(host reads of device values, data-dependent output shapes). Replay reruns the function
on the same static inputs and copies its results into the outputs recorded at capture,
so outputs are overwritten in place on every replay exactly as with a real graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._errors import CaptureError, UnsupportedOpError
from ._base import Captured

__all__ = ["SimBackend", "CaptureGuard", "UNCAPTURABLE_OPS"]

_copy_all = torch._foreach_copy_  # bound once: replay copies are not input copies

# Ops that break stream capture: they read device values on the host (a sync) or
# produce shapes that depend on data.
UNCAPTURABLE_OPS = {
    "aten::_local_scalar_dense": "reads a device value on the host (.item(), int(t), bool(t))",
    "aten::item": "reads a device value on the host",
    "aten::is_nonzero": "reads a device value on the host (if tensor: ...)",
    "aten::equal": "returns a Python bool computed on the device (torch.equal)",
    "aten::nonzero": "has an output shape that depends on the data",
    "aten::masked_select": "has an output shape that depends on the data",
    "aten::_unique2": "has an output shape that depends on the data",
    "aten::unique_dim": "has an output shape that depends on the data",
    "aten::unique_consecutive": "has an output shape that depends on the data",
    "aten::_linalg_check_errors": (
        "checks a torch.linalg result on the host (a sync); use the *_ex variant (torch.linalg.solve_ex, "
        "inv_ex, cholesky_ex) and check its `info` outside the graphified function"
    ),
}


def _device_to_host(name: str, args, kwargs) -> bool:
    """A copy from a CUDA tensor into host memory (a synchronising transfer)."""
    kwargs = kwargs or {}
    if name == "aten::_to_copy":
        target = kwargs.get("device")
        return args[0].is_cuda and target is not None and torch.device(target).type == "cpu"
    if name == "aten::copy_":
        return args[0].device.type == "cpu" and args[1].is_cuda
    return False


class CaptureGuard(TorchDispatchMode):
    """Raise `UnsupportedOpError` on the first op that a CUDA graph could not capture.

    The sim backend captures under it; the cuda backend runs its first warm-up under it,
    because a capture that CUDA invalidates leaves torch's allocator and RNG in capture
    state for the rest of the process."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        why = UNCAPTURABLE_OPS.get(name)
        if why is None and _device_to_host(name, args, kwargs):
            why = "copies a CUDA tensor to the host (.cpu(), .tolist(), .numpy())"
        if why is not None:
            raise UnsupportedOpError(
                f"op {name} {why}, which a CUDA graph cannot capture; keep it out of the graphified "
                "function, or make it a split op (split(fn, ops)) so it runs eagerly"
            )
        return func(*args, **(kwargs or {}))


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
        from .._state import eager_runs

        # Warm-ups, then the capture run itself (eager here): the first under the guard,
        # each one's writes to outside state undone after it.
        outputs = eager_runs(
            fn, args, keeper=keeper, guard=guard, count=warmups + 1, finish=lambda r: pytree.tree_map(_clone_out, r)
        )
        flat_out, _ = pytree.tree_flatten(outputs)
        static_out = [t for t in flat_out if isinstance(t, torch.Tensor)]

        def replay() -> None:
            fresh, _ = pytree.tree_flatten(fn(*args))
            fresh = [t for t in fresh if isinstance(t, torch.Tensor)]
            if len(fresh) != len(static_out) or any(a.shape != b.shape for a, b in zip(fresh, static_out)):
                raise CaptureError("sim replay: the function returned different output shapes than at capture")
            if static_out:
                _copy_all(static_out, [t.detach() for t in fresh])

        nbytes = sum(t.untyped_storage().nbytes() for t in static_out)
        return Captured(replay, None, outputs, nbytes)
