"""A CUDA graph's capture run, and what a capture CUDA refuses to end leaves behind.

CUDA invalidates a capture when something inside it cannot be captured (a host sync, a side
stream left unjoined), and `cudaStreamEndCapture` then fails. torch 2.11's `capture_end` raises
right there, before it ends the allocators' routing of the capture's pool id; its `reset`
gives the pool no use back either (pytorch#190348). So the id stays routed, and any later
capture into it fails "beginAllocateToPool: already recording to mempool_id". Whatever fails
after `capture_begin`, the pool captures into a fresh id from then on (`GraphPool.unended`).
Where torch 2.11 left the device allocator's routing in place (the capture over, its stream no
longer capturing), it is ended here. The pinned-host allocator's routing has no binding; its
filter reads the graph object, so that object is kept for the life of the process (a few
hundred bytes a failed capture). Newer torch ends the routing before it raises; in which
release that changed is not checked, so routing is ended here on torch before 2.12 only. On a
later torch that still left it, the stale device routing stays (the fresh id keeps captures
working); ending routing torch itself will end would throw in the graph's destructor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["record"]

_ENDS_ROUTING_FIRST = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)
_UNENDED: list = []  # graphs whose capture CUDA refused to end, on a torch that left them routed


def record(graph, pool, pool_id, run: Callable[[], Any]) -> Any:
    """`run()` captured into `graph`, in `pool`'s id `pool_id`, on the current stream."""
    graph.capture_begin(pool=pool_id, capture_error_mode="thread_local")
    try:
        result = run()
    except BaseException:
        pool.unended()
        try:
            graph.capture_end()
        except Exception:  # invalidated: the run's own error is the one reported
            _left_routed(graph, pool_id)
        raise
    try:
        graph.capture_end()
    except BaseException:
        pool.unended()
        _left_routed(graph, pool_id)
        raise
    return result


def _left_routed(graph, pool_id) -> None:
    if _ENDS_ROUTING_FIRST or torch.cuda.is_current_stream_capturing():
        return  # ended by torch, or the capture is not over (its own error says why)
    with contextlib.suppress(Exception):  # "not currently recording": torch ended it after all
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool_id)
    _UNENDED.append(graph)
