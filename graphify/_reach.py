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
all in a few C-level passes (a 24-layer transformers cache: ~300 edges, a few
microseconds); `describe()` names the first path that differs, for errors.

It also serves capture: `restore()` puts back every reference and plain value a warm-up
or capture changed (transformers' DynamicCache replaces its tensors with `torch.cat`), so
capture leaves objects as it found them, and `first_change()` says what a run changed.

First use builds on it to let a new object of known shapes take over a graph's memory
(`graphify._takeover`); what a function reads beyond its arguments is `graphify._roots`.
"""

from __future__ import annotations

import types
import weakref
from operator import attrgetter, getitem, is_
from typing import Any

import torch

from ._axes import by_value
from ._roots import GlobalSlot, function_roots

__all__ = ["Reach"]

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


class _Edges:
    """Parallel lists of one kind of edge: container, key, expected value, path."""

    __slots__ = ("holders", "keys", "values", "paths")

    def __init__(self):
        self.holders, self.keys, self.values, self.paths = [], [], [], []

    def add(self, holder, key, value, path) -> None:
        self.holders.append(holder)
        self.keys.append(key)
        self.values.append(value)
        self.paths.append(path)

    def __len__(self) -> int:
        return len(self.holders)


class Reach:
    """Everything reachable from some roots that a graph may read; see the module doc."""

    def __init__(self):
        self.ident = _Edges()  # getitem edges to objects: identity
        self.ident_attr = _Edges()  # getattr edges (slots, closure cells): identity
        self.plain = _Edges()  # getitem edges to plain values: equality
        self.plain_attr = _Edges()  # getattr edges to plain values: equality
        self.tensor = _Edges()  # getitem edges to tensors: identity, then address and shape
        self.tensor_attr = _Edges()
        self.sized: list = []  # lists and dicts walked, with their lengths
        self.sized_len: list[int] = []
        self.sized_paths: list[str] = []
        self.snapshots: list | None = []  # (container, shallow copy) to restore; dropped by freeze()
        self.truncated = False
        self.lengths = True
        self._tensors: tuple = ()
        self._addressed: tuple = ()
        self._ptrs: tuple = ()
        self._shapes: list = []

    # -- recording ------------------------------------------------------------------------
    @classmethod
    def walk(cls, roots: dict[str, Any], *, snapshots: bool = True, lengths: bool = True) -> "Reach":
        """Walk `roots` ({name: object}); objects compared by value are not roots.
        `snapshots`: keep a shallow copy of every container, for `restore()`. `lengths`:
        check that lists and dicts keep their length (a cache's layers); off for a
        function's closure, where a list that grows is a log, not something graphs read
        (the items recorded are still checked)."""
        reach = cls()
        reach.lengths = lengths
        if not snapshots:
            reach.snapshots = None
        seen: set[int] = set()
        for name, obj in roots.items():
            reach._visit(obj, name, 0, seen)
        reach._tensors = tuple(reach.tensor.values) + tuple(reach.tensor_attr.values)
        # addresses of strided tensors with storage (sparse tensors and DTensors have none: their
        # identity and shape are checked)
        reach._addressed = tuple(t for t in reach._tensors if _has_address(t))
        reach._ptrs = tuple(map(_data_ptr, reach._addressed))
        reach._shapes = list(map(_shape, reach._tensors))
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
                self._sized(obj, path)
            for i, x in enumerate(obj[:MAX_ITEMS]):
                self._edge(obj, i, x, f"{path}[{i}]", level, seen, attr=False)
            return
        if isinstance(obj, dict):
            self._sized(obj, path)
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
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            self._sized(d, path + ".__dict__")
            for k, x in list(d.items())[:MAX_ITEMS]:
                if not (isinstance(k, str) and k.startswith("__")):
                    self._edge(d, k, x, f"{path}.{k}", level, seen, attr=False)
        for name in _slots(type(obj)):
            try:
                x = getattr(obj, name)
            except AttributeError:
                continue
            self._edge(obj, name, x, f"{path}.{name}", level, seen, attr=True)

    def _sized(self, container, path: str) -> None:
        if not self.lengths:
            return
        self.sized.append(container)
        self.sized_len.append(len(container))
        self.sized_paths.append(path)
        if self.snapshots is not None:
            self.snapshots.append((container, list(container) if isinstance(container, list) else dict(container)))

    def _edge(self, holder, key, value, path: str, level: int, seen: set[int], *, attr: bool) -> None:
        if self.edges() >= MAX_EDGES:
            self.truncated = True
            return
        if isinstance(value, torch.Tensor):
            (self.tensor_attr if attr else self.tensor).add(holder, key, value, path)
        elif _immutable_plain(value):
            (self.plain_attr if attr else self.plain).add(holder, key, value, path)
        else:
            (self.ident_attr if attr else self.ident).add(holder, key, value, path)
            if isinstance(value, types.FunctionType):
                for root, x in function_roots(value, path).items():
                    self._visit(x, root, level + 1, seen)
            else:
                self._visit(value, path, level + 1, seen)

    def edges(self) -> int:
        return sum(map(len, (self.ident, self.ident_attr, self.plain, self.plain_attr, self.tensor, self.tensor_attr)))

    def freeze(self) -> "Reach":
        """Drop the restore snapshots (capture is over): only the checks remain."""
        self.snapshots = None
        return self

    def __bool__(self) -> bool:
        return self.edges() > 0 or bool(self.sized)

    # -- the per-call check -----------------------------------------------------------------
    def changed(self) -> bool:
        """Whether anything differs from the record: a few C-level passes, no allocation
        per edge beyond the lists `map` fills."""
        try:
            if not all(map(is_, map(getitem, self.ident.holders, self.ident.keys), self.ident.values)):
                return True
            if not all(map(is_, map(getattr, self.ident_attr.holders, self.ident_attr.keys), self.ident_attr.values)):
                return True
            if not all(map(is_, map(getitem, self.tensor.holders, self.tensor.keys), self.tensor.values)):
                return True
            if not all(map(is_, map(getattr, self.tensor_attr.holders, self.tensor_attr.keys), self.tensor_attr.values)):
                return True
            # plain values: the very objects as a rule (small ints, dtypes); else compare by value
            if not all(map(is_, map(getitem, self.plain.holders, self.plain.keys), self.plain.values)) \
                    and list(map(getitem, self.plain.holders, self.plain.keys)) != self.plain.values:
                return True
            if not all(map(is_, map(getattr, self.plain_attr.holders, self.plain_attr.keys), self.plain_attr.values)) \
                    and list(map(getattr, self.plain_attr.holders, self.plain_attr.keys)) != self.plain_attr.values:
                return True
        except (KeyError, IndexError, AttributeError, ValueError, TypeError):
            return True
        if list(map(len, self.sized)) != self.sized_len:
            return True
        return tuple(map(_data_ptr, self._addressed)) != self._ptrs or list(map(_shape, self._tensors)) != self._shapes

    def describe(self) -> str | None:
        """The first path that differs from the record, as 'path: what changed'; None if none."""
        for edges, read, same in (
            (self.ident, getitem, is_), (self.ident_attr, getattr, is_), (self.tensor, getitem, is_),
            (self.tensor_attr, getattr, is_), (self.plain, getitem, _equal), (self.plain_attr, getattr, _equal),
        ):
            for holder, key, value, path in zip(edges.holders, edges.keys, edges.values, edges.paths):
                try:
                    now = read(holder, key)
                except Exception:
                    return f"{path}: gone (was {_show(value)})"
                if not same(now, value):
                    return f"{path}: {_show(value)} -> {_show(now)}"
        for container, n, path in zip(self.sized, self.sized_len, self.sized_paths):
            if len(container) != n:
                return f"{path}: {n} entries -> {len(container)}"
        ptrs = dict(zip(map(id, self._addressed), self._ptrs))
        for t, shape, path in zip(self._tensors, self._shapes, self._tensor_paths()):
            moved = id(t) in ptrs and t.data_ptr() != ptrs[id(t)]
            if moved or t.shape != shape:
                return f"{path}: tensor storage or shape changed in place ({tuple(shape)} -> {tuple(t.shape)})"
        return None

    def first_change(self) -> tuple[str, bool] | None:
        """(description, whether a tensor was replaced) of what differs now, or None.
        A replaced tensor is state a graph cannot follow at all (a growing cache); a changed
        plain value is a Python counter the graph would freeze."""
        if not self.changed():
            return None
        what = self.describe()
        if what is None:
            return None
        replaced = any(
            _read(h, k, attr) is not v
            for edges, attr in ((self.tensor, False), (self.tensor_attr, True))
            for h, k, v in zip(edges.holders, edges.keys, edges.values)
        )
        return what, replaced

    def _tensor_paths(self) -> list[str]:
        return self.tensor.paths + self.tensor_attr.paths

    def tensor_edges(self):
        """(holder, key, is_attribute, path) of every edge to a tensor, in `_tensors` order."""
        for edges, attr in ((self.tensor, False), (self.tensor_attr, True)):
            for holder, key, path in zip(edges.holders, edges.keys, edges.paths):
                yield holder, key, attr, path

    # -- capture: put things back ------------------------------------------------------------
    def restore(self) -> None:
        """Put back every reference and plain value recorded (containers to their recorded
        items, attributes and cells to their recorded values)."""
        for container, snap in self.snapshots or ():
            if isinstance(container, list):
                if len(container) != len(snap) or not all(map(is_, container, snap)):
                    container[:] = snap
            elif len(container) != len(snap) or any(container.get(k, _GONE) is not v for k, v in snap.items()):
                container.clear()
                container.update(snap)
        for edges in (self.ident_attr, self.plain_attr, self.tensor_attr):
            for holder, key, value in zip(edges.holders, edges.keys, edges.values):
                try:
                    if getattr(holder, key) is not value:
                        _set(holder, key, value)
                except (AttributeError, TypeError, ValueError):
                    pass
        for edges in (self.plain, self.tensor, self.ident):  # items of globals dicts (not snapshotted)
            for holder, key, value in zip(edges.holders, edges.keys, edges.values):
                if isinstance(holder, dict) and holder.get(key, _GONE) is not value:
                    holder[key] = value

_GONE = object()


def _read(holder, key, attr: bool):
    return getattr(holder, key) if attr else holder[key]


def _set(holder, key: str, value) -> None:
    """Set an attribute past any custom __setattr__ (closure cells take plain setattr)."""
    if isinstance(holder, types.CellType):
        holder.cell_contents = value
    else:
        object.__setattr__(holder, key, value)


def _has_address(t: torch.Tensor) -> bool:
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
