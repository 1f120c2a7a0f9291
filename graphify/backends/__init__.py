"""Capture backends: the only code that records and replays graphs.

- `cuda`: torch CUDA graphs (`torch.cuda.CUDAGraph`) in an explicit memory pool.
- `sim`: a CPU simulation with the same semantics (static buffers, outputs overwritten in
  place on every replay, persistent storage checked, uncapturable ops rejected), so the
  whole of graphify runs in tests without a GPU.
"""

from __future__ import annotations

from ._base import Backend, Captured
from .sim import SimBackend
from .torch_cuda import TorchCudaBackend

__all__ = ["Backend", "Captured", "SimBackend", "TorchCudaBackend", "get_backend", "BACKENDS"]

BACKENDS = {"cuda": TorchCudaBackend(), "sim": SimBackend()}


def get_backend(name: str, device) -> Backend:
    """The backend named `name`; "auto" picks cuda for CUDA tensors and sim otherwise."""
    if name == "auto":
        name = "cuda" if device is not None and device.type == "cuda" else "sim"
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid backends are 'auto', {', '.join(map(repr, BACKENDS))}") from None
