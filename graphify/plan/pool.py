"""Explicit graph memory pools, shareable across sizes and across graphified functions."""

from __future__ import annotations

import threading
from collections.abc import Callable
import weakref
from typing import Any

import attrs
import torch

from graphify.base.call_layout import fn_name

__all__ = ["Pool", "PoolReport", "PoolsByDevice"]

MiB = 1 << 20


@attrs.frozen
class PoolReport:
    """Bytes a pool holds: per live graph (what the pool grew by while capturing it), and
    in total as the allocator itself counts them: `reserved_bytes` (memory the pool holds
    from the device) and `used_bytes` (of that, in live blocks: outputs, kept buffers).
    Without an allocator to ask (the sim backend) both are the per-graph sum."""

    name: str
    backend: str | None
    device: str | None
    per_graph: tuple[tuple[str, int], ...]
    reserved_bytes: int
    used_bytes: int

    @property
    def total_bytes(self) -> int:
        """What the live graphs grew the pool by, summed."""
        return sum(b for _, b in self.per_graph)

    def __str__(self) -> str:
        lines = [
            f"pool {self.name!r} ({self.backend} on {self.device}): {len(self.per_graph)} graphs, "
            f"{self.reserved_bytes / MiB:.1f} MiB reserved, {self.used_bytes / MiB:.1f} MiB in use"
        ]
        lines += [f"  {label:<40} {b / MiB:9.2f} MiB" for label, b in self.per_graph]
        return "\n".join(lines)


@attrs.define(eq=False)
class Pool:
    """A memory pool for captured graphs.

    The pool's memory comes from the backend's allocator: a torch graph pool (`cuda`),
    a `cupy.cuda.MemoryPool` of its own (`cupy`). Pass one `Pool` to several `graphify` calls (a draft and a target model, say) and their
    graphs share memory. Sharing means their replays must not overlap in time (each
    replay may overwrite memory another graph's outputs live in), as in a serving loop
    that runs one model at a time. The memory returns when the last graph using it is
    dropped.

    !!! example
        >>> shared = Pool("decode")
        >>> # graphify(draft, mode="FULL", pool=shared); graphify(target, mode="FULL", pool=shared)
    """

    name: str = "pool"
    _handle: Any = attrs.field(default=None, init=False, repr=False)
    _backend: Any = attrs.field(default=None, init=False, repr=False)
    _device: torch.device | None = attrs.field(default=None, init=False)
    _graphs: "weakref.WeakKeyDictionary" = attrs.field(factory=weakref.WeakKeyDictionary, init=False, repr=False)
    # what the runtimes of its graphs share where graphify made it for a callable's structures
    # (`PoolsByDevice`: `graphify.call.shared_calls.SharedCalls`); None for a user's Pool
    shared: Any = attrs.field(default=None, init=False, repr=False)

    def handle_for(self, backend, device: torch.device, label: str):
        """The backend's pool handle, created on first use; one pool serves one device."""
        if self._handle is None:
            self._handle = backend.new_pool_handle(device)
            self._backend, self._device = backend, device
            if self.shared is not None:  # its captures' window holds off the calls sharing it
                self._handle.window = self.shared.window
        elif (self._backend.name, self._device) != (backend.name, device):
            raise ValueError(
                f"{label}: pool {self.name!r} belongs to backend {self._backend.name!r} on {self._device}, "
                f"not {backend.name!r} on {device}; use one Pool per device and backend"
            )
        return self._handle

    def track(self, owner: Any, label: str, nbytes: int) -> None:
        """Count `nbytes` against this pool while `owner` (a captured entry) lives."""
        self._graphs[owner] = (label, nbytes)

    def trim(self) -> None:
        """Give the pool's free cached blocks back to the device (memory of released or
        dropped graphs). Live graphs keep theirs: where the backend's allocator cannot tell
        their working memory (freed after capture, written on every replay) from free
        blocks (CuPy's `free_all_blocks`), nothing is given back while one lives."""
        if self._handle is None or (self._graphs and self._backend.trim_frees_live_graphs):
            return
        self._backend.trim(self._handle, self._device)

    def report(self) -> PoolReport:
        rows = tuple(sorted(self._graphs.values(), key=lambda r: -r[1]))
        if self._handle is None:
            return PoolReport(self.name, None, None, rows, 0, 0)
        usage = self._backend.usage(self._handle)
        if usage is None:
            captured = sum(b for _, b in rows)
            usage = (captured, captured)
        return PoolReport(self.name, self._backend.name, str(self._device), rows, *usage)


class PoolsByDevice:
    """One `Pool` per device for the call structures of one callable captured on first use
    (torch's CUDA graphs and the simulation), so that its graphs hold the largest structure's
    memory, not the sum (BERT at 40 request shapes holds 5 structures). Their runtimes share
    the pool's `shared` (`make_shared(device)`: one lock around copy, replay and hand-out, one stream
    order), so no replay meets another's in the blocks they share, and calls hand out copies.
    Not for a callable handing out views (a view of one structure's output stays valid across
    another structure's call), nor CuPy's pools (a pool per structure, as before)."""

    def __init__(self, name: str, make_shared: Callable[[Any], Any]):
        self.name, self.make_shared = name, make_shared
        self._pools: dict = {}
        self._lock = threading.Lock()

    @classmethod
    def for_spec(cls, spec, make_shared: Callable[[Any], Any]) -> "PoolsByDevice | None":
        """A first-use callable's pools; None where the user gave a `Pool` or outputs are views."""
        return cls(fn_name(spec.fn), make_shared) if spec.pool is None and spec.options.outputs == "copy" else None

    def __call__(self, backend, device) -> Pool:
        if backend.name == "cupy":
            return Pool(self.name)
        with self._lock:
            pool = self._pools.get((backend.name, device))
            if pool is None:
                pool = self._pools[(backend.name, device)] = Pool(self.name)
                pool.shared = self.make_shared(device)
            return pool
