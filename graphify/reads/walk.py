"""The walk behind `graphify.reads.reach.Reach`: every edge from some roots to what a call may read.

One `Walk` fills one `Reach`. Shallow (static arguments such as a cache): attributes,
slots, list and dict items; modules, functions and classes met are handed off to the deep
walk. Deep (the function and what it reaches): also modules through their `__dict__`, each
object's class dicts along the MRO, and for every function whose code ran (or that is a
root) its closure cells, defaults, attributes and the globals and module attributes its
bytecode names; every global the code that ran looks up is an edge too. torch's,
graphify's and Python's own code and classes are read by identity, never walked.
"""

from __future__ import annotations

import functools
import io
import logging
import threading
import types
import weakref
from typing import Any

import torch

from graphify.base.axes import by_value
from graphify.base.limits import Limits
from graphify.reads.code_names import NOT_CALLED, class_dict, code_names, library_code, library_module, own_module
from graphify.reads.stateful_types import state_type_of
from graphify.reads.dict_marks import attach_dict

__all__ = ["Walk", "PLAIN_CONTAINERS", "stored_item", "stored_items"]

# read by identity, never walked: their state is not what a kernel reads
_OPAQUE = (
    weakref.ReferenceType, torch.Generator, torch.dtype, torch.device, logging.Logger, logging.Handler,
    io.IOBase, type(threading.Lock()), type(threading.RLock()), threading.Thread, types.FrameType,
    types.CodeType, types.BuiltinFunctionType, types.BuiltinMethodType, types.GeneratorType,
    types.MappingProxyType,
)
# the deep walk's kinds of objects; a shallow walk hands them off
_CODE = (torch.nn.Module, types.FunctionType, types.MethodType, functools.partial, type, types.ModuleType)
_FUNCTION_STATE = ("__code__", "__defaults__", "__kwdefaults__")
_MAX_MODULE_HOPS = 3  # `torch.nn.functional.silu`: module attributes followed from a global
# class entries no call reads (descriptions of the class, and methods that only make or show objects)
_NOT_READ_BY_A_CALL = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__slotnames__"}) | NOT_CALLED


def _immutable_plain(value: Any) -> bool:
    """A value compared by equality that cannot change in place (numbers, strings, dtypes,
    enums, tuples of them); lists and dicts are walked as containers instead."""
    return not isinstance(value, (list, dict)) and by_value(value)


def _own(obj: Any) -> bool:
    """An object of graphify's own (a graphified callable set as a model's forward): its
    state is the call machinery, read by identity."""
    return own_module(getattr(type(obj), "__module__", None))


def _slots(cls: type) -> tuple[str, ...]:
    names = []
    for klass in cls.__mro__:
        for name in getattr(klass, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                names.append(name)
    return tuple(names)




class Walk:
    """Fills `reach` with the edges from some roots; see the module doc."""

    def __init__(self, reach, deep: bool, ran, skip: tuple, limits: Limits):
        self.reach, self.deep = reach, deep
        self.limits = limits  # (`Limits`' walk_depth, walk_items, walk_edges)
        self.seen: set[int] = set(map(id, skip))
        self.read_globals: set = set()  # (id(globals dict), name) recorded
        self.count = 0  # edges recorded
        self.pending: list = []  # (function, path, level) met whose code was not seen running
        self.ran: dict = dict(ran.codes) if ran is not None else {}  # id(code) -> (name, names, globals) that ran
        # every name code that ran looks up (None: no run recorded, every attribute counts)
        self.names: set | None = set(ran.names) if ran is not None and ran.names else None

    def run(self, roots: dict[str, Any]) -> None:
        if self.deep:  # the roots' own functions are read whether or not a run was recorded
            for f in map(_function_under, roots.values()):
                if f is not None:
                    self.ran[id(f.__code__)] = (f.__qualname__, code_names(f.__code__), f.__globals__)
        for name, obj in roots.items():
            self._visit(obj, name, 0)
        if self.deep:
            self._executed_globals()

    def extend(self, ran) -> None:
        """Go on after more code was seen running (`ran`, a `graphify.reads.code_ran.CodeRan`): the
        functions met before whose code ran now, and the globals of all code that ran."""
        self.ran.update(ran.codes)
        self.names = set(ran.names) if self.names is None else self.names | ran.names
        waiting, self.pending = self.pending, []
        for f, path, level in waiting:
            self._function(f, path, level)
        self._executed_globals()

    def _truncate(self, path: str, why: str) -> None:
        if self.reach.truncated is None:
            self.reach.truncated = f"{path}: {why}"

    def _visit(self, obj: Any, path: str, level: int) -> None:
        if id(obj) in self.seen or isinstance(obj, torch.Tensor) or isinstance(obj, _OPAQUE) or _own(obj):
            return
        if level > self.limits.walk_depth:
            return self._truncate(path, f"nested more than {self.limits.walk_depth} levels deep")
        self.seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            if len(obj) > self.limits.walk_items:
                return self._truncate(path, f"{len(obj)} items, more than the {self.limits.walk_items} a walk records")
            if isinstance(obj, list):
                self._container(obj, path)
            for i, x in enumerate(obj):
                self._edge(obj, i, x, f"{path}[{i}]", level, attr=False)
            return
        if isinstance(obj, dict):
            if len(obj) > self.limits.walk_items:
                return self._truncate(path, f"{len(obj)} entries, more than the {self.limits.walk_items} a walk records")
            self._container(obj, path)
            for k, x in stored_items(obj):
                self._edge(obj, k, x, f"{path}[{k!r}]", level, attr=False)
            return
        if isinstance(obj, types.CellType):
            try:
                x = obj.cell_contents
            except ValueError:  # an empty cell
                return
            self._edge(obj, "cell_contents", x, path, level, attr=True)
            return
        if isinstance(obj, _CODE):
            if not self.deep:
                self.reach.handoff.append((path, obj))
                return
            if not isinstance(obj, torch.nn.Module):
                return self._code(obj, path, level)
        original = getattr(obj, "_torchdynamo_orig_callable", None)  # a torch.compile'd callable object
        if original is not None and self.deep:
            self._visit(original, path, level + 1)
        self._object(obj, path, level)

    def _object(self, obj: Any, path: str, level: int) -> None:
        """An object's attributes (`__dict__` and slots) and, deep, its class."""
        state_type = state_type_of(obj)
        owned = ()
        if state_type is not None:
            self.reach.stateful.append((obj, state_type, path))
            owned = state_type.owns
        d = attach_dict(obj) if self.deep else getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            if len(d) > self.limits.walk_items:
                return self._truncate(path, f"{len(d)} attributes, more than the {self.limits.walk_items} a walk records")
            self._container(d, path + ".__dict__", attributes=True)
            for k, x in stored_items(d):
                if not (isinstance(k, str) and k.startswith("__")) and k not in owned:
                    self._edge(d, k, x, f"{path}.{k}", level, attr=False)
        for name in _slots(type(obj)):
            if name in owned:
                continue
            try:
                x = getattr(obj, name)
            except AttributeError:
                continue
            self._edge(obj, name, x, f"{path}.{name}", level, attr=True)
        cls = type(obj)
        if self.deep:  # the class decides which code runs (parametrize swaps a module's)
            self._edge(obj, "__class__", cls, f"{path}.__class__", level, attr=True)
        elif not library_code(cls):  # the methods of a static object's class that ran: the deep walk's
            self.reach.handoff.append((f"type({path})", cls))

    def _code(self, obj: Any, path: str, level: int) -> None:
        """A function, bound method, partial, class or Python module met by a deep walk."""
        if isinstance(obj, types.FunctionType):
            return self._function(obj, path, level)
        if isinstance(obj, types.MethodType):  # immutable: its object and function are edges to walk
            self._edge(obj, "__self__", obj.__self__, f"{path}.__self__", level, attr=True)
            self._edge(obj, "__func__", obj.__func__, path, level, attr=True)
            return
        if isinstance(obj, functools.partial):
            for name in ("func", "args", "keywords"):
                self._edge(obj, name, getattr(obj, name), f"{path}.{name}", level, attr=True)
            return
        if isinstance(obj, type):
            return self._class(obj, path, level)
        # a Python module: the names code reads from it are edges of that code's walk

    def _function(self, f: types.FunctionType, path: str, level: int) -> None:
        """A function that ran (or a root): its closure cells, defaults, attributes and the
        globals (and module attributes reached from them) its bytecode names. Others are
        read by identity only, as are torch's, graphify's and Python's own (by where the
        code was defined: a wrapper's `__module__` may be copied from what it wraps)."""
        original = getattr(f, "_torchdynamo_orig_callable", None)
        if original is not None:  # torch.compile's wrapper: its closure is dynamo's; what it runs is the original
            return self._visit(original, path, level + 1)
        if library_module(f.__globals__.get("__name__")):
            return
        code = f.__code__
        if id(code) not in self.ran:
            self.pending.append((f, path, level))
            return
        self.reach.functions.append((f, path))
        for var, cell in zip(code.co_freevars, f.__closure__ or ()):
            self._visit(cell, f"{path} closure {var!r}", level + 1)
        self._globals_of(code_names(code), f.__globals__, path, level)
        for name in _FUNCTION_STATE:  # assignable: `helper.__defaults__ = (3.0,)` changes what runs
            self._edge(f, name, getattr(f, name), f"{path}.{name}", level, attr=True)
        if f.__dict__:
            self._visit(f.__dict__, f"{path}.__dict__", level + 1)

    def _globals_of(self, names: frozenset, g: dict, path: str, level: int) -> None:
        """Every global (and module attribute reached from one) among `names` (what some
        code looks up), as edges of the globals dict: a global rebound or monkeypatched is
        a change."""
        done = self.read_globals
        for name in sorted(names):
            if name in g and (id(g), name) not in done:
                done.add((id(g), name))
                self._global(g, name, names, f"{path} global {name!r}", level, _MAX_MODULE_HOPS)

    def _executed_globals(self) -> None:
        """The globals of the code that ran but was not met as a function object (a helper
        reached through a library, a method of a static object's class)."""
        for qualname, names, g in list(self.ran.values()):
            if not library_module(g.get("__name__")):
                self._globals_of(names, g, qualname, 1)

    def _global(self, g: dict, name: str, names: frozenset, path: str, level: int, hops: int,
                walk: bool = True) -> None:
        value = g[name]
        self._edge(g, name, value, path, level, attr=False, walk=walk)
        if isinstance(value, types.ModuleType) and hops > 1:  # `F.silu`, `torch.nn.functional.silu`
            d = value.__dict__
            # what a library module holds (`sys.meta_path`, torch's state) is read by identity, not walked
            inner = walk and not library_module(value.__name__)
            for attribute in sorted(names):
                if attribute in d:
                    self._global(d, attribute, names, f"{path}.{attribute}", level + 1, hops - 1, inner)

    def _class(self, cls: type, path: str, level: int) -> None:
        """A class and its bases: every entry of their dicts by identity (a method replaced on
        the class), plain class attributes by value; the methods that ran are walked."""
        for klass in cls.__mro__:
            if klass is not cls:
                if id(klass) in self.seen:
                    continue
                self.seen.add(id(klass))
            d = class_dict(klass)
            if d is None:
                continue
            self.reach.classes[id(d)] = klass
            where = f"{klass.__module__}.{klass.__qualname__}"
            library = library_code(klass)
            for name, value in stored_items(d):
                if name in _NOT_READ_BY_A_CALL:
                    continue
                method = isinstance(value, (types.FunctionType, staticmethod, classmethod, property))
                # dunder data (`__dataclass_fields__`, `__annotations__`) describes the class, read by identity
                data = not method and not library and not (name.startswith("__") and name.endswith("__"))
                self._edge(d, name, value, f"{where}.{name}", level + 1, attr=False, walk=data)
                if method and not library:
                    for f in _functions_of(value):
                        self._visit(f, f"{where}.{name}", level + 1)

    def _container(self, container, path: str, attributes: bool = False) -> None:
        """A list or dict walked, its length recorded; an object's `__dict__` (`attributes`)
        is marked so, with the key "__dict__": its entries count only where code that ran
        names them (`Reach.describe`)."""
        if self.reach.lengths:
            self.reach.sized.add(container, "__dict__" if attributes else None, len(container), path)

    def _edge(self, holder, key, value, path: str, level: int, *, attr: bool, walk: bool = True) -> None:
        self.count += 1
        if self.count > self.limits.walk_edges:
            return self._truncate(path, f"more than the {self.limits.walk_edges} edges a walk records")
        if isinstance(value, torch.Tensor):
            self.reach.tensor_items[attr].add(holder, key, value, path)
        elif _immutable_plain(value):
            self.reach.plains[attr].add(holder, key, value, path)
        else:
            self.reach.objects[attr].add(holder, key, value, path)
            if walk:
                self._visit(value, path, level + 1)


def _function_under(obj) -> types.FunctionType | None:
    """The Python function a callable runs first (through bound methods, partials and
    torch.compile's wrapper), if any."""
    for _ in range(8):
        if isinstance(obj, types.FunctionType):
            return obj
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif isinstance(obj, functools.partial):
            obj = obj.func
        elif getattr(obj, "_torchdynamo_orig_callable", None) is not None:
            obj = obj._torchdynamo_orig_callable
        else:
            return None
    return None


def _functions_of(value) -> list:
    """The functions a class entry runs: a function, a static or class method's, a
    property's getter and setter."""
    if isinstance(value, (staticmethod, classmethod)):
        return [value.__func__]
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset) if f is not None]
    return [value]


PLAIN_CONTAINERS = (dict, list, tuple)


def stored_item(holder, key):
    """An item as its container stores it, past a subclass's own `__getitem__` (transformers'
    `ACT2FN` makes a new module on every lookup)."""
    if isinstance(holder, dict):
        return dict.__getitem__(holder, key)
    if isinstance(holder, list):
        return list.__getitem__(holder, key)
    if isinstance(holder, tuple):
        return tuple.__getitem__(holder, key)
    return holder[key]


def stored_items(d: dict) -> list:
    """A dict's (key, value) pairs as stored (see `stored_item`)."""
    return list(dict.items(d))
