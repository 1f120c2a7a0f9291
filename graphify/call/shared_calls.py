"""What the runtimes of graphs that share one pool share, so that their replays never meet.

Graphs captured into one pool reuse the blocks earlier captures freed: one graph's
intermediates and static outputs are another's. That is right while their calls come one
after another, each replay and the copy of its outputs done before the next replay starts.
Two threads calling two such runtimes could enqueue `[B replay][A replay][B copy]` (B hands
out A's numbers), and calls on two CUDA streams would overlap on the device. So such
runtimes hold one lock around copy → replay → hand-out, and a replay on another stream than
the last one first makes its stream wait for the last one's work:
- on a stream torch owns (its default and pool streams, never destroyed), by `wait_stream`;
- on one it does not (an ExternalStream: a caller's CuPy stream, made per request and
  destroyed) or the per-thread default stream (handle 2, `cudaStreamPerThread`: a different
  stream on each thread under one handle), by an event graphify records after each hand-out
  there: an event outlives its stream. Every call on such a stream waits for it: CUDA gives
  a new stream the pointer of one destroyed (a request's CuPy stream, made after the last
  one's call), so a pointer seen before may name a stream not ordered after that call.
On torch's own streams the raw pointer, compared per call, tells whether the stream changed. A call inside
another graph's capture neither waits nor moves the order (a wait on an event recorded
outside the capture would invalidate it; what it records runs only when that graph does).
Captures into the pool take their own lock, one at a time. The call lock is held through a
capture's warm-ups where they put back state outside the call (tensors written outside it,
registered types' Python state, the random generators: `restores`), which would undo the
writes of other structures' calls meanwhile; a callable's captures hold it until one has
shown that they restore nothing, and a split function's throughout (its split ops and piece
warm-ups run in the pool). Otherwise other structures' calls go on during the warm-ups and
compiles, and the window from `capture_begin` to `capture_end` holds the call lock
(`window`): torch puts its random generators in capture mode there, where a replay on
another thread raises ("Offset increment outside graph capture") or reads the seed and
offset the capture's start rewrites. Eager calls (`Runtime._eager`, first use's) run the
function outside the call lock. A function that, inside a capture, waits for another thread
calling this callable deadlocks.
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
# handles that name another stream on each thread: cudaStreamPerThread. Not 0: torch's wheels
# launch on it as the legacy default stream (one for all threads), and CuPy's per-thread mode
# (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM) hands out handle 2; code compiled with
# `--default-stream per-thread` launching on 0 would need 0 added here
_PER_THREAD = frozenset({2})


class SharedCalls:
    """One call lock, one capture lock and (on CUDA `device`) one stream order for every
    runtime whose graphs share a pool (a runtime of its own graphs makes one of its own).
    Lock order: `captures`, a runtime's own lock (`Runtime.own`), `lock`."""

    def __init__(self, device: "torch.device | None" = None):
        self.cuda = device is not None and device.type == "cuda"  # a stream order to keep
        self.index = (device.index or 0) if self.cuda else None
        self.lock = threading.RLock()  # calls: copy → replay → hand-out (some captures: throughout)
        self.captures = threading.RLock()  # one capture into the pool at a time (one capture stream a device)
        # whether captures put back state outside the call (None: no capture has shown it yet; then
        # and where True, they hold `lock` through their warm-ups)
        self.restores: "bool | None" = None
        self._raw = None  # raw pointer of the stream the last work in the pool was ordered on
        self._stream = None  # torch's object for it: waited on only where torch owns that stream
        self._evented = False  # that stream may be destroyed or is per-thread: it is followed by `_event`
        self._event = None  # graphify's event, recorded on such a stream after its last hand-out (`mark`)

    def order(self) -> None:
        """On CUDA, with `lock` held before work in the pool (a replay, a capture): where the
        current stream is not the last one's, it waits for the last one's work (see the module
        docstring); not inside another graph's capture."""
        raw = _raw_stream(self.index)
        if raw == self._raw and not self._evented:  # a stream torch owns, never destroyed: the same one
            return
        if _capturing():  # it runs nothing now; the order stays where the last work ran
            return
        stream, last, evented = _current_stream(self.index), self._stream, self._evented
        if evented:
            if self._event is not None:
                stream.wait_event(self._event)
        elif last is not None:
            stream.wait_stream(last)
        # an external stream's id is its pointer (c10's CUDAStream); torch's own are encoded, or 0
        self._raw, self._stream = raw, stream
        self._evented = raw in _PER_THREAD or (raw != 0 and stream.stream_id == raw)
        if self._evented and last is not None and not evented:  # the event now follows it: from
            self._record()  # what it waited for (the torch stream's work), not a record before that

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
                    self.mark(moved=True)

    def mark(self, moved: bool = False) -> None:
        """On CUDA, with `lock` held after a hand-out on the stream `order` saw (`moved`: the
        current stream may be another, as at a capture's end): where that stream is followed
        by the event, record it. Not inside another graph's capture: the event would be one a
        stream outside it cannot wait on."""
        if moved:
            self.order()
        if self._evented and not _capturing():
            self._record()

    def _record(self) -> None:
        event = self._event
        if event is None:
            event = self._event = _new_event()
        event.record(self._stream)
