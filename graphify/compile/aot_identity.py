"""What stands, in the caller, for the guards of a compiled function the compile worker saved
whole (`graphify.compile.aot`) that torch cannot check there: the identity of the objects its
dropped guards named (`identity`), the values of the kept guards torch rebuilds from the
loading process (`value_print`), and the code of the classes the call reaches
(`class_namespaces`). Each is recorded in the worker and compared here over the call."""

from __future__ import annotations

import builtins
import enum
import functools
import hashlib
import re
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["identity", "fingerprint", "value_print", "value_changes", "identity_changes", "class_namespaces",
           "class_changes", "prehash_classes", "rebuilt_from_caller", "VALUE_GUARDS", "UNVERIFIABLE", "code_hash"]


def rebuilt_from_caller(guard) -> bool:
    """Whether a kept guard reads its value through a global or a class: torch saves modules and
    classes by name, and rebuilds such a guard's expected value from the loading process, where
    it would compare the caller's value with itself. Its value is recorded here instead
    (`fingerprint`), and compared at each capture."""
    name = guard.name
    return bool(getattr(guard, "is_global", False)) or "G[" in name or "type(" in name or "__class__" in name


# The kept guards whose expected value torch takes from the loading process when it rebuilds
# them (where it reads the value through a global or a class), by what of the value they check.
VALUE_GUARDS = {"EQUALS_MATCH": "value", "CONSTANT_MATCH": "value", "TENSOR_MATCH": "value", "TYPE_MATCH": "type",
                "DICT_KEYS_MATCH": "keys", "DICT_KEYS": "keys", "SEQUENCE_LENGTH": "len"}


def value_print(kind: str, value: Any) -> tuple:
    """What a kept guard of this `kind` (`VALUE_GUARDS`) checks of `value`."""
    if kind == "type":
        return identity(type(value))
    if kind == "keys":
        return ("keys", tuple(sorted(map(str, value.keys())))) if hasattr(value, "keys") else fingerprint(value)
    if kind == "len":
        return ("len", len(value)) if hasattr(value, "__len__") else fingerprint(value)
    return fingerprint(value)


def value_changes(compiled, values, args: tuple, kwargs: dict) -> list[str]:
    """The names among `values` (name, kind, print) whose value here does not print the same."""
    changed = []
    for kind in {k for _, k, _ in values}:
        of = functools.partial(value_print, kind)
        changed += identity_changes(compiled, [(n, p) for n, k, p in values if k == kind], args, kwargs, of)
    return changed


def fingerprint(value: Any, depth: int = 0) -> tuple:
    """What a kept guard's value is across processes: a tensor's metadata (its data is read at
    run time), a sequence's or dict's entries, else `identity` (an object by its type)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), str(value.dtype), value.device.type)
    if isinstance(value, (list, tuple)) and depth < 3:
        return ("seq", type(value).__name__, len(value), tuple(fingerprint(v, depth + 1) for v in value[:64]))
    if isinstance(value, dict) and depth < 3:
        return ("map", tuple(sorted((str(k), fingerprint(v, depth + 1)) for k, v in list(value.items())[:256])))
    found = identity(value, depth)
    return ("type",) + found[1:] if found[:1] == UNVERIFIABLE else found


def classes_reached(fn, args: tuple, kwargs: dict) -> list[type]:
    """The classes whose methods a trace of `fn` on this call may inline: those of the module
    `fn` is bound to and its submodules, of the arguments and of their attributes (a cache's
    layers), with their bases (not Python's own)."""
    owner = getattr(fn, "__self__", None)
    objects = list(owner.modules()) if isinstance(owner, torch.nn.Module) else ([owner] if owner is not None else [])
    for a in (*args, *kwargs.values()):
        objects.append(a)
        for v in list(getattr(a, "__dict__", {}).values()):
            objects += list(v) if isinstance(v, (list, tuple)) else [v]
    seen: dict[int, type] = {}
    for obj in objects:
        if obj is None or isinstance(obj, (torch.Tensor, int, float, bool, str)):
            continue
        for cls in type(obj).__mro__:
            if cls.__module__ != "builtins":
                seen.setdefault(id(cls), cls)
    return list(seen.values())


# Entries of torch's classes that torch (dynamo's generation tags) and graphify (its watch)
# replace in a process that compiles or watches: not compared.
PATCHED_HERE = {("torch.nn.modules.module", "Module"): frozenset({"__init__", "__setstate__", "__setattr__", "_apply"})}


def class_namespaces(fn, args: tuple, kwargs: dict) -> list[tuple]:
    """(module, qualified name, identity of its namespace) of each class `classes_reached`: a
    method the caller's process patched on a class (as libraries that rewrite a model class's
    methods do) differs here from the class the worker imported as written."""
    return [(c.__module__, c.__qualname__, identity(vars(c))) for c in classes_reached(fn, args, kwargs)]


def class_changes(recorded, fn, args: tuple, kwargs: dict) -> list[str]:
    """The classes among `recorded` whose namespace here is not the worker's (or that are not
    found here)."""
    here = {(c.__module__, c.__qualname__): c for c in classes_reached(fn, args, kwargs)}
    # A method this process added that no class the worker saw defines shadows nothing the
    # trace called (transformers adds `Module.smart_apply` while it initialises weights).
    seen_names = {k for module, qualname, want in recorded for k in _code_of(want)}
    changed = []
    for module, qualname, want in recorded:
        cls = here.get((module, qualname))
        skip = PATCHED_HERE.get((module, qualname), frozenset())
        if cls is None:
            changed.append(f"{module}.{qualname}")
            continue
        now, then = _code_of(identity(vars(cls)), skip), _code_of(want, skip)
        if any(now.get(k) != v for k, v in then.items()) or any(k in seen_names for k in now.keys() - then.keys()):
            changed.append(f"{module}.{qualname}")
    return changed


CODE_KINDS = frozenset({"function", "method", "builtin", "code", "property", "staticmethod", "classmethod"})


def _code_of(namespace: tuple, skip: frozenset = frozenset()) -> dict:
    """A class namespace's identity, its code entries alone: plain values there are caches a
    library fills on first use (transformers' `_can_set_experts_implementation_cached_value`),
    and a value the trace read is guarded by a kept guard anyway."""
    if namespace[:1] != ("dict",):
        return {}
    return {k: v for k, v in namespace[1] if k not in skip and v[:1] and v[0] in CODE_KINDS}


def identity(value: Any, depth: int = 0) -> tuple:
    """What stands for an object's identity in another process: a module's name, a class's
    qualified name, a function's qualified name, code (bytecode, constants, names) and
    defaults, a builtin's name, a small constant's value, a dict's (a class's namespace)
    entries by key. For any other object there is none (`UNVERIFIABLE`): a loaded function
    whose dropped guards name one is not used."""
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, types.FunctionType):
        defaults = tuple(identity(d, depth + 1) for d in (value.__defaults__ or ())) if depth < 2 else ()
        return ("function", value.__module__, value.__qualname__, code_hash(value.__code__), defaults)
    if isinstance(value, types.MethodType):
        return ("method", identity(value.__func__, depth + 1), identity(type(value.__self__), depth + 1))
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        owner = getattr(value, "__self__", None)
        where = owner.__name__ if isinstance(owner, types.ModuleType) else getattr(value, "__module__", None)
        return ("builtin", where, getattr(value, "__qualname__", value.__name__))
    if isinstance(value, types.CodeType):
        return ("code", code_hash(value))
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return ("value", type(value).__qualname__, repr(value))
    if isinstance(value, (dict, types.MappingProxyType)) and depth < 2:
        return ("dict", tuple(sorted((str(k), identity(v, depth + 1)) for k, v in value.items())))
    if isinstance(value, (property, staticmethod, classmethod)) and depth < 3:
        parts = (value.fget, value.fset) if isinstance(value, property) else (value.__func__,)
        return (type(value).__name__, tuple(identity(f, depth + 1) for f in parts))
    return UNVERIFIABLE + (type(value).__module__, type(value).__qualname__)


UNVERIFIABLE = ("unverifiable",)


def code_hash(code: types.CodeType) -> str:
    """A code object's bytecode, constants (nested code by its own hash) and names: two
    versions of a function that differ in a constant or a callee differ here. Code objects
    are immutable, so each is hashed once a process (the caller's checks at a swap hash every
    method of the classes the call reaches)."""
    key = (code, code.co_filename)  # equal code objects may come from two files
    found = _CODE_HASHES.get(key)
    if found is None:
        if len(_CODE_HASHES) >= _MAX_CODE_HASHES:
            _CODE_HASHES.clear()
        found = _CODE_HASHES[key] = _code_hash(code)
    return found


_CODE_HASHES: dict[tuple, str] = {}  # holds the code objects (and their constants) it hashed
_MAX_CODE_HASHES = 65536  # past it the memo starts over (code made at run time, call after call)


def prehash_classes(recorded) -> None:
    """Hash the code of the classes a worker's record names (`class_namespaces`), as this
    process has them: the thread that loads a compiled function does it, so that the check at
    the capture that takes it in (`class_changes`) finds the hashes made."""
    for module, qualname, _ in recorded:
        try:  # a module's own __getattr__ may raise anything
            found = functools.reduce(lambda owner, part: getattr(owner, part, None), qualname.split("."),
                                     sys.modules.get(module))
            if isinstance(found, type):
                identity(vars(found))
        except Exception:  # noqa: BLE001 - a head start only: the check hashes what is left
            continue


def _code_hash(code: types.CodeType) -> str:
    consts = tuple(code_hash(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    what = repr((code.co_code, consts, code.co_names, code.co_firstlineno, code.co_filename.rsplit("/", 1)[-1]))
    return hashlib.sha1(what.encode()).hexdigest()


def identity_changes(compiled, identities, args: tuple, kwargs: dict, of: Callable = None) -> list[str]:
    """The names (dynamo's sources) among `identities` whose object here is not the one the
    worker's trace met (`of`: `identity`, or `fingerprint` for kept guards' values): evaluated
    over this call of the trampoline (`args`, `kwargs`), as dynamo's own guards would be."""
    from torch._dynamo.guards import _get_closure_vars

    of = of or identity
    scope = {**_get_closure_vars(), **compiled.prepare_f_locals(*args, **kwargs),
             "G": _trace_globals(compiled.fn.__globals__, [name for name, _ in identities])}
    return [name for name, want in identities
            if want[:1] == UNVERIFIABLE or _identity_at(name, scope, of) != want]


def _trace_globals(f_globals: dict, names: list[str]) -> dict:
    """The globals the worker's trace named, as this process has them: the compiled function's,
    and the names dynamo gave there to the builtins (`__builtins_dict___<n>`) and to imported
    modules (`__import_<dotted name, dots as _dot_>`)."""
    g = dict(f_globals)
    for key in {k for name in names for k in re.findall(r"G\['(\w+)'\]", name)} - g.keys():
        if key.startswith("__builtins_dict___"):
            g[key] = vars(builtins)
        elif key.startswith("__import_"):
            module = sys.modules.get(key.removeprefix("__import_").replace("_dot_", "."))
            if module is not None:
                g[key] = module
    return g


def _identity_at(name: str, scope: dict, of: Callable) -> tuple | None:
    try:
        return of(eval(name, scope))  # noqa: S307 - dynamo's own source names, over this call
    except Exception:  # noqa: BLE001 - not found here: a change
        return None
