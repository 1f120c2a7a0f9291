"""Tensors over the same memory as another, on a storage object of their own.

Used for weak outputs (a later capture may reuse the memory; the alias does not keep it
alive) and for checked views (poisoning the alias's storage leaves the graph's own alone).
`held_alias` is the simulation's: a view that keeps the memory a simulated graph reads, as
the device keeps a graph's addresses, counted (`held_count`) so that takeover's check that
nothing else shares a tensor's memory can leave them out.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["alias", "alias_maker", "metadata", "held_alias", "held_count"]

_FROM_METADATA = getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None)


def metadata(t) -> dict | None:
    """What `alias` needs of a tensor, computed once (None: not a tensor)."""
    if not isinstance(t, torch.Tensor):
        return None
    storage = t.untyped_storage()
    return {"nbytes": storage.nbytes(), "data_ptr": storage.data_ptr(), "size": t.shape, "stride": t.stride(),
            "dtype": t.dtype, "device": t.device, "storage_offset": t.storage_offset()}


def alias(t: torch.Tensor, meta: dict) -> torch.Tensor:
    """`t` over a storage object of its own (same memory), so poisoning it leaves `t` alone.
    Built in C++ from precomputed metadata where torch offers it (as its CUDA graph trees do)."""
    storage = torch._C._construct_storage_from_data_pointer(meta["data_ptr"], meta["device"], meta["nbytes"])
    if _FROM_METADATA is not None and meta["device"].type == "cuda":
        return _FROM_METADATA(meta, storage)
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def alias_maker(t: torch.Tensor):
    """A function that returns a fresh `alias(t, ...)` per call, with everything but the
    two constructor calls done once (checked views make one per output per call)."""
    meta = metadata(t)
    if _FROM_METADATA is None or meta["device"].type != "cuda":
        return lambda: alias(t, meta)
    from_ptr, from_meta = torch._C._construct_storage_from_data_pointer, _FROM_METADATA
    ptr, device, nbytes = meta["data_ptr"], meta["device"], meta["nbytes"]
    return lambda: from_meta(meta, from_ptr(ptr, device, nbytes))


_held: dict[int, int] = {}  # storage address -> views the simulation holds of it


def held_alias(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s memory as it is now (the same storage, whatever later becomes of `t`)."""
    view = t.detach()
    ptr = t.untyped_storage().data_ptr()
    _held[ptr] = _held.get(ptr, 0) + 1
    weakref.finalize(view, _release, ptr)
    return view


def _release(ptr: int) -> None:
    left = _held.get(ptr, 0) - 1
    if left > 0:
        _held[ptr] = left
    else:
        _held.pop(ptr, None)


def held_count(storage_ptr: int) -> int:
    """How many `held_alias` views of the storage at this address exist."""
    return _held.get(storage_ptr, 0)
