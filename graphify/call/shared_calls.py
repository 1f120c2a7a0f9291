"""What the runtimes of graphs that share one pool share, so that their replays never meet.

Graphs captured into one pool reuse the blocks earlier captures freed: one graph's
intermediates and static outputs are another's. That is right while their calls come one
after another, each replay and the copy of its outputs done before the next replay starts.
Two threads calling two such runtimes could enqueue `[B replay][A replay][B copy]` (B hands
out A's numbers), and calls on two CUDA streams would overlap on the device. So such
runtimes hold one lock around copy → replay → hand-out, and a replay on another stream than
the last one first makes its stream wait for that one (a stream's pointer compared per call,
the wait only where it changed).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["SharedCalls"]


class SharedCalls:
    """One lock and one stream order for every runtime whose graphs share a pool."""

    def __init__(self):
        self.lock = threading.RLock()  # a capture holds it while another branch of its structure replays
        self._last = None  # (raw stream pointer, stream) of the last replay on CUDA

    def order(self, device_index: int) -> None:
        """On CUDA, with the lock held before a replay: wait for the last replay's stream
        where this one runs on another."""
        raw = torch._C._cuda_getCurrentRawStream(device_index)
        last = self._last
        if last is not None and last[0] == raw:
            return
        current = torch.cuda.current_stream(device_index)
        if last is not None:
            current.wait_stream(last[1])
        self._last = (raw, current)
