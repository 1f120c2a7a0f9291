"""Compiled functions carried from the compile worker to the caller whole, without dynamo's
trace in the caller (`Options(compile="background")`).

The worker compiles a call with torch's `aot_compile` (dynamo's full-graph capture, then the
backend) and saves the result to a file; the caller loads it (`load_compiled_function`: the
transformed bytecode, its guards and the backend's artifacts) and its captures call it. The
swap that once re-ran dynamo's trace of a whole model forward in the caller (7-30 s at 0.5B)
becomes a load (about 1 s at 0.5B on an H200, torch 2.11; its imports are made when
`graphify(...)` makes the line, `preimport`).

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
import contextlib
import importlib
import io
import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from graphify.compile import rewrites
from graphify.compile.tuning_memory import tune_outside_pools
from graphify.compile.shape_policy import AUTO, Specialise, asked_to_specialise, per_shape_from_the_start, wants_static
from graphify.compile.layout_policy import inductor_layout
from graphify.compile.aot_identity import (UNVERIFIABLE, VALUE_GUARDS, class_changes, class_namespaces, identity,
                            identity_changes, rebuilt_from_caller, value_changes, value_print)

__all__ = ["TRAMPOLINE", "UNSAVED_GUARDS", "AotLoads", "available", "checks_held", "saves", "save", "load", "preimport",
           "identity", "UNVERIFIABLE"]

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


def saves(backend: str) -> bool:
    """Whether this torch saves functions compiled with `backend` whole. Inductor's always;
    others from torch 2.13: 2.11's aot_compile bundles AOTAutograd's cache entry, which asks
    for inductor's output code ("expected OutputCode, got <class 'function'>" for aot_eager).
    2.12 is not known here, so it is treated as 2.11: a job not saved whole is traced here."""
    if backend == "inductor":
        return available()
    return available() and tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 13)


def _import_aot():
    try:
        import torch._dynamo.aot_compile as aot
    except ImportError:
        return None
    return aot


def _backend(backend: str, mode, options, dynamic, switched: tuple, specialise: bool = False):
    """A backend `aot_compile` can save: torch's own wrappers (inductor, or an AOTAutograd
    backend by name), with the graph rewrites `switched` on before it; with `specialise`, one
    that refuses a graph to compile per shape (`graphify.compile.shape_policy`)."""
    base = torch._TorchCompileInductorWrapper if backend == "inductor" else torch._TorchCompileWrapper

    class Folding(base):
        def __call__(self, gm, example_inputs):
            if specialise and wants_static(gm):
                raise Specialise("compiled per shape")
            rewrites.rewrite(gm, switched)
            with inductor_layout(gm, self):
                return super().__call__(gm, example_inputs)

    return Folding(mode, options, dynamic) if backend == "inductor" else Folding(backend, mode, options, dynamic)


def save(fn: Callable, args: tuple, kwargs: dict, how: dict, path: str, dynamo_config: dict) -> dict:
    """In the worker: compile `TRAMPOLINE(fn, args, kwargs)` as `compile_for_captures` would
    (`how`: backend, mode, options, dynamic, rewrites), save it at `path` and call it once (its
    kernels built, and proof it runs). Returns the guard types kept and dropped, counted."""
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    counts: dict = {"kept": {}, "dropped": {}, "identities": [], "values": []}

    def keep(entries) -> list[bool]:
        out = []
        for g in entries:
            kinds = {g.guard_type, *(getattr(g, "derived_guard_types", ()) or ())}
            ok = not kinds & UNSAVED_GUARDS
            side = counts["kept" if ok else "dropped"]
            side[g.guard_type] = side.get(g.guard_type, 0) + 1
            if not ok and g.has_value:
                counts["identities"].append((g.name, identity(g.value)))
            elif ok and g.has_value and g.guard_type in VALUE_GUARDS and rebuilt_from_caller(g):
                counts["values"].append((g.name, VALUE_GUARDS[g.guard_type], value_print(VALUE_GUARDS[g.guard_type],
                                                                                         g.value)))
            out.append(ok)
        return out

    how = dict(how)
    dynamic = how.get("dynamic", AUTO)

    def compiled_with(dynamic, specialise: bool):
        backend = _backend(how.get("backend", "inductor"), how.get("mode"), how.get("options"), dynamic,
                           tuple(how.get("rewrites", ())), specialise)
        return aot_compile_fullgraph(TRAMPOLINE, ((fn, args, kwargs), {}), hooks=Hooks(guard_filter_fn=keep),
                                     backend=backend, dynamic=dynamic)

    with torch._dynamo.config.patch(enable_aot_compile=True, **dynamo_config):
        compiled = None
        if not (dynamic == AUTO and per_shape_from_the_start(fn)):  # a CNN: no dynamic trace to refuse first
            try:
                compiled = compiled_with(True if dynamic == AUTO else dynamic, dynamic == AUTO)
            except Exception as exc:  # a graph that compiles per shape (`graphify.compile.shape_policy`)
                if dynamic != AUTO or not asked_to_specialise(exc):
                    raise
        if compiled is None:
            counts.update(kept={}, dropped={}, identities=[], values=[], per_shape=True)
            compiled = compiled_with(False, False)
        compiled.save_compiled_function(path)
    compiled(fn, args, kwargs)
    counts["classes"] = class_namespaces(fn, args, kwargs)
    return counts


def load(path: str, data: bytes | None = None) -> Callable:
    """In the caller: the compiled function saved at `path` (or its bytes, `data`). Its code
    names the modules it uses as `___module_<dotted name, dots as _>_<id>_c<n>` globals of the
    compiling process; each is the module of that name here."""
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    rewrites.registered()  # the ops rewrites put in (graphify::one_row_linear), which saved code may call
    tune_outside_pools()  # its first run here may tune kernels: not into a graph's pool
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


# What `load` and the code it loads import: torch's loader and what its load of a saved function
# reaches (the shape validator, AOTAutograd's subclass wrappers, what sympy imports the first time
# it subtracts two guard expressions), the headers of inductor's output code
# (`torch/_inductor/codegen/wrapper.py`) and of its Triton kernels, and what inductor's compile
# pool (which the output code starts) imports. Where one cannot be imported (Triton on most CPU
# machines) the load does without it too.
LOAD_IMPORTS = ("torch._dynamo.aot_compile", "torch._dynamo.package", "torch._functorch._aot_autograd.autograd_cache",
                "torch._functorch._aot_autograd.subclass_codegen", "torch.fx.experimental.validator", "sympy.tensor.tensor",
                "torch._inductor.codecache", "torch._inductor.compile_fx", "torch._inductor.hooks",
                "torch._inductor.utils", "torch._inductor.codegen.memory_planning", "torch._inductor.async_compile",
                "torch._inductor.select_algorithm", "torch._inductor.runtime.debug_utils", "triton", "triton.language",
                "torch._inductor.runtime.triton_heuristics", "torch._inductor.runtime.triton_helpers",
                "torch._inductor.runtime.hints", "multiprocessing.synchronize")
_PREIMPORTED = False


def preimport() -> None:
    """Import what loading a compiled function needs (seconds the first time in a process), on
    the caller's thread when `graphify(...)` makes a background line, not inside the call that
    takes compiled graphs in. Never on a thread of its own: these imports register operators and
    lowerings with torch's dispatcher, which the caller's thread reads without its lock while an
    operator runs (the GPU suite failed with std::bad_alloc and basic_string::_M_create inside
    graphify.models' attention operators while such imports ran beside it)."""
    global _PREIMPORTED
    if _PREIMPORTED:
        return
    _PREIMPORTED = True
    rewrites.registered()  # their modules register operators too
    for name in LOAD_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the load imports it again, and says what fails
            log.debug("graphify: pre-import of %s for compiled-function loads failed", name, exc_info=True)


def _first_call_checked():
    """AOTAutograd checks a compiled function's custom ops for aliasing on its first call, under
    a dispatch mode over every op (about 80 ms of the call that took an 8B model's compiled
    graphs in, H100). The worker's save made that first call on the same compiled code, so a
    loaded function's calls here skip it."""
    config = torch._functorch.config
    if getattr(config, "check_custom_op_aliasing", None) is None:
        return contextlib.nullcontext()
    return config.patch(check_custom_op_aliasing=False)


_HELD = threading.local()  # `checks_held`'s verdicts on this thread, while one is open


@contextlib.contextmanager
def checks_held():
    """Within one capture of one call, a loaded function's checks of what its dropped guards
    stood for (identities, kept guards' values, class namespaces: `AotLoads._usable`), once
    passed, stand for its later calls on the same objects; its kept guards still run each
    call. Open it only where no user code runs between those calls: a capture's compiled
    warm-ups and the capture itself run inductor's code and graphify's own, and the eager
    original (the op guard's run) comes before the first of them. It halves what the call
    that takes compiled graphs in spends on these checks (about 30 ms at 0.5B)."""
    outer = getattr(_HELD, "verdicts", None)
    if outer is None:
        _HELD.verdicts = {}
    try:
        yield
    finally:
        if outer is None:
            _HELD.verdicts = None


def _objects_key(args: tuple, kwargs: dict) -> tuple:
    """The call's top-level objects by identity: a verdict holds for the same objects only."""
    return tuple(map(id, args)), tuple((k, id(v)) for k, v in kwargs.items())


class AotLoads:
    """The compiled functions loaded for one graphified function: a call goes to the first
    whose guards pass (`call`); `forget` drops them all (what they were traced over changed)."""

    def __init__(self, fn: Callable):
        self.fn = fn  # the function the trampoline calls
        self.loaded: list = []  # (compiled function, what stands for its dropped guards)
        self.calls = 0  # calls that ran a loaded function (tests, logs)
        self.refused: list[str] = []  # names whose identity changed, of loaded functions passed over
        # Every function a call ran through, kept while this lives (as long as the graphified
        # function): graphs captured through one launch its kernels after it is no longer a
        # candidate (`drop`, `forget`).
        self.served: list = []

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
            with _first_call_checked():
                out = compiled.fn(self.fn, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - not this process's to run: compiled here instead
            self.drop(compiled)
            log.warning("graphify: a compiled function from the worker failed here (%s: %s); compiling here instead",
                        type(exc).__name__, exc)
            return False, None
        self.calls += 1
        if all(compiled is not c for c in self.served):
            self.served.append(compiled)
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
        verdicts = getattr(_HELD, "verdicts", None)
        key = (id(compiled), _objects_key(args, kwargs))
        if verdicts is not None and verdicts.get(key) is compiled:
            return True
        changed = identity_changes(compiled, guards.get("identities", ()), (self.fn, args, kwargs), {})
        changed += value_changes(compiled, guards.get("values", ()), (self.fn, args, kwargs), {}) \
            if "values" in guards else ["(no record of the kept guards' values)"]
        changed += class_changes(guards.get("classes", ()), self.fn, args, kwargs) if "classes" in guards \
            else ["(no record of the classes the worker's trace reached)"]
        if changed:
            self.drop(compiled)
            self.refused += changed
            log.info("graphify: a compiled function from the worker was traced over other objects than this "
                     "process holds, or ones it cannot compare (%s%s); compiling here instead",
                     ", ".join(changed[:3]), "..." if len(changed) > 3 else "")
            return False
        if verdicts is not None:
            verdicts[key] = compiled  # held with the function: its id cannot be another's meanwhile
        return True
