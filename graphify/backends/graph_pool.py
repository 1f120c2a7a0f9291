"""A Pool's graph pool id, for backends whose allocator counts graphs per id (torch's).

torch frees a graph pool once the last graph captured into it is gone: its device and its
pinned-host caching allocators count the graphs of each id, and at zero mark the pool
releasable until their next `empty_cache`. A capture into an id in that state fails an
internal assert (`CachingHostAllocator.h`: `use_count > 0`) and leaves the CUDA RNG in
capture mode, so every later capture in the process fails too. That happens whenever a Pool
outlives all its graphs and captures again: a structure dropped and captured anew (a second
`generate()` of T5), or a first capture that failed and is tried again. Such a capture takes
a fresh id instead: no live graph shares the old one's memory, so nothing is lost. So does
a capture after one that raised inside the capture (`GraphPool.unended`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["GraphPool"]


class GraphPool:
    """The id captures go into (`for_capture()`), renewed when every graph captured into
    it is gone, or after a capture into it raised (`unended()`); `holds(graph)` counts a
    graph captured into it while it lives."""

    def __init__(self, new_id: Callable[[], Any]):
        self._new_id = new_id
        self.id = new_id()
        self.live = 0  # live graphs of `id`
        self.used = False  # a capture has begun with `id` (it may have failed: torch counted it)
        self._spoilt = False  # a capture into `id` raised after it began
        self._lock = threading.RLock()  # `_gone` may run inside `for_capture` (a collection)

    def for_capture(self) -> Any:
        with self._lock:
            if self.used and (self.live == 0 or self._spoilt):
                self.id, self.live, self._spoilt = self._new_id(), 0, False
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

    def holds(self, graph: Any, pool_id: Any) -> None:
        """`graph`, captured into `pool_id`, counted while it lives (against that id only)."""
        with self._lock:
            self.live += pool_id == self.id
        weakref.finalize(graph, self._gone, pool_id)

    def _gone(self, pool_id) -> None:
        with self._lock:
            if pool_id == self.id:
                self.live -= 1

    def __repr__(self) -> str:
        return f"GraphPool(id={self.id!r}, live graphs={self.live})"
