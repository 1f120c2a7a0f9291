"""Warm-ups that allocate from the graph's own pool, as torch.compile's graph trees warm up.

A warm-up runs the function eagerly on the capture stream before its capture. Left to the
caching allocator's default pool, what it allocated stays cached on that stream once freed:
about a warm-up's peak (56 MiB for ResNet-50 at B = 1 in bf16) held beyond the graph's own
pool, reusable only by eager code on a stream nobody else uses. Routed to the graph's pool,
those blocks are the ones the capture then takes: one peak, not two.

torch routes a thread's allocations to a private pool between `beginAllocate...ToPool`
(which counts a use of the pool, creating it if new) and `endAllocateToPool`; the count is
given back by `releasePool`. `into(pool_id, device)` holds that count from the warm-ups
until the caller is done with the capture (`release()`), so the pool cannot become
releasable between them (a capture into a releasable id fails an internal assert; see
`graph_pool`). torch's allocator takes the first routing that matches an allocation, so a
capture that starts while another one's warm-ups route this thread (a graphified function
called by the function warming up) first stops that routing (`outside()`), and restores it
after: its own memory goes to its own pool.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["Routing", "NoRouting", "routes", "outside", "routed_pools"]

_routes = threading.local()  # this thread's routings, innermost last: [(device, pool id), ...]


def _stack() -> list:
    stack = getattr(_routes, "stack", None)
    if stack is None:
        stack = _routes.stack = []
    return stack


def routed_pools() -> tuple:
    """(device, pool id) of the routings under way on this thread, outermost first."""
    return tuple(_stack())


class Routing:
    """One capture's hold on its pool: `warm_ups()` routes this thread's allocations there;
    `release()` gives back the use counted when it was made (idempotent)."""

    def __init__(self, device: int, pool_id):
        self.device, self.pool_id = device, pool_id
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool_id)  # counts a use of the pool
        torch._C._cuda_endAllocateToPool(device, pool_id)  # routed only inside warm_ups()
        self._held = True

    @contextlib.contextmanager
    def warm_ups(self):
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device, self.pool_id)
        torch._C._cuda_releasePool(self.device, self.pool_id)  # that begin counted a second use
        _stack().append((self.device, self.pool_id))
        try:
            yield
        finally:
            _stack().pop()
            torch._C._cuda_endAllocateToPool(self.device, self.pool_id)

    def release(self) -> None:
        if self._held:
            self._held = False
            torch._C._cuda_releasePool(self.device, self.pool_id)


class NoRouting:
    """Warm-ups left to the default pool: `Routing`'s interface, doing nothing."""

    def warm_ups(self):
        return contextlib.nullcontext()

    def release(self) -> None:
        pass


def routes(warmups: int, live: int) -> bool:
    """Whether a capture's `warmups` warm-ups route into its pool: only where none of the
    pool's `live` graphs replays there. Between its replays a graph's intermediates are free
    blocks of its pool, and a tensor a warm-up keeps (a cache's buffer, a lazily made table)
    could be given one and be overwritten by that graph's next replay."""
    return warmups > 0 and live == 0


@contextlib.contextmanager
def outside():
    """No routing of an enclosing warm-up on this thread while inside (restored after)."""
    stack = _stack()
    if not stack:
        yield
        return
    device, pool_id = stack[-1]
    torch._C._cuda_endAllocateToPool(device, pool_id)
    saved = stack[:]
    stack.clear()
    try:
        yield
    finally:
        stack[:] = saved
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool_id)
        torch._C._cuda_releasePool(device, pool_id)  # the outer routing already counts its use
