"""torch CUDA graphs: warm up and capture on one side stream, into an explicit pool.
Replay is `CUDAGraph.replay()` on the caller's current stream."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from .._errors import CaptureError
from ._base import Captured
from .sim import CaptureGuard

__all__ = ["TorchCudaBackend", "weak_alias"]

_CAPTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def weak_alias(t):
    """A tensor over `t`'s memory that does not keep that memory alive.

    After capture, the pool may hand an output's block to the next (smaller) capture, so
    all sizes share the largest one's memory; the graph still writes its output there on
    replay. Non-tensors pass through.
    """
    if not isinstance(t, torch.Tensor):
        return t
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


class TorchCudaBackend:
    """Real CUDA graphs through `torch.cuda.CUDAGraph`."""

    name = "cuda"

    def validate(self, call: str, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise CaptureError(
                f"{call}: backend='cuda' needs a CUDA GPU, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); pass backend='sim' to run the same capture and replay "
                "semantics on the CPU"
            )
        if device is None or device.type != "cuda":
            raise CaptureError(
                f"{call}: backend='cuda' captures CUDA tensors, but the example arguments are on {device}; "
                "move them to a CUDA device or pass backend='sim'"
            )

    def new_pool_handle(self, device: torch.device):
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    def new_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The side stream every warm-up and capture on `device` uses. cuBLAS keeps a
        workspace per stream for the life of the process: a fresh stream per graph would
        put one in every graph's pool, and one per table would never give it back."""
        index = torch.device(device).index or 0
        stream = _CAPTURE_STREAMS.get(index)
        if stream is None:
            stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
        return stream

    def capture(
        self, fn: Callable, args: tuple, *, pool, warmups: int, weak_outputs: bool, stream=None, guard: bool = True
    ) -> Captured:
        device = torch.cuda.current_device()
        stream = stream if stream is not None else self.new_stream(device)
        # Warm-up and capture share one stream so per-stream workspaces (cuBLAS) exist
        # before capture (vLLM #53818). The first warm-up runs under the op guard.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            with CaptureGuard() if guard else contextlib.nullcontext():
                fn(*args)
            for _ in range(warmups - 1):
                fn(*args)
        stream.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs = fn(*args)
        nbytes = torch.cuda.memory_reserved(device) - before
        if weak_outputs:
            outputs = pytree.tree_map(weak_alias, outputs)
        return Captured(graph.replay, graph, outputs, nbytes)
