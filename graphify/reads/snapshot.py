"""Put back the Python state a capture's runs changed in the objects a graph reads.

Warm-ups and captures run the function, and a run may rebind what a static object holds
(transformers' DynamicCache replaces its tensors with `torch.cat`) or bump a Python
counter. `Snapshot.take(reach)` keeps a shallow copy of every container a `Reach` walked
and the recorded value of every edge; `restore()` puts them back, so capture leaves the
objects as it found it. The attributes registered types own (`graphify.reads.stateful_types`),
which every run changes, are put back after every capture (`restore_owned`). Tensors'
contents are `graphify.backends.tensor_writes`'s job.
"""

from __future__ import annotations

import types
from operator import is_

from graphify.reads.reach import Reach, read_edge, stored_items
from graphify.reads.stateful_types import owned_values, put_owned

__all__ = ["Snapshot", "set_attr"]

class Snapshot:
    """The references and plain values under a `Reach`, as recorded; see the module doc."""

    def __init__(self, reach: Reach, containers: list, owned: list):
        self.reach = reach
        self.containers = containers  # (container, shallow copy)
        self.owned = owned  # (object, attribute names, their values) of registered types

    @classmethod
    def take(cls, reach: Reach) -> "Snapshot":
        """Copy what `reach` walked, now (right after the walk, before any run)."""
        copies = [(c, list.copy(c) if isinstance(c, list) else dict(stored_items(c))) for c in reach.sized.holders]
        owned = [(obj, st.owns, owned_values(obj, st.owns)) for obj, st, _ in reach.stateful]
        return cls(reach, copies, owned)

    def restore_owned(self) -> None:
        """Put back the attributes registered types own, as they were when taken."""
        put_owned(self.owned)

    def restore(self) -> None:
        """Put back every reference and plain value recorded (containers to their recorded
        items, attributes and cells to their recorded values)."""
        for container, snap in self.containers:
            if isinstance(container, list):
                if len(container) != len(snap) or not all(map(is_, container, snap)):
                    container[:] = snap
            elif len(container) != len(snap) or any(k not in container or read_edge(container, k, False) is not v
                                                    for k, v in snap.items()):
                container.clear()
                container.update(snap)
        for edges in self.reach.all_edges():
            for holder, key, value, _ in edges:
                if edges.attr:
                    _put_back(holder, key, value)
                elif isinstance(holder, dict) and (key not in holder or read_edge(holder, key, False) is not value):
                    owner = self.reach.classes.get(id(holder))
                    if owner is not None:  # a class's dict: through the class, so its method cache hears of it
                        setattr(owner, key, value)
                    else:
                        holder[key] = value  # items of globals dicts (not snapshotted)


def _put_back(holder, key: str, value) -> None:
    try:
        if getattr(holder, key) is not value:
            set_attr(holder, key, value)
    except (AttributeError, TypeError, ValueError):
        pass


def set_attr(holder, key: str, value) -> None:
    """Set an attribute past any custom __setattr__ (closure cells take plain setattr)."""
    if isinstance(holder, types.CellType):
        holder.cell_contents = value
    else:
        object.__setattr__(holder, key, value)
