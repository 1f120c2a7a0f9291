"""Capture backends: the only code that records and replays graphs.

- `cuda`: torch CUDA graphs (`torch.cuda.CUDAGraph`) in an explicit memory pool.
- `cupy`: CuPy stream capture into `cupy.cuda.Graph`, CuPy memory pools (CuPy imported
  only when used).
- `sim`: a CPU simulation with the same semantics (static buffers, outputs overwritten in
  place on every replay, persistent storage checked, uncapturable ops rejected), so the
  whole of graphify runs in tests without a GPU.
"""

from __future__ import annotations

from graphify.base.options import BACKEND_NAMES
from graphify.backends.interface import Backend, Captured
from graphify.backends.cupy_graph import CupyBackend
from graphify.backends.sim import SimBackend
from graphify.backends.torch_cuda import TorchCudaBackend

__all__ = ["Backend", "Captured", "CupyBackend", "SimBackend", "TorchCudaBackend", "get_backend", "BACKENDS"]

BACKENDS = {"cuda": TorchCudaBackend(), "cupy": CupyBackend(), "sim": SimBackend()}
assert tuple(BACKENDS) == BACKEND_NAMES  # what `Options(backend=...)` validates against
_SIM_RERUN = SimBackend(rerun=True)  # NumPy functions: no ATen ops to tape (graphify.backends.sim)


def get_backend(name: str, device, library: str | None = None) -> Backend:
    """The backend named `name`; "auto" picks cupy for CuPy arrays, cuda for CUDA tensors
    and sim otherwise."""
    if name == "auto":
        name = "cupy" if library == "cupy" else "cuda" if device is not None and device.type == "cuda" else "sim"
    elif name == "cupy" and library != "cupy":
        raise ValueError(
            "backend='cupy' captures functions of CuPy arrays; for torch tensors (or functions mixing "
            "torch and CuPy kernels on torch tensors) use Options(backend='cuda')"
        )
    if name == "sim" and library is not None:
        return _SIM_RERUN
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid backends are 'auto', {', '.join(map(repr, BACKENDS))}") from None
