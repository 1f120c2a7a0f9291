"""The op guard: ops a CUDA graph cannot capture, rejected before CUDA sees them.

A capture that CUDA invalidates (a host sync inside it) leaves torch's allocator and RNG
in capture state for the rest of the process, so the first warm-up of a capture runs under
`CaptureGuard`, a dispatch mode that raises `UnsupportedOpError` naming the op instead. The
simulation backend captures under it too, so CPU tests reject what a GPU would.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._errors import UnsupportedOpError
from ._keepalive import torch_fft_seen

__all__ = ["CaptureGuard", "UNCAPTURABLE_OPS"]

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

    The sim backend captures under it; the cuda backend runs its first warm-up under it
    (see the module docstring). Library calls it passes are told to `graphify._keepalive`,
    which keeps what their graphs will launch alive."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        torch_fft_seen(name, args)
        why = UNCAPTURABLE_OPS.get(name)
        if why is None and _device_to_host(name, args, kwargs):
            why = "copies a CUDA tensor to the host (.cpu(), .tolist(), .numpy())"
        if why is not None:
            raise UnsupportedOpError(
                f"op {name} {why}{_caller()}, which a CUDA graph cannot capture; keep it out of the graphified "
                "function, or make it a split op (split(fn, ops)) so it runs eagerly"
            )
        return func(*args, **(kwargs or {}))


LIBRARY_PACKAGES = frozenset({"graphify", "torch", "cupy", "cupyx", "cupy_backends", "numpy"})


def library_frame(frame) -> bool:
    """Whether `frame` runs code of torch, CuPy, NumPy or graphify: found by module name,
    not by folder (a user's checkout may sit in a folder named graphify)."""
    module = frame.f_globals.get("__name__") or ""
    return module.split(".", 1)[0] in LIBRARY_PACKAGES or frame.f_code.co_filename.startswith("<frozen")


def _caller() -> str:
    """' at file:line in function' of the innermost frame outside the libraries: the code
    that made the call (a model's forward)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if not library_frame(frame):
            return f" at {frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""
