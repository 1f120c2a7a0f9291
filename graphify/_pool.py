"""Explicit graph memory pools, shareable across sizes and across graphified functions."""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch

__all__ = ["Pool", "PoolReport"]

MiB = 1 << 20


@attrs.frozen
class PoolReport:
    """Bytes a pool holds: per live graph (reserved while capturing it) and in total."""

    name: str
    device: str | None
    per_graph: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.per_graph)

    def __str__(self) -> str:
        lines = [f"pool {self.name!r} on {self.device}: {len(self.per_graph)} graphs, {self.total_bytes / MiB:.1f} MiB"]
        lines += [f"  {label:<40} {b / MiB:9.2f} MiB" for label, b in self.per_graph]
        return "\n".join(lines)


@attrs.define(eq=False)
class Pool:
    """A memory pool for captured graphs.

    Pass one `Pool` to several `graphify` calls (a draft and a target model, say) and their
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
    _backend: str | None = attrs.field(default=None, init=False)
    _device: torch.device | None = attrs.field(default=None, init=False)
    _graphs: "weakref.WeakKeyDictionary" = attrs.field(factory=weakref.WeakKeyDictionary, init=False, repr=False)

    def handle_for(self, backend, device: torch.device, call: str):
        """The backend's pool handle, created on first use; one pool serves one device."""
        if self._handle is None:
            self._handle = backend.new_pool_handle(device)
            self._backend, self._device = backend.name, device
        elif (self._backend, self._device) != (backend.name, device):
            raise ValueError(
                f"{call}: pool {self.name!r} belongs to backend {self._backend!r} on {self._device}, "
                f"not {backend.name!r} on {device}; use one Pool per device and backend"
            )
        return self._handle

    def track(self, owner: Any, label: str, nbytes: int) -> None:
        """Count `nbytes` against this pool while `owner` (a captured entry) lives."""
        self._graphs[owner] = (label, nbytes)

    def report(self) -> PoolReport:
        rows = tuple(sorted(self._graphs.values(), key=lambda r: -r[1]))
        return PoolReport(self.name, None if self._device is None else str(self._device), rows)
