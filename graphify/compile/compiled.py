"""torch.compile for `Options(compile=...)`, holding on to what it compiles.

A graph captured over a compiled function launches the kernels inductor generated for it.
Dynamo keeps those only in its caches, which `torch._dynamo.reset()` (and
`torch.compiler.reset()`) drop while graphs still replay them. Compiling through a backend
that keeps every compiled callable makes them live as long as the graphified function and
so as long as its graphs.
"""

from __future__ import annotations

import functools
import threading
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
from graphify.compile.shape_policy import (AUTO, Generalise, Specialise, asked_to_generalise, asked_to_specialise,
                                           per_shape_from_the_start, plain_call, wants_static)
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
    refused with `Specialise` before anything is built; with `first_shape`, a frame compiled
    before (a second shape) is refused with `Generalise`. Inductor compiles with channels-last
    off where it would slow the graph (`graphify.compile.layout_policy`); compiling and tuning
    allocate outside a warm-up's routing to a graph's pool (`graphify.compile.tuning_memory`)."""

    def __init__(self, backend="inductor", mode=None, options=None, dynamic=None, rewrites: tuple = (),
                 specialise: bool = False, first_shape: bool = False):
        if backend == "inductor":
            self.inner = torch._TorchCompileInductorWrapper(mode, options, dynamic)
            tune_outside_pools()  # the compiled code's first run tunes kernels: not into a graph's pool
        else:
            self.inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
        self.rewrites = tuple(rewrites)
        self.counts: dict[str, int] = dict.fromkeys(self.rewrites, 0)
        self.outputs: list[Callable] = []
        self.specialise = specialise
        self.first_shape = first_shape

    @property
    def __name__(self) -> str:  # dynamo names the backend after it
        return getattr(self.inner, "compiler_name", "inductor")

    def __call__(self, gm, example_inputs):
        if self.specialise and wants_static(gm):
            raise Specialise(f"{len(self.outputs)} graphs compiled before this one")
        if self.first_shape:
            self._first_compile_of_its_frame()
        for name, count in rewrites.rewrite(gm, self.rewrites).items():
            self.counts[name] += count
        with inductor_layout(gm, self.inner), outside():  # a compile's memory is no warm-up's
            compiled = self.inner(gm, example_inputs)
        self.outputs.append(compiled)
        return compiled

    def _first_compile_of_its_frame(self) -> None:
        """Refuse (`Generalise`) a recompile of the frame the calling function's first compile
        was for: the frame a call enters, compiled as it starts, before anything of the call
        ran (so the call can start again, compiled dynamically). Another frame compiled again
        (resumed after a graph break, called inside: part of the call ran) compiles static
        once more, and the function's next call compiles dynamically."""
        calls = getattr(_FIRST_SHAPE_CALLS, "stack", None)
        frame = getattr(torch._guards.CompileContext.current_compile_id(), "frame_id", None)
        if not calls or frame is None:
            return
        frames = calls[-1].setdefault("frames", [])
        if frames and frame == frames[0]:
            raise Generalise(f"frame {frame} compiled for another shape before")
        if frame in frames:
            calls[-1]["dynamic_next"] = True
        else:
            frames.append(frame)

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()


def compile_for_captures(label: str, fn: Callable, how: "bool | str | dict") -> Callable:
    """`torch.compile(fn, dynamic=True, **how)`, compiled lazily on the first capture that
    calls it, through `KeptCompiles`; per shape (`dynamic=False`) from the first graph
    `graphify.compile.shape_policy` refuses, under `dynamic="auto"` (the default). For a split function, the function it was split from,
    compiled whole: FULL graphs record it (inductor fuses across the split ops), PIECEWISE
    graphs keep the pieces."""
    split = as_split(fn)
    if split is not None:
        fn = split.fn
    if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
        raise ValueError(f"{label}: the function is torch.compile'd already; pass the function itself with "
                         "Options(compile=True), or keep torch.compile(fn) without the option")
    # Dynamic shapes from the first compile: a transformers generate() loop meets new batch
    # sizes and cache lengths all the time, and dynamo's default (static first, dynamic on a
    # change, 0/1 specialised) compiled 5 times over 10 chat-like calls where this compiles
    # twice (batch 1, and larger batches): CPU count, tests/test_compile_option.py.
    background = compiles_in_background(how)
    if background:
        _aot.preimport()  # what the swap's load needs, imported here and now (0.8 s on a CPU), not inside the swap
    how = compile_settings(how)
    dynamic, switched = how.pop("dynamic"), how.pop("rewrites")
    rewrites.ready(switched)  # Triton and the GEMV imported here and now, not inside the call that takes compiled graphs in (0.15 s, H200)
    made = (how.pop("backend"), how.pop("mode"), how.pop("options"))

    def compiled_with(dynamic, first_shape: bool = False) -> Callable:  # holds its backend, so the backend's outputs
        auto = dynamic == AUTO
        backend = shared_backend(*made, True if auto else dynamic, switched, specialise=auto, first_shape=first_shape)
        return torch.compile(fn, backend=backend, dynamic=True if auto else dynamic, **how)

    per_shape = (lambda: compiled_with(False)) if dynamic == AUTO else None
    cnn = per_shape is not None and per_shape_from_the_start(fn)
    first = compiled_with(False, first_shape=True) if dynamic == AUTO and not background and not cnn else None
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


# The first-shape compiles in progress on this thread, innermost last: each the state of one
# compiled function (`_with_dynamo_config`), whose first compile's frame its backend records
_FIRST_SHAPE_CALLS = threading.local()


# Live backends by what makes them: dynamo guards every compiled entry of a code object on its
# backend's identity (BACKEND_MATCH), so a backend per graphified model would compile a class's
# forward once per model, and past dynamo's recompile limit (8) run the rest eagerly. Models
# graphified with the same options share one; it lives while any function compiled with it does.
_BACKENDS: "weakref.WeakValueDictionary[tuple, KeptCompiles]" = weakref.WeakValueDictionary()


def shared_backend(backend="inductor", mode=None, options=None, dynamic=None, switched: tuple = (),
                   specialise: bool = False, first_shape: bool = False) -> KeptCompiles:
    """The live `KeptCompiles` made with these arguments, or a new one (unshared where an
    argument cannot be compared)."""
    made = (backend, mode, options, dynamic, switched, specialise, first_shape)
    try:
        key = (backend, mode, tuple(sorted(options.items())) if isinstance(options, dict) else options, dynamic,
               tuple(switched), specialise, first_shape)
        hash(key)
    except TypeError:  # an unhashable option value: a backend of its own
        return KeptCompiles(*made)
    found = _BACKENDS.get(key)
    if found is None:
        found = _BACKENDS[key] = KeptCompiles(*made)
    return found


def _with_dynamo_config(compiled: Callable, config: dict, loads: AotLoads,
                        per_shape: "Callable[[], Callable] | None" = None, first: "Callable | None" = None) -> Callable:
    """`compiled`, called with dynamo's `config` in force (it applies when a call compiles),
    or through a compiled function loaded from the worker (`loads`, its `aot_loads`) whose
    guards pass. With `first` (the first shape's static compile), calls go to it until its
    backend refuses a second shape (`Generalise`), then to `compiled`. Where `compiled`'s
    backend refuses a graph as one to compile per shape (`graphify.compile.shape_policy`),
    `per_shape()` makes the static compile every later call goes to. Keeps what marks it as
    torch.compile'd (`_torchdynamo_orig_callable`): captures find its eager original through it."""
    static: list[Callable] = []
    firsts: list[Callable] = [first] if first is not None else []
    state: dict = {}  # the first compile's frame (`KeptCompiles._first_compile_of_its_frame`)

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
            if firsts and not state and not plain_call(args, kwargs):
                firsts.clear()  # it carries objects that hold state (a cache): a loop's, dynamic from the start
            if firsts:
                calls = _FIRST_SHAPE_CALLS.__dict__.setdefault("stack", [])
                calls.append(state)
                try:
                    return firsts[0](*args, **kwargs)
                except Exception as exc:
                    if not asked_to_generalise(exc):
                        raise
                finally:
                    calls.pop()
                    if state.get("dynamic_next"):
                        firsts.clear()
                firsts.clear()  # dynamic from this call on
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:
                if per_shape is None or not asked_to_specialise(exc):
                    raise
            static.append(per_shape())
            return static[0](*args, **kwargs)

    configured.aot_loads = loads
    configured.per_shape = static  # holds the static compile once made (tests read it)
    configured.first_shape = firsts  # holds the first shape's compile until a second shape (tests read it)
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
