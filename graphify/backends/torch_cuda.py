"""torch CUDA graphs: warm up and capture on one side stream, into an explicit pool.
Replay is `CUDAGraph.replay()` on the caller's current stream."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from graphify.base.alias import alias, metadata
from graphify.base.errors import CaptureError
from graphify.backends.capture_run import record
from graphify.backends.pool_routing import NoRouting, Routing, outside, routes
from graphify.backends.keepalive import clear_cublas_workspaces
from graphify.backends.tensor_writes import eager_runs
from graphify.backends.interface import Captured, CompiledCode
from graphify.backends.graph_pool import GraphPool
from graphify.backends.streams import cupy_follows_torch

__all__ = ["TorchCudaBackend", "weak_alias"]

log = logging.getLogger("graphify")

_CAPTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def weak_alias(t):
    """A tensor over `t`'s memory that does not keep that memory alive.

    After capture, the pool may hand an output's block to the next (smaller) capture, so
    all sizes share the largest one's memory; the graph still writes its output there on
    replay. Non-tensors pass through.
    """
    if not isinstance(t, torch.Tensor):
        return t
    return alias(t, metadata(t))


class TorchCudaBackend:
    """Real CUDA graphs through `torch.cuda.CUDAGraph`."""

    name = "cuda"
    trim_frees_live_graphs = False  # torch frees no block of a pool whose graphs live (`Pool.trim`)

    def validate(self, label: str, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise CaptureError(
                f"{label}: backend='cuda' needs a CUDA GPU, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); pass Options(backend='sim') to run the same capture and replay "
                "semantics on the CPU"
            )
        if device is None or device.type != "cuda":
            raise CaptureError(
                f"{label}: backend='cuda' captures CUDA tensors, but the example arguments are on {device}; "
                "move them to a CUDA device or pass Options(backend='sim')"
            )

    def new_pool_handle(self, device: torch.device) -> GraphPool:
        def new_id():
            with torch.cuda.device(device):
                return torch.cuda.graph_pool_handle()

        return GraphPool(new_id)

    def new_stream(self, device: torch.device) -> "torch.cuda.Stream":
        """The side stream every warm-up and capture on `device` uses. cuBLAS keeps a
        workspace per stream for the life of the process: a fresh stream per graph would
        put one in every graph's pool, and one per table would never give it back."""
        index = torch.device(device).index or 0
        stream = _CAPTURE_STREAMS.get(index)
        if stream is None:
            stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
        return stream

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def usage(self, handle) -> tuple[int, int]:
        """(reserved, in use) bytes of the pool `handle`, from the caching allocator's own
        segment table (the segments torch assigned to that pool)."""
        reserved = used = 0
        for seg in torch.cuda.memory._snapshot()["segments"]:
            if tuple(seg.get("segment_pool_id", ())) == tuple(handle.id):
                reserved += seg["total_size"]
                used += seg["allocated_size"]
        return reserved, used

    def trim(self, handle, device) -> None:
        """The allocator's free cached blocks given back. torch before pytorch#180395 leaves an
        invalidated capture registered with its allocator, and every later `empty_cache`
        then fails an internal assert: trimming is a saving only, so that is logged."""
        try:
            torch.cuda.empty_cache()
        except RuntimeError as exc:
            log.info("empty_cache failed after an invalidated capture (torch %s): %s", torch.__version__, exc)

    def capture(
        self, fn: Callable, args: tuple, *, pool, warmups: int, weak_outputs: bool, stream=None,
        guard: "bool | Callable" = True, keeper=None,
    ) -> Captured:
        device = torch.cuda.current_device()
        stream = stream if stream is not None else self.new_stream(device)
        # Warm-up and capture share one stream so per-stream workspaces (cuBLAS) exist
        # before capture (vLLM #53818). The first warm-up runs under the op guard; every
        # warm-up's in-place writes to outside state are undone after it (`keeper`).
        # CuPy kernels in `fn` follow the capture stream and allocate from torch.
        # `warmups=0` captures straight away (the caller warmed this code up already).
        stream.wait_stream(torch.cuda.current_stream(device))
        # An enclosing capture's warm-ups (a graphified function called by the function warming
        # up) route this thread's allocations to their pool: not this capture's (`graphify.backends.pool_routing`).
        with outside():
            return self._warm_and_capture(fn, args, pool, warmups, weak_outputs, stream, (guard, keeper))

    def _warm_and_capture(self, fn, args, pool, warmups, weak_outputs, stream, checks) -> Captured:
        """Warm-ups, then the capture. Where no live graph replays into the pool, the warm-ups
        allocate from it and the capture reuses their blocks: one peak, not a warm-up's cache
        beside the pool (`pool_routing.routes`); they then run inside the capture's window
        and its id, held until the capture holds its own (captures are one at a time, so no
        graph of the pool appears meanwhile). Otherwise they run first, outside the window:
        other graphs' calls sharing the pool go on meanwhile (`graphify.call.shared_calls`)."""
        device = torch.cuda.current_device()
        routed = routes(warmups, pool.live)
        if warmups and not routed:
            self._warm_ups(fn, args, warmups, stream, device, checks, NoRouting())
        # (`capturing`: inside the pool's window, where other graphs' calls share the pool none
        # replays through the capture and the capture stream is ordered after the last; then a
        # fresh id where every graph of the last one is gone)
        with torch.cuda.stream(stream), pool.capturing() as pool_id:
            before = self.usage(pool)[0]
            routing = Routing(device, pool_id) if routed else NoRouting()
            try:
                if routed:
                    self._warm_ups(fn, args, warmups, stream, device, checks, routing)
                return self._capture(fn, args, pool, pool_id, before, weak_outputs, stream, device)
            finally:
                routing.release()

    @staticmethod
    def _warm_ups(fn, args, warmups, stream, device, checks, routing) -> None:
        with torch.cuda.stream(stream), cupy_follows_torch(stream, device), routing.warm_ups():
            eager_runs(fn, args, keeper=checks[1], guard=checks[0], count=warmups)
        stream.synchronize()  # the warm-ups' frees settle before the capture allocates

    def _capture(self, fn, args, pool, pool_id, before, weak_outputs, stream, device) -> Captured:
        graph = torch.cuda.CUDAGraph()
        # Not `torch.cuda.graph(...)`: its __enter__ synchronises the device and empties the
        # allocator's cache before every capture, which costs more than a small capture and
        # makes the next warm-up allocate afresh; the stream was synchronised above.
        # cuBLAS keeps one workspace per (handle, stream) in a table of torch's that anyone may
        # clear (torch.compile's graph trees do, around each recording): dropped here, the
        # capture allocates its own inside the graph's pool, where a later clear cannot hand
        # it to eager code (graphify.backends.keepalive).
        clear_cublas_workspaces()
        # compiled code must not see a mode of ours: dynamo would compile it again, inside the capture
        staged = StagedConstants() if not isinstance(fn, CompiledCode) else contextlib.nullcontext(StagedConstants())

        def run():
            with staged as constants:
                return fn(*args), constants

        with cupy_follows_torch(stream, device):
            outputs, constants = record(graph, pool, pool_id, run)
        # what this capture grew the pool by, from the pool's own segments: capture_begin
        # itself may allocate outside it (torch's RNG seed and offset tensors for graphs,
        # made when the first live graph registers, kept in the default pool)
        nbytes = self.usage(pool)[0] - before
        pool.holds(graph, pool_id)
        graph.graphify_constants = constants.kept  # the host memory its copies read, for as long as it lives
        if weak_outputs:
            outputs = pytree.tree_map(weak_alias, outputs)
        return Captured(graph.replay, graph, outputs, nbytes)


_FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)


class StagedConstants(TorchFunctionMode):
    """While a graph captures: a CUDA tensor made from Python data (transformers' sliding
    cache builds `torch.tensor([-1], device=...)` every step) is a copy from pageable host
    memory, which stream capture refuses. Made in pinned host memory and copied
    asynchronously instead, the copy is a node of the graph that reads that memory on every
    replay; `kept` holds it, and the graph holds `kept`."""

    def __init__(self):
        super().__init__()
        self.kept: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in _FROM_DATA and args and not isinstance(args[0], torch.Tensor) and device is not None \
                and torch.device(device).type == "cuda":
            host = func(*args, **{**kwargs, "device": "cpu"}).pin_memory()
            out = torch.empty_like(host, device=device)
            out.copy_(host, non_blocking=True)
            self.kept.append(host)
            return out
        return func(*args, **kwargs)

