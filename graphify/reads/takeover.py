"""A new object of known shapes takes over the memory a graph reads.

transformers makes a new StaticCache in every `generate()`. Its tensors have the shapes of
the last one's, but other addresses, so a graph captured over the last cache cannot read
them. Instead of capturing again, the new cache's tensors are copied into the memory the
graph reads (the last cache's, which nothing else holds any more) and the new cache is
pointed at that memory: its values unchanged, the graph's addresses right.

Only when it is safe: the two objects look alike to the last detail (`skeleton`: types,
plain values, every tensor's shape, strides, dtype, device, offset and which tensors share
storage); no one but graphify holds the old tensors (their reference counts are what they
were right after capture, `owners`, and no view shares their memory); and the new tensors
are held by their container alone. Otherwise first use captures for the new object.
"""

from __future__ import annotations

import sys

import torch

from graphify.base.alias import held_count
from graphify.reads.reach import Reach, has_address, read_edge
from graphify.reads.snapshot import set_attr

__all__ = ["skeleton", "owners", "can_take_over", "take_over"]

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
_OWN_REFS = 3  # references a Reach holds to each addressed tensor: its edge list, `tensors`, `_addressed`


def skeleton(reach: Reach) -> tuple:
    """What `reach` looks like apart from object identity: per edge its path and the value's
    type (objects), value (plain values) or metadata (tensors, with which share storage)."""
    groups: dict = {}
    tensors = []
    for t, (_, _, _, path) in zip(reach.tensors, reach.tensor_edges()):
        storage = t.untyped_storage().data_ptr() if has_address(t) else ("no storage", id(t))
        group = groups.setdefault(storage, len(groups))
        tensors.append((path, tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(), group))
    paths, values = reach.object_edges()
    objects = tuple((p, type(v)) for p, v in zip(paths, values))
    plain = tuple(zip(*reach.plain_edges()))
    sized = tuple(zip(reach.sized.paths, reach.sized.values))
    return objects, plain, tuple(tensors), sized, reach.truncated


def owners(reach: Reach) -> tuple[int, ...]:
    """References to each tensor now (taken right after capture: the containers that hold
    it and graphify's own); a larger count later means someone else kept it."""
    return tuple(sys.getrefcount(t) for t in reach.tensors)


def can_take_over(home: Reach, counts: tuple[int, ...], new: Reach) -> bool:
    """Whether `new` (a new object's reach) may take over
    `home`'s tensors; `counts` are `owners(home)` as taken after its last capture."""
    if _storage_use_count is None or home.truncated or new.truncated or skeleton(home) != skeleton(new):
        return False
    if owners(home) != counts or not all(has_address(t) and _sole_storage(t) for t in home.tensors):
        return False
    for holder, key, attr, _ in new.tensor_edges():
        t = read_edge(holder, key, attr)  # references: its container, `t`, `new`'s own, getrefcount's argument
        if sys.getrefcount(t) != 2 + _OWN_REFS + 1 or not _sole_storage(t):
            return False
    return True


def take_over(home: Reach, new: Reach) -> None:
    """Copy `new`'s tensors into `home`'s (the memory the graphs read) and point `new`'s
    containers at them; check `can_take_over` first. `new` is stale afterwards."""
    homes = home.tensors
    with torch.no_grad():
        torch._foreach_copy_(list(homes), list(new.tensors))
    for i, (holder, key, attr, _) in enumerate(new.tensor_edges()):
        if attr:
            set_attr(holder, key, homes[i])
        else:
            holder[key] = homes[i]


def _sole_storage(t: torch.Tensor) -> bool:
    """No other tensor (a view) shares `t`'s memory: one tensor impl, plus the temporary
    storage object this check makes (and the views a simulated graph holds, as a device
    graph holds the address)."""
    storage = t.untyped_storage()
    return _storage_use_count(storage._cdata) == 2 + held_count(storage.data_ptr())
