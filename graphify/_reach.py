"""What a graph reads without copying it in, recorded at capture and checked on every call.

A graph reads memory by address. Batch-axis arguments are copied into static buffers and
persistent tensors are checked by address, but a static object (a transformers cache, a
config) and the function's closure reach tensors and plain values no argument names:
`past_key_values.layers[3].keys`, a closure's weight, a closure's scale factor. If one of
them is replaced after capture, a graph goes on reading the old memory (or the old number
baked into a kernel's arguments): a wrong answer with no error.

`Reach.walk(roots)` walks those objects (attributes, slots, list and dict items, closure
cells, a function's globals; nn.Modules are left to `graphify._params.ModuleWatch`) and
keeps every edge it took: identity for objects and tensors, equality for plain values,
lengths for lists and dicts, and each tensor's address and shape. `changed()` compares them
all in a few C-level passes, so it can run before every replay; `describe()` names the
first path that differs, for errors; `first_change()` says what a run changed.

Putting back what a capture's runs changed is `graphify._snapshot`; a new object of the
same shapes taking over a graph's memory is `graphify._takeover`; what a function reads
beyond its arguments is `graphify._roots`.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator
from operator import attrgetter, getitem, is_
from typing import Any

import torch

from ._axes import by_value
from ._roots import GlobalSlot, function_roots
from ._state_types import adapters_for, any_registered, state_type_of

__all__ = ["Reach", "Edges", "has_address", "read_edge", "stateful_in"]

MAX_DEPTH = 8
MAX_ITEMS = 4096  # per list or dict
MAX_EDGES = 100_000

_data_ptr = torch.Tensor.data_ptr
_shape = attrgetter("shape")
_OPAQUE = (
    torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    weakref.ReferenceType, torch.Generator, torch.dtype, torch.device,
)


def _immutable_plain(value: Any) -> bool:
    """A value compared by equality that cannot change in place (numbers, strings, dtypes,
    enums, tuples of them); lists and dicts are walked as containers instead."""
    return not isinstance(value, (list, dict)) and by_value(value)


def _slots(cls: type) -> tuple[str, ...]:
    names = []
    for klass in cls.__mro__:
        for name in getattr(klass, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                names.append(name)
    return tuple(names)


class Edges:
    """Parallel lists of one kind of edge: holder, key, expected value, path. `attr`: the
    edges are attributes (read with getattr), else items (getitem)."""

    __slots__ = ("holders", "keys", "values", "paths", "attr")

    def __init__(self, attr: bool):
        self.holders, self.keys, self.values, self.paths = [], [], [], []
        self.attr = attr

    def add(self, holder, key, value, path) -> None:
        self.holders.append(holder)
        self.keys.append(key)
        self.values.append(value)
        self.paths.append(path)

    def now(self) -> list:
        """What each edge reads now (raises if one is gone)."""
        return list(map(getattr if self.attr else getitem, self.holders, self.keys))

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
        self.truncated = False  # the walk stopped at MAX_EDGES
        # (object, its `graphify._state_types.StateType`, path): Python state graphs follow by branch,
        # the attributes it owns left out of the edges
        self.stateful: list = []
        self.tensors: tuple = ()  # every tensor, in `tensor_edges()` order
        self._addressed: tuple = ()  # those with an address that means something
        self._ptrs: tuple = ()
        self._shapes: list = []

    # -- recording ------------------------------------------------------------------------
    @classmethod
    def walk(cls, roots: dict[str, Any], *, lengths: bool = True, plains_are_effects: bool = False) -> "Reach":
        """Walk `roots` ({name: object}); objects compared by value are not roots.
        `lengths`: check that lists and dicts keep their length (a cache's layers); off for
        a function's closure, where a list that grows is a log, not something graphs read
        (the items recorded are still checked). `plains_are_effects`: `changed()` ignores
        plain values (counters a function keeps as side effects); `first_change()` does not."""
        reach = cls(lengths, plains_are_effects)
        seen: set[int] = set()
        for name, obj in roots.items():
            reach._visit(obj, name, 0, seen)
        reach.tensors = tuple(t for edges in reach.tensor_items for t in edges.values)
        # addresses of strided tensors with storage (sparse tensors and DTensors have none: their
        # identity and shape are checked)
        reach._addressed = tuple(t for t in reach.tensors if has_address(t))
        reach._ptrs = tuple(map(_data_ptr, reach._addressed))
        shapes: dict = {}  # one object per distinct shape: fewer objects for the per-call check to read
        reach._shapes = [shapes.setdefault(s, s) for s in map(_shape, reach.tensors)]
        return reach

    def _visit(self, obj: Any, path: str, level: int, seen: set[int]) -> None:
        if id(obj) in seen or level > MAX_DEPTH or isinstance(obj, _OPAQUE) or isinstance(obj, torch.Tensor):
            return
        seen.add(id(obj))
        if isinstance(obj, GlobalSlot):  # one name of a module's globals, not the whole dict
            if obj.name in obj.globals:
                self._edge(obj.globals, obj.name, obj.globals[obj.name], path, level, seen, attr=False)
            return
        if isinstance(obj, (list, tuple)):
            if isinstance(obj, list):
                self._container(obj, path)
            for i, x in enumerate(obj[:MAX_ITEMS]):
                self._edge(obj, i, x, f"{path}[{i}]", level, seen, attr=False)
            return
        if isinstance(obj, dict):
            self._container(obj, path)
            for k, x in list(obj.items())[:MAX_ITEMS]:
                self._edge(obj, k, x, f"{path}[{k!r}]", level, seen, attr=False)
            return
        if isinstance(obj, types.CellType):
            try:
                x = obj.cell_contents
            except ValueError:  # an empty cell
                return
            self._edge(obj, "cell_contents", x, path, level, seen, attr=True)
            return
        state_type = state_type_of(obj)
        owned = ()
        if state_type is not None:
            self.stateful.append((obj, state_type, path))
            owned = state_type.owns
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            self._container(d, path + ".__dict__")
            for k, x in list(d.items())[:MAX_ITEMS]:
                if not (isinstance(k, str) and k.startswith("__")) and k not in owned:
                    self._edge(d, k, x, f"{path}.{k}", level, seen, attr=False)
        for name in _slots(type(obj)):
            if name in owned:
                continue
            try:
                x = getattr(obj, name)
            except AttributeError:
                continue
            self._edge(obj, name, x, f"{path}.{name}", level, seen, attr=True)

    def _container(self, container, path: str) -> None:
        if self.lengths:
            self.sized.add(container, None, len(container), path)

    def _edge(self, holder, key, value, path: str, level: int, seen: set[int], *, attr: bool) -> None:
        if self.edges() >= MAX_EDGES:
            self.truncated = True
            return
        if isinstance(value, torch.Tensor):
            self.tensor_items[attr].add(holder, key, value, path)
        elif _immutable_plain(value):
            self.plains[attr].add(holder, key, value, path)
        else:
            self.objects[attr].add(holder, key, value, path)
            if isinstance(value, types.FunctionType):
                for root, x in function_roots(value, path).items():
                    self._visit(x, root, level + 1, seen)
            else:
                self._visit(value, path, level + 1, seen)

    def edges(self) -> int:
        return sum(len(e) for group in (self.objects, self.plains, self.tensor_items) for e in group)

    def __bool__(self) -> bool:
        return self.edges() > 0 or bool(self.sized)

    # -- what was recorded, for `graphify._takeover` and `graphify._snapshot` ---------------
    def tensor_edges(self) -> Iterator[tuple]:
        """(holder, key, is_attribute, path) of every edge to a tensor, in `tensors` order."""
        for edges in self.tensor_items:  # never binding the tensor: `graphify._takeover` counts references
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
        return tuple(map(_data_ptr, self._addressed)) != self._ptrs or list(map(_shape, self.tensors)) != self._shapes

    def describe(self) -> str | None:
        """The first path that differs from the record, as 'path: what changed'; None if none."""
        checks = [(e, is_) for e in self.objects + self.tensor_items] + [(e, _equal) for e in self.plains]
        for edges, same in checks:
            for holder, key, value, path in edges:
                try:
                    now = read_edge(holder, key, edges.attr)
                except Exception:
                    return f"{path}: gone (was {_show(value)})"
                if not same(now, value):
                    return f"{path}: {_show(value)} -> {_show(now)}"
        for container, _, n, path in self.sized:
            if len(container) != n:
                return f"{path}: {n} entries -> {len(container)}"
        ptrs = dict(zip(map(id, self._addressed), self._ptrs))
        for t, shape, (_, _, _, path) in zip(self.tensors, self._shapes, self.tensor_edges()):
            moved = id(t) in ptrs and t.data_ptr() != ptrs[id(t)]
            if moved or t.shape != shape:
                return f"{path}: tensor storage or shape changed in place ({tuple(shape)} -> {tuple(t.shape)})"
        return None

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
    """(object, StateType, path) of every registered type (`graphify._state_types`) the
    static `objects` reach, their library's adapters imported first; () when none is."""
    if not objects:
        return ()
    adapters_for(objects)
    return tuple(Reach.walk(objects).stateful) if any_registered() else ()


def read_edge(holder, key, attr: bool):
    """What an edge reads now."""
    return getattr(holder, key) if attr else holder[key]


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
