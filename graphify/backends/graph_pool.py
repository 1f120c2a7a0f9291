"""A Pool's graph pool id, for backends whose allocator counts graphs per id (torch's).

torch frees a graph pool once the last graph captured into it is gone: its device and its
pinned-host caching allocators count the graphs of each id, and at zero mark the pool
releasable until their next `empty_cache`. A capture into an id in that state fails an
internal assert (`CachingHostAllocator.h`: `use_count > 0`) and leaves the CUDA RNG in
capture mode, so every later capture in the process fails too. That happens whenever a Pool
outlives all its graphs and captures again: a structure dropped and captured anew (a second
`generate()` of T5), or a first capture that failed and is tried again. Such a capture takes
a fresh id instead: no live graph shares the old one's memory, so nothing is lost.

A capture that began and never ended (invalidated: a host sync, the most common first-use
failure) may pin its id's pool for the life of the process: torch's `CUDAGraph::reset` gave
a pool's use back only for a capture that ended, until pytorch#190348. torch 2.11's
`capture_end` also raises before it ends the allocators' routing to the id, so a later
capture into it fails ("already recording to mempool_id"). Later captures take a fresh id
(`GraphPool.unended`): the graphs of the pinned one keep their memory, and the pool is split
in two (its peak the sum of both working sets) only after such a failure. On a torch before
#190348 the pinned id's memory stays reserved, as large as it grew, until the process exits
(the simulation mirrors both).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["GraphPool"]


class GraphPool:
    """The id captures go into (`for_capture()`), renewed when every graph captured into
    it is gone; `holds(graph)` counts a graph captured into it while it lives."""

    def __init__(self, new_id: Callable[[], Any]):
        self._new_id = new_id
        self.id = new_id()
        self.live = 0
        self.used = False  # a capture has begun with `id` (it may have failed: torch counted it)
        self._spoilt = False  # a capture into `id` raised after it began
        self._graphs: "weakref.WeakSet" = weakref.WeakSet()  # the live graphs of `id`
        self._lock = threading.RLock()  # `_gone` may run inside `for_capture` (a collection)
        # what a capture into it holds first (`capturing()`), where other graphs' calls share the
        # pool (`graphify.call.shared_calls.SharedCalls.window`: their lock, and the stream order)
        self.window: Callable[[], Any] = contextlib.nullcontext

    def for_capture(self) -> Any:
        with self._lock:
            if self.used and (self.live == 0 or self._spoilt or self._any_graph() is None):
                # counts are per id: a graph of the last one still to be finalised is not this one's
                self.id, self.live, self._graphs, self._spoilt = self._new_id(), 0, weakref.WeakSet(), False
            self.used = True
            return self.id

    def unended(self) -> None:
        """A capture into `id` raised after it began. Where CUDA refuses to end it (an
        invalidated capture: a host sync inside it), torch's `capture_end` raises before it
        ends the allocators' routing to the id (torch 2.11), and every later capture into
        that id fails ("already recording to mempool_id"), silently after the first
        warning. Later captures take a fresh id; the graphs of this one keep theirs."""
        with self._lock:
            self._spoilt = True

    def _any_graph(self) -> Any:
        """A strong reference to one live graph of `id`, or None."""
        return next(iter(self._graphs), None)

    @contextlib.contextmanager
    def capturing(self):
        """`for_capture()`'s id inside the pool's `window`, held until the capture into it is
        counted (`holds`): no other thread's drop of that id's last graph in between, which
        would leave torch a capture into a released id (graphs of several call structures
        share a pool)."""
        with self.window(), self._lock:
            # a graph of the id kept alive until this capture counts: torch releases a dropped
            # graph's use of its pool in its C++ destructor, before any finalizer of ours runs
            keep = self._any_graph()  # noqa: F841 (held, not read)
            yield self.for_capture()
            del keep

    def holds(self, graph: Any, pool_id: Any) -> None:
        """`graph`, captured into `pool_id`, counted while it lives (against that id only)."""
        with self._lock:
            if pool_id == self.id:
                self.live += 1
                self._graphs.add(graph)
            weakref.finalize(graph, self._gone, pool_id)

    def _gone(self, pool_id) -> None:
        with self._lock:
            if pool_id == self.id:
                self.live -= 1

    def __repr__(self) -> str:
        return f"GraphPool(id={self.id!r}, live graphs={self.live})"
