"""What a graph reads without copying it in, recorded at capture and checked before replays.

A graph reads memory by address and bakes in what Python decided at capture: which kernels
run, with which numbers. Batch-axis arguments are copied into static buffers and persistent
tensors are checked by address, but everything else a call reads is reached from the
function and its static arguments: a transformers cache's tensors, a closure's weight or
scale factor, a model reached through a global or a list, its parameters per slot, its
`training` flag and float attributes, its hooks and the global ones, the globals of every
function and method the call runs, the classes whose methods run. If any of it changes
after capture, a replay would be wrong with no error.

`Reach.walk(roots)` walks those objects and keeps every edge it took: identity for objects
and tensors, equality for plain values, lengths for lists and dicts, and each tensor's
address and shape. Two depths:

- *shallow* (static arguments, such as a cache, which change Python state as they are
  used): attributes, slots, list and dict items; modules, functions and classes met are
  handed off (`handoff`) to the deep walk;
- *deep* (`deep=True`: the function, its modules, everything it reaches): also each
  function's closure cells, the globals and module attributes its bytecode names (and the
  functions those are, recursively, torch's own read by identity), its defaults; each
  object's class dicts along the MRO (a monkeypatched method), the methods walked code
  names; and modules like any other object, through their `__dict__` (parameters, buffers,
  submodules, hooks, `training`, plain attributes).

`changed()` compares every edge (a few C-level passes), `describe()` names the first path
that differs, `first_change()` says what a run changed. `graphify.reads.watch` turns a deep walk
into a per-call check of a microsecond or two. A walk that meets more than it may record
(`Limits`' walk_items in one container, walk_edges in all, walk_depth levels) sets `truncated`:
graphs over it do not replay, since a change past the limit would go unseen.

Putting back what a capture's runs changed is `graphify.reads.snapshot`; a new object of the
same shapes taking over a graph's memory is `graphify.reads.takeover`; the facts about code the
deep walk uses are `graphify.reads.code_names`.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import attrgetter, getitem, is_
from typing import Any

import torch

from graphify.reads.stateful_types import adapters_of_imported, any_registered
from graphify.base.limits import Limits
from graphify.reads.walk import PLAIN_CONTAINERS, Walk, stored_item, stored_items

__all__ = ["Reach", "Edges", "has_address", "read_edge", "stateful_in", "stored_items"]

_data_ptr = torch.Tensor.data_ptr
_shape = attrgetter("shape")
_stride = torch.Tensor.stride

class Edges:
    """Parallel lists of one kind of edge: holder, key, expected value, path. `attr`: the
    edges are attributes (read with getattr), else items (getitem)."""

    __slots__ = ("holders", "keys", "values", "paths", "attr", "raw")

    def __init__(self, attr: bool):
        self.holders, self.keys, self.values, self.paths = [], [], [], []
        self.attr = attr
        self.raw = False  # some holder's class reads items its own way: read them as stored

    def add(self, holder, key, value, path) -> None:
        self.holders.append(holder)
        self.keys.append(key)
        self.values.append(value)
        self.paths.append(path)
        if not self.attr and type(holder) not in PLAIN_CONTAINERS:
            self.raw = True

    def now(self) -> list:
        """What each edge reads now (raises if one is gone)."""
        return list(map(getattr if self.attr else (stored_item if self.raw else getitem), self.holders, self.keys))

    def __iter__(self) -> Iterator[tuple]:
        return zip(self.holders, self.keys, self.values, self.paths)

    def __len__(self) -> int:
        return len(self.holders)


class Reach:
    """Everything reachable from some roots that a graph may read; see the module doc."""

    def __init__(self, lengths: bool = True, plains_are_effects: bool = False):
        self.objects = (Edges(attr=False), Edges(attr=True))  # edges to objects: identity
        self.plains = (Edges(attr=False), Edges(attr=True))  # edges to plain values: equality
        self.tensor_items = (Edges(attr=False), Edges(attr=True))  # edges to tensors: identity, address, shape
        self.sized = Edges(attr=False)  # lists and dicts walked (holders), with their lengths (values)
        self.lengths = lengths  # whether containers must keep their length
        # plain values are side effects (`Options(side_effects="at_capture")`): calls need not see them as recorded
        self.plains_are_effects = plains_are_effects
        self.truncated: str | None = None  # what the walk could not record (a limit it met), if anything
        # (object, its `graphify.reads.stateful_types.StateType`, path): Python state graphs follow by branch,
        # the attributes it owns left out of the edges
        self.stateful: list = []
        self.handoff: list = []  # (path, object): modules, functions and classes a shallow walk left to a deep one
        self.functions: list = []  # (function, path) whose code, defaults and closure a deep walk read
        self.classes: dict = {}  # id(class dict) -> class, for the class dicts a deep walk read
        self.tensors: tuple = ()  # every tensor, in `tensor_edges()` order
        # (tensors with an address that means something, their addresses and strides, every tensor's shape)
        self._where: tuple = ((), (), [], [])
        self._index: dict = {}  # id(edge list) -> {id(holder): edge indices}, for `describe(within=...)`
        self.walker = None  # the `Walk` that recorded it, to go on with (`extend`)

    # -- recording ------------------------------------------------------------------------
    @classmethod
    def walk(cls, roots: dict[str, Any], *, lengths: bool = True, plains_are_effects: bool = False,
             deep: bool = False, skip: tuple = (), ran=None, limits: Limits | None = None) -> "Reach":
        """Walk `roots` ({name: object}); objects compared by value are not roots.
        `lengths`: check that lists and dicts keep their length. `plains_are_effects`:
        `changed()` ignores plain values (counters a function keeps as side effects);
        `first_change()` does not. `deep`: see the module doc. `skip`: objects another walk
        covers (a deep walk leaves the static arguments to their own), read by identity.
        `ran` (deep): the code the call was seen running (`graphify.reads.code_ran.CodeRan`): the
        functions met whose code ran, and the root functions, are walked, and every global
        the code that ran looks up is an edge."""
        reach = cls(lengths, plains_are_effects)
        walker = Walk(reach, deep, ran, skip, limits if limits is not None else Limits())
        walker.run(roots)
        walker.reach = None  # no cycle: a reach of a cache must go when its last reference does
        reach.walker = walker if deep else None
        reach._recorded()
        return reach

    def extend(self, ran) -> None:
        """Record what code seen running since the walk reads (`Walk.extend`), in place."""
        self.walker.reach = self
        try:
            self.walker.extend(ran)
        finally:
            self.walker.reach = None
        self._index = {}
        self._recorded()

    def _recorded(self) -> None:
        """What the checks compare tensors against, from the edges recorded."""
        self.tensors = tuple(t for edges in self.tensor_items for t in edges.values)
        # addresses of strided tensors with storage (sparse tensors and DTensors have none: their
        # identity and shape are checked)
        addressed = tuple(t for t in self.tensors if has_address(t))
        shapes: dict = {}  # one object per distinct shape: fewer objects for the per-call check to read
        self._where = (addressed, tuple(map(_data_ptr, addressed)), [shapes.setdefault(s, s) for s in map(_shape, self.tensors)],
                       list(map(_stride, addressed)))

    def edges(self) -> int:
        return sum(len(e) for group in (self.objects, self.plains, self.tensor_items) for e in group)

    def __bool__(self) -> bool:
        return self.edges() > 0 or bool(self.sized)

    # -- what was recorded, for `graphify.reads.takeover` and `graphify.reads.snapshot` ---------------
    def tensor_edges(self) -> Iterator[tuple]:
        """(holder, key, is_attribute, path) of every edge to a tensor, in `tensors` order."""
        for edges in self.tensor_items:  # never binding the tensor: `graphify.reads.takeover` counts references
            for holder, key, path in zip(edges.holders, edges.keys, edges.paths):
                yield holder, key, edges.attr, path

    def object_edges(self) -> tuple[list, list]:
        """(paths, values) of every edge to an object."""
        a, b = self.objects
        return a.paths + b.paths, a.values + b.values

    def plain_edges(self) -> tuple[list, list]:
        """(paths, values) of every edge to a plain value."""
        a, b = self.plains
        return a.paths + b.paths, a.values + b.values

    def all_edges(self) -> Iterator[Edges]:
        yield from self.objects
        yield from self.plains
        yield from self.tensor_items

    # -- the per-call check -----------------------------------------------------------------
    def changed(self, *, plains: bool | None = None) -> bool:
        """Whether anything differs from the record: a few C-level passes, no allocation
        per edge beyond the lists `map` fills. `plains`: whether plain values count (default:
        unless they are side effects)."""
        try:
            for edges in self.objects + self.tensor_items:
                if not all(map(is_, edges.now(), edges.values)):
                    return True
            for edges in self.plains if (not self.plains_are_effects if plains is None else plains) else ():
                if edges.now() != edges.values:  # list equality: the very objects pass without __eq__
                    return True
        except (KeyError, IndexError, AttributeError, ValueError, TypeError):
            return True
        if list(map(len, self.sized.holders)) != self.sized.values:
            return True
        addressed, ptrs, shapes, strides = self._where
        # (the same address with other strides reads other elements: `p.data = p.data.t()`)
        return tuple(map(_data_ptr, addressed)) != ptrs or list(map(_shape, self.tensors)) != shapes \
            or list(map(_stride, addressed)) != strides

    def describe(self, within: set | None = None, plains: bool = True) -> str | None:
        """The first path that differs from the record, as 'path: what changed'; None if none.
        `within`: only the edges and lengths of these holders (ids), tensors' addresses left
        out; `plains`: whether plain values count."""
        checks = [(e, is_) for e in self.objects + self.tensor_items] + [(e, _equal) for e in self.plains if plains]
        names = self.walker.names if self.walker is not None else None
        attribute_dicts = {id(h) for h, kind in zip(self.sized.holders, self.sized.keys) if kind == "__dict__"} \
            if names is not None else set()
        for edges, same in checks:
            for holder, key, value, path in (edges if within is None else self._edges_of(edges, within)):
                if id(holder) in attribute_dicts and key not in names:
                    continue  # an attribute no code that ran names (transformers' generate() sets some on the model)
                try:
                    now = read_edge(holder, key, edges.attr)
                except Exception:
                    return f"{path}: gone (was {_show(value)})"
                if not same(now, value):
                    return f"{path}: {_show(value)} -> {_show(now)}"
        for container, kind, n, path in (self.sized if within is None else self._edges_of(self.sized, within)):
            if len(container) != n:
                added = self._added_keys(container)
                if id(container) in attribute_dicts and not any(k in names for k in added):
                    continue  # attributes added that no code that ran names
                shown = f" (added: {', '.join(map(repr, added[:3]))})" if added else ""
                return f"{path}: {n} entries -> {len(container)}{shown}"
        if within is not None:
            return None
        addressed, addresses, shapes, strides = self._where
        layouts = dict(zip(map(id, addressed), zip(addresses, strides)))
        for t, shape, (_, _, _, path) in zip(self.tensors, shapes, self.tensor_edges()):
            ptr, stride = layouts.get(id(t), (None, None))
            if ptr is not None and t.data_ptr() != ptr:
                return f"{path}: new storage under the same tensor ({ptr:#x} -> {t.data_ptr():#x})"
            if t.shape != shape:
                return f"{path}: shape changed in place ({tuple(shape)} -> {tuple(t.shape)})"
            if stride is not None and t.stride() != stride:
                return (f"{path}: strides changed over the same storage ({stride} -> {t.stride()}, "
                        f"offset {t.storage_offset()})")
        return None

    def _edges_of(self, edges: Edges, within: set) -> list:
        """`edges`' (holder, key, value, path) for holders whose id is in `within`, through an
        index by holder made on first use."""
        index = self._index.get(id(edges))
        if index is None:
            index = self._index[id(edges)] = {}
            for i, holder in enumerate(edges.holders):
                index.setdefault(id(holder), []).append(i)
        return [(edges.holders[i], edges.keys[i], edges.values[i], edges.paths[i])
                for h in within for i in index.get(h, ())]

    def _added_keys(self, container) -> list:
        """The keys a dict gained since the walk ([] for a list)."""
        if not isinstance(container, dict):
            return []
        known = {k for edges in self.all_edges() if not edges.attr for h, k in zip(edges.holders, edges.keys)
                 if h is container}
        return [k for k in container if k not in known and not (isinstance(k, str) and k.startswith("__"))]

    def first_change(self) -> tuple[str, bool] | None:
        """(description, whether a tensor was replaced) of what differs now, or None.
        A replaced tensor is state a graph cannot follow at all (a growing cache); a changed
        plain value is a Python counter the graph would freeze."""
        if not self.changed(plains=True):
            return None
        what = self.describe()
        if what is None:
            return None
        return what, self._tensor_replaced()

    def _tensor_replaced(self) -> bool:
        """Whether a tensor recorded is no longer where it was: its edge reads another, or an
        object holding tensors (a tuple of a quantized cache's tensors) was replaced."""
        if any(read_edge(holder, key, attr) is not t for t, (holder, key, attr, _) in zip(self.tensors, self.tensor_edges())):
            return True
        holding = {id(holder) for edges in self.tensor_items for holder in edges.holders}
        for edges in self.objects:
            for holder, key, value, _ in edges:
                if id(value) in holding and _reads_other(holder, key, edges.attr, value):
                    return True
        return False


def _reads_other(holder, key, attr: bool, value) -> bool:
    try:
        return read_edge(holder, key, attr) is not value
    except Exception:
        return True


def stateful_in(objects: dict) -> tuple:
    """(object, StateType, path) of every registered type (`graphify.reads.stateful_types`) the
    static `objects` reach, their library's adapters imported first; () when none is."""
    if not objects:
        return ()
    adapters_of_imported()
    return tuple(Reach.walk(objects).stateful) if any_registered() else ()


def read_edge(holder, key, attr: bool):
    """What an edge reads now."""
    return getattr(holder, key) if attr else stored_item(holder, key)


def has_address(t: torch.Tensor) -> bool:
    """A strided tensor with storage, whose data pointer means something."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return t.layout is torch.strided and not is_traceable_wrapper_subclass(t) and t.device.type != "meta"


def _equal(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}@{value.data_ptr():#x}"
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__} object>"
