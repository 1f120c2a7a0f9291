"""torch.compile for `Options(compile=...)`, holding on to what it compiles.

A graph captured over a compiled function launches the kernels inductor generated for it.
Dynamo keeps those only in its caches, which `torch._dynamo.reset()` (and
`torch.compiler.reset()`) drop while graphs still replay them. Compiling through a backend
that keeps every compiled callable makes them live as long as the graphified function and
so as long as its graphs.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable

import torch

from graphify.base.compile_options import CompileOptions
from graphify.compile import aot as _aot
from graphify.compile import rewrites
from graphify.compile.aot import AotLoads
from graphify.compile.code_claims import claim, reset_code
from graphify.compile.layout_policy import inductor_layout
from graphify.compile.tuning_memory import tune_outside_pools
from graphify.compile.shape_policy import (AUTO, FirstShape, Specialise, asked_to_specialise, call_signature, first_shape,
                                           per_shape_from_the_start, wants_static)
from graphify.base.split_contract import as_split
from graphify.backends.pool_routing import outside

__all__ = ["compile_for_captures", "compile_settings", "compiles_in_background", "KeptCompiles", "DYNAMO_CONFIG", "shared_backend",
           "forget_compiled"]

# Dynamo settings while the function compiles. With dynamic shapes dynamo makes every float
# it meets a symbol (a module's `eps`, attention `scaling`); AOTAutograd's pass that turns
# such symbols into tensors cannot take one an op gets as a number (SDPA's `scale`), and
# dynamo traces the whole function again with floats specialised: two traces and two AOT runs of the model for one compile (logged as
# "Restarting analysis due to ... _tensorify_python_scalars"). Specialising floats from the
# start traces once; a float that changes is a new static value to graphify anyway.
#
# Dynamo counts recompiles per code object, and transformers' forwards of every model class
# share one (its `deprecate_kwarg` wrapper): a process with several model classes, batch 1
# and larger batches reaches the default limit (8) of compiles, after which the frame runs
# eagerly. Within graphify's own compiles the limit is higher.
#
# Dynamo skips guards on module hooks by default (`skip_nnmodule_hook_guards`): code compiled
# for a module without hooks ran for one with them, and a hook added after a compile was
# never called (wrong graphs, seen on the H100). Here hooks are guarded.
DYNAMO_CONFIG = {"specialize_float": True, "recompile_limit": 64, "skip_nnmodule_hook_guards": False}


class KeptCompiles:
    """A torch.compile backend: `backend` (inductor by default, with `mode` and `options`
    as torch.compile applies them) whose compiled callables are kept in `outputs`, after the
    graph rewrites named in `rewrites` (`graphify.compile.rewrites`: `fold_gqa` reads one
    query's grouped-query attention from the unexpanded keys and values, `gemv` runs one-row
    linears through a Triton GEMV); `counts` says how many places each changed. With
    `specialise`, a graph that compiles faster per shape (`graphify.compile.shape_policy`) is
    refused with `Specialise` before anything is built. Inductor compiles with channels-last
    off where it would slow the graph (`graphify.compile.layout_policy`); compiling and tuning
    allocate outside a warm-up's routing to a graph's pool (`graphify.compile.tuning_memory`)."""

    def __init__(self, backend="inductor", mode=None, options=None, dynamic=None, rewrites: tuple = (),
                 specialise: bool = False):
        if backend == "inductor":
            self.inner = torch._TorchCompileInductorWrapper(mode, options, dynamic)
            tune_outside_pools()  # the compiled code's first run tunes kernels: not into a graph's pool
        else:
            self.inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
        self.rewrites = tuple(rewrites)
        self.counts: dict[str, int] = dict.fromkeys(self.rewrites, 0)
        self.outputs: list[Callable] = []
        self.specialise = specialise

    @property
    def __name__(self) -> str:  # dynamo names the backend after it
        return getattr(self.inner, "compiler_name", "inductor")

    def __call__(self, gm, example_inputs):
        if self.specialise and wants_static(gm):
            raise Specialise(f"{len(self.outputs)} graphs compiled before this one")
        for name, count in rewrites.rewrite(gm, self.rewrites).items():
            self.counts[name] += count
        with inductor_layout(gm, self.inner), outside():  # a compile's memory is no warm-up's
            compiled = self.inner(gm, example_inputs)
        self.outputs.append(compiled)
        return compiled

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()


def compile_for_captures(label: str, fn: Callable, how: "bool | str | dict") -> Callable:
    """`torch.compile(fn, **how)`, compiled lazily on the first capture that calls it, through
    `KeptCompiles`. Under `dynamic="auto"` (the default): the first shape static, dynamic from a
    call of another shape, and per shape (`dynamic=False`) from the first graph
    `graphify.compile.shape_policy` refuses. For a split function, the function it was split from,
    compiled whole: FULL graphs record it (inductor fuses across the split ops), PIECEWISE
    graphs keep the pieces."""
    split = as_split(fn)
    if split is not None:
        fn = split.fn
    if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
        raise ValueError(f"{label}: the function is torch.compile'd already; pass the function itself with "
                         "Options(compile=True), or keep torch.compile(fn) without the option")
    # The first shape static, then dynamic in one compile (`shape_policy`): a generate() loop,
    # which carries a cache, is dynamic from the start, as it meets new batch sizes and cache
    # lengths all the time; dynamo's own default (dynamic one changed dimension at a time, 0/1
    # specialised) compiled 5 times over 10 chat-like calls where this compiles twice (batch 1,
    # and larger batches): CPU count, tests/test_compile_option.py.
    background = compiles_in_background(how)
    if background:
        _aot.preimport()  # what the swap's load needs, imported here and now (0.8 s on a CPU), not inside the swap
    how = compile_settings(how)
    dynamic, switched = how.pop("dynamic"), how.pop("rewrites")
    rewrites.ready(switched)  # Triton and the GEMV imported here and now, not inside the call that takes compiled graphs in (0.15 s, H200)
    made = (how.pop("backend"), how.pop("mode"), how.pop("options"))

    def compiled_with(dynamic, backend=None) -> Callable:  # holds its backend, so the backend's outputs
        auto = dynamic == AUTO
        backend = backend or shared_backend(*made, True if auto else dynamic, switched, specialise=auto)
        return torch.compile(fn, backend=backend, dynamic=True if auto else dynamic, **how)

    per_shape = (lambda: compiled_with(False)) if dynamic == AUTO else None
    cnn = per_shape is not None and per_shape_from_the_start(fn)
    first = None
    if per_shape is not None and not background and not cnn:
        static = shared_backend(*made, False, switched)  # one per settings (one per function if unhashable)
        first = (compiled_with(False, static), first_shape(fn, static), static)
    configured = _with_dynamo_config(compiled_with(dynamic), dict(DYNAMO_CONFIG), AotLoads(fn), per_shape, first)
    if cnn:  # no dynamic trace to refuse first
        configured.per_shape.append(per_shape())
    return configured


def compiles_in_background(how: "bool | str | dict") -> bool:
    """Whether `Options.compile` asks for a compile in a worker process while plain graphs serve."""
    return how == "background" or isinstance(how, dict) and how.get("background", False) is True


def compile_settings(how: "bool | str | dict") -> dict:
    """`Options.compile` as torch.compile's settings: backend, mode, options, dynamic (True
    unless given), the graph rewrites switched on (`rewrites`, by name), and any other
    torch.compile keyword given."""
    parsed = CompileOptions.parse(how) if isinstance(how, dict) else CompileOptions()
    # (background, whole, deadline_s: where it compiles, `graphify.compile.background`, and for how long, not how)
    settings = {"backend": parsed.backend, "mode": parsed.mode, "options": parsed.options, "dynamic": parsed.dynamic,
                "rewrites": rewrites.switched_on(parsed.rewrites)}
    return {**settings, **{k: True for k in ("fullgraph", "disable") if getattr(parsed, k)}}


# Live backends by what makes them: dynamo guards every compiled entry of a code object on its
# backend's identity (BACKEND_MATCH), so a backend per graphified model would compile a class's
# forward once per model, and past dynamo's recompile limit (8) run the rest eagerly. Models
# graphified with the same options share one; it lives while any function compiled with it does.
_BACKENDS: "weakref.WeakValueDictionary[tuple, KeptCompiles]" = weakref.WeakValueDictionary()


def shared_backend(backend="inductor", mode=None, options=None, dynamic=None, switched: tuple = (),
                   specialise: bool = False) -> KeptCompiles:
    """The live `KeptCompiles` made with these arguments, or a new one (unshared where an
    argument cannot be compared)."""
    try:
        key = (backend, mode, tuple(sorted(options.items())) if isinstance(options, dict) else options, dynamic,
               tuple(switched), specialise)
        hash(key)
    except TypeError:  # an unhashable option value: a backend of its own
        return KeptCompiles(backend, mode, options, dynamic, switched, specialise)
    found = _BACKENDS.get(key)
    if found is None:
        found = _BACKENDS[key] = KeptCompiles(backend, mode, options, dynamic, switched, specialise)
    return found


def _with_dynamo_config(compiled: Callable, config: dict, loads: AotLoads,
                        per_shape: "Callable[[], Callable] | None" = None,
                        first: "tuple[Callable, FirstShape, KeptCompiles] | None" = None) -> Callable:
    """`compiled`, called with dynamo's `config` in force (it applies when a call compiles),
    or through a compiled function loaded from the worker (`loads`, its `aot_loads`) whose
    guards pass. With `first` (a static compile, its `FirstShape` and its backend), calls whose
    arguments match the first call's (`call_signature`) go to it, and from the first call that
    differs (or after one that compiled it again) every call goes to `compiled`
    (`graphify.compile.shape_policy`). Where `compiled`'s backend refuses a graph as one to
    compile per shape, `per_shape()` makes the static compile every later call goes to.
    Keeps what marks it as torch.compile'd (`_torchdynamo_orig_callable`): captures find its
    eager original through it."""
    static: list[Callable] = []

    @functools.wraps(compiled)
    def configured(*args, **kwargs):
        if loads.loaded:
            hit, out = loads.call(args, kwargs)
            if hit:
                return out
        claim(loads.fn, loads)  # a closure's code: no entry another graphified closure's compile made
        with torch._dynamo.config.patch(**config):
            if static:
                return static[0](*args, **kwargs)
            if first is not None and first[1].static(call_signature(args, kwargs)):
                made = len(first[2].outputs)
                out = first[0](*args, **kwargs)
                first[1].ran(len(first[2].outputs) > made)
                return out
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:
                if per_shape is None or not asked_to_specialise(exc):
                    raise
            static.append(per_shape())
            return static[0](*args, **kwargs)

    configured.aot_loads = loads
    configured.per_shape = static  # holds the static compile once made (tests read it)
    configured.first_shape = first[1] if first is not None else None  # tests read it
    return configured


@functools.cache
def _module_frame_codes() -> tuple:
    """The code of the frames torch.compile of a module puts around it, where dynamo keeps
    that compile's entries (torch 2.11: `external_utils.wrap_inline`'s wrapper, one code
    object for every compiled module): left there, an entry traced over a module's old
    submodule class kept serving after `m[1].__class__ = Tanh` (2.11 keeps no guard on it)."""
    utils = getattr(getattr(torch, "_dynamo", None), "external_utils", None)
    codes = []
    for make in (lambda u: u.wrap_inline(len), lambda u: u.wrap_inline_with_error_on_graph_break(len, True),
                 lambda u: u.wrap_inline_with_error_on_graph_break(len, False)):
        try:
            codes.append(make(utils).__code__)
        except Exception:  # noqa: BLE001 - this torch makes no such frame
            continue
    return tuple(codes)


def forget_compiled(spec) -> None:
    """Drop dynamo's compiled entries for the code of `spec`'s function (a `FunctionSpec`),
    where it is compiled (`Options(compile=...)`), so its next compile traces the Python
    state as it is now. After graphify saw that state change, a compiled entry whose own
    guards missed it (torch 2.11 kept one over a helper's new `__defaults__`) must not be
    captured again. For a module, its class's `forward` and the module call path dynamo
    compiles, `Module._wrapped_call_impl` (other modules compiled the same way compile
    again on their next call)."""
    if spec.compiled is None:
        return
    loads = getattr(spec.compiled, "aot_loads", None)
    if loads is not None:  # compiled in the worker over the old state; guards on identity not kept
        loads.forget()
    target = getattr(spec.fn, "_orig_mod", spec.fn)
    codes = []
    if isinstance(target, torch.nn.Module):
        forward = getattr(type(target), "forward", None)
        codes += [getattr(forward, "__code__", None), torch.nn.Module._wrapped_call_impl.__code__,
                  torch.nn.Module._call_impl.__code__, *_module_frame_codes()]
    for _ in range(8):  # through bound methods and partials to the function
        target = getattr(target, "__func__", None) or getattr(target, "func", None) or target
        if isinstance(target, types.FunctionType):
            codes.append(target.__code__)
            break
    for code in codes:
        if code is not None:
            reset_code(code)
