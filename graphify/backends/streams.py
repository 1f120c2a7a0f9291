"""Stream interop between torch and CuPy, so one function may mix their kernels.

Both libraries name a CUDA stream by its raw pointer; these helpers wrap a pointer of one
library as a stream object of the other (cached: the wrappers own nothing). Pointer 0 is
the legacy default stream in both.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch

__all__ = ["torch_stream_for", "cupy_stream_for", "cupy_follows_torch", "caller_cupy_stream"]

_TORCH: dict[tuple[int, int], "torch.cuda.Stream"] = {}
_CUPY: dict[tuple[int, int], object] = {}


def torch_stream_for(ptr: int, index: int) -> "torch.cuda.Stream":
    """The torch stream over raw stream `ptr` on device `index`."""
    stream = _TORCH.get((ptr, index))
    if stream is None:
        stream = torch.cuda.default_stream(index) if ptr == 0 else torch.cuda.ExternalStream(ptr, device=index)
        _TORCH[ptr, index] = stream
    return stream


class _Handle:
    """A raw stream pointer speaking the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def cupy_stream_for(ptr: int, index: int):
    """The CuPy stream over raw stream `ptr` on device `index`."""
    import cupy as cp

    stream = _CUPY.get((ptr, index))
    if stream is None:
        with cp.cuda.Device(index):
            if ptr == 0:
                stream = cp.cuda.Stream.null
            elif hasattr(cp.cuda.Stream, "from_external"):
                stream = cp.cuda.Stream.from_external(_Handle(ptr))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stream = cp.cuda.ExternalStream(ptr, index)
        _CUPY[ptr, index] = stream
    return stream


def _torch_malloc(cp, index: int):
    """A CuPy allocator that takes memory from torch's caching allocator, so CuPy
    allocations inside a torch graph capture land in that graph's pool."""

    def malloc(size: int):
        block = torch.empty((size,), dtype=torch.uint8, device=index)
        return cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(block.data_ptr(), size, block, index), 0)

    return malloc


@contextlib.contextmanager
def cupy_follows_torch(stream: "torch.cuda.Stream", index: int):
    """While torch captures on `stream`: CuPy launches on it too and allocates from torch.
    A no-op where CuPy was never imported (no function can have used it)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        yield
        return
    with cp.cuda.Device(index), cupy_stream_for(stream.cuda_stream, index), cp.cuda.using_allocator(_torch_malloc(cp, index)):
        yield


def caller_cupy_stream():
    """Torch's current stream set to the caller's current CuPy stream, for one call."""
    import cupy as cp

    index = torch.cuda.current_device()
    return torch.cuda.stream(torch_stream_for(cp.cuda.get_current_stream().ptr, index))
