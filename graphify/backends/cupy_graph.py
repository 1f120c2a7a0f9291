"""CuPy graphs: functions of CuPy arrays captured by CuPy stream capture.

Warm-up and capture run on one dedicated non-blocking CuPy stream per device, with every
CuPy allocation served by the graphify `Pool`'s own `cupy.cuda.MemoryPool`: memory a graph
uses is never handed to eager code, and the pool's `total_bytes()` is the graph memory.
Replay launches the graph on the caller's current CuPy stream. CuPy will not run cuBLAS
during a capture (its `setStream` refuses), so a CuPy graph holds elementwise, reduction
and custom kernels; matrix products go through torch and the `cuda` backend. Torch's current stream
follows the CuPy stream inside capture, so the DLPack views graphify makes (torch <-> CuPy)
never insert a cross-stream wait into the graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from graphify.base.errors import CaptureError, UnsupportedOpError
from graphify.base.interop import module
from graphify.backends.interface import Captured
from graphify.backends.streams import torch_stream_for

__all__ = ["CupyBackend"]

_CAPTURE_STREAMS: dict[int, object] = {}

CUBLAS_ADVICE = (
    "CuPy refuses to call cuBLAS (matmul, dot, tensordot, einsum, linalg) while a stream is captured, "
    "so a CuPy graph cannot hold them: do the matrix products with torch (torch.from_dlpack / "
    "cupy.from_dlpack views cost nothing) and capture with Options(backend='cuda'), whose graphs hold cuBLAS "
    "and the CuPy kernels alike"
)


def _index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else 0


class CupyBackend:
    """Real CUDA graphs through `cupy.cuda.Stream.begin_capture` / `cupy.cuda.Graph`."""

    name = "cupy"
    trim_frees_live_graphs = True  # free_all_blocks returns the blocks live graphs work in (`Pool.trim`)

    def validate(self, label: str, device: torch.device) -> None:
        try:
            cp = module("cupy")
        except ImportError as exc:
            raise CaptureError(f"{label}: backend='cupy' {exc}") from None
        if cp.cuda.runtime.getDeviceCount() < 1 or device is None or device.type != "cuda":
            raise CaptureError(
                f"{label}: backend='cupy' captures CuPy arrays on a CUDA GPU, but the example arguments "
                f"are on {device}; pass CuPy arrays, or NumPy arrays with Options(backend='sim')"
            )

    def new_pool_handle(self, device: torch.device):
        cp = module("cupy")
        with cp.cuda.Device(_index(device)):
            return cp.cuda.MemoryPool()

    def new_stream(self, device: torch.device):
        cp = module("cupy")
        index = _index(device)
        stream = _CAPTURE_STREAMS.get(index)
        if stream is None:
            with cp.cuda.Device(index):
                stream = _CAPTURE_STREAMS[index] = cp.cuda.Stream(non_blocking=True)
        return stream

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A static buffer in CuPy memory, seen as a torch tensor."""
        cp = module("cupy")
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        with cp.cuda.Device(_index(device)):
            raw = cp.empty(max(nbytes, 1), dtype=cp.uint8)
        return torch.from_dlpack(raw)[:nbytes].view(dtype).view(shape)

    def usage(self, handle) -> tuple[int, int]:
        """(reserved, in use) bytes of a pool handle, from CuPy's own counters."""
        return handle.total_bytes(), handle.used_bytes()

    def trim(self, handle, device) -> None:
        handle.free_all_blocks()

    def capture(
        self, fn: Callable, args: tuple, *, pool, warmups: int, weak_outputs: bool, stream=None, guard: bool = True,
        keeper=None,
    ) -> Captured:
        """CuPy kernels are invisible to torch's dispatcher, so `keeper` cannot see their
        writes: a CuPy function that writes outside arrays in place keeps its warm-ups'
        writes (documented)."""
        cp = module("cupy")
        index = torch.cuda.current_device()
        stream = stream if stream is not None else self.new_stream(index)
        torch.cuda.synchronize(index)  # static buffers were written on the caller's stream
        follow = torch.cuda.stream(torch_stream_for(stream.ptr, index))
        before = pool.total_bytes()  # warm-up growth counts too: the pool keeps it for the graph
        with cp.cuda.Device(index), stream, follow, cp.cuda.using_allocator(pool.malloc):
            for _ in range(max(warmups, 1)):
                fn(*args)
            stream.synchronize()
            stream.begin_capture()
            try:
                outputs = fn(*args)
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    stream.end_capture()
                if isinstance(exc, NotImplementedError) and "cuBLAS" in str(exc):
                    raise UnsupportedOpError(CUBLAS_ADVICE) from exc
                raise
            graph = stream.end_capture()
            stream.synchronize()
            nbytes = pool.total_bytes() - before

        def replay() -> None:
            graph.launch(cp.cuda.get_current_stream())

        return Captured(replay, graph, outputs, nbytes)
