"""What the runtimes of graphs that share one pool share, so that their replays never meet.

Graphs captured into one pool reuse the blocks earlier captures freed: one graph's
intermediates and static outputs are another's. That is right while their calls come one
after another, each replay and the copy of its outputs done before the next replay starts.
Two threads calling two such runtimes could enqueue `[B replay][A replay][B copy]` (B hands
out A's numbers), and calls on two CUDA streams would overlap on the device. So such
runtimes hold one lock around copy → replay → hand-out, and a replay on another stream than
the last one first makes its stream wait for an event graphify recorded after the last
hand-out: an event outlives its stream (a caller's CuPy or external stream, made per request
and destroyed), a stream object may not. A stream's raw pointer, compared per call, only
tells whether the stream changed; the wait is made only where it did. (CUDA gives a
destroyed stream's handle back only once its work is done, so a new stream at the same
pointer is ordered after it.) Captures into the pool take their own lock, one at a time,
so the calls of other structures go on during a capture's warm-ups and compiles; the window
from `capture_begin` to `capture_end` holds the call lock (`window`): torch puts its random
generators in capture mode there, where a replay on another thread raises ("Offset increment
outside graph capture") or reads the seed and offset the capture's start rewrites. A split
function's capture holds it throughout (its split ops and piece warm-ups run in the pool).
A function that, inside a capture, waits for another thread calling this callable deadlocks.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["SharedCalls"]

# the CUDA primitives `SharedCalls` uses, as names a CPU test can stand in for
_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None
_current_stream = torch.cuda.current_stream
_new_event = torch.cuda.Event
_capturing = torch.cuda.is_current_stream_capturing


class SharedCalls:
    """One call lock, one capture lock and (on CUDA `device`) one stream order for every
    runtime whose graphs share a pool (a runtime of its own graphs makes one of its own).
    Lock order: `captures`, a runtime's own lock (`Runtime.own`), `lock`."""

    def __init__(self, device: "torch.device | None" = None):
        self.cuda = device is not None and device.type == "cuda"  # a stream order to keep
        self.index = (device.index or 0) if self.cuda else None
        self.lock = threading.RLock()  # calls: copy → replay → hand-out (a split function's capture: throughout)
        self.captures = threading.RLock()  # one capture into the pool at a time (one capture stream a device)
        self._raw = None  # raw pointer of the stream the last work in the pool was ordered on
        self._stream = None  # torch's object for it: used only while that pointer is the current stream's
        self._event = None  # graphify's event, recorded after the last hand-out (`mark`)

    def order(self) -> None:
        """On CUDA, with `lock` held before work in the pool (a replay, a capture): where the
        current stream is not the last one's, it waits for the last hand-out's event."""
        raw = _raw_stream(self.index)
        if raw == self._raw:
            return
        stream = _current_stream(self.index)
        if self._event is not None:
            stream.wait_event(self._event)
        self._raw, self._stream = raw, stream

    @contextlib.contextmanager
    def window(self):
        """Held around a capture into the pool, from its begin to its end, on the capture
        stream: no call replays meanwhile, and the capture stream's work (the generators'
        seed and offset written at its start) is ordered after the last call and before the next."""
        with self.lock:
            if self.cuda:
                self.order()
            try:
                yield
            finally:
                if self.cuda:
                    self.mark()

    def mark(self) -> None:
        """On CUDA, with `lock` held after a hand-out (on the stream `order` saw): record the
        event the next call on another stream waits for. Not inside another graph's capture:
        the event would be one a stream outside it cannot wait on."""
        if _capturing():
            return
        self.order()  # where the stream changed since `order` (a call nested in the lock holder's capture)
        event = self._event
        if event is None:
            event = self._event = _new_event()
        event.record(self._stream)
