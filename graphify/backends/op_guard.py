"""The op guard: ops a CUDA graph cannot capture, rejected before CUDA sees them.

A capture that CUDA invalidates (a host sync inside it) leaves torch's allocator and RNG
in capture state for the rest of the process, so the first warm-up of a capture runs under
`CaptureGuard`, a dispatch mode that raises `UnsupportedOpError` naming the op instead. The
simulation backend captures under it too, so CPU tests reject what a GPU would.

Every read of a device tensor's values by the host is a copy to the host on a GPU, but the
dispatch mode does not see them all: `repr(t)` turns dispatch modes off before it copies,
and on the simulation, whose tensors already live on the host, `.tolist()`, `.numpy()`,
`np.asarray(t)` and `.cpu()` dispatch no op at all. So `HostReadGuard`, a function mode,
rejects those Tensor methods themselves on a device tensor (a CUDA tensor; while the
simulation captures, `simulating()`, any tensor), with the same error on either.
(`.item()`, `bool(t)`, `int(t)` and formatting dispatch `aten::_local_scalar_dense`, which
the op guard refuses.)
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphify.base.errors import UnsupportedOpError
from graphify.backends.keepalive import torch_fft_seen

__all__ = ["CaptureGuard", "HostReadGuard", "UNCAPTURABLE_OPS", "first_run_guards", "simulating"]

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


# Tensor methods that read a tensor's values on the host (on a GPU: a copy to the host) and
# dispatch no op on the CPU (`.item()`, `bool(t)`, `int(t)`, formatting dispatch one: the op guard sees them)
_HOST_READS = {"tolist": ".tolist()", "numpy": ".numpy()", "__array__": "np.asarray(t)", "cpu": ".cpu()",
               "__repr__": "repr(t) or print(t)", "__str__": "str(t) or print(t)"}
_READERS = {getattr(torch.Tensor, name): what for name, what in _HOST_READS.items()}
_to = torch.Tensor.to


def _host_read(func, args, kwargs) -> str | None:
    """What `func(*args, **kwargs)` reads on the host, if it is a host read of a tensor's values."""
    if func is _to:  # `.to("cpu")` names the host; `.to(x.device)` on the simulation is no read
        target = (kwargs or {}).get("device", args[1] if len(args) > 1 else None)
        return '.to("cpu")' if isinstance(target, str) and target.split(":")[0] == "cpu" else None
    return _READERS.get(func)


_local = threading.local()


@contextlib.contextmanager
def simulating():
    """While inside, on this thread, captures run on the simulation: its tensors stand for a
    GPU's, and a host read of their values is refused as a GPU's copy would be."""
    before = getattr(_local, "simulating", False)
    _local.simulating = True
    try:
        yield
    finally:
        _local.simulating = before


class HostReadGuard(TorchFunctionMode):
    """Raise `UnsupportedOpError` on a Tensor method that reads values on the host (the
    simulation's stand-in for a GPU's copy to the host; see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _host_read(func, args, kwargs)
        if what is not None and args and isinstance(args[0], torch.Tensor) and _on_device(args[0]):
            kind = "a CUDA" if args[0].is_cuda else "a device"  # (the simulation's tensors stand for a GPU's)
            raise UnsupportedOpError(
                f"{what} copies {kind} tensor to the host (a read of its values){_caller()}, which a CUDA "
                "graph cannot capture (a replay would keep the values read at capture); keep it out of the "
                "graphified function, or make it a split op (split(fn, ops)) so it runs eagerly"
            )
        return func(*args, **(kwargs or {}))


def _on_device(t: torch.Tensor) -> bool:
    """Whether `t` stands for device memory: a GPU's tensor, or any tensor the simulation captures over."""
    kind = t.device.type
    return kind not in ("cpu", "meta") or (kind == "cpu" and getattr(_local, "simulating", False))


@contextlib.contextmanager
def first_run_guards():
    """The guards a capture's first run is under: the op guard and the host-read guard."""
    with CaptureGuard(), HostReadGuard():
        yield


class CaptureGuard(TorchDispatchMode):
    """Raise `UnsupportedOpError` on the first op that a CUDA graph could not capture.

    The sim backend captures under it; the cuda backend runs its first warm-up under it
    (see the module docstring). Library calls it passes are told to `graphify.backends.keepalive`,
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
