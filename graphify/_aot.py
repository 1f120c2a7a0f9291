"""Compiled functions carried from the compile worker to the caller whole, without dynamo's
trace in the caller (`Options(compile="background")`).

The worker compiles a call with torch's `aot_compile` (dynamo's full-graph capture, then the
backend) and saves the result to a file; the caller loads it (`load_compiled_function`: the
transformed bytecode, its guards and the backend's artifacts) and its captures call it. The
swap that once re-ran dynamo's trace of a whole model forward in the caller (7-30 s at 0.5B)
becomes a load (about 1 s at 0.5B on an H200, torch 2.11; its imports are made on a thread
of their own when the first job is sent, `preimport`).

What is compiled is `TRAMPOLINE(fn, args, kwargs)`: the function as the caller calls it is an
argument, so its guards name it as one. The guards torch cannot save are dropped
(`UNSAVED_GUARDS`: the identity of objects, functions, classes, modules, builtins and closure
cells the trace met). Two checks stand in for them:
- at each capture through a loaded function, each dropped guard's object is looked up here by
  dynamo's own source name and compared with what the worker's trace met (`identity`: a
  module's name, a function's qualified name and code, a class's name; an object with no
  identity across processes makes the function unusable), and so are the code entries of the
  namespaces of the classes the call reaches (`class_namespaces`: dynamo keeps no guard on a
  class's methods). The worker imports modules as written, so a global, a closure cell or a
  class method this process changed before the job was sent is caught here, and the call is
  compiled in this process instead;
- on every call, graphify's watch of what the call reads (globals, module attributes,
  closures, hooks); a change drops the loaded functions (`AotLoads.forget`, from
  `forget_compiled`) with the graphs, so the next capture traces the state as it is.
A loaded function whose kept guards fail (another shape class, another grad mode) is passed
over for the in-process compile.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
import io
import logging
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TRAMPOLINE", "UNSAVED_GUARDS", "AotLoads", "available", "save", "load", "preimport"]

log = logging.getLogger("graphify")

# Guard types whose check is an object's identity (ids do not survive a process), dropped from
# what is saved; graphify's watch covers what they stood for (module docstring).
UNSAVED_GUARDS = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "BUILTIN_MATCH",
                            "CLOSURE_MATCH", "TYPE_MATCH_ID", "DICT_VERSION", "NN_MODULE", "WEAKREF_ALIVE"})

# The trampoline's globals hold the builtins: torch 2.11's aot_compile asks the compiled
# function's globals for every name its code reads, builtins included ("Missing required
# external references: ['type']"); 2.13 looks builtins up itself.
TRAMPOLINE_GLOBALS: dict = {**vars(builtins), "__name__": __name__}
exec("def TRAMPOLINE(fn, args, kwargs):\n    return fn(*args, **kwargs)\n", TRAMPOLINE_GLOBALS)  # noqa: S102
TRAMPOLINE: Callable = TRAMPOLINE_GLOBALS["TRAMPOLINE"]


def available() -> bool:
    """Whether this torch saves and loads compiled functions (2.11 and later)."""
    return (hasattr(torch.compiler, "load_compiled_function")
            and hasattr(getattr(torch._dynamo, "aot_compile", None) or _import_aot(), "aot_compile_fullgraph"))


def _import_aot():
    try:
        import torch._dynamo.aot_compile as aot
    except ImportError:
        return None
    return aot


def _backend(backend: str, mode, options, dynamic, fold_gqa: bool):
    """A backend `aot_compile` can save: torch's own wrappers (inductor, or an AOTAutograd
    backend by name), with graphify's grouped-query fold before it."""
    from ._gqa_fold import fold_grouped_query_decode

    base = torch._TorchCompileInductorWrapper if backend == "inductor" else torch._TorchCompileWrapper

    class Folding(base):
        def __call__(self, gm, example_inputs):
            if fold_gqa:
                fold_grouped_query_decode(gm)
            return super().__call__(gm, example_inputs)

    return Folding(mode, options, dynamic) if backend == "inductor" else Folding(backend, mode, options, dynamic)


def save(fn: Callable, args: tuple, kwargs: dict, how: dict, path: str, dynamo_config: dict) -> dict:
    """In the worker: compile `TRAMPOLINE(fn, args, kwargs)` as `compile_for_captures` would
    (`how`: backend, mode, options, dynamic, fold_gqa), save it at `path` and call it once (its
    kernels built, and proof it runs). Returns the guard types kept and dropped, counted."""
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    counts: dict = {"kept": {}, "dropped": {}, "identities": []}

    def keep(entries) -> list[bool]:
        out = []
        for g in entries:
            kinds = {g.guard_type, *(getattr(g, "derived_guard_types", ()) or ())}
            ok = not kinds & UNSAVED_GUARDS
            side = counts["kept" if ok else "dropped"]
            side[g.guard_type] = side.get(g.guard_type, 0) + 1
            if not ok and g.has_value:
                counts["identities"].append((g.name, identity(g.value)))
            out.append(ok)
        return out

    how = dict(how)
    dynamic = how.get("dynamic", True)
    backend = _backend(how.get("backend", "inductor"), how.get("mode"), how.get("options"), dynamic,
                       how.get("fold_gqa", True))
    with torch._dynamo.config.patch(enable_aot_compile=True, **dynamo_config):
        compiled = aot_compile_fullgraph(TRAMPOLINE, ((fn, args, kwargs), {}), hooks=Hooks(guard_filter_fn=keep),
                                         backend=backend, dynamic=dynamic)
        compiled.save_compiled_function(path)
    compiled(fn, args, kwargs)
    counts["classes"] = class_namespaces(fn, args, kwargs)
    return counts


def classes_reached(fn, args: tuple, kwargs: dict) -> list[type]:
    """The classes whose methods a trace of `fn` on this call may inline: those of the module
    `fn` is bound to and its submodules, of the arguments and of their attributes (a cache's
    layers), with their bases; not Python's or torch's own (`TORCH_OWN`)."""
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
            if not cls.__module__.startswith(TORCH_OWN):
                seen.setdefault(id(cls), cls)
    return list(seen.values())


# Classes left out of the namespace check: Python's and torch's own, which both processes import
# as released, apart from the patches torch (dynamo's generation tags on `Module.__init__`) and
# graphify (its watch on `Module.__setattr__`) make in a process that compiles or watches.
TORCH_OWN = ("builtins", "torch.")


def class_namespaces(fn, args: tuple, kwargs: dict) -> list[tuple]:
    """(module, qualified name, identity of its namespace) of each class `classes_reached`: a
    method the caller's process patched on a class (as libraries that rewrite a model class's
    methods do) differs here from the class the worker imported as written."""
    return [(c.__module__, c.__qualname__, identity(vars(c))) for c in classes_reached(fn, args, kwargs)]


def class_changes(recorded, fn, args: tuple, kwargs: dict) -> list[str]:
    """The classes among `recorded` whose namespace here is not the worker's (or that are not
    found here)."""
    here = {(c.__module__, c.__qualname__): c for c in classes_reached(fn, args, kwargs)}
    changed = []
    for module, qualname, want in recorded:
        cls = here.get((module, qualname))
        if cls is None or _code_of(identity(vars(cls))) != _code_of(want):
            changed.append(f"{module}.{qualname}")
    return changed


CODE_KINDS = frozenset({"function", "method", "builtin", "code", "property", "staticmethod", "classmethod"})


def _code_of(namespace: tuple) -> dict:
    """A class namespace's identity, its code entries alone: plain values there are caches a
    library fills on first use (transformers' `_can_set_experts_implementation_cached_value`),
    and a value the trace read is guarded by a kept guard anyway."""
    return {k: v for k, v in namespace[1] if v[:1] and v[0] in CODE_KINDS} if namespace[:1] == ("dict",) else {}


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
    versions of a function that differ in a constant or a callee differ here."""
    consts = tuple(code_hash(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    what = repr((code.co_code, consts, code.co_names, code.co_firstlineno, code.co_filename.rsplit("/", 1)[-1]))
    return hashlib.sha1(what.encode()).hexdigest()


def identity_changes(compiled, identities, args: tuple, kwargs: dict) -> list[str]:
    """The names (dynamo's sources) among `identities` whose object here is not the one the
    worker's trace met: evaluated over this call of the trampoline (`args`, `kwargs`), as
    dynamo's own guards would be."""
    from torch._dynamo.guards import _get_closure_vars

    scope = {**_get_closure_vars(), **compiled.prepare_f_locals(*args, **kwargs),
             "G": _trace_globals(compiled.fn.__globals__, [name for name, _ in identities])}
    return [name for name, want in identities
            if want[:1] == UNVERIFIABLE or _identity_at(name, scope) != want]


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


def _identity_at(name: str, scope: dict) -> tuple | None:
    try:
        return identity(eval(name, scope))  # noqa: S307 - dynamo's own source names, over this call
    except Exception:  # noqa: BLE001 - not found here: a change
        return None


def load(path: str, data: bytes | None = None) -> Callable:
    """In the caller: the compiled function saved at `path` (or its bytes, `data`). Its code
    names the modules it uses as `___module_<dotted name, dots as _>_<id>_c<n>` globals of the
    compiling process; each is the module of that name here."""
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    f_globals = dict(TRAMPOLINE_GLOBALS)
    for _ in range(3):
        try:
            return torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=f_globals)
        except RuntimeError as exc:
            missing = re.findall(r"'(___module_\w+?)'", str(exc))
            if not missing:
                raise
            by_flat = {name.replace(".", "_"): m for name, m in list(sys.modules.items()) if m is not None}
            for ref in missing:
                flat = re.sub(r"_\d+_c\d+$", "", ref.removeprefix("___module_"))
                if flat not in by_flat:
                    raise RuntimeError(f"the compiled function names a module not loaded here ({ref})") from exc
                f_globals[ref] = by_flat[flat]
    raise RuntimeError("the compiled function still misses globals after they were supplied")


_PREIMPORTED = threading.Event()


def preimport() -> None:
    """Import, on a thread of its own, what loading a compiled function needs (seconds, the
    first time in a process), when the first job is sent rather than at the swap."""
    if _PREIMPORTED.is_set():
        return
    _PREIMPORTED.set()

    def run():
        try:
            import torch._dynamo.aot_compile  # noqa: F401
            import torch._dynamo.package  # noqa: F401
            import torch._functorch._aot_autograd.autograd_cache  # noqa: F401
            import torch._inductor.codecache  # noqa: F401
            import torch._inductor.compile_fx  # noqa: F401
        except Exception:  # noqa: BLE001 - the load imports it again, and says what fails
            log.debug("graphify: pre-import for compiled-function loads failed", exc_info=True)

    threading.Thread(target=run, name="graphify-aot-imports", daemon=True).start()


class AotLoads:
    """The compiled functions loaded for one graphified function: a call goes to the first
    whose guards pass (`call`); `forget` drops them all (what they were traced over changed)."""

    def __init__(self, fn: Callable):
        self.fn = fn  # the function the trampoline calls
        self.loaded: list = []  # (compiled function, what stands for its dropped guards)
        self.calls = 0  # calls that ran a loaded function (tests, logs)
        self.refused: list[str] = []  # names whose identity changed, of loaded functions passed over

    def add(self, compiled, guards: dict | None = None) -> None:
        """`compiled` with what stands for its dropped guards (`guards`: the worker's record of
        identities and class namespaces)."""
        if compiled is not None and all(compiled is not c for c, _ in self.loaded):
            self.loaded.append((compiled, guards or {}))

    def forget(self) -> None:
        self.loaded = []

    def drop(self, compiled) -> None:
        self.loaded = [(c, i) for c, i in self.loaded if c is not compiled]

    def serves(self, args: tuple, kwargs: dict) -> bool:
        """Whether a loaded function would serve a call with `args`, `kwargs` (see `call`)."""
        return self._pick(args, kwargs) is not None

    def call(self, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, output) through the first loaded function whose kept guards pass and whose
        dropped ones' objects are the worker's (`identity_changes`), else (False, None). One
        whose objects changed is dropped, logged: the in-process compile traces the call."""
        compiled = self._pick(args, kwargs)
        if compiled is None:
            return False, None
        try:
            out = compiled.fn(self.fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - not this process's to run: compiled here instead
            self.drop(compiled)
            log.warning("graphify: a compiled function from the worker failed here (%s: %s); compiling here instead",
                        type(exc).__name__, exc)
            return False, None
        self.calls += 1
        return True, out

    def _pick(self, args: tuple, kwargs: dict):
        for compiled, guards in tuple(self.loaded):
            try:
                usable = self._usable(compiled, guards, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - a check that cannot run here: not used
                log.info("graphify: a loaded compiled function could not be checked here (%s: %s)",
                         type(exc).__name__, exc)
                usable = False
                self.drop(compiled)
            if usable:
                return compiled
        return None

    def _usable(self, compiled, guards: dict, args: tuple, kwargs: dict) -> bool:
        """Its kept guards pass on this call, its dropped ones' objects are the worker's, and
        so are the namespaces of the classes the call reaches."""
        if not compiled.guard_check(self.fn, args, kwargs):
            if log.isEnabledFor(logging.DEBUG):
                f_locals = compiled.prepare_f_locals(self.fn, args, kwargs)
                log.debug("graphify: a loaded compiled function's guards fail here: %s",
                          compiled._artifacts.guard_manager.check_verbose(f_locals))
            return False
        changed = identity_changes(compiled, guards.get("identities", ()), (self.fn, args, kwargs), {})
        changed += class_changes(guards.get("classes", ()), self.fn, args, kwargs) if "classes" in guards \
            else ["(no record of the classes the worker's trace reached)"]
        if changed:
            self.drop(compiled)
            self.refused += changed
            log.info("graphify: a compiled function from the worker was traced over other objects than this "
                     "process holds, or ones it cannot compare (%s%s); compiling here instead",
                     ", ".join(changed[:3]), "..." if len(changed) > 3 else "")
            return False
        return True
